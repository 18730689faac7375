// kernels/gemm_fmt.cu — the prefill GEMMs over weights in their per-tensor formats
// (weight_formats.cuh: the GGUF's Q4_0 … Q6_K blocks), for the prompt's tokens at once.
//
//   gemm_fmt_store_rows         out fp32 [M, ldo] columns col0 … col0+N-1 = x Wᵀ   (q, k, v into qkv)
//   gemm_fmt_residual_rows      residual fp32 [M, N]                     += x Wᵀ   (o_proj, down_proj)
//   gemm_fmt_gate_up_swiglu_rows h fp16 [M, F]   = silu(x Wgᵀ) ⊙ (x Wuᵀ)           (gate and up in one format)
//
// x is FP16 [rows, K] row-major (the normed hidden states, the attention output or h), M =
// prefill_state[1] ≤ rows the live row count (the launch list serves every chunk of up to `rows`
// tokens, as gemm_int4.cu's); rows ≥ M are neither read nor written.
//
// What it is built around: each weight is dequantized once per block into FP16 in shared memory
// with the reference's arithmetic (wf_dequant_pairs: (c − z)·s or c·s + o in FP32, the chunk's
// scales computed once), then rounded to FP16 — unlike the decode GEMVs (gemv_fmt.cu), which
// keep the codes exact and scale FP32 sums, an MMA here adds inputs of 4 lanes and 8 tokens, so
// a scale per 32 (or 16) inputs cannot be applied after it; the FP16 rounding of w costs
// ≤ 2^-11 of each weight, errors that average out over K. The K-quants' two-level scales, the
// offsets and the high bits are all handled by weight_formats.cuh, so one skeleton serves every
// format.
//
// Work split
// ----------
//   block = 4 warps, a tile of GF_BM = 64 tokens × GF_BN = 64 weight rows (for gate/up: the
//           same 64 rows of both); grid = (ceil(rows / 64), ceil(N / 64)).
//   step  = GF_BK = 64 inputs (two 32-input chunks): thread tid dequantizes chunk tid / 64 of
//           row tid % 64 (16 half2, 64 B into shared memory) and copies 4 of the 512 16-byte
//           pieces of the 64 tokens' x; then each warp runs 4 (k) × 8 (token tiles) m16n8k16
//           MMAs per matrix on its 16 rows. The next step's weights and x are loaded into
//           registers before those MMAs, so their global latency overlaps the tensor work.
//   MMA   = A = 16 weight rows, B = 8 tokens (ptx/mma.cuh fragments, read as 32-bit words from
//           rows padded to 72 halves: lanes (g, t) read word t of row g at bank 36g + t ≡ 4g + t
//           mod 32, 8 distinct groups of 4: no conflicts), FP32 accumulators, 32 (64 for
//           gate/up) per lane.
//   epilogue = each output element is owned by one lane of one block: the residual add needs no
//           atomics, and the result is bit-reproducible.
// Bytes: every block reads its 64 rows' weights (the whole matrix once per 64 tokens) and x
// (64 tokens × K) once; at 512 tokens the weights are read 8 times, mostly from L2.
// The limit of this version: the tensor cores are fed by mma.sync from one shared-memory stage,
// with two barriers per 64 inputs; the dequantization, once ~20 instructions per weight
// (wf_dequant recomputed the chunk's scales for each), is now ~6 per pair of weights.
// Measured (H200, `drvqwen bench`, the synthetic 7B in llama.cpp's Q4_K_M layout, 512-token
// prompt, docs/bench/2026-12-01_84b2bea_h200_syn7b_q4_k_m.json): TTFT 58.9 ms, against 120.5 ms
// for the version before (32-input steps, the scales recomputed per weight, no loads during the
// MMAs: …_2d1fca6_h200_syn7b_q4_k_m.json) and 17.4 ms for the INT4 7B's wgmma GEMMs
// (gemm_int4.cu). The prefill now runs gemm_fmt_wgmma.cu wherever K is a multiple of 128 (every
// Qwen2.5 shape: 30.7 ms for the same model); this file serves the other K and the comparison
// (`drvqwen bench --prefill-gemm mma`).
//
// Barriers, and why nothing races: per step, every thread writes only its own slots of xs and
// ws (its row's chunk, its 4 pieces of x), then __syncthreads (all threads: the early return for
// blocks past M happens before the loop and is block-uniform, as is the format); the MMAs only
// read xs and ws; the second __syncthreads ends those reads before the next step's stores
// overwrite them. The loads of the next step go to registers only. The accumulators are
// registers; each output element is written by one lane of one block.
//
// Requirements (checked by launchers/gemm_fmt.py): K % 32 == 0 and a multiple of the format's
// group (256 for the K-quants; a K that is not a multiple of 64 ends on a step of one chunk);
// pointers 16-byte aligned; ldo ≥ col0 + N.
#include <cuda_fp16.h>

