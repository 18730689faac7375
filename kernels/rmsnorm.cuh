// kernels/rmsnorm.cuh — RMSNorm of the FP32 residual stream, as device functions: the one
// definition of its arithmetic, used by the stand-alone kernel (rmsnorm.cu) and by the GEMVs
// that normalise their own input (gemv_int4.cu, gemv_fmt.cu).
//
//   rmsnorm_inv_rms         1 / sqrt(mean(x²) + eps) of one row, summed in one fixed order
//   rmsnorm_inv_rms_pieces  the same, of a row the block holds in registers (D ≤ 4096)
//   rmsnorm_apply4          fp16(x · inv_rms · w) for 4 consecutive elements
//
// The order of the sum of squares is that of a 1024-thread block (RMSNORM_THREADS): virtual
// thread t sums the squares of float4 chunks t, t + 1024, … (at most RMSNORM_MAX_CHUNKS),
// each warp of 32 virtual threads is reduced by a butterfly, and the 32 warp sums are added in
// warp order. A block of any size (a multiple of 32 threads) computes exactly that — its warp
// w takes virtual warps w, w + W, … — so every block that normalises the same row gets the
// same bits, and they are the bits of the stand-alone kernel.
//
// Everything is FP32 until the one rounding to FP16: the residual carries a few channels of
// magnitude ~1e3–3e4 in real Qwen2 models (docs/numerics.md#the-residual-stream-is-fp32);
// their squares and the sum over D channels are far inside FP32 range, where FP16 would
// overflow at 65504.
#pragma once
#include <cuda_fp16.h>

#include "types.cuh"  // u32, WARP_SIZE
#include "warp.cuh"   // warp_sum

#define RMSNORM_THREADS    1024
#define RMSNORM_MAX_CHUNKS 4     // float4 chunks per thread: D ≤ 4 · 1024 · 4 = 16384
#define RMSNORM_WARPS      (RMSNORM_THREADS / WARP_SIZE)

// x² summed over one float4, in one expression shape for every caller.
__device__ __forceinline__ float rmsnorm_ss4(float4 v) {
    return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
}

// Virtual thread t's share of the sum of squares of row (D/4 float4 chunks).
__device__ __forceinline__ float rmsnorm_thread_ss(const float4* row, int t, int n_chunks) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMSNORM_MAX_CHUNKS; ++j) {
        const int c = t + j * RMSNORM_THREADS;
        ss += rmsnorm_ss4(c < n_chunks ? row[c] : make_float4(0.f, 0.f, 0.f, 0.f));
    }
    return ss;
}

// RMSNORM_ALL_WARPS=1 runs every one of the 32 virtual warps, the empty ones too (a comparison
// build for tools/bench_gemv.py; the same bits).
#ifndef RMSNORM_ALL_WARPS
#define RMSNORM_ALL_WARPS 0
#endif

// 1 / sqrt(mean(row²) + eps) in the fixed order above. Call from every thread of the block
// (blockDim.x a multiple of 32, at most 1024); warp_sums: RMSNORM_WARPS floats of shared
// memory. Contains one __syncthreads(); the row is read with ordinary loads (they stay after a
// preceding griddepcontrol.wait, ptx/griddep.cuh).
// Only the virtual warps that hold a chunk run (`used`: vw·32 < D/4; a later one's chunks
// vw·32 + lane + j·1024 lie past the row too): an empty one's sum is +0, and total + 0 is
// total, so skipping them changes no bit. It matters to the GEMVs' prologues, whose W ≤ 8
// warps would otherwise each run ⌈32/W⌉ virtual warps in turn, a butterfly each, on the
// step's critical path: at the 0.5B's D = 896, 7 of the 32 hold a chunk, one for each of the
// 7 warps of its GEMVs' blocks (all 32 would be ⌈32/7⌉ = 5 rounds a warp).
__device__ __forceinline__ float rmsnorm_inv_rms(const float* __restrict__ x, int D, float eps,
                                                 float* warp_sums) {
    const float4* row = reinterpret_cast<const float4*>(x);
    const int lane = threadIdx.x % WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    const int used = RMSNORM_ALL_WARPS ? RMSNORM_WARPS : min(RMSNORM_WARPS, (D / 4 + WARP_SIZE - 1) / WARP_SIZE);
    for (int vw = threadIdx.x / WARP_SIZE; vw < used; vw += n_warps) {
        const float ss = warp_sum(rmsnorm_thread_ss(row, vw * WARP_SIZE + lane, D / 4));
        if (lane == 0) warp_sums[vw] = ss;
    }
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < used; ++w) total += warp_sums[w];  // same order in every thread
    return rsqrtf(total / (float)D + eps);
}

// RMSNORM_ONE_PASS=1 (the default) lets the GEMV prologues take the one-pass path below wherever
// the row fits one round: the residual and gains are read once, the squares summed from those
// registers, one dependent L2 round trip less on the step's critical path than sum, barrier and
// read again. On one H100 (docs/benchmarks.md, the 2026-12-07 *_one_pass runs) it took the 7B's
// INT4 gate_up from 25.16 to 24.29 µs (tools/bench_gemv.py --pdl, the step's build and grid),
// Q4_K's qkv_rope from 8.81 to 8.02 and gate_up from 26.83 to 25.91, the 0.5B's INT4 qkv_rope
// from 3.35 to 3.06 and gate_up from 4.58 to 4.25, and the 7B's graph decode step from
// 2.127 / 2.150 to 2.065 / 2.064 ms in INT4, 2.160 / 2.153 to 2.104 / 2.102 ms in the Q4_K_M
// layout (tools/bench_commits.py, in turns; the 0.5B's within its spread). 0 makes rmsnorm_one_pass refuse
// every row, so the prologues read the row twice, as rmsnorm_inv_rms needs: the build the kernel
// tests compare bit for bit with the default, and decode_persistent.cu's (one pass spills there).
#ifndef RMSNORM_ONE_PASS
#define RMSNORM_ONE_PASS 1
#endif

