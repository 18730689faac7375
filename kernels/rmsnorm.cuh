// kernels/rmsnorm.cuh — RMSNorm of the FP32 residual stream, as device functions: the one
// definition of its arithmetic, used by the stand-alone kernel (rmsnorm.cu) and by the GEMVs
// that normalise their own input (gemv_int4.cu).
//
//   rmsnorm_inv_rms   1 / sqrt(mean(x²) + eps) of one row, summed in one fixed order
//   rmsnorm_apply4    fp16(x · inv_rms · w) for 4 consecutive elements
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
// RMSNORM_BATCH=B > 1 (a candidate for tools/bench_gemv.py --int4-defines / --fmt-defines, not yet
// measured; 1, the default, is the loop below): where a row has at most 1024 float4 chunks (D ≤
// 4096, every preset but the 14B), a warp loads the chunks of up to B of its virtual warps before
// it reduces any, so their L2 round trips overlap. The loop waits for each in turn: a GEMV block
// of W = 8 warps at the 7B's D = 3584 runs 28 virtual warps, 3–4 a warp, one round trip after
// another on the step's critical path. With one chunk a virtual thread, its share is
// 0 + ss4(chunk) (+ the zeros of chunks past the row, which add nothing): the same bits.
#ifndef RMSNORM_BATCH
#define RMSNORM_BATCH 1
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
    if (RMSNORM_BATCH > 1 && D / 4 <= RMSNORM_THREADS) {  // block-uniform
        constexpr int B = RMSNORM_BATCH;
        for (int base = threadIdx.x / WARP_SIZE; base < used; base += B * n_warps) {
            float4 v[B];
#pragma unroll
            for (int b = 0; b < B; ++b) {  // every load of the batch before any use
                const int c = (base + b * n_warps) * WARP_SIZE + lane;
                v[b] = c < D / 4 ? row[c] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int vw = base + b * n_warps;  // warp-uniform
                if (vw < used) {
                    const float ss = warp_sum(0.f + rmsnorm_ss4(v[b]));
                    if (lane == 0) warp_sums[vw] = ss;
                }
            }
        }
    } else {
        for (int vw = threadIdx.x / WARP_SIZE; vw < used; vw += n_warps) {
            const float ss = warp_sum(rmsnorm_thread_ss(row, vw * WARP_SIZE + lane, D / 4));
            if (lane == 0) warp_sums[vw] = ss;
        }
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