#include "types.cuh"           // u32, u64, WARP_SIZE, QUAD_SIZE
#include "mma.cuh"             // mma_m16n8k16_f32_f16
#include "ldst.cuh"            // l2_evict_first_policy
#include "int4_matmul.cuh"     // swiglu_f16
#include "weight_formats.cuh"  // WfWeight, WfRaw, wf_load, wf_dequant_pairs, wf_known, WF_DISPATCH

#define GF_BM      64   // tokens per block
#define GF_BN      64   // weight rows per block
#define GF_THREADS 128  // 4 warps of 16 rows each
#define GF_BK      64   // inputs per step: two 32-input chunks
#define GF_LD      72   // halves per shared-memory row: 64 inputs + 8 of padding (see the header)

// The block's product for MT matrices of format F: acc[m][nt][0..3] holds C of MMA rows g, g+8
// and tokens nt·8 + 2t, +1 (ptx/mma.cuh). Contains __syncthreads(): every thread calls it.
// xs: [GF_BM * GF_LD] and ws: [MT][GF_BN * GF_LD] halves of shared memory, declared by the
// kernel (once: a __shared__ array here would be allocated once per format instance).
template <int F, int MT>
__device__ __forceinline__ void gf_gemm_block(const WfWeight (&w)[MT], const __half* __restrict__ x, int M, int N,
                                              int K, int tok0, int row0, float (&acc)[MT][8][4], __half* xs,
                                              __half (*ws)[GF_BN * GF_LD]) {
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const u64 policy = l2_evict_first_policy();
    const int chunks = K / WF_CHUNK, steps = (K + GF_BK - 1) / GF_BK;
    // Thread tid dequantizes row r = tid % 64 of the block (rows past N repeat row N − 1, never
    // stored), chunk h = tid / 64 of each step; and copies 4 of the step's 512 16-byte pieces
    // of x (64 tokens × 8 pieces of 8 inputs; tokens ≥ M and inputs ≥ K read as zeros).
    const int r = tid % GF_BN, h = tid / GF_BN;
    const u32 row = (u32)min(row0 + r, N - 1);
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) acc[m][nt][0] = acc[m][nt][1] = acc[m][nt][2] = acc[m][nt][3] = 0.f;

    // The next step's bytes, in registers while the MMAs of this one run.
    WfRaw wr[MT];
    uint4 xr[4];
    auto load = [&](int s) {
        const int c = 2 * s + h;  // this thread's chunk; past the last chunk: not loaded
#pragma unroll
        for (int m = 0; m < MT; ++m)
            if (c < chunks) wr[m] = wf_load<F>(w[m], row, c, K, policy);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = tid + GF_THREADS * j, tok = i / 8, k = s * GF_BK + (i % 8) * 8;
            xr[j] = tok0 + tok < M && k < K ? *reinterpret_cast<const uint4*>(x + (u64)(tok0 + tok) * K + k)
                                            : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    auto store = [&](int s) {
        const int c = 2 * s + h;
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            u32 v[16];
            if (c < chunks) {
                wf_dequant_pairs<F>(wr[m], c, v);
            } else {
#pragma unroll
                for (int q = 0; q < 16; ++q) v[q] = 0u;  // K's last step holds one chunk: zeros
            }
            uint4* dst = reinterpret_cast<uint4*>(ws[m] + r * GF_LD + h * WF_CHUNK);
#pragma unroll
            for (int j = 0; j < 4; ++j) dst[j] = make_uint4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = tid + GF_THREADS * j;
            *reinterpret_cast<uint4*>(xs + (i / 8) * GF_LD + (i % 8) * 8) = xr[j];
        }
    };

    load(0);
    for (int s = 0; s < steps; ++s) {
        store(s);
        __syncthreads();              // the step's tiles are in shared memory
        if (s + 1 < steps) load(s + 1);  // in flight during the MMAs
#pragma unroll
        for (int ks = 0; ks < GF_BK / 16; ++ks) {  // inputs 16·ks … +15 of the step
            const int k0 = ks * 16 + 2 * t;
            u32 b[8][2];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const __half* xrow = xs + (nt * 8 + g) * GF_LD + k0;
                b[nt][0] = *reinterpret_cast<const u32*>(xrow);
                b[nt][1] = *reinterpret_cast<const u32*>(xrow + 8);
            }
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const __half* wrow = ws[m] + (warp * 16 + g) * GF_LD + k0;
                const u32 a[4] = {*reinterpret_cast<const u32*>(wrow), *reinterpret_cast<const u32*>(wrow + 8 * GF_LD),
                                  *reinterpret_cast<const u32*>(wrow + 8), *reinterpret_cast<const u32*>(wrow + 8 * GF_LD + 8)};
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) mma_m16n8k16_f32_f16(acc[m][nt], a, b[nt][0], b[nt][1]);
            }
        }
        __syncthreads();  // every read of this step's tiles is done: the next store overwrites them
    }
}

