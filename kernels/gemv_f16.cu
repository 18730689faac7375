// kernels/gemv_f16.cu — the FP16 lm_head GEMV on tensor cores, with the first pass of the greedy argmax.
//
//   gemv_f16_lm_head         logits fp32[V] = W x;  per block: (max logit, its index) of its 32 rows
//   gemv_f16_lm_head_tokens  the same for T ≤ 16 tokens at once, each token bit for bit the
//                            single-token kernel's (the verify pass; see "T tokens" below)
//
// The limit: HBM bandwidth. lm_head stays FP16 (docs/quantization.md#what-is-quantized): 152064 × 3584 × 2 B
// = 1.09 GB at 7B (272 MB at 0.5B), a quarter of the whole decode step's bytes, read once per
// call. Everything else (x, the logits, the partials) is under 0.1 % of that per token.
//
// Why mma.sync for a GEMV: the weights go into `mma.sync.m16n8k16` (FP16 × FP16 → FP32,
// ptx/mma.cuh) as they are loaded — no conversion, no per-token FMA. A lane spends, per k step
// of 32 inputs × 16 rows (1 KB of weights per warp), two 16-byte weight loads, one 16-byte x load
// and two MMAs per 8 tokens: a handful of instructions per 512 weights, where an FP32 FMA path
// spends a conversion per weight plus a conversion and an FMA per weight and token (at T = 16
// some 2T + 1 = 33 instructions per weight against the ~14 HBM pays for: instruction-bound). Products
// of two FP16 numbers are exact in FP32 and the sums stay FP32 (docs/numerics.md); the MMA adds
// them in its own internal order, which the tests' float64 reference bounds (TOL_LM_HEAD).
//
// Work split
// ----------
//   tile   = 16 consecutive rows of W: the A operand (M = 16) of the MMAs.
//   grid.x = ceil(V / 32) blocks of 32 rows (4752 at 7B), one argmax partial each.
//   block  = LM_WARPS = 8 warps: 2 tiles × LM_KSPLIT = 4 contiguous, balanced ranges of the
//            k steps (steps of 32 inputs; ceil(D/32) of them, 112 at 7B: 28 per warp).
//   warp   = its tile × its k range. Lane (g, t) = (lane / 4, lane % 4) loads chunk 4s + t (8 FP16,
//            16 bytes) of rows g and g + 8 for step s, so the 4 lanes of a row read 64
//            contiguous bytes per step and 256 per batch:
//
//                step s of row r:  | t=0: inputs 32s+0..7 | t=1: +8..15 | t=2: +16..23 | t=3: +24..31 |
//
//            and feeds two MMAs with them: "lo" takes inputs 0..3 of the chunk at its k positions
//            {2t, 2t+1 | 2t+8, 2t+9} (ptx/mma.cuh: the order of k inside an MMA is free as long as
//            A and B use the same one), "hi" inputs 4..7. Its B fragment is x at exactly those
//            inputs: the same chunk 4s + t of x, one 16-byte load. For one token every column of B
//            is that x, so all 8 columns of the result are the row's dot product over the warp's
//            k range; lane (g, 0) publishes rows g (c[0]) and g + 8 (c[2]).
//   reduce = the 4 warps of a tile write their partial row sums to shared memory; after the
//            __syncthreads warp j (token j) takes the block's 32 rows, lane = row, adds the 4
//            K-range partials in order 0, 1, 2, 3 (fixed, whatever T), stores its logit
//            (coalesced) and runs a warp argmax. No atomics: bit-reproducible.
//            Why the one __syncthreads is enough: each slot partial[token][kpart][row] is written
//            by exactly one lane before the barrier and only read after it; a block runs its
//            32 rows once and never writes the buffer again, so there is no reuse to order
//            (no write-after-read), and each token's argmax is one warp's butterfly, with no
//            second round through shared memory.
// D % 32 != 0: the last step's chunks past D are zero in A and B (exact zero products).
//
// Bytes in flight: a batch is LM_STEPS = 4 steps, 8 streaming 16-byte loads per lane (128 B,
// 4 KB per warp, 32 KB per block), all issued before the batch's MMAs; the next batch is issued
// before the current one is multiplied, so a warp has 4–8 KB on its way. Weights use
// ld_stream_v4 (L1::no_allocate, L2 evict-first, no prefetch size: ptx/ldst.cuh). At two blocks
// per SM (the register counts below) that is 64–128 KB per SM, over the ~32 KB the H200 needs to
// read at the HBM rate (docs/kernels.md, "The warp-specialised TMA version").
//
// x (T × 7 KB at 7B) is read through L1 with ordinary loads, not staged in shared memory: every
// block on the SM reads the same bytes, the weights (which bypass L1) cannot evict them, and a
// block needs no prologue or barrier after the wait before its first MMA. Staging would cost
// each of the 4752 blocks T·2D bytes of L2 traffic and, at T = 16, 115 KB of shared memory
// (one block per SM).
//
// PDL (ptx/griddep.cuh): the first batch of weights is requested before grid_dependency_wait()
// — for the blocks of the first wave it arrives under the final norm's tail — and x, that
// kernel's output, is read only after it. grid_launch_dependents() at the start.
//
// Rows n_valid … V-1 (the padding past the tokenizer's ids, `.nanoqwen` text_vocab) get the
// logit -inf: the row's dot product is still computed (the loads are the bandwidth-bound part
// either way, and 271 of 151936 rows are 0.2 % of them), then replaced. Rows past V (the last
// block) read row V - 1 and are never stored.
//
// Fused argmax, pass 1: each block writes the best (value, index) of its 32 rows to
// part_val/part_idx[blockIdx.x] (larger value wins, lower index on ties: argmax_better,
// ptx/warp.cuh; a strict total order, so the butterfly's answer does not depend on the order
// the candidates meet), so argmax_final (argmax.cu) reduces 4752 pairs instead of re-reading
// 608 KB of logits.
//
// Registers (ptxas, sm_90a, no spills): gemv_f16_lm_head 96, gemv_f16_lm_head_tokens 106
// (LM_TOKENS = 16; 94 when built with -DLM_TOKENS=8): two blocks of 256 threads per SM for both,
// so one build serves every T ≤ 16. Static shared memory: 512 B / 8 KB (the partials).
//
// Measured on the H200, 7B (tools/bench_verify.py --kernels: eager, an event pair around each
// launch, ~2 µs of it the pair's own; docs/bench/2026-12-02_f6448f9_h200_syn7b_verify.json), µs:
//   | kernel                         | 1 token | T = 1 | T = 2 | T = 4 | T = 8 | T = 16 |
//   | this one (mma.sync)            |  264.7  | 263.6 | 265.2 | 266.6 | 293.2 | 409.6  |
//   | FP32 FMA (commit bbfc301's)    |  259.0  | 307.9 | 342.8 | 435.2 | 638.8 | 1042.8 |
// (the FMA row from docs/bench/2026-12-02_bbfc301_h200_syn7b_verify.json, another run). The
// bandwidth limit is ~255 µs (1.09 GB at the ~4.3 TB/s copy bandwidth): one token is within
// 4 % of it; T = 8 is 11 % over the single token. Whether the single-token call lost the 2 %
// against the FMA kernel or the runs differ is for a run that times both. argmax_final over
// the 4752 partials: 3.9 µs.
//
// T tokens at once
// ----------------
// The verify pass of speculative decoding needs the logits of T = k + 1 ≤ 16 positions, each bit
// for bit what gemv_f16_lm_head computes for that position alone. gemv_f16_lm_head_block<NTOK> is
// one body: NTOK = 1 for the single-token kernel, NTOK = LM_TOKENS for gemv_f16_lm_head_tokens
// (T = n_tokens ≤ NTOK at run time).
//   The column trick: column n of MMA b (b < ceil(NTOK/8)) takes token 8b + n: lane (g, t)
//   supplies token 8b + g's x at exactly the inputs it supplies in the single-token kernel (chunk
//   4s + t), and after the MMA holds columns 2t, 2t + 1 — tokens 8b + 2t, 8b + 2t + 1 — of rows g
//   (c[b][0], c[b][1]) and g + 8 (c[b][2], c[b][3]). The same A fragments feed every MMA b. Columns
//   past T repeat token T - 1 (finite, never stored); MMA 1 is skipped when T ≤ 8.
//   Why it is exact: each element of an MMA's result is its own dot product over the 16 k of its
//   row of A and column of B, plus its own element of C; nothing of the other columns enters it.
//   Token j's column therefore sees, step by step, the same A fragments, the same B values at
//   the same k positions and the same accumulator as the single-token kernel's column for x_j:
//   the same chain of MMAs (lo then hi, steps in order) over the same k range (the K split
//   depends on D only), the same K-range partials added in the same order (0, 1, 2, 3, not
//   depending on T), the same -inf padding, the same argmax over the same (value, row) set.
//   The T-token launch has the single-token grid and block (launchers/gemv_f16.py); the outputs
//   are [T, …]: logits [T, V], part_val / part_idx [T, gridDim.x], and argmax_final_tokens
//   (argmax.cu) picks each token's from its own row.
//   Bytes per call: the weights once for all T tokens (1.09 GB at 7B), plus T × (x 7 KB read +
//   logits 608 KB written).
//   Work per weight grows with T only in the MMAs (two per 8 tokens and step) and the x loads
//   (one per 8 tokens and step, through L1): at T = 16, 4 MMAs per 1 KB of weights per warp.
//
// Requirements (checked by the launcher): D % 8 == 0, D > 0; 1 ≤ n_valid ≤ V; pointers 16-byte
// aligned.
#include <cuda_fp16.h>

