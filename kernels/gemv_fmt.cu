// kernels/gemv_fmt.cu — the decode GEMVs over the per-tensor weight formats (weight_formats.cuh:
// the GGUF's own Q4_0 … Q6_K blocks), with the fusions of the INT4 step (gemv_int4.cu), and the
// embedding row read in its format.
//
//   gemv_fmt_f16             y fp16[N]          = W x
//   gemv_fmt_qkv_rope        q, K/V cache slot  = rope([Wq; Wk; Wv] · rmsnorm(residual) + bias)
//                                                 (q, k and v each in its own format)
//   gemv_fmt_residual        residual fp32[N]  += W x                        (o_proj, down_proj)
//   gemv_fmt_gate_up_swiglu  h fp16[F]          = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual)
//   gemv_fmt_lm_head         logits fp32[V]     = W xn, + per block (max logit, its row)
//   embedding_fmt            residual fp32[D]   = embed[state[1]]        (decode)
//   embedding_fmt_rows       residual[r]        = embed[ids[r]]          (prefill)
//
// The bytes: the format's bits per weight (4.5 for Q4_0/Q4_K … 8.5 for Q8_0; the real 0.5B's
// Q4_K_M GGUF averages 5.6), each weight read once per launch. The floor is HBM bandwidth, but
// the limit these kernels meet first is instruction issue (measured below).
//
// Work split
// ----------
// gemv_int4.cu's, with one change that lets every format keep its own scale groups:
//   tile   = 16 output rows (the M of one m16n8k16 MMA); gate/up pairs the same rows of both.
//   grid   = blocks that own contiguous ranges of tiles, in one wave. A block works on ONE
//            matrix, so one format: qkv gives q_blocks blocks to q, k_blocks to k and the rest
//            to v (the launcher splits the wave by makespan, a tile weighed by its bytes:
//            launchers/gemv_fmt.py split_blocks), and the block picks its format's
//            engine once (WF_DISPATCH); a format never changes inside a warp's loop.
//   block  = W warps splitting K into W contiguous ranges of 128 inputs ("quads").
//   warp   = items (tile, quad) in batches, the next batch in flight while one is multiplied.
//            Lane (g, t) = (lane/4, lane%4) loads chunk 4·quad + t (inputs 32t … 32t+31 of the
//            quad) of rows g and g + 8: the quad's 4 lanes read 64 (128) contiguous bytes of
//            each row, as in gemv_int4.cu, and with 4–6-bit codes (tile-major on the GPU,
//            weight_formats.cuh) the warp's codes of an item are 1 KiB of contiguous memory.
//   MMA    = 8 m16n8k16 per chunk and row pair, A = the chunk's codes: for 4-, 5- and 8-bit
//            codes with one scale a chunk (all but Q6_K, "Codes as subnormals" below) the codes
//            c as FP16 subnormals c·2⁻²⁴ (wf_pairs_tiny), else c − z exact in FP16 (wf_pairs).
//            gemv_int4.cu lets an MMA add the 4 lanes' inputs together, which is right only
//            when the 4 chunks share a scale (int4_g128's 128-input groups). Here each lane's
//            chunk has scales of its own (groups of 32 or 16), so B masks x per lane: column n
//            of B holds x only at the k positions of lane t = n / 2, zero elsewhere. Lane
//            (g, t) supplies B[·][g] (ptx/mma.cuh), so lanes with g / 2 == t hand in their
//            chunk's x and the others zeros, and then C[g][2t] — lane (g, t)'s c[0] — is the
//            dot product of lane (g, t)'s own 4 inputs of row g (c[2]: row g + 8). Every
//            product of A is used; only B's columns are sparse, and the tensor cores are far
//            from the limit at batch 1. After each scale group (4 or 8 MMAs) the lane adds
//            s · c (+ o · Σx of the group for the formats with an offset; the subnormal codes:
//            s·2²⁴ · c, then o · Σx or −z·s · Σx) to FP32 accumulators.
//   reduce = at a tile's end (GF_FLAT_SPLIT: also at the end of the warp's range), the quad's 4
//            lanes add up (shfl_xor_f32 over lanes 1 and 2 apart: a fixed order), lane
//            t = 0 writes the warp's row sums to shared memory; after the block's loop one
//            thread per row pair adds the W warp partials in warp order and runs the epilogue.
//            No atomics: bit-reproducible.
// x is staged once per block in shared memory (K·2 bytes; natural order, or gf_tiny_order's for
// the subnormal codes), with Σx of every 32-input chunk (K/32 fp32, written and read only where
// gf_block's XSUM holds: the formats with an offset, and the subnormal codes' z), then the warp
// partials.
//
// Barriers, and why nothing races: shared memory is written in two phases, each closed by a
// __syncthreads that every thread of the block reaches (the format is chosen per block, so the
// whole block takes the same branch; a block with an unknown id returns before any barrier).
//   1. the prologue writes x_smem and, where XSUM (a format with an offset, or the subnormal
//      codes), xsum (x_smem: each thread its own 8-input pieces; xsum: each chunk's first lane,
//      after a warp shuffle of registers); __syncthreads; from then on they are only read
//      (xsum only by the format that wrote it: the block's one format F decides both, and x's
//      order with them).
//   2. the main loop writes partial[tile][m][warp][row]: each (tile, warp, row) slot by exactly
//      one lane (t = 0 of its quad; GF_FLAT_SPLIT: the zeros of the tiles a warp's range does not
//      reach are written before the loop, by the same rule); gf_reduce's __syncthreads; then one thread per row pair
//      reads them. Nothing is written to shared memory after that barrier.
// The RMSNorm prologue's own __syncthreads (rmsnorm.cuh) orders its warp sums the same way.
// Global outputs: each element is written by one thread of one block (no atomics).
// PDL as in gemv_int4.cu: the first batch of weights is requested before griddepcontrol.wait.
// A decode kernel's block is a device function over its BlockCoord and Dep (block_coord.cuh:
// `gemv_fmt_qkv_rope_item`, …, `embedding_fmt_item`), which the kernel calls with its own launch's
// and which decode_persistent.cu runs as items of the persistent step; a persistent block's warps
// past the planned block's W take part in the barriers only (gf_block).
//
// Measured on the H200 (each launch alone, a graph of back-to-back launches, random weights;
// docs/bench/2026-12-01_3c7fde7_h200_gemv_fmt_7b_shapes.json), µs per call at 7B shapes:
//   | format      | o_proj 3584×3584 | down_proj 3584×18944 | GB/s (down) |
//   | int4_g128   |  5.52            | 16.57                | 2117        |  gemv_int4.cu: 4.52 / 15.00
//   | q4_g32      |  5.63            | 16.52                | 2315        |
//   | q5_g32      |  6.76            | 21.37                | 2188        |
//   | q8_g32      |  6.72            | 22.89                | 3154        |
//   | q4_k        |  6.38            | 21.19                | 1806        |
//   | q5_k        |  7.72            | 27.23                | 1717        |
//   | q6_k        |  7.12            | 23.86                | 2337        |
// The limit these kernels meet is issue, not bandwidth: Nsight Compute on the q4_k and q4_g32
// down_proj (same 38.6 MB from DRAM) counts 8.95 M against 6.04 M warp instructions, at ~0.45
// issued per scheduler and cycle with 3.3 warps each: every instruction per 32-input chunk
// (unpack, scale, the K-quants' 6-bit (sc, m) and their shuffles) is time. Keeping more bytes in
// flight per warp (GF_UNROLL 4) needs more than 128 registers and spills. Integer dot products
// on int8 activations (llama.cpp's: x in blocks of 32 with a scale each) would remove most of the
// unpack, but move the real 0.5B's logits to a minimum cosine of 0.99917 against the reference,
// where the target is 0.9999 (docs/numerics.md: "Activations stay FP16"). These figures, and
// those below: docs/bench/2026-12-01_2d1fca6_h200_gemv_fmt_7b_shapes.json.
//
// Where a warp's cycles go (Nsight Compute, q4_k gate_proj shape, cycles per issued
// instruction 6.98 at 3.46 warps per scheduler): wait (fixed-latency dependencies) 1.75,
// barrier 0.97 (the x prologue and the block's final reduce: ramp-up and drain), math pipe
// throttle 0.60, long scoreboard (global loads) 0.58 — the loads are not what it waits for.
// These runs computed every item's load addresses from (row, chunk) (wf_load per item: ~50 of
// the loop's ~270 SASS instructions per item, 8 more gathering the quad's scale words); the load
// cursor below is not in them. Tried and not kept, each timed against that loop in one run
// (docs/bench/2026-12-01_h200_gemv_fmt_loop_variants.json, with the patches): 2 or 4 independent
// MMA accumulator chains per scale group (±2%: noise); the zero lanes of B loaded from 64 B of
// zeros instead of zeroed registers (±4%, no direction); the loop unrolled into (cur, next) /
// (next, cur) halves to drop the `cur = next` moves (7–15% slower: twice the code). What is left
// besides is the launch itself — its prologue, drain and barrier — which the persistent decode
// kernel removes.
//
// Load addresses: each lane keeps, per matrix, the addresses of its chunk in every plane of row
// g (the load cursor, gf_block: wf_addr once, then moved down to each next tile's rows by
// wf_addr_rows). An item's addresses are one 64-bit multiply-add per plane from it for row g
// (wf_addr_quads) and one per plane from those for row g + 8 (wf_addr_rows, by a step made once a
// tile: wf_row_step, as the tile-major codes move by the rows' places), where wf_load per
// item recomputes the tile's rows, each plane's row offset and chunk term and the super-block.
// SASS instructions per item of the main loop in a stretch where the tile carries on (NVRTC 13.0
// as the launchers compile, cuobjdump; a uniform branch counts half its instructions), with the
// cursor / with wf_load per item:
//   | build (WF_FORMATS)        | format | residual, f16, lm_head | qkv_rope    | gate_up   |
//   | the 7B's {q4_k, q6_k}     | q4_k   | 201–202.5 / 231.5      | 201.5 / 265 | 374 / 396 |
//   |                           | q6_k   | 234 / 243.5            | 227 / 284   | 427 / 439 |
//   | the 0.5B's {q5_0, q8_0,   | q4_k   | 194.5 / 225.5          | 194.5 / 254 | 344 / 386 |
//   |   q4_k, q6_k}             | q5_0   | 206 / 212.5            | 198 / 241.5 | 361 / 382 |
//   |                           | q8_0   | 149 / 155              | 140 / 182   | 244 / 281 |
//   |                           | q6_k   | 231 / 236              | 220 / 264.5 | 406 / 428 |
// qkv_rope's q and k blocks pair rows for RoPE, a division per item without the cursor. In
// residual, f16 and lm_head ptxas often predicates the tile switch (gf_block: next_tile) into
// every item instead of branching around it (q6_k here; q5_0 and q8_0 in the 0.5B's build): 8–10
// of their instructions per item. Both builds fit 128 registers without spills in every kernel,
// qkv_rope and gate_up with 2 blocks per SM.
//
// Occupancy is the other lever: qkv_rope and gate_up need 150–180 registers when compiled for
// every format and run one block of 8 warps per SM; compiled for one model's formats
// (WF_FORMATS, launchers/gemv_fmt.py: format_defines) they fit 128 and run 2. Measured, q4_k
// gate_up at the 7B shape 37.3 → 32.6 µs; qkv_rope (q4_k, q4_k, q6_k) stays at 13.0–13.1,
// where splitting the wave over q, k and v by makespan (launchers/gemv_fmt.py: split_blocks)
// had taken it from 15.4. The whole decode step on the synthetic 7B in llama.cpp's Q4_K_M
// layout: graph ITL 2.60 ms (docs/bench/2026-12-01_2d1fca6_h200_syn7b_q4_k_m.json), on the
// 0.5B shape 0.748 ms (…_syn05b_q4_k_m.json; 0.794 before these changes). With the load cursor,
// against the same step without it in turns: the 7B in Q4_K_M 2.553 / 2.555 ms against 2.614 /
// 2.590, the 0.5B 0.764 / 0.750 against 0.749 / 0.751
// (docs/bench/2026-12-04_{5a1cebb,a204a0f}_h200_syn{7b,05b}_q4_k_m_{cursor,parent}_*.json); alone
// (tools/bench_gemv.py --formats all, …_gemv_formats_{cursor,parent}.json) most GEMVs move within
// ±2 %: fewer instructions per item buy a little where the loop waits on issue, not more.
// Compiling each kernel for its own role's formats only (gate_up for Q5_0 alone in the real
// 0.5B's model) would also shrink its code, 100–118 KB a fused kernel built for four formats:
// Nsight Compute puts a third of those kernels' warp samples on instruction fetch, in the reduce
// and epilogue after the main loop, but only after its cache flush; in the step, where the code
// stays in L2, the same GEMVs built for two formats took as long (docs/benchmarks.md, the
// 2026-12-07 rows on a kernel file built for fewer formats). So the build stays per model.
// Tried and not kept: Q4_K on gemv_int4.cu's engine (commit 000bd01: a Q4_K weights policy of
// that engine and its residual and gate/up kernels, the decode step's Q4_K o_proj, gate/up and
// down_proj on them). There a lane's 32 inputs of an item are one whole sub-block, so its A
// fragments can carry that sub-block's scale and one MMA adds the quad's four chunks, where this
// file gives each lane an MMA column: c·sc is exact in FP16 (fma of the magic-number code
// 1024 + c by sc with −1024·sc, or of 1024 + 16c by sc/16 with −64·sc: the unpack costs what
// INT4's does), the super-block's d multiplies the MMA sum in FP32, and Σ_t m_t·Σx_t comes from
// one more MMA over each chunk's Σx held as an FP16 pair (hi, lo), times −dmin. The weights are
// exact (y = W x within 1.5e-7 rel L2 of float64 at the 7B shapes), but the lane's 6-bit
// (sc, m) decode, the quad's four shuffles of the 16 scale bytes and the offset MMA cost ~75
// SASS instructions an item (193 against INT4's 117: cuobjdump, nvcc -O3), about what this
// file's four MMA columns cost, and the times moved both ways — tools/bench_gemv.py --formats
// q4_k at the 7B shapes, no PDL, this file against it: gate_up 35.3 / 32.7 µs, gate_proj
// 17.6 / 18.7, down_proj 19.8 / 21.4, o_proj 7.2 / 7.1; the synthetic 7B in Q4_K_M, graph ITL
// 2.524 ms against 2.525 / 2.549 (docs/bench/2026-12-04_000bd01_h200_*q4k*.json). Where its
// time would come from next: one decode of the scales per super-block (items of 256 inputs:
// half the shuffles and decodes a weight), not per 128-input group.
//
// Codes as subnormals (GF_TINY, the default): the magic-number unpack (wf_pairs) ORs each code
// under 0x6400 (the FP16 1024) and then takes the 1024 and z off with one sub.f16x2 or
// fma.f16x2 a pair — a third of its instructions at 4 bits, each one more step in the chain
// from the load to the MMA. Left without the 0x6400, the masked bits are FP16 subnormals c·2⁻²⁴
// (16c·2⁻²⁴ for the nibbles at bits 4–7), which the tensor cores multiply exactly (FP16
// products are exact in them; subnormal inputs are not flushed — measured, not promised: the
// PTX ISA leaves mma's handling of subnormal inputs unspecified, and
// tests/test_kernel_gemv_fmt.py's integer case, every partial sum an integer, holds each format's
// residual GEMV to float64 bit for bit). What the fixups did moves after the MMAs, once a chunk and row instead of
// once a pair: the nibbles at bits 4–7 (inputs 2, 3, 6, 7 of each 8) get MMAs of their own, so
// each 8-MMA chain of a chunk becomes two independent chains of 4 (lo, hi) whose sums add as
// lo + hi/16; the 2²⁴ goes into the scale; z (the formats without an offset) becomes −z·s·Σx
// of the chunk, from the Σx the offset formats already stage. x is staged with the pairs of
// inputs (0, 1), (4, 5), (2, 3), (6, 7) of each 8 in that order (gf_tiny_order), so each MMA's
// B is two consecutive registers of one 16-byte shared-memory load (in natural order ptxas
// needed ~28 moves a chunk to pair them). The sums change rounding (c·x in two chains, z after
// the MMA in FP32), within the tests' bounds. SASS of the main loops, two blocks an SM, default
// against GF_TINY=0 (tools/sass_loops.py gemv_fmt, NVRTC 13.0; a loop of 2 items, gate/up 1 item
// of 2 matrices): the 7B's {q4_k, q6_k} build, q4_k residual 401 against 459, gate_up 351 / 414,
// qkv_rope 463 / 521 (q6_k unchanged: 545, 493, 610); {q5_k, q6_k}: q5_k residual 526 / 596,
// gate_up 467 / 538, qkv_rope 593 / 663; the real 0.5B's {q5_0, q8_0, q4_k, q6_k}: residual
// 291 / 344 (q8_0), 397 / 458, 401 / 459, gate_up 251 / 299, 351 / 409, 354 / 417; registers the
// same or fewer (125 against 128 at gate_up there), no spills. Measured (one H100, 3023 GB/s
// copy; tools/bench_gemv.py --formats q4_k q5_k q6_k q5_g32 q8_g32 --fmt-shapes gate_up_swiglu
// down_proj o_proj --fmt-defines GF_TINY=1 GF_TINY=0, each format's own build, 7B shapes, µs
// default / GF_TINY=0; docs/bench/2026-12-06_4896769_h100_gemv_fmt_tiny.json):
//   q4_k   gate_up 36.63 / 36.93   down 19.15 / 19.79   o_proj 6.55 / 6.79
//   q5_k           48.67 / 49.50        25.58 / 26.93          8.14 / 8.32
//   q5_g32         48.30 / 48.21        25.85 / 26.25          7.49 / 7.75
//   q8_g32         53.37 / 53.29        28.20 / 28.36          7.50 / 7.72
//   q6_k           57.62 / 57.75        27.89 / 27.91          7.76 / 7.78   (the same code)
// — 2–5 % at o_proj and down_proj, nothing at gate_up, whose load stream (69 % of copy at q4_k)
// is its limit on this GPU. The synthetic 7B in llama.cpp's Q4_K_M layout, graph ITL, three
// rounds in turns with its parent (tools/bench_commits.py): 2.622 / 2.620 / 2.621 ms against
// 2.673 / 2.672 / 2.673 (docs/bench/2026-12-06_{4896769,4b0ad8c}_h100_syn7b_q4_k_m_*tiny_*.json).
// Requirements (checked by launchers/gemv_fmt.py): K % 128 == 0 (K % 256 for the K-quants);
// 1 ≤ W ≤ K/128; Dh % 16 == 0 for qkv; gate and up in one format; pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"           // u32, u64, WARP_SIZE, QUAD_SIZE
#include "ldst.cuh"            // l2_evict_first_policy
#include "mma.cuh"             // mma_m16n8k16_f32_f16
#include "warp.cuh"            // shfl_xor_f32, warp_argmax, argmax_better
#include "block_coord.cuh"     // BlockCoord, GridDep
#include "int4_matmul.cuh"     // INT4_TILE_ROWS, int4_tiles, gemv_tile_rows, gemv_store_rows, swiglu_f16
#include "rmsnorm.cuh"         // rmsnorm_inv_rms, rmsnorm_apply4, RMSNORM_WARPS
#include "rope.cuh"            // rope_rotate
#include "kv_cache.cuh"        // kv_offset, PAGE_TOKENS
#include "weight_formats.cuh"  // WfWeight, WfRaw, WfAddr, wf_addr(_quads, _rows), wf_load(_at), wf_pairs,
                               // wf_scales, wf_dequant, WF_DISPATCH

