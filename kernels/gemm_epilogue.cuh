// kernels/gemm_epilogue.cuh — the epilogues of the wgmma prefill GEMMs (gemm_int4.cu,
// gemm_fmt_wgmma.cu): what a consumer lane does with its GEMM_ACC FP32 accumulators of a tile of
// GEMM_BM tokens once the tile's MMAs are done.
//
// The accumulators are those of wgmma m64nNk16 with N = GEMM_BM (ptx/wgmma.cuh): lane (g, t) of
// a consumer warp holds rows g and g+8 of the warp's 16 weight rows for tokens 8j + 2t, +1
// (j = 0 … GEMM_BM/8 − 1). Each
// output element belongs to exactly one lane of one block, so no epilogue needs atomics and the
// results are bit-reproducible.
#pragma once
#include "types.cuh"  // u64

// Tokens per tile (wgmma N), fixed per build: gemm_int4.cu is built with 64, 128 and 256 (the
// launcher picks one per GEMM shape), gemm_fmt_wgmma.cu with the default.
#ifndef GEMM_BM
#define GEMM_BM 128
#endif
static_assert(GEMM_BM == 64 || GEMM_BM == 128 || GEMM_BM == 256, "GEMM_BM: 64, 128 or 256");
#define GEMM_ACC (GEMM_BM / 2)  // FP32 accumulators a consumer thread: 64 rows × GEMM_BM tokens / 128 threads

// Calls f(token, va, vb) for the lane's tokens < M: acc[4j + c] is (row g, token m0 + 8j + 2t + c),
// acc[4j + 2 + c] is (row g+8, the same token) — the wgmma accumulator layout (ptx/wgmma.cuh).
// A tile whose every token is < M (all but a chunk's last) takes the loop without the per-token
// bound: one uniform branch instead of a divergent one around each token (a compare and a
// BSSY/BRA/BSYNC each, 64 a lane at 256-token tiles). The epilogue runs after the tile's MMAs,
// with the tensor cores idle: its instructions are its time.
template <typename F>
struct GemmEachToken {
    F f;
    __device__ __forceinline__ void operator()(const float (&acc)[GEMM_ACC], int m0, int M, int t) {
        if (m0 + GEMM_BM <= M) each<true>(acc, m0, M, t);
        else each<false>(acc, m0, M, t);
    }
    template <bool WHOLE>
    __device__ __forceinline__ void each(const float (&acc)[GEMM_ACC], int m0, int M, int t) {
#pragma unroll
        for (int j = 0; j < GEMM_BM / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int token = m0 + 8 * j + 2 * t + c;
                if (WHOLE || token < M) f(token, acc[4 * j + c], acc[4 * j + 2 + c]);
            }
    }
};

template <typename F>
__device__ __forceinline__ GemmEachToken<F> gemm_each_token(F f) { return GemmEachToken<F>{f}; }

// residual[token, row] += acc for rows ra, ra+8: the loads of 4 token columns (16 values) are
// issued together, then the adds and stores — 4 round trips per lane instead of 64.
struct GemmResidualAdd {
    float* residual;
    int N;
    const int* ra;  // the lane's row g (set by the kernel's rows_of)
    __device__ __forceinline__ void operator()(const float (&acc)[GEMM_ACC], int m0, int M, int t) {
        const int r0 = *ra, r1 = r0 + 8;
#pragma unroll
        for (int j0 = 0; j0 < GEMM_BM / 8; j0 += 4) {
            float old[4][4];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int token = m0 + 8 * (j0 + jj) + 2 * t + c;
                    const bool live = token < M;
                    old[jj][c] = live && r0 < N ? residual[(u64)token * N + r0] : 0.f;
                    old[jj][2 + c] = live && r1 < N ? residual[(u64)token * N + r1] : 0.f;
                }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int token = m0 + 8 * (j0 + jj) + 2 * t + c;
                    if (token >= M) continue;
                    if (r0 < N) residual[(u64)token * N + r0] = old[jj][c] + acc[4 * (j0 + jj) + c];
                    if (r1 < N) residual[(u64)token * N + r1] = old[jj][2 + c] + acc[4 * (j0 + jj) + 2 + c];
                }
        }
    }
};