#include "types.cuh"    // u32, u64, WARP_SIZE, QUAD_SIZE, F32_NEG_INF
#include "ldst.cuh"     // ld_stream_v4, l2_evict_first_policy
#include "mma.cuh"      // mma_m16n8k16_f32_f16
#include "warp.cuh"     // argmax_better, warp_argmax
#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents

#define LM_WARPS          8
#define LM_TILE_ROWS      16                             // rows of one 16-row tile: the M of the MMA
#define LM_TILES          2                              // tiles per block
#define LM_ROWS_PER_BLOCK (LM_TILES * LM_TILE_ROWS)      // 32: one argmax partial each
#define LM_KSPLIT         (LM_WARPS / LM_TILES)          // warps that split K for one tile
#define LM_STEP_CHUNKS    QUAD_SIZE                      // 16-byte chunks of a row per k step: one per lane t
#define LM_MMA_TOKENS     8                              // tokens one MMA takes: the N of m16n8k16
#define INT_MAX_I32       0x7fffffff
// k steps (32 inputs of 16 rows each, 1 KB of weights per warp) whose loads a lane issues
// together: 2·LM_STEPS 16-byte loads per lane per batch, the next batch in flight while the
// current one is multiplied.
#ifndef LM_STEPS
#define LM_STEPS 4
#endif
// Tokens gemv_f16_lm_head_tokens is built for (launchers/gemv_f16.py mirrors it): 16, two MMAs
// per k step and half-chunk, the second skipped at run time when T ≤ 8. Overridable
// (-DLM_TOKENS=8: one MMA, 94 registers) for a benchmark; the launcher uses the default build.
#ifndef LM_TOKENS
#define LM_TOKENS 16
#endif
static_assert(LM_TOKENS >= 1 && LM_TOKENS <= 2 * LM_MMA_TOKENS, "LM_TOKENS: 1 … 16");
static_assert(LM_KSPLIT * LM_TILES == LM_WARPS, "every warp has one tile and one K range");