#define GF_MAX_WARPS 8    // K-split warps per block
// Registers: the plain GEMVs and the lm_head ask for GF_MIN_BLOCKS = 2 blocks per SM
// (__launch_bounds__(256, 2): ≤ 128 registers, no spills). The qkv (RoPE epilogue) and gate/up (two matrices) kernels ask
// for GF_QKV_MIN_BLOCKS and GF_GATE_UP_MIN_BLOCKS: compiled for every format (WF_FORMATS'
// default) they need 150–180 registers, so one block of 8 warps per SM; compiled for one
// model's formats (Q4_K with Q6_K, or the real 0.5B's Q5_0, Q8_0, Q4_K and Q6_K) they fit 128
// without spilling, and the launcher asks for 2 (launchers/gemv_fmt.py: format_defines keeps
// 2 for each kernel only where ptxas reports no spills in it).
// GF_MIN_BLOCKS (default 2) is the plain GEMVs' and the lm_head's: at 1, with fewer
// warps a block (tools/bench_gemv.py --formats … --warps 4), deeper batches (GF_UNROLL 4) get
// the registers they need — q4_k's gate/up 167, 3 blocks of 4 warps an SM — where 2 blocks of
// 8 warps leave 128 and spill them. Measured (7B shapes, one run, µs, the default GF_UNROLL 2 at
// 2 blocks of 8 warps first; docs/bench/2026-12-05_e6b8a90_h200_gemv_fmt_occupancy.json):
//   | format, GEMV     | default | 4 warps | GF_UNROLL 4, 1 block | the same, 4 warps |
//   | q4_k gate_up     |  31.24  |  31.42  |  35.75               |  31.14            |
//   | q4_k down_proj   |  19.89  |  22.78  |  23.12               |  23.18            |
//   | q4_k o_proj      |   6.92  |   7.08  |   7.35               |   7.25            |
//   | q6_k gate_up     |  43.98  |  45.77  |  42.18               |  39.46            |
//   | q6_k down_proj   |  22.49  |  23.96  |  23.69               |  24.35            |
//   | q6_k o_proj      |   7.55  |   7.43  |   7.88               |   7.71            |
// Only Q6_K's gate/up gains (10 %, bound by its load stream, as above); Q4_K's is even and every
// plain GEMV loses. The default stays; a Q6_K gate/up build of its own is the one to wire in.
#ifndef GF_MIN_BLOCKS
#define GF_MIN_BLOCKS 2
#endif
#ifndef GF_QKV_MIN_BLOCKS
#define GF_QKV_MIN_BLOCKS 1
#endif
#ifndef GF_GATE_UP_MIN_BLOCKS
#define GF_GATE_UP_MIN_BLOCKS 1
#endif
#define GF_QUAD      128  // inputs per item and lane quad (4 chunks)
#define LM_FMT_PART_MAX 8 // warps whose argmax candidates a block compares (GF_MAX_WARPS)
// Items per load batch for one matrix (fewer for gate/up, and for 8- and 16-bit codes, whose
// chunks are 2 and 4 times the bytes): ~2 KB per warp per batch, the next in flight behind it.
#ifndef GF_UNROLL
#define GF_UNROLL 2
#endif
// GF_UNROLL_4BIT: GF_UNROLL for the one-matrix GEMVs (residual, f16, qkv's blocks, lm_head) over
// 4-bit codes without high bits (q4_g32, q4_g32_min, q4_k; int4_g128): their items are the
// smallest in registers, so twice the batch fits where a 5-, 6- or 8-bit format's does not — in
// a model's build the largest format's batch sets the kernel's registers. ptxas (NVRTC 13.0),
// the 7B's {q4_k, q6_k} build at 2 blocks an SM with GF_UNROLL_4BIT=4: residual, f16, lm_head and
// qkv_rope at 128 registers without spills (q4_k's batch 4 items, q6_k's 2), gate/up as before;
// the real 0.5B's {q5_0, q8_0, q4_k, q6_k}: qkv_rope spills 16 bytes
// (docs/bench/2026-12-06_2d98fb9_cpu_sass_gemv_fmt_*_unroll4bit.json). A compile-time choice for
// tools/bench_gemv.py --fmt-defines (default: GF_UNROLL, the same code). Measured on one H100,
// each format's own build, as programmatic dependents (tools/bench_gemv.py --preset 7b --formats
// q4_k q6_k --fmt-shapes qkv_rope o_proj down_proj --fmt-defines "" GF_UNROLL_4BIT=4 --pdl; µs,
// batch of 2 / 4 items; docs/bench/2026-12-07_3af20d8_h100_bench_gemv_7b_fmt_unroll4bit.json):
// q4_k qkv_rope 8.01 / 7.52, o_proj 4.77 / 5.09, down_proj 15.02 / 15.17 (q6_k, not affected:
// 10.20 / 10.20 at qkv_rope). Tried for qkv_rope alone in the 7B's Q4_K_M build (q4_k with q6_k;
// commit ced2fff, a define of that kernel's own that format_defines set where it fit 2 blocks):
// the step's qkv_rope launches, each timed alone (drvqwen bench --kernels), took 397.4 / 398.4 µs
// over the 28 layers against 386.8 / 386.7, and the graph ITL 2.154 / 2.143 / 2.154 / 2.147 ms
// against 2.149 / 2.152 / 2.153 / 2.145 in turns (tools/bench_commits.py;
// docs/bench/2026-12-07_{ced2fff,3af20d8}_h100_syn7b_q4_k_m_qkv_deep_batch_{1..4}.json). The
// model's build is not the one-format build the table times: there the deeper q4_k batch shares
// the kernel's 128 registers with q6_k's v blocks, and the gain alone does not carry over. Not kept.
#ifndef GF_UNROLL_4BIT
#define GF_UNROLL_4BIT GF_UNROLL
#endif
// Timing probes, results WRONG by design (tools/bench_gemv.py --formats … --fmt-defines): they
// split a GEMV's time into its memory stream and its arithmetic, as gemv_int4.cu's do.
//   GF_PROBE_LOADS_ONLY=1   every load as in the real kernel; an item's gather → unpack → scales
//                           → MMAs replaced by one XOR of its raw words into the accumulator
//                           (and the exact codes' prologue: no Σx for the formats without an
//                           offset, whose default build stages it for the subnormal codes' z)
//   GF_PROBE_NO_LOADS=1     the real arithmetic on raw words made from the item's index: no
//                           weight, high-bit or scale load and no address of one
// Measured at the 7B shapes (tools/bench_gemv.py --formats q4_k q6_k --fmt-defines
// GF_PROBE_LOADS_ONLY=1 GF_PROBE_NO_LOADS=1, one run, µs, loads alone / arithmetic alone;
// docs/bench/2026-12-04_848df12_h200_gemv_fmt_probes.json; the kernels themselves in an earlier
// run, docs/bench/2026-12-04_5a1cebb_h200_gemv_formats_cursor.json, in brackets):
//   q4_k gate_up 26.21 / 27.59 (35.19), down 14.08 / 17.16 (19.79), o_proj 4.93 / 5.31 (7.20)
//   q6_k gate_up 41.73 / 28.65 (44.62), down 19.11 / 17.42 (23.39), o_proj 5.83 / 5.27 (7.86)
// Q6_K is bound by its load stream (62 % of copy at gate_up); Q4_K by both halves, its
// arithmetic (two-level scales per 32 inputs) alone taking longer than its loads — and 1.6×
// the INT4 GEMV's arithmetic alone at gate_up (17.42 µs, gemv_int4.cu) for 9 % more bytes.
// Why the loads alone stop at 68 % (q4_k gate_up) where gemv_int4.cu's reach 77 %: a gate/up
// batch here is one item (U = GF_UNROLL / MT = 1: 2 KB a warp, 4 KB in flight with the next),
// half of gemv_int4.cu's two (its loads alone with one item a batch, GEMV_UNROLL=2: 27.26 µs
// against this file's 26.21). Two items a batch (GF_UNROLL=4) need more registers than the
// 2 blocks of 8 warps an SM leave (ptxas, the 7B Q4_K_M set q4_k + q6_k: 128 with 436 bytes of
// spills; uncapped 218 at gate/up and 194 at qkv; q4_k alone 167 at gate/up, q6_k alone 220).
// Two items a batch with one block of 8 warps an SM instead (GF_UNROLL 4 and
// GF_GATE_UP_MIN_BLOCKS 1, compiled for one format; tools/bench_gemv.py --formats q4_k q6_k
// --fmt-defines …, µs at the 7B shapes, no PDL, against GF_UNROLL 2 at two blocks):
//   q4_k gate_up 35.96 against 31.29 (its loads alone 24.61 against 26.64: 73 % of copy)
//   q6_k gate_up 42.61 against 45.02 (loads alone 38.13 against 41.86)
// (docs/bench/2026-12-04_b873b61_h200_gemv_fmt_unroll4_one_block.json; down_proj's rows there
// are the residual kernel at GF_UNROLL 4 with its 2 blocks and 128 registers: spilling, slower.)
// The deeper batch buys the load stream 8–9 %, but Q4_K's arithmetic then runs with half the
// warps to hide its latency and loses more; Q6_K, bound by its loads, gains 5 %.
// GF_FLAT_SPLIT=1: a block's (tile, quad) items as one flat sequence split evenly among its
// warps, as gemv_int4.cu's GEMV_FLAT_SPLIT (its comment says why: at K = 3584, 28 quads over 8
// warps give half of them one item a tile more). A compile-time knob for tools/bench_gemv.py
// --fmt-defines; the sums are added in another grouping, so the bits differ from 0's. ptxas, built
// for the 7B's Q4_K_M formats and the real 0.5B's: the plain GEMVs, lm_head and qkv_rope fit 128
// registers with it, gate_up spills 16–32 bytes at two blocks per SM. Measured slower than the
// default split at the 7B shapes (µs, the default's figures from the table above, another run
// on the same machine; docs/bench/2026-12-05_e6b8a90_h200_gemv_fmt_flat_split.json): q4_k gate_up
// 34.88, down 20.55, o_proj 7.18; q6_k gate_up 47.20, down 24.38, o_proj 8.10. Kept off.
#ifndef GF_FLAT_SPLIT
#define GF_FLAT_SPLIT 0
#endif
// GF_ZERO_BATCHES=1 starts a warp's two batches at zero instead of leaving them undefined:
// gemv_int4.cu's GEMV_ZERO_BATCHES, for the same reason. A slot past the warp's last item is
// never loaded nor multiplied, but to the compiler it may be read undefined, so its registers
// are live from the kernel's entry; in decode_persistent.cu, which defines it, they would be live
// across every other op. Not the default: a launch of its own gains nothing from the zeros.
#ifndef GF_ZERO_BATCHES
#define GF_ZERO_BATCHES 0
#endif
#ifndef GF_PROBE_LOADS_ONLY
#define GF_PROBE_LOADS_ONLY 0
#endif
// GF_TINY=1 (default): the formats of WfTiny (4-, 5- and 8-bit codes, one scale group a chunk:
// all but Q6_K and dense) hand their codes to the MMAs as FP16 subnormals (wf_pairs_tiny): no
// f16x2 fixup a pair; the scale times 2²⁴ and, for the formats without an offset, −z·s·Σx of the
// chunk after the MMAs. 0: wf_pairs' exact c − z, as before (for tools/bench_gemv.py --fmt-defines).
#ifndef GF_TINY
#define GF_TINY 1
#endif
#ifndef GF_PROBE_NO_LOADS
#define GF_PROBE_NO_LOADS 0
#endif
// Two more probes for the fused GEMVs' own parts, also WRONG by design:
//   GF_PROBE_NO_NORM=1      the RMSNorm prologue (qkv_rope, gate_up) stages fp16(residual · gain)
//                           with 1/rms = 1: no sum of squares, none of its barrier
//   GF_PROBE_NO_ROPE=1      qkv_rope's epilogue stores q and k with bias, unrotated: no sincosf
#ifndef GF_PROBE_NO_NORM
#define GF_PROBE_NO_NORM 0
#endif
#ifndef GF_PROBE_NO_ROPE
#define GF_PROBE_NO_ROPE 0
#endif