// Calls f(token, row, values[MT]) for each output this lane owns (tokens < M, rows < N).
template <int MT, typename Fn>
__device__ __forceinline__ void gf_gemm_outputs(const float (&acc)[MT][8][4], int M, int N, int tok0, int row0, Fn f) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int tok = tok0 + nt * 8 + 2 * t + (i & 1), row = row0 + warp * 16 + g + 8 * (i >> 1);
            if (tok >= M || row >= N) continue;
            float v[MT];
#pragma unroll
            for (int m = 0; m < MT; ++m) v[m] = acc[m][nt][i];
            f(tok, row, v);
        }
}

// The body of the one-matrix GEMMs (gemm_fmt_store_rows, gemm_fmt_residual_rows): the
// block's 64 × 64 tile of x Wᵀ, each output (token < M, row < N) handed to store(token, row, value) by the one lane
// that owns it. Blocks past M, or a format this build does not read, return before any barrier
// (block-uniform). The shared tiles are declared here, outside the per-format instances.
template <typename Store>
__device__ __forceinline__ void gf_gemm_one(const WfWeight& w, const __half* __restrict__ x, int M, int N, int K,
                                            int fmt, Store store) {
    const int tok0 = blockIdx.x * GF_BM, row0 = blockIdx.y * GF_BN;
    if (tok0 >= M || !wf_known(fmt)) return;  // block-uniform
    const WfWeight ws[1] = {w};
    __shared__ __align__(16) __half xs[GF_BM * GF_LD];
    __shared__ __align__(16) __half wsm[1][GF_BN * GF_LD];
    float acc[1][8][4];
    WF_DISPATCH(fmt, F, gf_gemm_block<F, 1>(ws, x, M, N, K, tok0, row0, acc, xs, wsm);)
    gf_gemm_outputs<1>(acc, M, N, tok0, row0, [&](int tok, int row, const float (&v)[1]) { store(tok, row, v[0]); });
}

