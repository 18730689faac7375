// kernels/gemv_f16.cu — the FP16 lm_head GEMV, with the first pass of the greedy argmax.
//
//   gemv_f16_lm_head   logits fp32[V] = W x;  per block: (max logit, its index) of its rows
//   gemv_f16_lm_head_tokens  the same for T ≤ 16 tokens at once, each token bit for bit the
//                      single-token kernel's (the verify pass; see "T tokens" below)
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
// T tokens at once
// ----------------
// The verify pass of speculative decoding needs the logits of T = k + 1 ≤ 16 positions, each bit
// for bit what this kernel computes for that position alone. The kernel uses plain FP32 FMAs,
// no MMA, so there is no column of B to give each token; instead each lane loads its weights
// once (the same 16-byte chunks, rows and steps as the single-token kernel) and, for each token
// j in turn, converts token j's x chunk and runs token j's FMA chain on those weights:
// acc[j][r] = dot8_f16_f32(w, x_j, acc[j][r]). gemv_f16_lm_head_block<NTOK> is one body, NTOK = 1
// for the single-token kernel (x loaded for the whole step before its FMAs, as it always was),
// NTOK = LM_TOKENS for gemv_f16_lm_head_tokens (T = n_tokens ≤ NTOK at run time, x loaded
// where used: 2·T chunks at once would take every register).
//   Why it is exact: token j's sum for row r in lane l is the chain of FMAs over the chunks
//   l, l + 32, … in the same order with the same operands, then the same warp_sum butterfly;
//   the -inf padding, the block's argmax over its rows and warps in the same order. Nothing in
//   it depends on the other tokens. The T-token launch has the single-token grid and block
//   (launchers/gemv_f16.py); the outputs are [T, …]: logits [T, V], part_val / part_idx
//   [T, gridDim.x], and argmax_final_tokens (argmax.cu) picks each token's from its own row.
//   Bytes per call: the weights once for all T tokens (1.09 GB at 7B), plus T × (x 7 KB read
//   + logits 608 KB written): under 0.06 % of the weights per token.
//   Instructions: per weight, its FP16 → FP32 conversion once and per token one x conversion and
//   one FMA; at T = 16 that is well past the ~14 instructions per weight that keep up with HBM,
//   so the T-token kernel is compute-bound at large T (not timed yet). Registers (ptxas): 150
//   against the single-token kernel's 58 (one block of 256 threads per SM instead of four).
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
#define LM_TOKENS        16  // tokens of gemv_f16_lm_head_tokens (the verify pass's T ≤ 16)

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