// The probes' stand-ins: every field of a raw chunk folded into one word (GF_PROBE_LOADS_ONLY),
// and a raw chunk made from a number (GF_PROBE_NO_LOADS).
__device__ __forceinline__ u32 gf_probe_fold(const WfRaw& r) {
    return r.q0.x ^ r.q0.y ^ r.q0.z ^ r.q0.w ^ r.q1.x ^ r.q1.y ^ r.q1.z ^ r.q1.w ^ r.q2.x ^ r.q2.y ^ r.q2.z ^
           r.q2.w ^ r.q3.x ^ r.q3.y ^ r.q3.z ^ r.q3.w ^ r.h0 ^ r.h1 ^ r.s0 ^ r.s1 ^ r.s2 ^ r.d;
}
__device__ __forceinline__ WfRaw gf_probe_raw(u32 v) {
    const uint4 q = make_uint4(v, v ^ 1u, v ^ 2u, v ^ 3u);
    return WfRaw{q, q, q, q, v ^ 4u, v ^ 5u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
}

template <int F, int MT>
struct GfBatch {
    static constexpr int BYTES = Wf<F>::BITS >= 8 ? Wf<F>::BITS / 8 : 1;  // chunk bytes / 16 (codes)
    static constexpr int UNROLL = (Wf<F>::BITS == 4 && MT == 1) ? GF_UNROLL_4BIT : GF_UNROLL;
    static constexpr int U = UNROLL / MT / BYTES > 0 ? UNROLL / MT / BYTES : 1;
    WfRaw w[U][MT][2];  // the chunk of MMA row g / row g + 8, per matrix
};

// x_smem's order for the TINY formats (gf_block): the pairs of inputs (0, 1), (4, 5), (2, 3), (6, 7)
// of each 8, so that the x of each of their MMAs (inputs 0, 1, 4, 5 or 2, 3, 6, 7: wf_pairs_tiny)
// is two consecutive registers of one 16-byte shared-memory load, as an MMA's B operand must be.
__device__ __forceinline__ uint4 gf_tiny_order(const uint4& v) { return make_uint4(v.x, v.z, v.y, v.w); }

// The prologues below work one thread per 8-input piece (16 bytes of x), as gemv_int4.cu's do,
// not one per 32-input chunk: they run after griddepcontrol.wait, on the step's critical path,
// and a thread per chunk made each of K/32 threads do four pieces and a 32-add chain in turn
// (at the 0.5B's K = 896, 28 threads of the block). Σx of a chunk (SUMS) is then its 4 pieces'
// sums added across the 4 consecutive lanes that hold them (two butterfly steps, a fixed order):
// every lane takes part, so the loops run a block-uniform number of rounds and lanes past the
// last piece add zeros. A round loads R pieces a thread (R·blockDim apart) before it uses any,
// so R loads are in flight where a guarded load a piece would wait for each in turn (K = 18944,
// the 7B's down_proj: 2368 pieces, 10 a thread of 256).
__device__ __forceinline__ float gf_piece_sum(const u32 (&w)[4]) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) s += wf_half_lo(w[i]) + wf_half_hi(w[i]);
    return s;
}

