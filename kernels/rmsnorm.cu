// kernels/rmsnorm.cu — RMSNorm of the FP32 residual stream into the FP16 GEMV input.
//
//   rmsnorm        out[r, :] = fp16( x[r, :] · rsqrt(mean(x[r, :]²) + eps) · w )   a block a row
//   rmsnorm_rows   the same bits, a warp a row: the prefill's T rows
//
// The arithmetic lives in rmsnorm.cuh (FP32 throughout, one rounding to FP16, one fixed
// summation order), shared with the decode GEMVs that normalise their own input: the
// stand-alone kernel serves the prefill rows and the final norm before lm_head.
//
// Work split: one block per row (grid.x = rows: 1 for decode, T for a prefill batch),
// RMSNORM_THREADS threads; thread i handles the float4 chunks i, i + blockDim, … of the row
// (D/4 = 896 chunks at 7B: one per thread, D = 896 at 0.5B: 224 threads busy). The sum of
// squares is reduced by a warp butterfly and then across warps in shared memory, in a fixed
// order: bit-reproducible. The output pass reads the row again (from L1). D ≤ 4 · 1024 · 4 =
// 16384 (RMSNORM_MAX_CHUNKS per thread; checked by the launcher).
//
// Bytes per call at 7B (decode): 3584 × (4 read + 2 weight + 2 written) = 28.7 KB. The limit
// is latency (one block, a dependent chain load → reduce → store), not bandwidth: ~2–3 µs,
// which is why the decode step normalises inside the GEMVs instead (gemv_int4.cu).
//
// Requirements: D % 4 == 0 (every Qwen2.5 D is a multiple of 128); pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"    // u64
#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents
#include "rmsnorm.cuh"  // RMSNORM_THREADS, RMSNORM_ROWS_*, rmsnorm_inv_rms{,_warp}, rmsnorm_apply4

// grid (rows), block (RMSNORM_THREADS).
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm(__half* __restrict__ out,          // [rows, D] fp16, out
        const float* __restrict__ x,       // [rows, D] fp32 (residual stream)
        const __half* __restrict__ weight, // [D] fp16 (RMSNorm gain)
        int D, float eps) {
    __shared__ float warp_sums[RMSNORM_WARPS];
    grid_launch_dependents();
    grid_dependency_wait();  // x is the previous kernel's output
    const float* row = x + (u64)blockIdx.x * D;
    const float inv_rms = rmsnorm_inv_rms(row, D, eps, warp_sums);
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const uint2* w4 = reinterpret_cast<const uint2*>(weight);
    uint2* out_row = reinterpret_cast<uint2*>(out + (u64)blockIdx.x * D);
    for (int c = threadIdx.x; c < D / 4; c += blockDim.x)
        out_row[c] = rmsnorm_apply4(row4[c], w4[c], inv_rms);
}

// A warp per row for the prefill's many rows (T = 512 at the 7B: 56 launches a prefill). The block
// form spends its time on latency, not bytes — a 1024-thread block per row, its loads one per
// thread, then a block barrier, then the output pass: 7.9–8.9 µs a launch at T = 512, D = 3584
// (docs/bench/2026-12-04_3b034e0_h200_syn7b_int4_kernels.json) for 11 MB, ~3 µs of HBM. Here a
// warp owns a row: no block barrier, no shared memory, and the rows of a launch are 4 to a block
// of RMSNORM_ROWS_THREADS, so T = 512 is 128 blocks, one wave on 132 SMs. Each lane loads its
// D/128 float4 of the row (28 at 7B) into registers before it uses any (rmsnorm_inv_rms_warp):
// __launch_bounds__(…, 1) gives ptxas the registers (142) to keep them all in flight at once, and
// the output pass reads them again from L1. The sum's order is rmsnorm_inv_rms's (rmsnorm.cuh),
// so every row gets the block kernel's bits.
//
// Bytes per launch: rows × D × (4 read + 2 written) + D × 2 of weight (from L2 after the first
// blocks): 11.0 MB at T = 512, D = 3584.
//
// grid (ceil(rows / RMSNORM_ROWS_WARPS)), block (RMSNORM_ROWS_THREADS).
extern "C" __global__ void __launch_bounds__(RMSNORM_ROWS_THREADS, 1)
rmsnorm_rows(__half* __restrict__ out,          // [rows, D] fp16, out
             const float* __restrict__ x,       // [rows, D] fp32 (residual stream)
             const __half* __restrict__ weight, // [D] fp16 (RMSNorm gain)
             int rows, int D, float eps) {
    grid_launch_dependents();
    grid_dependency_wait();  // x is the previous kernel's output
    const int r = blockIdx.x * RMSNORM_ROWS_WARPS + threadIdx.x / WARP_SIZE;
    if (r >= rows) return;   // a whole warp: the last block's rows past the end
    const float* row = x + (u64)r * D;
    const float inv_rms = rmsnorm_inv_rms_warp(row, D, eps);
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const uint2* w4 = reinterpret_cast<const uint2*>(weight);
    uint2* out_row = reinterpret_cast<uint2*>(out + (u64)r * D);
    const int lane = threadIdx.x % WARP_SIZE, n_chunks = D / 4;
    // Unrolled, so the gains' loads (from L2) are all in flight together rather than one per
    // iteration of a loop, and the row's chunks are the registers rmsnorm_inv_rms_warp loaded.
#pragma unroll
    for (int vw = 0; vw < RMSNORM_WARPS; ++vw) {
        const int c = vw * WARP_SIZE + lane;
        if (c < n_chunks) out_row[c] = rmsnorm_apply4(row4[c], w4[c], inv_rms);
    }
    for (int c = RMSNORM_THREADS + lane; c < n_chunks; c += WARP_SIZE)  // D > 4096 only
        out_row[c] = rmsnorm_apply4(row4[c], w4[c], inv_rms);
}
