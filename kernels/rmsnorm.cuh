// kernels/rmsnorm.cuh — RMSNorm of the FP32 residual stream, as device functions: the one
// definition of its arithmetic, used by the stand-alone kernel (rmsnorm.cu) and by the GEMVs
// that normalise their own input (gemv_int4.cu).
//
//   rmsnorm_inv_rms        1 / sqrt(mean(x²) + eps) of one row by a block, in one fixed order
//   rmsnorm_inv_rms_warp   the same bits by one warp alone (no block barrier)
//   rmsnorm_apply4         fp16(x · inv_rms · w) for 4 consecutive elements
//
// The order of the sum of squares is that of a 1024-thread block (RMSNORM_THREADS): virtual
// thread t sums the squares of float4 chunks t, t + 1024, … (at most RMSNORM_MAX_CHUNKS),
// each warp of 32 virtual threads is reduced by a butterfly, and the 32 warp sums are added in
// warp order. A block of any size (a multiple of 32 threads) computes exactly that — its warp
// w takes virtual warps w, w + W, … — so every block that normalises the same row gets the
// same bits, and they are the bits of the stand-alone kernel. One warp alone computes them too
// (rmsnorm_inv_rms_warp): it plays the 32 virtual warps in turn, with the same butterflies, and
// adds their sums in the same order.
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
#define RMSNORM_ROWS_WARPS   4   // rmsnorm_rows: rows (warps) a block
#define RMSNORM_ROWS_THREADS (RMSNORM_ROWS_WARPS * WARP_SIZE)

// x² summed over one float4, in one expression shape for every caller.
__device__ __forceinline__ float rmsnorm_ss4(float4 v) {
    return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
}

// Chunk c of a row of n_chunks float4, zeros past its end.
__device__ __forceinline__ float4 rmsnorm_chunk(const float4* row, int c, int n_chunks) {
    return c < n_chunks ? row[c] : make_float4(0.f, 0.f, 0.f, 0.f);
}

// Virtual thread t's share of the sum of squares of row (D/4 float4 chunks).
__device__ __forceinline__ float rmsnorm_thread_ss(const float4* row, int t, int n_chunks) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMSNORM_MAX_CHUNKS; ++j) ss += rmsnorm_ss4(rmsnorm_chunk(row, t + j * RMSNORM_THREADS, n_chunks));
    return ss;
}

// 1 / sqrt(total / D + eps): the last step, one expression for both orders' callers.
__device__ __forceinline__ float rmsnorm_inv_rms_of(float total, int D, float eps) {
    return rsqrtf(total / (float)D + eps);
}

// 1 / sqrt(mean(row²) + eps) in the fixed order above. Call from every thread of the block
// (blockDim.x a multiple of 32, at most 1024); warp_sums: RMSNORM_WARPS floats of shared
// memory. Contains one __syncthreads(); the row is read with ordinary loads (they stay after a
// preceding griddepcontrol.wait, ptx/griddep.cuh).
__device__ __forceinline__ float rmsnorm_inv_rms(const float* __restrict__ x, int D, float eps,
                                                 float* warp_sums) {
    const float4* row = reinterpret_cast<const float4*>(x);
    const int lane = threadIdx.x % WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    for (int vw = threadIdx.x / WARP_SIZE; vw < RMSNORM_WARPS; vw += n_warps) {
        const float ss = warp_sum(rmsnorm_thread_ss(row, vw * WARP_SIZE + lane, D / 4));
        if (lane == 0) warp_sums[vw] = ss;
    }
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < RMSNORM_WARPS; ++w) total += warp_sums[w];  // same order in every thread
    return rmsnorm_inv_rms_of(total, D, eps);
}

// rmsnorm_inv_rms's bits from one warp, every lane getting them: lane l is lane l of each virtual
// warp vw in turn (virtual thread 32·vw + l), each virtual thread's squares are summed as
// rmsnorm_thread_ss sums them, each virtual warp's go through the same butterfly, and the warp
// sums are added in warp order into one register instead of shared memory. No barrier, so the
// warps of a block may normalise different rows. The first chunk of every virtual thread (all of
// the row while D ≤ 4096: 28 float4 a lane at 7B) is loaded into registers before any of them is
// used, so the lane has them all in flight at once — the kernel's limit is that latency — and the
// 32 butterflies have no branch between them, so their shuffles overlap. Where D ≤ 4096 (a
// warp-uniform test) the chunks j ≥ 1, all past the row, which the block form adds as zeros, are
// left out: adding +0.0f to a sum of squares (never −0) leaves its bits as they are. Longer rows
// (the 14B's and 32B's D = 5120) take rmsnorm_thread_ss itself a virtual warp at a time, chunk 0
// read again from L1: unrolled, the registers for both forms at once would spill.
__device__ __forceinline__ float rmsnorm_inv_rms_warp(const float* __restrict__ x, int D, float eps) {
    const float4* row = reinterpret_cast<const float4*>(x);
    const int lane = threadIdx.x % WARP_SIZE, n_chunks = D / 4;
    float4 first[RMSNORM_WARPS];  // chunk 32·vw + lane: virtual thread 32·vw + lane's chunk j = 0
#pragma unroll
    for (int vw = 0; vw < RMSNORM_WARPS; ++vw) first[vw] = rmsnorm_chunk(row, vw * WARP_SIZE + lane, n_chunks);
    float total = 0.f;
    if (n_chunks <= RMSNORM_THREADS) {  // warp-uniform: every Qwen2.5 D ≤ 4096, one chunk a thread
        float sums[RMSNORM_WARPS];  // virtual warp vw's sum: 32 butterflies with no branch between them
#pragma unroll
        for (int vw = 0; vw < RMSNORM_WARPS; ++vw) {
            float ss = 0.f;
            ss += rmsnorm_ss4(first[vw]);
            sums[vw] = warp_sum(ss);
        }
#pragma unroll
        for (int vw = 0; vw < RMSNORM_WARPS; ++vw) total += sums[vw];
    } else {  // D > 4096: the block form's own per-thread sum, a virtual warp at a time
#pragma unroll 1
        for (int vw = 0; vw < RMSNORM_WARPS; ++vw)
            total += warp_sum(rmsnorm_thread_ss(row, vw * WARP_SIZE + lane, n_chunks));
    }
    return rmsnorm_inv_rms_of(total, D, eps);
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