// Σx of the chunk whose piece p this lane holds (sum: its piece's, 0 past the last piece) into
// xsum[p / 4], written by the chunk's first lane. Every lane of the warp calls it.
__device__ __forceinline__ void gf_chunk_sum(float sum, int p, int pieces, float* xsum) {
    sum += shfl_xor_f32(sum, 1);
    sum += shfl_xor_f32(sum, 2);
    if (p < pieces && (p & 3) == 0) xsum[p >> 2] = sum;
}

// Prologue: x (K fp16, an earlier kernel's output) into x_smem in natural order (TINY_ORDER:
// gf_tiny_order's), and, where asked (SUMS: gf_block's XSUM), Σx of each 32-input chunk into
// xsum. One thread per 8-input piece: reads 16 B, writes them.
struct GfStageX {
    const __half* __restrict__ x;  // [K] fp16
    template <bool SUMS, bool TINY_ORDER>
    __device__ __forceinline__ void run(uint4* x_smem, float* xsum, int K) const {
        constexpr int R = 4;  // pieces a thread in flight (16 registers)
        const uint4* src = reinterpret_cast<const uint4*>(x);
        const int pieces = K / 8;
        for (int base = threadIdx.x; base - (int)threadIdx.x < pieces; base += R * blockDim.x) {
            uint4 v[R];
#pragma unroll
            for (int j = 0; j < R; ++j) {
                const int p = base + j * blockDim.x;
                v[j] = p < pieces ? src[p] : make_uint4(0u, 0u, 0u, 0u);  // zeros add nothing to Σx
            }
#pragma unroll
            for (int j = 0; j < R; ++j) {
                const int p = base + j * blockDim.x;
                if (p < pieces) x_smem[p] = TINY_ORDER ? gf_tiny_order(v[j]) : v[j];
                const u32 w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
                if constexpr (SUMS) gf_chunk_sum(gf_piece_sum(w), p, pieces, xsum);
            }
        }
    }
};