// The lm_head of a block for T ≤ NTOK tokens (n_tok = T at run time): logits [T, V], part_val /
// part_idx [T, gridDim.x], x [T, D]. NTOK = 1 is the single-token kernel. Each lane loads its
// weights once and runs every token's FMA chain on them, token by token (T tokens, header).
template <int NTOK>
__device__ __forceinline__ void gemv_f16_lm_head_block(float* __restrict__ logits, float* __restrict__ part_val,
                                                       int* __restrict__ part_idx, const __half* __restrict__ x,
                                                       const __half* __restrict__ weight, int V, int D, int n_valid,
                                                       int n_tok) {
    __shared__ float warp_val[NTOK][LM_WARPS];
    __shared__ int warp_idx[NTOK][LM_WARPS];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int row0 = blockIdx.x * LM_ROWS_PER_BLOCK + warp * LM_ROWS_PER_WARP;
    const int n_chunks = D / 8;
    const u64 policy = l2_evict_first_policy();

    const uint4* w_rows[LM_ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < LM_ROWS_PER_WARP; ++r)  // rows past V re-read row V-1, never stored
        w_rows[r] = reinterpret_cast<const uint4*>(weight + (u64)min(row0 + r, V - 1) * D);
    const uint4* x_chunks = reinterpret_cast<const uint4*>(x);  // token j's chunk c: j · n_chunks + c

    // The first step's weights are requested before the wait (PDL, ptx/griddep.cuh): for the
    // blocks of the first wave they arrive under the previous kernel's tail. x, the previous
    // kernel's output, is read after it, with ordinary loads.
    grid_launch_dependents();
    uint4 w[LM_CHUNK_UNROLL][LM_ROWS_PER_WARP];
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

    float acc[NTOK][LM_ROWS_PER_WARP] = {};
    for (int c0 = lane; c0 < n_chunks; c0 += LM_CHUNK_UNROLL * WARP_SIZE) {
        if (c0 != lane) load_weights(c0);
        // x of the step: one token's chunks all loaded before its FMAs (the single-token
        // schedule); T tokens' chunks one at a time where used (2·T chunks held at once would take
        // every register). The same values in the same FMA order either way.
        uint4 xv[LM_CHUNK_UNROLL];
        if constexpr (NTOK == 1) {
#pragma unroll
            for (int u = 0; u < LM_CHUNK_UNROLL; ++u) {
                const int c = c0 + u * WARP_SIZE;
                if (c >= n_chunks) break;
                xv[u] = x_chunks[c];
            }
        }
#pragma unroll
        for (int u = 0; u < LM_CHUNK_UNROLL; ++u) {
            const int c = c0 + u * WARP_SIZE;
            if (c >= n_chunks) break;
#pragma unroll
            for (int j = 0; j < NTOK; ++j) {
                if (j >= n_tok) break;
                const uint4 xj = NTOK == 1 ? xv[u] : x_chunks[(u64)j * n_chunks + c];
#pragma unroll
                for (int r = 0; r < LM_ROWS_PER_WARP; ++r) acc[j][r] = dot8_f16_f32(w[u][r], xj, acc[j][r]);
            }
        }
    }

#pragma unroll
    for (int j = 0; j < NTOK; ++j) {
        if (j >= n_tok) break;
        float best_v = F32_NEG_INF;
        int best_i = INT_MAX_I32;
#pragma unroll
        for (int r = 0; r < LM_ROWS_PER_WARP; ++r) {
            const float sum = warp_sum(acc[j][r]);  // identical in every lane
            const int row = row0 + r;
            if (row < V) {
                // The lm_head is padded past the tokenizer (151936 rows for 151665 ids): no text
                // comes of a padded row, so its logit is -inf — out of this greedy argmax, and out
                // of sample_token, which reads these logits (weight 0). The CPU backend masks the
                // same rows the same way (generate.CPUBackend).
                const float logit = row < n_valid ? sum : F32_NEG_INF;
                if (lane == (LM_ROWS_PER_WARP * j + r) % WARP_SIZE) logits[(u64)j * V + row] = logit;
                if (argmax_better(logit, row, best_v, best_i)) { best_v = logit; best_i = row; }
            }
        }
        if (lane == 0) { warp_val[j][warp] = best_v; warp_idx[j][warp] = best_i; }
    }
    __syncthreads();
    // Token j's block winner by thread j, over the warps in order (the single-token order).
    const int j = threadIdx.x;
    if (j < n_tok) {
        float best_v = warp_val[j][0];
        int best_i = warp_idx[j][0];
        for (int w = 1; w < LM_WARPS; ++w)
            if (argmax_better(warp_val[j][w], warp_idx[j][w], best_v, best_i)) {
                best_v = warp_val[j][w]; best_i = warp_idx[j][w];
            }
        part_val[(u64)j * gridDim.x + blockIdx.x] = best_v;
        part_idx[(u64)j * gridDim.x + blockIdx.x] = best_i;
    }
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
    gemv_f16_lm_head_block<1>(logits, part_val, part_idx, x, weight, V, D, n_valid, 1);
}

// The same for T = n_tokens ≤ LM_TOKENS tokens, grid and block as gemv_f16_lm_head: logits [T, V],
// part_val / part_idx [T, gridDim.x], x [T, D]; each token's outputs the single-token kernel's bits.
extern "C" __global__ void __launch_bounds__(LM_WARPS * WARP_SIZE)
gemv_f16_lm_head_tokens(float* __restrict__ logits, float* __restrict__ part_val, int* __restrict__ part_idx,
                        const __half* __restrict__ x, const __half* __restrict__ weight, int V, int D, int n_valid,
                        int n_tokens) {
    gemv_f16_lm_head_block<LM_TOKENS>(logits, part_val, part_idx, x, weight, V, D, n_valid, n_tokens);
}