// out[tok, col0 + n] = Σ_k x[tok, k] W[n, k] for tokens < M (q, k and v into their columns of qkv).
// grid (ceil(rows/64), ceil(N/64)), block (128).
extern "C" __global__ void __launch_bounds__(GF_THREADS)
gemm_fmt_store_rows(float* __restrict__ out,                 // [rows, ldo] fp32, columns col0 … col0+N-1 written
                    const __half* __restrict__ x,            // [rows, K] fp16
                    const u32* __restrict__ w_qweight,       // [N, K] in format fmt: codes (weight_formats.cuh)
                    const u32* __restrict__ w_qhigh,         // high bits, or null
                    const void* __restrict__ w_scales,       // scales (fp16 | uint8 | int8, by format)
                    const void* __restrict__ w_aux,          // offsets | superscales, or null
                    const int* __restrict__ prefill_state,   // [2] int32: start, n_rows (M = [1])
                    int N, int K, int ldo, int col0, int fmt) {
    gf_gemm_one(WfWeight{w_qweight, w_qhigh, w_scales, w_aux}, x, prefill_state[1], N, K, fmt,
                [&](int tok, int row, float v) { out[(u64)tok * ldo + col0 + row] = v; });
}

// residual[tok, n] += Σ_k x[tok, k] W[n, k] for tokens < M (o_proj, down_proj).
// grid (ceil(rows/64), ceil(N/64)), block (128).
extern "C" __global__ void __launch_bounds__(GF_THREADS)
gemm_fmt_residual_rows(float* __restrict__ residual,          // [rows, N] fp32, in/out
                       const __half* __restrict__ x,          // [rows, K] fp16
                       const u32* __restrict__ w_qweight,     // [N, K] in format fmt: codes (weight_formats.cuh)
                       const u32* __restrict__ w_qhigh,       // high bits, or null
                       const void* __restrict__ w_scales,     // scales (fp16 | uint8 | int8, by format)
                       const void* __restrict__ w_aux,        // offsets | superscales, or null
                       const int* __restrict__ prefill_state, // [2] int32: start, n_rows (M = [1])
                       int N, int K, int fmt) {
    gf_gemm_one(WfWeight{w_qweight, w_qhigh, w_scales, w_aux}, x, prefill_state[1], N, K, fmt,
                [&](int tok, int row, float v) { residual[(u64)tok * N + row] += v; });
}

// h[tok, f] = silu(x Wgᵀ) · (x Wuᵀ) for tokens < M, rounded once to FP16 (swiglu_f16).
// grid (ceil(rows/64), ceil(F/64)), block (128).
extern "C" __global__ void __launch_bounds__(GF_THREADS)
gemm_fmt_gate_up_swiglu_rows(__half* __restrict__ h,                  // [rows, F] fp16, out
                             const __half* __restrict__ x,            // [rows, K] fp16
                             const u32* __restrict__ gate_qweight,    // [F, K] in format fmt: codes
                             const u32* __restrict__ gate_qhigh,      // high bits, or null
                             const void* __restrict__ gate_scales,    // scales (by format)
                             const void* __restrict__ gate_aux,       // offsets | superscales, or null
                             const u32* __restrict__ up_qweight,      // [F, K] in format fmt: codes
                             const u32* __restrict__ up_qhigh,        // high bits, or null
                             const void* __restrict__ up_scales,      // scales (by format)
                             const void* __restrict__ up_aux,         // offsets | superscales, or null
                             const int* __restrict__ prefill_state,   // [2] int32: start, n_rows (M = [1])
                             int F, int K, int fmt) {
    const int M = prefill_state[1], tok0 = blockIdx.x * GF_BM, row0 = blockIdx.y * GF_BN;
    if (tok0 >= M || !wf_known(fmt)) return;  // block-uniform
    const WfWeight ws[2] = {WfWeight{gate_qweight, gate_qhigh, gate_scales, gate_aux},
                            WfWeight{up_qweight, up_qhigh, up_scales, up_aux}};
    __shared__ __align__(16) __half xs[GF_BM * GF_LD];
    __shared__ __align__(16) __half wsm[2][GF_BN * GF_LD];
    float acc[2][8][4];
    WF_DISPATCH(fmt, FM, gf_gemm_block<FM, 2>(ws, x, M, F, K, tok0, row0, acc, xs, wsm);)
    gf_gemm_outputs<2>(acc, M, F, tok0, row0, [&](int tok, int row, const float (&v)[2]) {
        h[(u64)tok * F + row] = swiglu_f16(v[0], v[1]);
    });
}