// Prologue: x = fp16(rmsnorm(residual) · w) (rmsnorm.cuh: rmsnorm.cu's arithmetic) into x_smem
// (TINY_ORDER as GfStageX), and (SUMS) Σx of each chunk. Contains a __syncthreads (the sum of squares); every thread
// takes part.
struct GfStageRmsNorm {
    const float* __restrict__ residual;  // [K] fp32
    const __half* __restrict__ weight;   // [K] fp16 RMSNorm gain
    float eps;
    template <bool SUMS, bool TINY_ORDER>
    __device__ __forceinline__ void run(uint4* x_smem, float* xsum, int K) const {
        __shared__ float warp_sums[RMSNORM_WARPS];
        constexpr int R = 2;  // pieces a thread in flight (2 × 48 bytes: residual and gain)
        const int pieces = K / 8;
        // Where the block's threads hold the whole row in one round (rmsnorm_one_pass: K ≤ 4096),
        // the sum of squares comes from the loaded registers (the row read once); else first.
        const bool one_pass = rmsnorm_one_pass<R>(K);  // block-uniform
        float inv_rms = 1.f;
        if (!GF_PROBE_NO_NORM && !one_pass) inv_rms = rmsnorm_inv_rms(residual, K, eps, warp_sums);
        for (int base = threadIdx.x; base - (int)threadIdx.x < pieces; base += R * blockDim.x) {
            float4 r[R][2];
            uint2 g[R][2];
#pragma unroll
            for (int j = 0; j < R; ++j) rmsnorm_load_piece(residual, weight, base + j * blockDim.x, pieces, r[j], g[j]);
            // one_pass: this is the only round (pieces ≤ R · blockDim.x), whose every thread calls it
            if (!GF_PROBE_NO_NORM && one_pass) inv_rms = rmsnorm_inv_rms_pieces<R>(r, K, eps, warp_sums);
#pragma unroll
            for (int j = 0; j < R; ++j) {
                const int p = base + j * blockDim.x;
                const uint2 lo = rmsnorm_apply4(r[j][0], g[j][0], inv_rms);  // zeros past the end: x = 0
                const uint2 hi = rmsnorm_apply4(r[j][1], g[j][1], inv_rms);
                if (p < pieces)
                    x_smem[p] = TINY_ORDER ? make_uint4(lo.x, hi.x, lo.y, hi.y) : make_uint4(lo.x, lo.y, hi.x, hi.y);
                const u32 w[4] = {lo.x, lo.y, hi.x, hi.y};
                if constexpr (SUMS) gf_chunk_sum(gf_piece_sum(w), p, pieces, xsum);
            }
        }
    }
};

// W, the planned block's warps: bc.threads / 32. A launch (Dep::exact_block) reads it from
// blockDim.x where it is used — the compiler loads that again rather than keep it live across the
// main loop, where a register more spills these kernels at 2 blocks per SM.
template <typename Dep>
__device__ __forceinline__ int gf_warps(const BlockCoord& bc) {
    return Dep::exact_block() ? (int)(blockDim.x / WARP_SIZE) : bc.threads / WARP_SIZE;
}

// The GEMV of one block over one matrix set (MT matrices of format F, n rows, RoPE-paired when
// rope_dim > 0) for its tiles [tile_b, tile_e): leaves each warp's row sums in `partial`
// [tiles][MT][W][16], W = bc.threads / 32 (block_coord.cuh: the planned block, which a block
// of the persistent decode step may exceed; its warps past W take part in the barriers only).
// Order: dep.launch_dependents, the first weight batch, dep.wait(), stage.run(x_smem, xsum, K),
// the main loop. Contains __syncthreads(): every thread calls it.
template <int F, int MT, typename Stage, typename Dep>
__device__ __forceinline__ void gf_block(const WfWeight (&w)[MT], int n, int rope_dim, int tile_b, int tile_e,
                                         int K, const BlockCoord& bc, Dep dep, Stage stage, uint4* x_smem,
                                         float* xsum, float* partial) {
    using Batch = GfBatch<F, MT>;
    constexpr int U = Batch::U, SUBS = Wf<F>::SUBS, MMAS = 8 / SUBS;
    constexpr bool TINY = GF_TINY && WfTiny<F>::ON && !GF_PROBE_LOADS_ONLY;
    constexpr bool XSUM = Wf<F>::OFFSET || TINY;  // Σx of each chunk: the offset's term, or TINY's z
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int warp = threadIdx.x / WARP_SIZE, n_warps = gf_warps<Dep>(bc);
    const bool in_plan = Dep::exact_block() || warp < n_warps;  // else no items: its loops start at their end
    const int n_quads = K / GF_QUAD;
    // This warp's quads of every tile (non-empty: W ≤ K/128); GF_FLAT_SPLIT: its items [ib, ie) of
    // the block's flat (tile, quad) sequence instead, from quad q_0 of tile tile_0.
    const int qb = GF_FLAT_SPLIT ? 0 : warp * n_quads / n_warps;
    const int qe = GF_FLAT_SPLIT ? n_quads : (warp + 1) * n_quads / n_warps;
    const int n_items = (tile_e - tile_b) * n_quads;
    const int ib = in_plan ? warp * n_items / n_warps : 0, ie = in_plan ? (warp + 1) * n_items / n_warps : 0;
    const int tile_0 = !in_plan ? tile_e : GF_FLAT_SPLIT ? tile_b + ib / n_quads : tile_b;
    const int q_0 = GF_FLAT_SPLIT ? ib % n_quads : qb;
    const bool feeds_b = (g >> 1) == t;  // this lane hands its chunk's x to B (header)
    const u64 policy = l2_evict_first_policy();

    dep.launch_dependents();  // every block of the grid is resident (one wave)

    // The load cursor, because these GEMVs are issue-bound: per matrix, the addresses of this
    // lane's chunk t of quad 0 in MMA row g of tile ld_tile (wf_addr; QUAD: the quad shares the
    // K-quant scale loads). An item's addresses are wf_addr_quads of it for row g and wf_addr_rows
    // of those for row g + 8: one multiply-add per plane and row (the header has the counts). Row
    // g + 8 has no cursor of its own: 2 more registers per plane and matrix, which spill residual,
    // f16 and lm_head at 2 blocks per SM when compiled for q6_k alone (q5_g32_min and q8_g32 are
    // at that edge).
    int ld_tile = tile_0, ld_q = q_0, ld_left = ie - ib;  // ld_left: GF_FLAT_SPLIT's items to go
    // The weight rows of MMA rows g and g + 8 in tile ld_tile (rows past n: n − 1, loaded, never
    // stored; tiles past tile_e: never loaded). They only grow from tile to tile.
    auto tile_rows = [&](u32& r0, u32& r1) {
        int lo, hi;
        gemv_tile_rows(ld_tile, g, rope_dim, lo, hi);
        r0 = min(lo, n - 1);
        r1 = min(hi, n - 1);
    };
    u32 row0, row1;  // tile_rows of tile ld_tile
    tile_rows(row0, row1);
    // From row g's addresses to row g + 8's, once a tile (wf_row_step: the tile-major codes move by
    // the rows' places, not by whole rows).
    WfRowStep down = wf_row_step(row0, row1, K);
    WfAddr at[MT];  // the cursor
#pragma unroll
    for (int m = 0; m < MT; ++m) at[m] = wf_addr<F, true>(w[m], row0, t, K, t);
    // At a tile's end the cursor moves down to the next tile's rows (wf_addr_rows): no plane
    // pointer needed, where wf_addr would reload them all — which ptxas loads ahead of the branch,
    // on every item's path, into registers the loop is short of.
    auto next_tile = [&]() {
        u32 r0, r1;
        tile_rows(r0, r1);
        const WfRowStep step = wf_row_step(row0, r0, K);
#pragma unroll
        for (int m = 0; m < MT; ++m) at[m] = wf_addr_rows<F>(at[m], step, K);
        row0 = r0;
        down = wf_row_step(r0, r1, K);
    };
    auto load = [&](Batch& b) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (GF_FLAT_SPLIT ? ld_left == 0 : ld_tile >= tile_e) break;  // warp-uniform
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if constexpr (GF_PROBE_NO_LOADS) {  // timing only, wrong sums (see the define)
                    b.w[u][m][0] = gf_probe_raw(0x88888888u ^ (u32)(ld_q * 0x01010101 + m));
                    b.w[u][m][1] = gf_probe_raw(0x77777777u ^ (u32)(ld_q * 0x01010101 + m));
                    continue;
                }
                const WfAddr p0 = wf_addr_quads<F>(at[m], (u32)ld_q);
                b.w[u][m][0] = wf_load_at<F, true>(p0, policy);
                b.w[u][m][1] = wf_load_at<F, true>(wf_addr_rows<F>(p0, down, K), policy);
            }
            if (GF_FLAT_SPLIT) --ld_left;
            if (++ld_q == qe) {
                ld_q = qb;
                ++ld_tile;
                next_tile();
            }
        }
    };

    Batch cur, next;
    if constexpr (GF_ZERO_BATCHES) cur = next = {};
    load(cur);  // weights are never written by a kernel: safe before the wait
    dep.wait();
    stage.template run<XSUM, TINY>(x_smem, xsum, K);  // Σx only where the format has offsets or TINY
    __syncthreads();

    float acc[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
    // This warp's row sums of a tile (the quad's 4 lanes added) into the block's partials, slot
    // [tile][m][warp][row], from lane t = 0.
    auto publish = [&](int tile) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                acc[m][h] += shfl_xor_f32(acc[m][h], 1);
                acc[m][h] += shfl_xor_f32(acc[m][h], 2);
            }
        if (t == 0) {
            float* dst = partial + (tile - tile_b) * MT * n_warps * INT4_TILE_ROWS;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                dst[(m * n_warps + warp) * INT4_TILE_ROWS + g] = acc[m][0];
                dst[(m * n_warps + warp) * INT4_TILE_ROWS + g + 8] = acc[m][1];
            }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
    };
    // GF_FLAT_SPLIT: zeros in this warp's slots of the tiles its range does not reach (as
    // gemv_int4.cu's engine: each slot is written once, here or by the main loop's publish, and
    // gf_reduce's barrier orders it for the reading threads).
    if (GF_FLAT_SPLIT && in_plan)
        for (int tl = tile_b; tl < tile_e; ++tl)
            if (ib == ie || tl < tile_0 || tl > tile_b + (ie - 1) / n_quads) publish(tl);
    int c_tile = tile_0, c_q = q_0, c_left = ie - ib;  // c_left: GF_FLAT_SPLIT's items to go
    while (GF_FLAT_SPLIT ? c_left > 0 : c_tile < tile_e) {
        load(next);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (GF_FLAT_SPLIT ? c_left == 0 : c_tile >= tile_e) break;  // warp-uniform
            const int chunk = 4 * c_q + t;
            u32 xb[16];  // B: x of this lane's chunk as 16 half2, or zeros (header)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 v = feeds_b ? x_smem[4 * chunk + j] : make_uint4(0u, 0u, 0u, 0u);
                xb[4 * j] = v.x; xb[4 * j + 1] = v.y; xb[4 * j + 2] = v.z; xb[4 * j + 3] = v.w;
            }
            const float xs = XSUM ? xsum[chunk] : 0.f;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if constexpr (GF_PROBE_LOADS_ONLY) {  // timing only, wrong sums (see the define)
                    const u32 v = gf_probe_fold(cur.w[u][m][0]) ^ gf_probe_fold(cur.w[u][m][1]);
                    acc[m][0] += __uint_as_float(v & 0x3f7fffffu);
                    continue;
                }
                const WfRaw ra = wf_quad_gather<F>(cur.w[u][m][0], lane), rb = wf_quad_gather<F>(cur.w[u][m][1], lane);
                u32 pa[16], pb[16];
                float s0[SUBS], o0[SUBS], s1[SUBS], o1[SUBS];
                wf_scales<F, true>(ra, chunk, s0, o0);
                wf_scales<F, true>(rb, chunk, s1, o1);
                if constexpr (TINY) {  // the codes as subnormals (wf_pairs_tiny), z and 2²⁴ settled here
                    wf_pairs_tiny<F>(ra, pa);
                    wf_pairs_tiny<F>(rb, pb);
                    // MMA i of `lo` takes the pairs of inputs 8i+0, 1 and 8i+4, 5 (codes ·1), MMA i
                    // of `hi` those of 8i+2, 3 and 8i+6, 7 (codes ·16; 8-bit codes: ·1 too), each
                    // with B's x of the same inputs (mma.cuh: the order of k is free where A and B
                    // agree), which x_smem's order (gf_tiny_order) puts in consecutive registers.
                    // Two chains of 4 MMAs instead of one of 8.
                    float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const u32 a0[4] = {pa[4 * i], pb[4 * i], pa[4 * i + 2], pb[4 * i + 2]};
                        const u32 a1[4] = {pa[4 * i + 1], pb[4 * i + 1], pa[4 * i + 3], pb[4 * i + 3]};
                        mma_m16n8k16_f32_f16(lo, a0, xb[4 * i], xb[4 * i + 1]);
                        mma_m16n8k16_f32_f16(hi, a1, xb[4 * i + 2], xb[4 * i + 3]);
                    }
                    constexpr float HI = Wf<F>::BITS == 8 ? 1.f : 0.0625f;  // the second chain's factor
                    constexpr float Z = (float)Wf<F>::ZERO;
                    const float c0 = fmaf(hi[0], HI, lo[0]), c1 = fmaf(hi[2], HI, lo[2]);  // Σ c·x · 2⁻²⁴
                    acc[m][0] = fmaf(s0[0] * 0x1p24f, c0, acc[m][0]);
                    acc[m][1] = fmaf(s1[0] * 0x1p24f, c1, acc[m][1]);
                    // The offset's o·Σx, or −z·s·Σx (c − z was not taken in the unpack).
                    const float f0 = Wf<F>::OFFSET ? o0[0] : -Z * s0[0], f1 = Wf<F>::OFFSET ? o1[0] : -Z * s1[0];
                    acc[m][0] = fmaf(f0, xs, acc[m][0]);
                    acc[m][1] = fmaf(f1, xs, acc[m][1]);
                    continue;
                }
                wf_pairs<F>(ra, pa);
                wf_pairs<F>(rb, pb);
