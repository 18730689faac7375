// kernels/gemv_f16.cu — the FP16 lm_head GEMV, with the first pass of the greedy argmax.
//
//   gemv_f16_lm_head   logits fp32[V] = W x;  per block: (max logit, its index) of its rows
//
// The limit: HBM bandwidth. lm_head stays FP16 (docs/quantization.md#what-is-quantized): 152064 × 3584 × 2 B = 1.09 GB
// at 7B (272 MB at 0.5B), a quarter of the whole decode step's bytes, read once per token.
// Budget at 2 B per weight is ~14 instructions per weight at full bandwidth, so the plain
// FP32 path is affordable: each FP16 weight and x value is converted and multiplied with an
// FP32 FMA (the product of two FP16 numbers is exact in FP32), summed in FP32.
//
// Work split: block = LM_WARPS warps, warp = LM_ROWS_PER_WARP consecutive rows (32 rows per
// block, grid.x = ceil(V / 32) = 4752 blocks at 7B). Lane l walks 16-byte chunks l, l+32, …
// of its rows (coalesced: a warp reads 512 contiguous bytes of each row per step), two steps
// of 4 rows = 8 streaming loads (L1::no_allocate, L2 evict-first) in flight per lane. x
// (7 KB) is read through L1: every block on the SM shares it, and the weights, which bypass
// L1, cannot evict it. Each row's sum is a warp butterfly (fixed order).
//
// Rows n_valid … V-1 (the padding past the tokenizer's ids, `.nanoqwen` text_vocab) get the
// logit -inf: the row's dot product is still computed (the loads are the bandwidth-bound
// part either way, and 271 of 151936 rows are 0.2 % of them), then replaced.
//
// Fused argmax, pass 1: each block writes the best (value, index) of its 32 rows to
// part_val/part_idx[blockIdx.x] (larger value wins, lower index on ties: ptx/warp.cuh), so
// argmax_final (argmax.cu) reduces 4752 pairs instead of re-reading 608 KB of logits.
//
// Measured on the H200 (7B, graph replay): 257 µs per call = 4.24 TB/s, 98.5 % of the 4.3 TB/s
// copy bandwidth; argmax_final over its 4752 partials: 3.9 µs.
//
// Requirements: D % 8 == 0; pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"  // u32, u64, WARP_SIZE
#include "ldst.cuh"   // ld_stream_v4, l2_evict_first_policy
#include "warp.cuh"   // warp_sum, argmax_better
#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents

#define LM_WARPS         8
#define LM_ROWS_PER_WARP 4
#define LM_ROWS_PER_BLOCK (LM_WARPS * LM_ROWS_PER_WARP)
#define LM_CHUNK_UNROLL  2   // 16-byte chunk steps whose loads are issued together
#define INT_MAX_I32      0x7fffffff

// Σ_k fp32(a[k]) · fp32(b[k]) over 8 FP16 pairs packed in two uint4.
__device__ __forceinline__ float dot8_f16_f32(uint4 a, uint4 b, float acc) {
    const u32 av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 af = __half22float2(*reinterpret_cast<const __half2*>(&av[i]));
        const float2 bf = __half22float2(*reinterpret_cast<const __half2*>(&bv[i]));
        acc = fmaf(af.x, bf.x, acc);
        acc = fmaf(af.y, bf.y, acc);
    }
    return acc;
}

// grid (ceil(V/32)), block (LM_WARPS · 32).
extern "C" __global__ void __launch_bounds__(LM_WARPS * WARP_SIZE)
gemv_f16_lm_head(float* __restrict__ logits,        // [V] fp32, out
                 float* __restrict__ part_val,      // [gridDim.x] fp32, out: block's max logit
                 int* __restrict__ part_idx,        // [gridDim.x] int32, out: its row index
                 const __half* __restrict__ x,      // [D] fp16 (final-normed hidden state)
                 const __half* __restrict__ weight, // [V, D] fp16 (lm_head)
                 int V, int D,
                 int n_valid) {                     // rows >= n_valid: padding, logit -inf
    __shared__ float warp_val[LM_WARPS];
    __shared__ int warp_idx[LM_WARPS];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int row0 = blockIdx.x * LM_ROWS_PER_BLOCK + warp * LM_ROWS_PER_WARP;
    const int n_chunks = D / 8;
    const u64 policy = l2_evict_first_policy();

    const uint4* w_rows[LM_ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < LM_ROWS_PER_WARP; ++r)  // rows past V re-read row V-1, never stored
        w_rows[r] = reinterpret_cast<const uint4*>(weight + (u64)min(row0 + r, V - 1) * D);
    const uint4* x_chunks = reinterpret_cast<const uint4*>(x);

    // The first step's weights are requested before the wait (PDL, ptx/griddep.cuh): for the
    // blocks of the first wave they arrive under the previous kernel's tail. x, the previous
    // kernel's output, is read after it, with ordinary loads.
    grid_launch_dependents();
    uint4 w[LM_CHUNK_UNROLL][LM_ROWS_PER_WARP], xv[LM_CHUNK_UNROLL];
    auto load_weights = [&](int c0) {
#pragma unroll
        for (int u = 0; u < LM_CHUNK_UNROLL; ++u) {
            const int c = c0 + u * WARP_SIZE;
            if (c >= n_chunks) break;
#pragma unroll
            for (int r = 0; r < LM_ROWS_PER_WARP; ++r) w[u][r] = ld_stream_v4(w_rows[r] + c, policy);
        }
    };
    load_weights(lane);
    grid_dependency_wait();

    float acc[LM_ROWS_PER_WARP] = {};
    for (int c0 = lane; c0 < n_chunks; c0 += LM_CHUNK_UNROLL * WARP_SIZE) {
        if (c0 != lane) load_weights(c0);
#pragma unroll
        for (int u = 0; u < LM_CHUNK_UNROLL; ++u) {
            const int c = c0 + u * WARP_SIZE;
            if (c >= n_chunks) break;
            xv[u] = x_chunks[c];
        }
#pragma unroll
        for (int u = 0; u < LM_CHUNK_UNROLL; ++u) {
            if (c0 + u * WARP_SIZE >= n_chunks) break;
#pragma unroll
            for (int r = 0; r < LM_ROWS_PER_WARP; ++r) acc[r] = dot8_f16_f32(w[u][r], xv[u], acc[r]);
        }
    }

    float best_v = F32_NEG_INF;
    int best_i = INT_MAX_I32;
#pragma unroll
    for (int r = 0; r < LM_ROWS_PER_WARP; ++r) {
        const float sum = warp_sum(acc[r]);  // identical in every lane
        const int row = row0 + r;
        if (row < V) {
            // The lm_head is padded past the tokenizer (151936 rows for 151665 ids): no text
            // comes of a padded row, so its logit is -inf — out of this greedy argmax, and out
            // of sample_token, which reads these logits (weight 0). The CPU backend masks the
            // same rows the same way (generate.CPUBackend).
            const float logit = row < n_valid ? sum : F32_NEG_INF;
            if (lane == r) logits[row] = logit;
            if (argmax_better(logit, row, best_v, best_i)) { best_v = logit; best_i = row; }
        }
    }
    if (lane == 0) { warp_val[warp] = best_v; warp_idx[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < LM_WARPS; ++w)
            if (argmax_better(warp_val[w], warp_idx[w], best_v, best_i)) {
                best_v = warp_val[w]; best_i = warp_idx[w];
            }
        part_val[blockIdx.x] = best_v;
        part_idx[blockIdx.x] = best_i;
    }
}
