// kernels/rmsnorm.cu — RMSNorm of the FP32 residual stream into the FP16 GEMV input.
//
//   rmsnorm   out[r, :] = fp16( x[r, :] · rsqrt(mean(x[r, :]²) + eps) · w )
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
// Measured and not kept: a warp per row for the prefill's T rows (four rows a block, no barrier,
// each lane's 28 float4 of the row loaded before any was used, the same summation order and bits)
// took 7.2–8.7 µs a launch at T = 512, D = 3584, as this form's 7.9–8.9, and the 7B's TTFT was
// 12.19–12.41 ms against 12.10–12.16 in turns (docs/bench/2026-12-04_2ebf575_…_rmsnorm_rows_*.json,
// 2026-12-04_83c2cc2_…_rmsnorm_block_*.json): a launch here costs its place in the chain of
// dependent kernels, not the row's load latency.
//
// Measured and not kept either: the prefill's two RMSNorms a layer inside the residual GEMM
// before them (commit d536c28: o_proj and down_proj, after their last tile, meet at a grid
// barrier on a counter and then each block normalises its share of the rows, a row a warp with
// the block form's bits; the next layer's input_layernorm in down_proj), 144 prefill launches
// instead of 198. Bit for bit this kernel's xn, sanitizers clean; one eager
// prefill's launches summed nearly the same (o_proj + norm 1267 µs against 1007 + 231, down_proj
// + norm 3382 against 3063 + 234), but the graph TTFT of the 7B rose: 12.81 / 13.03 / 12.93 ms
// against 12.10 / 12.09 / 12.08 in turns (`--prefill-reps 30`; docs/bench/2026-12-04_d536c28_
// h200_syn7b_int4_norm_*.json). The reading: with the norm a launch of its own, the next GEMM's
// blocks become resident SM by SM while the norm's small blocks run; behind a grid barrier no
// block of the GEMM leaves before the last one's rows are done, and the next GEMM starts on an
// emptied GPU. A launch boundary here costs less than a barrier that holds every SM.
// Requirements: D % 4 == 0 (every Qwen2.5 D is a multiple of 128); pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"    // u64
#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents
#include "rmsnorm.cuh"  // RMSNORM_THREADS, rmsnorm_inv_rms, rmsnorm_apply4

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