#pragma unroll
                for (int sub = 0; sub < SUBS; ++sub) {
                    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int k = sub * MMAS; k < (sub + 1) * MMAS; ++k) {
                        const u32 a[4] = {pa[2 * k], pb[2 * k], pa[2 * k + 1], pb[2 * k + 1]};
                        mma_m16n8k16_f32_f16(c, a, xb[2 * k], xb[2 * k + 1]);
                    }
                    acc[m][0] = fmaf(s0[sub], c[0], acc[m][0]);
                    acc[m][1] = fmaf(s1[sub], c[2], acc[m][1]);
                    if constexpr (Wf<F>::OFFSET) {  // SUBS == 1: the chunk is the offset's group
                        acc[m][0] = fmaf(o0[sub], xs, acc[m][0]);
                        acc[m][1] = fmaf(o1[sub], xs, acc[m][1]);
                    }
                }
            }
            if (GF_FLAT_SPLIT) --c_left;
            const bool tile_done = ++c_q == qe;  // the tile's last quad of this warp
            if (tile_done || (GF_FLAT_SPLIT && c_left == 0)) {  // publish, start the next tile
                publish(c_tile);
                if (tile_done) {
                    c_q = qb;
                    ++c_tile;
                }
            }
        }
        cur = next;
    }
}

// After gf_block: __syncthreads, then epilogue(tile, g, sums[MT][2]) once per (tile, g < 8) of
// the block, from one thread, sums[m][0] of MMA row g and sums[m][1] of MMA row g + 8 (the W
// partials added in warp order, W = bc.threads / 32).
template <int MT, typename Dep, typename Epilogue>
__device__ __forceinline__ void gf_reduce(const float* partial, int tile_b, int tile_e, const BlockCoord& bc, Dep,
                                          Epilogue epilogue) {
    const int n_warps = gf_warps<Dep>(bc);
    __syncthreads();
    for (int o = threadIdx.x; o < (tile_e - tile_b) * 8; o += blockDim.x) {
        const int tl = o / 8, gg = o % 8;
        float sums[MT][2];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float* src = partial + ((tl * MT + m) * n_warps) * INT4_TILE_ROWS + gg + 8 * h;
                float s = 0.f;
                for (int wi = 0; wi < n_warps; ++wi) s += src[wi * INT4_TILE_ROWS];
                sums[m][h] = s;
            }
        epilogue(tile_b + tl, gg, sums);
    }
}

// The block's tile range when `blocks` blocks of the planned grid, starting at block `first`,
// share n_tiles tiles.
__device__ __forceinline__ void gf_tile_range(const BlockCoord& bc, int first, int blocks, int n_tiles, int& tile_b,
                                              int& tile_e) {
    const int b = bc.bx - first;
    tile_b = b * n_tiles / blocks;
    tile_e = (b + 1) * n_tiles / blocks;
}

// Shared memory: x [K/8] uint4, xsum [K/32] fp32, partials [tiles_per_block][MT][W][16] fp32.
#define GF_SMEM_PARTS(K)                                               \
    extern __shared__ uint4 gf_smem[];                                 \
    uint4* x_smem = gf_smem;                                           \
    float* xsum = reinterpret_cast<float*>(gf_smem + (K) / 8);         \
    float* partial = xsum + (K) / WF_CHUNK

// One weight's planes, passed as four parameters <P>_qweight, <P>_qhigh, <P>_scales, <P>_aux
// (null where the format has none; weight_formats.cuh lists each format's planes and dtypes).
#define GF_WEIGHT(P) WfWeight{P##_qweight, P##_qhigh, P##_scales, P##_aux}

// The body of the one-matrix GEMVs whose x is an fp16 vector (f16, residual, lm_head): the
// block's tiles of W x, each output row handed to store(row, value) by the one thread that owns
// it. Returns false, before any barrier, for a format this build does not read (block-uniform:
// the caller returns too). Contains __syncthreads(): every thread calls it.
template <typename Dep, typename Store>
__device__ __forceinline__ bool gf_gemv_x(const WfWeight& w, const __half* __restrict__ x, int N, int K, int fmt,
                                          const BlockCoord& bc, Dep dep, Store store) {
    GF_SMEM_PARTS(K);
    int tile_b, tile_e;
    gf_tile_range(bc, 0, bc.gx, int4_tiles(N), tile_b, tile_e);
    const WfWeight ws[1] = {w};
    if (!wf_known(fmt)) return false;
    WF_DISPATCH(fmt, F, gf_block<F, 1>(ws, N, 0, tile_b, tile_e, K, bc, dep, GfStageX{x}, x_smem, xsum, partial);)
    gf_reduce<1>(partial, tile_b, tile_e, bc, dep, [&](int tile, int g, const float (&s)[1][2]) {
        gemv_store_rows(tile, g, N, s[0], store);
    });
    return true;
}

// y = W x, FP16 out. grid (G), block (32·W), dynamic smem (launchers/gemv_fmt.py).
#ifndef DEVICE_FUNCTIONS_ONLY  // a file that includes this one for its device functions defines it
extern "C" __global__ void __launch_bounds__(GF_MAX_WARPS * WARP_SIZE, GF_MIN_BLOCKS)
gemv_fmt_f16(__half* __restrict__ y,        // [N] fp16, out
             const __half* __restrict__ x,  // [K] fp16
             const u32* __restrict__ w_qweight,    // [N, K] in format `fmt`: codes (weight_formats.cuh)
             const u32* __restrict__ w_qhigh,      // high bits, or null
             const void* __restrict__ w_scales,    // scales (fp16 | uint8 | int8, by format)
             const void* __restrict__ w_aux,       // offsets | superscales, or null
             int N, int K, int fmt) {
    gf_gemv_x(GF_WEIGHT(w), x, N, K, fmt, BlockCoord::of_launch(), GridDep{},
              [&](int row, float v) { y[row] = __float2half_rn(v); });
}
#endif  // DEVICE_FUNCTIONS_ONLY

