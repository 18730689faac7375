// kernels/rmsnorm.cu — RMSNorm of the FP32 residual stream into the FP16 GEMV input.
//
//   rmsnorm   out[r, :] = fp16( x[r, :] · rsqrt(mean(x[r, :]²) + eps) · w )
//
// Everything is FP32 until the single rounding to FP16 at the end: the residual carries a
// few channels of magnitude ~1e3–3e4 in real Qwen2 models (DESIGN.md §9); their squares
// (≤ 1e9) and the sum over 3584 channels are far inside FP32 range, where FP16 would
// overflow at 65504.
//
// Work split: one block per row (grid.x = rows: 1 for decode, T for a prefill batch),
// RMSNORM_THREADS threads; thread i handles the float4 chunks i, i + blockDim, … of the row
// (D/4 = 896 chunks at 7B: one per thread, D = 896 at 0.5B: 224 threads busy). The sum of
// squares is reduced by a warp butterfly and then across warps in shared memory, in a fixed
// order: bit-reproducible. The chunks stay in registers between the reduction and the output
// (RMSNORM_MAX_CHUNKS per thread, so D ≤ 4 · 1024 · 4 = 16384; asserted by the launcher).
//
// Bytes per call at 7B (decode): 3584 × (4 read + 2 weight + 2 written) = 28.7 KB. The limit
// is latency (one block, a dependent chain load → reduce → store), not bandwidth: ~2–3 µs.
// Fusing it into the next GEMV's prologue is a later step.
//
// Requirements: D % 4 == 0 (every Qwen2.5 D is a multiple of 128); pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"  // WARP_SIZE
#include "warp.cuh"   // warp_sum

#define RMSNORM_THREADS    1024
#define RMSNORM_MAX_CHUNKS 4     // float4 chunks per thread held in registers

// grid (rows), block (RMSNORM_THREADS).
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm(__half* __restrict__ out,          // [rows, D] fp16, out
        const float* __restrict__ x,       // [rows, D] fp32 (residual stream)
        const __half* __restrict__ weight, // [D] fp16 (RMSNorm gain)
        int D, float eps) {
    __shared__ float warp_sums[RMSNORM_THREADS / WARP_SIZE];
    const float4* row = reinterpret_cast<const float4*>(x + (u64)blockIdx.x * D);
    const int n_chunks = D / 4;

    float4 v[RMSNORM_MAX_CHUNKS];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMSNORM_MAX_CHUNKS; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        v[j] = c < n_chunks ? row[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    }
    ss = warp_sum(ss);
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (lane == 0) warp_sums[warp] = ss;
    __syncthreads();
    float total = 0.f;
    const int n_warps = blockDim.x / WARP_SIZE;
    for (int w = 0; w < n_warps; ++w) total += warp_sums[w];  // same order in every thread
    const float inv_rms = rsqrtf(total / (float)D + eps);

    uint2* out_row = reinterpret_cast<uint2*>(out + (u64)blockIdx.x * D);
    const uint2* w4 = reinterpret_cast<const uint2*>(weight);
#pragma unroll
    for (int j = 0; j < RMSNORM_MAX_CHUNKS; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c >= n_chunks) break;
        const uint2 wb = w4[c];
        const float2 w01 = __half22float2(*reinterpret_cast<const __half2*>(&wb.x));
        const float2 w23 = __half22float2(*reinterpret_cast<const __half2*>(&wb.y));
        const __half2 o01 = __floats2half2_rn(v[j].x * inv_rms * w01.x, v[j].y * inv_rms * w01.y);
        const __half2 o23 = __floats2half2_rn(v[j].z * inv_rms * w23.x, v[j].w * inv_rms * w23.y);
        uint2 ob;
        ob.x = *reinterpret_cast<const u32*>(&o01);
        ob.y = *reinterpret_cast<const u32*>(&o23);
        out_row[c] = ob;
    }
}