// Whether rmsnorm_inv_rms_pieces<R> can normalise a row of D elements in a block of the
// caller's size: every 8-element piece in one thread's R registers (D/8 ≤ R · blockDim.x),
// and one float4 chunk a virtual thread (D/4 ≤ RMSNORM_THREADS: every preset up to the 7B's
// 3584; the 14B's 5120 is not). Block-uniform.
template <int R>
__device__ __forceinline__ bool rmsnorm_one_pass(int D) {
    return RMSNORM_ONE_PASS && D / 4 <= RMSNORM_THREADS && D / 8 <= R * (int)blockDim.x;
}

// Piece p of a row of n_pieces (inputs 8p … 8p + 7): its float4 chunks 2p, 2p + 1 of x and the
// matching 4 + 4 fp16 gains; zeros past the row (they add nothing to a sum of squares and
// normalise to 0). The registers rmsnorm_inv_rms_pieces and rmsnorm_apply4 take.
__device__ __forceinline__ void rmsnorm_load_piece(const float* __restrict__ x, const __half* __restrict__ w, int p,
                                                   int n_pieces, float4 (&r)[2], uint2 (&g)[2]) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const uint2* w4 = reinterpret_cast<const uint2*>(w);
    const bool in = p < n_pieces;
    r[0] = in ? x4[2 * p] : make_float4(0.f, 0.f, 0.f, 0.f);
    r[1] = in ? x4[2 * p + 1] : make_float4(0.f, 0.f, 0.f, 0.f);
    g[0] = in ? w4[2 * p] : make_uint2(0u, 0u);
    g[1] = in ? w4[2 * p + 1] : make_uint2(0u, 0u);
}

// rmsnorm_inv_rms from a row the block already holds in registers, so a GEMV prologue reads its
// residual once, not once for the sum of squares and again to normalise: one L2 round trip
// fewer on the step's critical path. Thread `tid` holds piece p = tid + j · blockDim.x of the
// row in r[j] (inputs 8p … 8p + 7 as float4 chunks 2p and 2p + 1; zeros past the row), for
// j < R; rmsnorm_one_pass<R>(D) must hold. Call from every thread; contains one __syncthreads.
//
// The same bits as rmsnorm_inv_rms: a real warp's 32 pieces of one j are the 64 chunks of two
// whole virtual warps (pieces start at multiples of 32, chunks at multiples of 64), lanes 0–15
// holding the first and lanes 16–31 the second. warp_sum's butterfly pairs chunk c with c ^ 16,
// then ^ 8, ^ 4, ^ 2, ^ 1; chunk 2i + k lives in register k of lane i, so chunk offsets 16 … 2
// are lane offsets 8 … 1 within the half, applied to each register, and offset 1 is the add of
// the lane's two registers. Each add takes the same two operands as warp_sum's (an FP32 add is
// commutative), so each virtual warp's sum has the same bits, written to the same warp_sums
// slot, and the total adds the same slots in the same order.
template <int R>
__device__ __forceinline__ float rmsnorm_inv_rms_pieces(const float4 (&r)[R][2], int D, float eps,
                                                        float* warp_sums) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int used = min(RMSNORM_WARPS, (D / 4 + WARP_SIZE - 1) / WARP_SIZE);
#pragma unroll
    for (int j = 0; j < R; ++j) {
        float s0 = 0.f + rmsnorm_ss4(r[j][0]), s1 = 0.f + rmsnorm_ss4(r[j][1]);
#pragma unroll
        for (int m = WARP_SIZE / 4; m >= 1; m >>= 1) {
            s0 += shfl_xor_f32(s0, m);
            s1 += shfl_xor_f32(s1, m);
        }
        const int vw = (j * (int)blockDim.x + warp * WARP_SIZE) / 16 + lane / 16;  // this half's virtual warp
        if (lane % 16 == 0 && vw < used) warp_sums[vw] = s0 + s1;
    }
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < used; ++w) total += warp_sums[w];  // same order in every thread
    return rsqrtf(total / (float)D + eps);
}

// fp16(v · inv_rms · w) of 4 elements, w the 4 fp16 gains packed in a uint2; returns 4 fp16.
__device__ __forceinline__ uint2 rmsnorm_apply4(float4 v, uint2 wb, float inv_rms) {
    const float2 w01 = __half22float2(*reinterpret_cast<const __half2*>(&wb.x));
    const float2 w23 = __half22float2(*reinterpret_cast<const __half2*>(&wb.y));
    const __half2 o01 = __floats2half2_rn(v.x * inv_rms * w01.x, v.y * inv_rms * w01.y);
    const __half2 o23 = __floats2half2_rn(v.z * inv_rms * w23.x, v.w * inv_rms * w23.y);
    uint2 ob;
    ob.x = *reinterpret_cast<const u32*>(&o01);
    ob.y = *reinterpret_cast<const u32*>(&o23);
    return ob;
}