// The decode step's format GEMVs and its embedding each come as an argument struct, a device
// function of one block (`…_item`: what a launch's block does, given its BlockCoord and Dep) and
// the kernel that runs it as a launch of its own, as gemv_int4.cu's do: the persistent decode
// step (decode_persistent.cu) runs the same items from argument structs the host packs with the
// kernel's parameter layout (each struct lists the kernel's parameters, in order, with their
// types; tests/test_decode_persistent.py compares the two lists).

// residual += W x in FP32 (each row read and written by one thread: no atomics).
struct GemvFmtResidualArgs {
    float* residual;       // [N] fp32, in/out
    const __half* x;       // [K] fp16
    const u32* w_qweight;  // [N, K] in format `fmt`: codes (weight_formats.cuh)
    const u32* w_qhigh;    // high bits, or null
    const void* w_scales;  // scales (fp16 | uint8 | int8, by format)
    const void* w_aux;     // offsets | superscales, or null
    int N, K, fmt;
};

template <typename Dep>
__device__ __forceinline__ void gemv_fmt_residual_item(const GemvFmtResidualArgs& a, const BlockCoord& bc, Dep dep) {
    gf_gemv_x(GF_WEIGHT(a.w), a.x, a.N, a.K, a.fmt, bc, dep, [&](int row, float v) { a.residual[row] += v; });
}

// grid (G), block (32·W), dynamic smem (launchers/gemv_fmt.py).
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(GF_MAX_WARPS * WARP_SIZE, GF_MIN_BLOCKS)
gemv_fmt_residual(float* __restrict__ residual, const __half* __restrict__ x, const u32* __restrict__ w_qweight,
                  const u32* __restrict__ w_qhigh, const void* __restrict__ w_scales, const void* __restrict__ w_aux,
                  int N, int K, int fmt) {  // GemvFmtResidualArgs says what each is
    gemv_fmt_residual_item(GemvFmtResidualArgs{residual, x, w_qweight, w_qhigh, w_scales, w_aux, N, K, fmt},
                           BlockCoord::of_launch(), GridDep{});
}
#endif  // DEVICE_FUNCTIONS_ONLY

// The attention input of one decode step (gemv_int4_qkv_rope's arithmetic and epilogue), with
// q, k and v each in its own format: blocks [0, q_blocks) of the planned grid compute q, the
// next k_blocks k, the rest v.
struct GemvFmtQkvRopeArgs {
    __half* q_out;          // [Hq·Dh] fp16, out: rotated query
    __half* k_cache;        // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
    __half* v_cache;        // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
    const float* residual;  // [K] fp32, the residual stream
    const __half* norm_w;   // [K] fp16, input_layernorm gain
    const u32* q_qweight;   // [Hq·Dh, K] in format q_fmt: codes (weight_formats.cuh)
    const u32* q_qhigh;     // high bits, or null
    const void* q_scales;   // scales (fp16 | uint8 | int8, by format)
    const void* q_aux;      // offsets | superscales, or null
    const u32* k_qweight;   // [Hkv·Dh, K] in format k_fmt: codes (weight_formats.cuh)
    const u32* k_qhigh;     // high bits, or null
    const void* k_scales;   // scales (fp16 | uint8 | int8, by format)
    const void* k_aux;      // offsets | superscales, or null
    const u32* v_qweight;   // [Hkv·Dh, K] in format v_fmt: codes (weight_formats.cuh)
    const u32* v_qhigh;     // high bits, or null
    const void* v_scales;   // scales (fp16 | uint8 | int8, by format)
    const void* v_aux;      // offsets | superscales, or null
    const __half* q_bias;   // [Hq·Dh] fp16
    const __half* k_bias;   // [Hkv·Dh] fp16
    const __half* v_bias;   // [Hkv·Dh] fp16
    const float* inv_freq;  // [Dh/2] fp32 (reference.rope_inv_freq)
    const int* state;       // [3] int32: pos, token, seq_len (reads [0])
    const int* block_table; // [max_pages] int32: logical → physical page
    int Hq, Hkv, Dh, K;
    float eps;
    int q_fmt, k_fmt, v_fmt, q_blocks, k_blocks;
};

template <typename Dep>
__device__ __forceinline__ void gemv_fmt_qkv_rope_item(const GemvFmtQkvRopeArgs& a, const BlockCoord& bc, Dep dep) {
    GF_SMEM_PARTS(a.K);
    const int Dh = a.Dh, Hkv = a.Hkv, q_blocks = a.q_blocks, k_blocks = a.k_blocks;
    const int nq = a.Hq * Dh, nkv = Hkv * Dh;
    const int seg = bc.bx < q_blocks ? 0 : bc.bx < q_blocks + k_blocks ? 1 : 2;  // block-uniform
    const int n = seg == 0 ? nq : nkv;
    const int first = seg == 0 ? 0 : seg == 1 ? q_blocks : q_blocks + k_blocks;
    const int blocks = seg == 0 ? q_blocks : seg == 1 ? k_blocks : bc.gx - q_blocks - k_blocks;
    int tile_b, tile_e;
    gf_tile_range(bc, first, blocks, int4_tiles(n), tile_b, tile_e);
    const WfWeight ws[1] = {seg == 0 ? GF_WEIGHT(a.q) : seg == 1 ? GF_WEIGHT(a.k) : GF_WEIGHT(a.v)};
    const int fmt = seg == 0 ? a.q_fmt : seg == 1 ? a.k_fmt : a.v_fmt;
    const int rope_dim = seg == 2 ? 0 : Dh;
    const GfStageRmsNorm stage{a.residual, a.norm_w, a.eps};
    if (!wf_known(fmt)) return;  // block-uniform
    WF_DISPATCH(fmt, F, gf_block<F, 1>(ws, n, rope_dim, tile_b, tile_e, a.K, bc, dep, stage, x_smem, xsum, partial);)
    gf_reduce<1>(partial, tile_b, tile_e, bc, dep, [&](int tile, int g, const float (&s)[1][2]) {
        const int pos = a.state[0];
        const u64 slot = kv_offset(a.block_table[pos / PAGE_TOKENS], 0, pos % PAGE_TOKENS, Hkv, Dh);
        if (seg == 2) {  // v: bias only, plain row order
            gemv_store_rows(tile, g, nkv, s[0], [&](int row, float val) {
                const int head = row / Dh, d = row % Dh;
                a.v_cache[slot + (u64)head * PAGE_TOKENS * Dh + d] = __float2half_rn(val + __half2float(a.v_bias[row]));
            });
            return;
        }
        int lo, hi;  // rows of dims i and i + Dh/2 of one head
        gemv_tile_rows(tile, g, Dh, lo, hi);
        const int head = lo / Dh, i = lo % Dh;
        const __half* b = seg == 0 ? a.q_bias : a.k_bias;
        float o1, o2;
        const float x1 = s[0][0] + __half2float(b[lo]), x2 = s[0][1] + __half2float(b[hi]);
        if (GF_PROBE_NO_ROPE) {  // timing only, unrotated (see the define)
            o1 = x1;
            o2 = x2;
        } else {
            rope_rotate(x1, x2, pos, a.inv_freq[i], o1, o2);
        }
        __half* dst = seg == 0 ? a.q_out + (u64)head * Dh : a.k_cache + slot + (u64)head * PAGE_TOKENS * Dh;
        dst[i] = __float2half_rn(o1);
        dst[i + Dh / 2] = __float2half_rn(o2);
    });
}

// grid (G ≥ 3), block (32·W), dynamic smem (launchers/gemv_fmt.py).
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(GF_MAX_WARPS * WARP_SIZE, GF_QKV_MIN_BLOCKS)
gemv_fmt_qkv_rope(__half* __restrict__ q_out, __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                  const float* __restrict__ residual, const __half* __restrict__ norm_w,
                  const u32* __restrict__ q_qweight, const u32* __restrict__ q_qhigh,
                  const void* __restrict__ q_scales, const void* __restrict__ q_aux,
                  const u32* __restrict__ k_qweight, const u32* __restrict__ k_qhigh,
                  const void* __restrict__ k_scales, const void* __restrict__ k_aux,
                  const u32* __restrict__ v_qweight, const u32* __restrict__ v_qhigh,
                  const void* __restrict__ v_scales, const void* __restrict__ v_aux,
                  const __half* __restrict__ q_bias, const __half* __restrict__ k_bias,
                  const __half* __restrict__ v_bias, const float* __restrict__ inv_freq,
                  const int* __restrict__ state, const int* __restrict__ block_table,
                  int Hq, int Hkv, int Dh, int K, float eps, int q_fmt, int k_fmt, int v_fmt, int q_blocks,
                  int k_blocks) {  // GemvFmtQkvRopeArgs says what each is
    gemv_fmt_qkv_rope_item(GemvFmtQkvRopeArgs{q_out, k_cache, v_cache, residual, norm_w, q_qweight, q_qhigh, q_scales,
                                              q_aux, k_qweight, k_qhigh, k_scales, k_aux, v_qweight, v_qhigh, v_scales,
                                              v_aux, q_bias, k_bias, v_bias, inv_freq, state, block_table, Hq, Hkv,
                                              Dh, K, eps, q_fmt, k_fmt, v_fmt, q_blocks, k_blocks},
                           BlockCoord::of_launch(), GridDep{});
}
#endif  // DEVICE_FUNCTIONS_ONLY