// One batch of weights as lane (g, t) holds it: chunk 4s + t of rows g and g + 8 of its tile
// for LM_STEPS consecutive k steps s.
struct LmBatch {
    uint4 w[LM_STEPS][2];  // [step][MMA row g, g + 8], 8 fp16 each
};

// The lm_head of one block for T ≤ NTOK tokens (n_tok = T at run time): logits [T, V], part_val /
// part_idx [T, gridDim.x], x [T, D]. NTOK = 1 is the single-token kernel. Contains __syncthreads():
// every thread of the block calls it.
template <int NTOK>
__device__ __forceinline__ void gemv_f16_lm_head_block(float* __restrict__ logits, float* __restrict__ part_val,
                                                       int* __restrict__ part_idx, const __half* __restrict__ x,
                                                       const __half* __restrict__ weight, int V, int D, int n_valid,
                                                       int n_tok) {
    constexpr int MMAS = (NTOK + LM_MMA_TOKENS - 1) / LM_MMA_TOKENS;  // MMAs per k slice: 1, or 2 above 8 tokens
    __shared__ float partial[NTOK][LM_KSPLIT][LM_ROWS_PER_BLOCK];     // [token][K range][row of the block] fp32

    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int tile = warp / LM_KSPLIT, kpart = warp % LM_KSPLIT;
    const int T = NTOK == 1 ? 1 : min(n_tok, NTOK);  // the launcher checks 1 ≤ n_tok ≤ NTOK
    const int n_chunks = D / 8;
    const int n_steps = (n_chunks + LM_STEP_CHUNKS - 1) / LM_STEP_CHUNKS;
    // This warp's contiguous, balanced share of the k steps (empty for some warps when D < 128).
    const int sb = kpart * n_steps / LM_KSPLIT, se = (kpart + 1) * n_steps / LM_KSPLIT;
    const int row_g = blockIdx.x * LM_ROWS_PER_BLOCK + tile * LM_TILE_ROWS + g;
    // Rows past V (the last block) read row V - 1 and are never stored.
    const uint4* w_g = reinterpret_cast<const uint4*>(weight + (u64)min(row_g, V - 1) * D) + t;
    const uint4* w_g8 = reinterpret_cast<const uint4*>(weight + (u64)min(row_g + 8, V - 1) * D) + t;
    // The x behind this lane's B fragments: column g of MMA b is token 8b + g (NTOK = 1: the one
    // token in every column). Columns past T repeat token T - 1: finite, never stored.
    const uint4* x_lane[MMAS];
#pragma unroll
    for (int b = 0; b < MMAS; ++b)
        x_lane[b] = reinterpret_cast<const uint4*>(x) +
                    (u64)(NTOK == 1 ? 0 : min(LM_MMA_TOKENS * b + g, T - 1)) * n_chunks + t;
    const u64 policy = l2_evict_first_policy();

    grid_launch_dependents();
    int ld_s = sb;
    auto load = [&](LmBatch& b) {
#pragma unroll
        for (int u = 0; u < LM_STEPS; ++u) {
            const int s = ld_s + u;
            if (s >= se) break;  // warp-uniform
            if (LM_STEP_CHUNKS * s + t < n_chunks) {
                b.w[u][0] = ld_stream_v4(w_g + LM_STEP_CHUNKS * s, policy);
                b.w[u][1] = ld_stream_v4(w_g8 + LM_STEP_CHUNKS * s, policy);
            } else {  // past D (D % 32 != 0, the last step): zero weights, zero products
                b.w[u][0] = b.w[u][1] = make_uint4(0, 0, 0, 0);
            }
        }
        ld_s += LM_STEPS;
    };

    LmBatch cur, next;
    load(cur);
    grid_dependency_wait();

    float c[MMAS][4];
#pragma unroll
    for (int b = 0; b < MMAS; ++b) c[b][0] = c[b][1] = c[b][2] = c[b][3] = 0.f;
    for (int s0 = sb; s0 < se; s0 += LM_STEPS) {
        load(next);  // in flight while `cur` is multiplied
#pragma unroll
        for (int u = 0; u < LM_STEPS; ++u) {
            const int s = s0 + u;
            if (s >= se) break;  // warp-uniform
            const bool in_d = LM_STEP_CHUNKS * s + t < n_chunks;
            // k positions {2t, 2t+1 | 2t+8, 2t+9} of MMA lo take inputs 0..3 of the lane's chunk,
            // those of MMA hi inputs 4..7, in A (rows g, g + 8) and in B (x) alike.
            const uint4 wg = cur.w[u][0], wg8 = cur.w[u][1];
            const u32 a_lo[4] = {wg.x, wg8.x, wg.y, wg8.y};
            const u32 a_hi[4] = {wg.z, wg8.z, wg.w, wg8.w};
#pragma unroll
            for (int b = 0; b < MMAS; ++b) {
                if (b > 0 && T <= LM_MMA_TOKENS * b) break;  // warp-uniform: no token in MMA b
                const uint4 xv = in_d ? x_lane[b][LM_STEP_CHUNKS * s] : make_uint4(0, 0, 0, 0);
                mma_m16n8k16_f32_f16(c[b], a_lo, xv.x, xv.y);
                mma_m16n8k16_f32_f16(c[b], a_hi, xv.z, xv.w);
            }
        }
        cur = next;
    }

    // Lane (g, t) holds columns 2t, 2t + 1 of MMA b: tokens 8b + 2t + h, rows g (c[b][h]) and
    // g + 8 (c[b][2 + h]). NTOK = 1: every column is the one token; lane t = 0 publishes column 0.
    if (NTOK > 1 || t == 0) {
#pragma unroll
        for (int b = 0; b < MMAS; ++b)
#pragma unroll
            for (int h = 0; h < (NTOK == 1 ? 1 : 2); ++h) {
                const int tok = NTOK == 1 ? 0 : LM_MMA_TOKENS * b + 2 * t + h;
                if (tok >= T) continue;
                partial[tok][kpart][tile * LM_TILE_ROWS + g] = c[b][h];
                partial[tok][kpart][tile * LM_TILE_ROWS + g + 8] = c[b][2 + h];
            }
    }
    __syncthreads();

    // Token j's 32 logits by warp j % 8, lane = row of the block: the K ranges added in order.
    for (int j = warp; j < T; j += LM_WARPS) {
        float sum = partial[j][0][lane];
#pragma unroll
        for (int q = 1; q < LM_KSPLIT; ++q) sum += partial[j][q][lane];
        const int row = blockIdx.x * LM_ROWS_PER_BLOCK + lane;
        // Each lane starts from (-inf, INT_MAX_I32), which any row's logit but a NaN beats: a row
        // past V leaves it there, and the butterfly picks the best of the 32 lanes.
        float best_v = F32_NEG_INF;
        int best_i = INT_MAX_I32;
        if (row < V) {
            // No text comes of a padded row: its logit is -inf, out of this argmax and of
            // sample_token, which reads these logits (the CPU backend masks the same rows).
            const float logit = row < n_valid ? sum : F32_NEG_INF;
            logits[(u64)j * V + row] = logit;
            if (argmax_better(logit, row, best_v, best_i)) { best_v = logit; best_i = row; }
        }
        warp_argmax(best_v, best_i);
        if (lane == 0) {
            part_val[(u64)j * gridDim.x + blockIdx.x] = best_v;
            part_idx[(u64)j * gridDim.x + blockIdx.x] = best_i;
        }
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