// h = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual) · post_attention_layernorm; gate and up in
// one format (each tile reads the same rows of both).
struct GemvFmtGateUpSwigluArgs {
    __half* h;                // [F] fp16, out
    const float* residual;    // [K] fp32, the residual stream
    const __half* norm_w;     // [K] fp16, post_attention_layernorm gain
    const u32* gate_qweight;  // [F, K] in format fmt: codes (weight_formats.cuh)
    const u32* gate_qhigh;    // high bits, or null
    const void* gate_scales;  // scales (fp16 | uint8 | int8, by format)
    const void* gate_aux;     // offsets | superscales, or null
    const u32* up_qweight;    // [F, K] in format fmt: codes (weight_formats.cuh)
    const u32* up_qhigh;      // high bits, or null
    const void* up_scales;    // scales (fp16 | uint8 | int8, by format)
    const void* up_aux;       // offsets | superscales, or null
    int F, K;
    float eps;
    int fmt;
};

template <typename Dep>
__device__ __forceinline__ void gemv_fmt_gate_up_swiglu_item(const GemvFmtGateUpSwigluArgs& a, const BlockCoord& bc,
                                                             Dep dep) {
    GF_SMEM_PARTS(a.K);
    const int F = a.F;
    int tile_b, tile_e;
    gf_tile_range(bc, 0, bc.gx, int4_tiles(F), tile_b, tile_e);
    const WfWeight ws[2] = {GF_WEIGHT(a.gate), GF_WEIGHT(a.up)};
    const GfStageRmsNorm stage{a.residual, a.norm_w, a.eps};
    if (!wf_known(a.fmt)) return;  // block-uniform
    WF_DISPATCH(a.fmt, FM, gf_block<FM, 2>(ws, F, 0, tile_b, tile_e, a.K, bc, dep, stage, x_smem, xsum, partial);)
    gf_reduce<2>(partial, tile_b, tile_e, bc, dep, [&](int tile, int g, const float (&s)[2][2]) {
        const int lo = tile * INT4_TILE_ROWS + g;
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (lo + 8 * r < F) a.h[lo + 8 * r] = swiglu_f16(s[0][r], s[1][r]);
    });
}

// grid (G), block (32·W), dynamic smem (launchers/gemv_fmt.py).
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(GF_MAX_WARPS * WARP_SIZE, GF_GATE_UP_MIN_BLOCKS)
gemv_fmt_gate_up_swiglu(__half* __restrict__ h, const float* __restrict__ residual, const __half* __restrict__ norm_w,
                        const u32* __restrict__ gate_qweight, const u32* __restrict__ gate_qhigh,
                        const void* __restrict__ gate_scales, const void* __restrict__ gate_aux,
                        const u32* __restrict__ up_qweight, const u32* __restrict__ up_qhigh,
                        const void* __restrict__ up_scales, const void* __restrict__ up_aux,
                        int F, int K, float eps, int fmt) {  // GemvFmtGateUpSwigluArgs says what each is
    gemv_fmt_gate_up_swiglu_item(GemvFmtGateUpSwigluArgs{h, residual, norm_w, gate_qweight, gate_qhigh, gate_scales,
                                                         gate_aux, up_qweight, up_qhigh, up_scales, up_aux, F, K,
                                                         eps, fmt},
                                 BlockCoord::of_launch(), GridDep{});
}
#endif  // DEVICE_FUNCTIONS_ONLY

// logits = W x (rows ≥ n_valid, the padding past the tokenizer's ids, get −inf, as in
// gemv_f16.cu), and the first pass of the greedy argmax: each block writes the best (value,
// row) of its rows to part_val/part_idx[blockIdx.x] (larger wins, lower row on ties), for
// argmax_final (argmax.cu) over gridDim.x partials.
// grid (G), block (32·W), dynamic smem (launchers/gemv_fmt.py).
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(GF_MAX_WARPS * WARP_SIZE, GF_MIN_BLOCKS)
gemv_fmt_lm_head(float* __restrict__ logits,    // [V] fp32, out
                 float* __restrict__ part_val,  // [≥ gridDim.x] fp32, out
                 int* __restrict__ part_idx,    // [≥ gridDim.x] int32, out
                 const __half* __restrict__ x,  // [K] fp16 (final-normed hidden state)
                 const u32* __restrict__ w_qweight,    // [V, K] in format fmt: codes (weight_formats.cuh)
                 const u32* __restrict__ w_qhigh,      // high bits, or null
                 const void* __restrict__ w_scales,    // scales (fp16 | uint8 | int8, by format)
                 const void* __restrict__ w_aux,       // offsets | superscales, or null
                 int V, int K, int n_valid, int fmt) {
    __shared__ float warp_val[GF_MAX_WARPS];
    __shared__ int warp_idx[GF_MAX_WARPS];
    float best_v = F32_NEG_INF;
    int best_i = 0x7fffffff;
    const bool known = gf_gemv_x(GF_WEIGHT(w), x, V, K, fmt, BlockCoord::of_launch(), GridDep{}, [&](int row, float v) {
        const float logit = row < n_valid ? v : F32_NEG_INF;
        logits[row] = logit;
        if (argmax_better(logit, row, best_v, best_i)) { best_v = logit; best_i = row; }
    });
    if (!known) return;  // block-uniform: before the barrier below
    warp_argmax(best_v, best_i);
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (lane == 0) { warp_val[warp] = best_v; warp_idx[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int wi = 1; wi < (int)(blockDim.x / WARP_SIZE); ++wi)
            if (argmax_better(warp_val[wi], warp_idx[wi], best_v, best_i)) { best_v = warp_val[wi]; best_i = warp_idx[wi]; }
        part_val[blockIdx.x] = best_v;
        part_idx[blockIdx.x] = best_i;
    }
}
#endif  // DEVICE_FUNCTIONS_ONLY

// One embedding row, dequantized as the reference does (wf_dequant: bit for bit), into
// residual fp32: block bx of `threads` threads, thread i chunk c = bx · threads + i (32 inputs:
// 32 fp32 out), nothing for c past the row. A token
// outside [0, V) is a bug upstream: the row is filled with NaN (embedding.cu).
template <int F>
__device__ __forceinline__ void embedding_fmt_row(float* __restrict__ out, const WfWeight& w, int token, int V, int D,
                                                  int bx, int threads) {
    const int c = bx * threads + threadIdx.x;
    if (c >= D / WF_CHUNK) return;
    float4* dst = reinterpret_cast<float4*>(out) + 8 * c;
    if (token < 0 || token >= V) {
        const float nan = F32_NAN;
        for (int j = 0; j < 8; ++j) dst[j] = make_float4(nan, nan, nan, nan);
        return;
    }
    const WfRaw r = wf_load<F>(w, (u32)token, c, D, l2_evict_first_policy());
#pragma unroll
    for (int j = 0; j < 8; ++j)
        dst[j] = make_float4(wf_dequant<F>(r, c, 4 * j), wf_dequant<F>(r, c, 4 * j + 1),
                             wf_dequant<F>(r, c, 4 * j + 2), wf_dequant<F>(r, c, 4 * j + 3));
}

#define EMBEDDING_FMT_THREADS 128

// The decode step's embedding row in its format (state[1], the previous step's token): block
// bc.bx of the planned grid takes chunks bc.bx · bc.threads + i (thread i < bc.threads; a
// persistent block's threads past the plan take none). No block-wide barrier.
struct EmbeddingFmtArgs {
    float* residual;       // [D] fp32, out
    const u32* w_qweight;  // [V, D] in format fmt: codes (weight_formats.cuh)
    const u32* w_qhigh;    // high bits, or null
    const void* w_scales;  // scales (fp16 | uint8 | int8, by format)
    const void* w_aux;     // offsets | superscales, or null
    const int* state;      // [3] int32: pos, token, seq_len (reads [1])
    int V, D, fmt;
};

template <typename Dep>
__device__ __forceinline__ void embedding_fmt_item(const EmbeddingFmtArgs& a, const BlockCoord& bc, Dep dep) {
    dep.launch_dependents();
    dep.wait();  // state[1] is the previous step's token; residual was read by it
    const WfWeight ws = GF_WEIGHT(a.w);
    const int token = a.state[1];
    if (!Dep::exact_block() && (int)threadIdx.x >= bc.threads) return;
    WF_DISPATCH(a.fmt, F, embedding_fmt_row<F>(a.residual, ws, token, a.V, a.D, bc.bx, bc.threads);)
}

// grid (ceil(D/32/128)), block (128).
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(EMBEDDING_FMT_THREADS)
embedding_fmt(float* __restrict__ residual, const u32* __restrict__ w_qweight, const u32* __restrict__ w_qhigh,
              const void* __restrict__ w_scales, const void* __restrict__ w_aux, const int* __restrict__ state,
              int V, int D, int fmt) {  // EmbeddingFmtArgs says what each is
    embedding_fmt_item(EmbeddingFmtArgs{residual, w_qweight, w_qhigh, w_scales, w_aux, state, V, D, fmt},
                       BlockCoord::of_launch(), GridDep{});
}

// grid (ceil(D/32/128), T), block (128).
extern "C" __global__ void __launch_bounds__(EMBEDDING_FMT_THREADS)
embedding_fmt_rows(float* __restrict__ residual,  // [T, D] fp32, out
                   const u32* __restrict__ w_qweight,    // [V, D] in format fmt: codes (weight_formats.cuh)
                   const u32* __restrict__ w_qhigh,      // high bits, or null
                   const void* __restrict__ w_scales,    // scales (fp16 | uint8 | int8, by format)
                   const void* __restrict__ w_aux,       // offsets | superscales, or null
                   const int* __restrict__ ids,   // [T] int32 token ids
                   int V, int D, int fmt) {
    const WfWeight ws = GF_WEIGHT(w);
    const int r = blockIdx.y;
    WF_DISPATCH(fmt, F, embedding_fmt_row<F>(residual + (u64)r * D, ws, ids[r], V, D, blockIdx.x, blockDim.x);)
}
#endif  // DEVICE_FUNCTIONS_ONLY
