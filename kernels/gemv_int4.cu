// kernels/gemv_int4.cu — decode GEMVs over INT4 (layout id 1) weights in the device layout
// (int4_matmul.cuh: tile-major), y = W x, batch 1.
//
//   gemv_int4_f16            y fp16[N]          = W x
//   gemv_int4_qkv_rope       q, K/V cache slot  = rope([Wq; Wk; Wv] · rmsnorm(residual) + bias)
//   gemv_int4_residual       residual fp32[N]  += W x                                (o_proj, down_proj)
//   gemv_int4_gate_up_swiglu h fp16[F]          = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual)
//   gemv_int4_…_tokens       the last three for T ≤ 16 tokens at once, each token bit for bit the
//                            single-token kernel's (the verify pass; see "T tokens" below)
//
// The limit: HBM bandwidth. Each weight byte is read exactly once per token and used for one
// multiply-add pair (2 weights per byte), so the whole decode step is a stream of 3.4 GB of
// INT4 through the SMs; nothing else matters as long as the SMs keep enough bytes in flight
// and spend few instructions per byte. Bytes per call at the 7B shape (weights + scales):
//   qkv      (3584+512+512) × 3584 / 2           =  8.26 MB + 0.26 MB scales
//   o_proj    3584 × 3584 / 2                    =  6.42 MB + 0.20 MB
//   gate_up   2 × 18944 × 3584 / 2               = 67.90 MB + 2.12 MB
//   down      3584 × 18944 / 2                   = 33.95 MB + 1.06 MB
//   per layer 116.5 MB + 3.6 MB; × 28 layers = 3.37 GB (docs/benchmarks.md#bytes-per-token).
//
// What the decode step fuses into them (fewer launches: each one costs the GPU ~2–3 µs of
// drain and ramp-up, as much as a small GEMV's bytes):
//   - the RMSNorm before qkv and before gate/up (input_layernorm, post_attention_layernorm):
//     each block normalises the FP32 residual itself while its first weights are in flight
//     (rmsnorm.cuh: the stand-alone kernel's arithmetic and summation order, so x has the same
//     bits as rmsnorm.cu would give). 14 KB of residual per block from L2, a few µs of L2
//     traffic per launch in all, against a launch.
//   - bias + RoPE + the K/V cache write after qkv (rope.cuh: rope_kv.cu's arithmetic). RoPE
//     rotates dim i with dim i + Dh/2 of the same head, so the q and k tiles of this kernel
//     pair their rows: MMA row g of a tile is dim 8j + g of a head and MMA row g + 8 is dim
//     8j + g + Dh/2 (j = the tile's index within its head). The thread that adds up row g then
//     holds both halves of its rotation pair. The device layout stores q, k and v in that
//     order (v's tiles paired too, so that the prefill GEMM, which pairs all three, reads the
//     same bytes), so the pairing costs no address arithmetic.
//   - the residual add after o_proj and down_proj, SwiGLU after gate/up.
// And each kernel is a programmatic dependent of the one before it (ptx/griddep.cuh): its
// first batch of weights is requested before griddepcontrol.wait, under the previous kernel's
// tail; x, the residual, the state and the block table are read only after the wait.
//
// Work split
// ----------
//   tile    = 16 output rows (the M of one m16n8k16 MMA) of one matrix; gemv_int4_qkv_rope
//             stacks the tiles of q, k and v (ceil(Nq/16) + 2·ceil(Nkv/16)), gate/up pairs the
//             same 16 rows of both matrices.
//   grid.x  = G blocks, each owning a contiguous, balanced range of tiles
//             [b·T/G, (b+1)·T/G) — G = T for one tile per block, or fewer ("persistent"): the
//             launcher picks G and W so that the tiles spread evenly over the SMs in one wave
//             (launchers/gemv_int4.py, gemv_launch_shape). A block stages x once for all its
//             tiles, and its warps stream their weights without a pause between tiles.
//   block   = W warps (W = blockDim.x / 32, 1 ≤ W ≤ 8). The K groups of 128 inputs are split
//             into W contiguous ranges, one per warp ("split-K inside the block").
//   warp    = for each tile of the block, 16 rows (× 2 matrices for gate/up) × its K range: a
//             flat sequence of (tile, group) items, loaded in batches of GEMV_UNROLL (half that
//             for gate/up) with the next batch in flight while the current one is multiplied
//             (nothing of a batch is used before then, its scales included: GemvBatch).
//             Per group of 128 inputs, lane (g, t) = (lane/4, lane%4) loads ONE 16-byte word
//             quad of row g and one of row g+8 (words 4t … 4t+3 of the group = inputs
//             32t … 32t+31), unpacks them to FP16 (int4_a_fragments, int4_matmul.cuh) and feeds 8 MMAs:
//
//                 group gi of row r:  | t=0: words 0-3 | t=1: 4-7 | t=2: 8-11 | t=3: 12-15 |
//                 lanes 4g..4g+3 → MMA rows g (and g+8), 64 contiguous bytes per row
//
//             MMA j of the group (j = 0..7, word i = j/2) takes from lane (g, t) the inputs
//             k = 128·gi + 32t + 8i + 4(j%2) + {0,1 | 2,3} as its k positions {2t,2t+1 | 2t+8,2t+9}
//             (ptx/mma.cuh: the order of k inside an MMA is free). The B operand is x at the
//             same positions: 8 consecutive bytes of x per MMA, identical for every column n of
//             B, so all 8 columns of the result are the same dot product and lane (g, t)
//             finds row g's partial in c[0] and row g+8's in c[2].
//             Products are exact and accumulate in FP32 (why MMA: ptx/mma.cuh); the per-group
//             FP32 partial is multiplied by the row's FP16 scale once per group.
//   reduce  = when a warp finishes a tile, its 16 (32) row sums go to shared memory; after
//             the block's __syncthreads the block's threads add the W partials of each output
//             row in warp order. One thread takes MMA rows g and g + 8 of a tile (a RoPE pair in
//             the q/k tiles) and writes both: no atomics, bit-reproducible.
//
// x is staged once per block in dynamic shared memory (K·2 bytes: 7 KB at K = 3584, 37 KB at
// K = 18944; the launcher raises the 48 KB opt-in limit when a model needs more), in a
// permuted order that makes the MMA B-fragment reads conflict-free broadcasts. Keeping x in
// registers instead would cost 16 registers per group in flight; the weights need them more.
// Weights use the streaming load (L1::no_allocate, L2 evict-first, no L2 prefetch size: the
// 256 B one made a decode step read 23 % more than its weights from DRAM, ptx/ldst.cuh).
//
// The weights' layout: tile-major (int4_matmul.cuh), so the two 16-byte loads of a warp for one
// (tile, group) item read 512 contiguous bytes each, where layout id 1 as stored in the file
// (row-major) gave 8 pieces of 64 B in 8 rows K/2 bytes apart. Graph ITL of the synthetic 7B
// (`drvqwen bench --preset 7b --mode graph`, in turns with 194fb36, the commit before the
// layout, one H100, medians of five rounds; docs/bench/2026-12-05_033f04b_h100_syn7b_item_rows_*
// .json and …_194fb36_h100_syn7b_vs_item_rows_*.json): 2.197 ms tile-major against 2.320
// row-major. Each GEMV alone, in a timing probe of the addresses over the file's bytes (the
// same bytes and work; tools/dev_kernels.py gemv_int4, weights rotated past L2,
// docs/bench/2026-12-05_194fb36_h100_dev_gemv_int4_v1.json), µs,
// tile-major / row-major: o_proj 4.63 / 4.82, gate_up 25.73 / 29.03, down 15.23 / 16.40 (copy
// bandwidth 3022 GB/s: gate_up at 90 % of it from 80 %). Where a row-major warp load touches 8
// DRAM rows with 64 B each, the tile-major one touches one with 512 B.
//
// Shared memory (dynamic): x, K·2 bytes, then the warp partials,
// ceil(T/G) · MT · W · 16 · 4 bytes (MT = 2 for gate/up, else 1). The T-token kernels: see
// "T tokens".
//
// Measured on the H200 (7B shapes, graph replay of 20 calls; q/k/v, o and down fit in the
// 60 MB L2 across those replays, gate/up does not; copy bandwidth 4.3 TB/s), before the
// fusions and PDL:
//   | launch shape                               | gate_up  | down     | qkv     | o_proj  |
//   | one tile per block (first version)         | 29.7 µs  | 16.9 µs  | 7.2 µs  | 4.6 µs  |
//   | persistent, gemv_launch_shape              | 24.5 µs  | 16.9 µs  | 6.1 µs  | 4.6 µs  |
//   | + tile-major weights (dev version)         | 22.5 µs  | 15.3 µs  |         |         |
// gate_up at 24.5 µs is 2.86 TB/s (3.12 TB/s tile-major); qkv and o are launch/latency bound
// (~1.5–2 µs of bytes in ~5 µs). Tile-major is the device layout (below: "The weights'
// layout"); the other rows of these tables were measured over layout id 1 as stored.
//
// With the fusions and PDL (tools/bench_gemv.py --pdl: each GEMV alone, back to back in a graph,
// weights rotated past L2, H200, 4273 GB/s copy bandwidth), µs per call:
//   | engine, launch shape                         | qkv_rope | o_proj | gate_up | down  |
//   | registers, the cost model's W (4, 7, 7, 8)   |   9.54   |  4.72  |  23.70  | 15.17 |
//   | registers, W = 8 warps                       |   8.56   |  4.56  |  22.38  | 15.15 |  ← kept
//   | shared-memory ring (cp.async), 16 KiB / warp |   9.96   |  5.63  |  26.90  | 18.37 |  dev v2
//   | shared-memory ring, 8 KiB / warp             |   7.90   |  5.17  |  25.36  | 14.56 |  dev v2, GEMV_RING=8
// The ring (each warp streams its weights through slots in shared memory with cp.async, 7–15
// KiB in flight instead of 4–8 KiB in registers) lost where it counts: at one or two blocks
// per SM too few warps are left to hide the latency of the unpack → MMA chain (8 dependent MMAs
// per item), and the bytes in flight were not the limit. gate_up is at 73 % of the copy
// bandwidth, down at 54 %, qkv and o at 23 % and 34 %: a small GEMV is mostly its ramp-up.
// The ring is kept as kernels/dev/gemv_int4/v2_smem_ring.cu; re-run both sizes beside this file
// with `PYTHONPATH=src python3 tools/dev_kernels.py gemv_int4 --versions v2`.
// Re-run on an H100 without the ring's 256 B L2 prefetch size, beside a ring filled by bulk copies
// (kernels/dev/gemv_int4/v4_bulk_ring.cu, whose header has the table), the 8 KiB ring at 3 blocks
// an SM led at qkv_rope (7.28 against 8.16 µs), gate_up (24.29 / 25.30) and down (14.83 / 15.11),
// and every ring at one block an SM trailed: warps per SM, not bytes in flight. What 3 blocks an
// SM give without a ring, GEMV_UNROLL=2 (80 registers; tools/bench_gemv.py --pdl --unroll 4 1, two
// runs, docs/bench/2026-12-06_d16c85f_h100_bench_gemv_unroll_{1,2}.json), µs at UNROLL 2 / 4 / 1:
//   qkv_rope 7.46 / 8.30 / 10.92 (grid 288 / 144 / 288)   o_proj 5.14 / 4.66 / 5.98 (224 each)
//   gate_up 25.13 / 25.34 / 25.14 (395 / 237 / 395)       down 18.43 / 15.13 / 23.61 (224 each)
// — only qkv_rope gains: its 288 tiles go one a block where 2 blocks an SM made it 144 blocks of
// two; o_proj and down keep their grid and lose half their bytes in flight. As the decode step's
// default (every GEMV at 2) the 7B took 2.275 ms against 2.211 (H100, graph ITL, medians of three
// in turns, docs/bench/2026-12-06_d16c85f_h100_syn7b_unroll2_all_*.json); qkv_rope alone at 2
// (launchers/gemv_int4.py: QKV_ROPE_DEFINES) 2.172 ms against 2.204, its launches 348–351 µs a
// step against 374–377 (--kernels; docs/bench/2026-12-06_7602f0f_h100_syn7b_qkv_unroll2_*.json,
// …_fa68086_h100_syn7b_vs_qkv_unroll2_*.json). Where its grid does not grow it only loses: the
// 0.5B's 72 qkv tiles run 72 blocks either way, 3.88 / 3.89 µs at 2 against 3.73 / 3.72 at 4
// (two runs; docs/bench/2026-12-06_047af3d_h100_bench_gemv_05b_unroll_{1,2}.json) — so the
// launcher takes it only where three blocks an SM give a block fewer tiles (qkv_rope_defines).
// The 8 KiB ring as gemv_int4_gate_up_swiglu's own engine (commit 9b30681: the same sums, 75
// registers, 3 blocks an SM of 76 KB each, 395 blocks) passed the GEMV, verify and persistent
// GPU tests and the sanitizers, and cost the 7B step 2.434 ms against 2.178 (H100, graph ITL,
// medians of three in turns), where its launches, timed one by one, summed to 902 µs a step
// against 871 (docs/bench/2026-12-06_9b30681_h100_syn7b_gate_up_ring_*.json,
// …_e86bc9e_h100_syn7b_vs_gate_up_ring_*.json). A GEMV alone, back to back with itself, does not
// show what a launch costs its neighbours: three ring blocks hold an SM's whole shared memory,
// so (not measured further) the blocks of the launches before and after it cannot share its
// SMs while it runs, and what programmatic dependent launch overlaps is lost.
//
// Two more ways to keep more bytes in flight, each timed beside this engine in one run
// (tools/bench_gemv.py --pdl --int4-defines …, same table; docs/bench/2026-12-02_h200_gemv_int4_variants.json)
// and in the persistent decode step (decode_persistent.cu, synthetic 7B, graph ITL):
//   | engine                                         | qkv_rope | o_proj | gate_up | down  | persistent 7B |
//   | this one (batches of UNROLL, next in flight)   |   8.54   |  4.57  |  21.60  | 15.01 |   2.630 ms    |
//   | + L2 bulk prefetch of the tiles 2 ahead        |  10.07   |  5.39  |  26.94  | 20.63 |   2.882 ms    |
//   | a rolling ring of 8 item slots (7 in flight)   |   8.24   |  4.52  |  22.84  | 14.07 |   2.705 ms    |
// (the third row from a second run, whose own baseline gave 8.52 / 4.61 / 22.46 / 15.10: ±4 % between
// runs; its persistent figure against the first run's 2.630).
// The L2 prefetch (cp.async.bulk.prefetch.L2 of whole tiles by one lane of warp 0, the scales by
// line prefetches) lost everywhere; the rolling ring moved nothing outside the noise but down_proj.
// Neither is kept: their compile-time switches live at commits 58e9cd1 and 4039c96.
// Nsight Compute at one block of 8 warps per SM (gate_up, 7B): 2.41 TB/s, the warps' stalls
// on the first use of the weight and scale loads (LOP3 unpack, HADD2.F32 scale conversion):
// latency-bound with few warps, as the batches already are.
// Lost too, and removed from kernels/dev (its code is at commit a4a735c, dev version 3): v1's
// tile-major weights streamed into a per-warp shared-memory ring by 1-D bulk copies
// (cp.async.bulk, one instruction an item's kilobyte, full/empty mbarriers per slot). Correct on
// the H200 (the dev runner's checks) and slower than this engine at all four 7B GEMVs in its one
// run, the 16 KiB ring slower still, while v1 beat this engine at three; that run's JSON did not
// come back, so no figure is quoted. More bytes in flight through shared memory did not pay here,
// as the ring of cp.async (dev v2) did not.
//
// Where the time goes: the loads and the arithmetic apart (the GEMV_PROBE_LOADS_ONLY and
// GEMV_PROBE_NO_LOADS builds below; tools/bench_gemv.py --pdl --int4-defines, one run, µs per
// call, docs/bench/2026-12-04_1ee9f50_h200_gemv_int4_probes.json):
//   | build                                       | qkv_rope | o_proj | gate_up | down  |
//   | the kernel                                  |   8.53   |  4.56  |  22.50  | 15.00 |
//   | its loads alone (no unpack, no MMA)         |   6.35   |  3.41  |  21.06  | 12.38 |
//   | its arithmetic alone (no weight/scale load) |   7.41   |  3.41  |  17.42  | 11.57 |
// Each half alone takes most of the kernel's time, so making one of them faster cannot give
// much: the load stream by itself reaches 78 % of the copy bandwidth at gate_up and 66 % at
// down, and the unpack → MMA chains by themselves take 77 % of either kernel's time. What is
// left (qkv, o_proj: ~3.4 µs with no load or no MMA) is the launch's fixed part — the wait, the
// x or RMSNorm prologue, the block's reduction and the epilogue.
// More bytes in flight speed the loads alone but not the kernel (same tool, one run each,
// docs/bench/2026-12-04_848df12_h200_gemv_int4_probes_unroll.json and …_unroll.json): the loads alone at
// GEMV_UNROLL 2 / 4 / 8 take gate_up 27.26 / 21.19 / 19.03 µs (60 / 77 / 86 % of copy) and down
// 15.60 / 12.28 / 12.20, but the whole kernel at 8 takes gate_up 23.32 against 22.44 at 4, down
// 17.90 against 14.96, qkv_rope 9.93 against 8.48 (at 6: 25.03, 18.02, 9.75): batches of 8 leave
// registers for one block of 8 warps per SM, too few to hide the unpack → MMA latency. And the
// most an unpack saving can give: without the f16x2 fixups (GEMV_PROBE_NO_FIXUP, wrong values)
// gate_up 21.73, down 14.16, qkv_rope 8.25, o_proj 4.45 against 22.39 / 14.96 / 8.55 / 4.57.
// Fewer instructions did not make the arithmetic faster: a load cursor (per tile, 32-bit offsets
// of row g's words and scales and the step to row g + 8, moved one group per item: ~22
// instructions of loads and addresses per item instead of ~46, the same addresses and bits —
// equal logit hashes with tools/decode_fingerprint.py on the synthetic 0.5B and 7B) gave
// qkv_rope 8.01 / 7.96 µs against 8.56 / 8.52, but o_proj 4.71 / 4.72 against 4.58 / 4.55,
// gate_up 24.40 / 24.40 against 22.39 / 22.37 and down 16.54 / 16.46 against 14.89 / 14.98, and
// the 7B's graph ITL 2.331 / 2.328 ms against 2.163 / 2.183 (in turns, one run; its registers
// went to 128 from 112–125; docs/bench/2026-12-04_{e20a862,100d1d8}_h200_*cursor*.json; the
// code is at commit e20a862). So the arithmetic is not bound by issue slots.
// Why a cursor loses, seen in the SASS of a second one (commit 749f32c: 32-bit offsets moved by
// a constant, set again where a tile starts): the tile change is a branch between a batch's
// loads, and across its join the compiler moved the batch's scale registers — a move of a
// load's destination waits for the load — so each item waited for its scales' memory round trip
// before the next item's loads went out: the 7B's graph ITL 2.270 ms against 2.177, down alone
// at one block an SM 25.5 µs against 17.0 (H100, in turns;
// docs/bench/2026-12-06_749f32c_h100_syn7b_load_cursor_*.json, …_e8ad914_h100_syn7b_vs_load_cursor_*.json,
// …_749f32c_h100_bench_gemv_load_cursor.json). What is kept instead: an item's offsets computed from (tile, group) as
// before, with no state between items and no branch, in 32-bit arithmetic (quad_offset; each
// pointer one wide add) where they were 64-bit — gate_up's main loop 617 → 546 instructions,
// down's 719 → 630, qkv_rope's 931 → 846 (tools/sass_loops.py gemv_int4;
// docs/bench/2026-12-06_e8ad914_cpu_sass_gemv_int4.json, …_1f44e65_cpu_sass_gemv_int4.json) — and, alone (tools/bench_gemv.py --pdl --blocks 132,
// the two trees in turns, two rounds, H100; docs/bench/2026-12-06_13ac54c_h100_bench_gemv_offsets32.json),
// µs 32-bit against 64-bit: qkv_rope 7.23 / 7.29 against 7.44 / 7.45, o_proj
// 4.63 / 4.65 against 4.63 / 4.68, gate_up 25.62 / 25.58 against 25.78 / 25.81, down 15.05 /
// 15.13 against 15.12 / 15.19; at one block an SM gate_up 27.75 / 27.67 against 28.20 / 28.15,
// down 16.64 / 16.53 against 17.18 / 17.17. The 7B's graph ITL 2.197 ms against 2.209 (rounds
// 2.197 / 2.186 / 2.202 against 2.209 / 2.211 / 2.209), the 0.5B's 0.643 against 0.646, within
// its spread (tools/bench_commits.py, three rounds in turns; …_13ac54c_h100_syn{7b,05b}_offsets32_*.json,
// …_e8ad914_h100_syn{7b,05b}_vs_offsets32_*.json).
// What a block of 8 warps an SM waits on (Nsight Compute over gate_up, H100;
// docs/bench/2026-12-06_12b2766_h100_gemv_gate_up_ncu_issue.json): ~161 warp instructions a 1 KiB item — the unpack ~75
// (LOP3 34, HADD2 16, HFMA2 16, shifts 9), 8 MMAs, the rest the items' addresses and the batch
// hand-over (`cur = next`: ~40 moves a batch) — at 1.58 instructions a cycle an SM in production's
// two blocks, where half the warp samples wait on a load (long scoreboard), and 1.35 at one
// block (kernels/dev/gemv_int4/v4_bulk_ring.cu, its weights in shared memory), where the samples
// spread over fixed-latency dependencies (wait, 23 %), loads (22 %) and issuing (18 %): with two
// warps a scheduler, each item's chain of dependent instructions is the time. Taking the batch
// hand-over out did not help: the main loop unrolled twice so that the two batches take turns
// (a compile-time switch at commit 0a436a9: batch A's loads, B's MMAs, B's loads, A's MMAs, no
// `cur = next`; gate_up's loop 1022 instructions for two batches against 546 for one, 127 registers, no spills;
// docs/bench/2026-12-06_0a436a9_cpu_sass_gemv_int4_ping_pong.json) lost
// everywhere but o_proj — alone, µs with it / without (the same loop body as a lambda, switch
// off, commit 3070ab7) / before: gate_up 27.83, 27.86 / 25.68, 25.62 / 25.64, 25.64, down
// 16.68, 16.80 / 15.12, 15.19 / 15.12, 15.18, qkv_rope 7.54, 7.54 / 7.22, 7.24 / 7.29, 7.25,
// o_proj 4.54, 4.57 / 4.62, 4.64 / 4.66, 4.67; at one block an SM gate_up 33.73 / 27.68 / 27.75,
// down 20.60 / 16.66 / 16.67; the 7B's graph ITL 2.314 / 2.199 / 2.203 ms, the 0.5B's 0.651 /
// 0.648 / 0.642 (H100, in turns: docs/bench/2026-12-06_0a436a9_h100_bench_gemv_ping_pong.json,
// …_0a436a9_h100_syn{7b,05b}_ping_pong_*.json, …_3070ab7_…_ping_pong_lambda_body_*.json,
// …_1f44e65_…_vs_ping_pong_*.json). The loads still go out one batch ahead, as before, so the
// turns could only save the moves; what the doubled loop costs instead was not profiled (its
// 16 KB of code against 8.7 KB is one candidate: the slowdown is largest at one block an SM).
// Nor by the length of an item's MMA chain: the 8 MMAs into 2 or 4 accumulators in turn, added
// after the item (a compile-time switch at commit 4ecab0a; other last bits) gave down 14.74 /
// 14.84 µs against 14.81, gate_up 23.22 / 23.49 against 22.33 (its build spills 8–12 bytes),
// qkv_rope and o_proj within 1 %, and the arithmetic alone of down 11.16 against 11.49, of
// gate_up 17.65 against 17.28 (one run, docs/bench/2026-12-04_4ecab0a_h200_gemv_int4_mma_chains.json).
// Nor by the unpack's fixups: a biased unpack (the lop3 halves kept as 1032 + q and 72 + q, 5
// instructions a word instead of 9, and each group's sum corrected once by C_g = 1032·Σ x[lo] +
// 72·Σ x[hi], computed per (token, group) from the staged x into shared memory; qkv_rope and
// gate_up; gate_up's main loop 612 → 486 instructions a batch, no spills) gave qkv_rope 8.98 µs
// against 8.57, gate_up 22.88 against 22.37, and with every pair at magic 64 (7 instructions a
// word) 9.23 and 23.08; the 7B's graph ITL at 512 tokens 2.193 / 2.182 / 2.190 / 2.190 ms
// against 2.152 / 2.158 / 2.157 / 2.158 (in turns, one run; a compile-time switch at commit
// a6b5a13; docs/bench/2026-12-04_a6b5a13_h200_gemv_int4_biased_unpack.json and
// …_syn7b_itl_{biased,exact}_{1,2}.json, whose 4096/8192 rows also hold the attention's split rule).
// Two more shapes measured and not kept, same tool: o_proj and down_proj reading x's B fragments
// from global memory instead of staging it (GemvXGlobal, as the T-token kernel does; the same
// bits): o_proj 4.58 µs, down 15.79 against 4.56 and 15.00 (the probes' file); other grids than
// gemv_launch_shape's (--blocks 264 / 200 / 132): qkv_rope 8.34 / 8.05 / 9.25 against 8.55 at
// 144, o_proj 4.53 (224) / 5.33 / 4.84 against 4.56, gate_up 22.96 / 23.74 / 24.90 against 22.39
// at 237, down 14.89 (224) / 23.48 / 18.16 against 14.88
// (docs/bench/2026-12-04_480162c_h200_gemv_int4_blocks.json): a block's time follows its tile
// count (200 blocks for down's 224 tiles: 24 blocks with two), not its SM's.
// The scales kept as FP16 bits until their batch is multiplied (GemvBatch), against their
// conversion at the load (the engine at commit 6d38835), each GEMV alone (tools/bench_gemv.py
// --pdl, the two trees in turns, two rounds, µs; docs/bench/2026-12-05_e6b8a90_h200_gemv_int4_vs_6d38835_{1,2}.json
// and …_6d38835_h200_gemv_int4_vs_e6b8a90_{1,2}.json):
//   qkv_rope 8.38 / 8.34 against 8.51 / 8.58, o_proj 4.52 / 4.54 against 4.59 / 4.57,
//   gate_up 22.92 / 22.89 against 22.42 / 22.41, down 14.14 / 14.12 against 14.97 / 14.90.
// down gains 5 %, gate_up loses 2 %; the step does not move outside its runs' spread (graph ITL,
// tools/bench_commits.py, in turns: 7B 2.132 / 2.165 ms against 2.128 / 2.118, 0.5B 0.629 /
// 0.623 / 0.621 against 0.617 / 0.619 / 0.623; …_syn{7b,05b}_vs_*.json). Kept for the persistent
// step (decode_persistent.cu), where an item's first batch waits longest: 2.455 ms against 2.537
// at 7B, 0.672 against 0.680 at 0.5B (one run each, in turns; …_syn{7b,05b}_persistent_vs_*_1.json).
// Each of these kernels, profiled alone, reads from DRAM the bytes it is counted for (Nsight
// Compute after a cache flush, 7B: qkv_rope 8.59 MB for 8.52, o_proj 6.67 for 6.62, gate_up 70.39 for 70.02, down 35.26
// for 35.01, and gate_up / down forced to 132 blocks 70.10 / 35.09;
// docs/bench/2026-12-05_e6b8a90_h200_gemv_int4_dram_ncu.json) — after a flush. Inside a step,
// with L2 full, a .L2::256B prefetch size on the weight loads makes them read more: gate_up
// 114.6 MB a launch, down_proj 47.1 (H100, no flush between launches;
// docs/bench/2026-12-05_7ac45fc_h100_persistent_dram_probes.json); hence no prefetch size
// (ptx/ldst.cuh).
//
// T tokens at once
// ----------------
// The verify pass of speculative decoding runs the last accepted token and k proposed ones
// (T = k + 1 ≤ 16) through the model in one pass, each token's logits bit for bit what the
// decode step computes for it alone. The *_tokens kernels (end of the file) are the three
// fused GEMVs for T tokens, on the same engine (gemv_int4_engine<NTOK>: NTOK = 1 is the
// single-token kernels, NTOK = GEMV_TOKENS the T-token ones; T = n_tokens ≤ NTOK at run time;
// in this section T counts tokens, not tiles).
//   The column trick: the single-token engine feeds the same x to all 8 columns n of the MMA's
//   B operand. Here column n of MMA b (b < ceil(NTOK/8)) takes token 8b + n: lane (g, t)
//   supplies token 8b + g's x at exactly the k positions it supplies in the single-token engine
//   (the same 16-byte chunk per word i), and after the MMA holds columns 2t, 2t + 1 — tokens 8b + 2t, 8b + 2t + 1
//   — of rows g (c[0], c[1]) and g + 8 (c[2], c[3]). One MMA (two for T > 8, same A fragment)
//   does for up to 8 tokens what it did for one.
//   Why it is exact: each element of an MMA's result is its own dot product over the 16 k of
//   its row and column, so token j's column is the single-token MMA's result for x_j, bit for
//   bit; the per-group sum is the same chain of 8 MMAs in the same k order, times the row's
//   scale with the same fmaf into the same accumulator, groups in the same order; the W warp
//   partials are added in warp order. W (the K split; with GEMV_FLAT_SPLIT, G too, which sets a
//   block's tiles) is the only launch parameter in that arithmetic, and the T-token launchers take the single-token launch's grid and block
//   (launchers/gemv_int4.py). The prologue normalises each token's residual row with
//   rmsnorm.cuh's arithmetic (its sum's order does not depend on the block); RoPE, the K/V
//   write, SwiGLU and the residual add run per (row, token) with the single-token epilogues,
//   token j at position pos + j. Columns past T repeat token T − 1 (no select in the loop)
//   and are never stored.
//   Bytes per call: the weights and scales once for all T tokens (the table above), plus T
//   times the activations (x or the residual in, the outputs): at the 7B shapes under 0.5 % of
//   the weights per token, so a T-token call moves about as many bytes as a single-token one.
//   x in shared memory: T·(K·2 + 64) bytes (GEMV_X_TOKEN_PAD: conflict-free B reads), 57 KB for
//   8 tokens at K = 3584, 115 KB for 16; the partials grow T-fold too. That is how the two
//   RMSNorm kernels (qkv, gate/up: K = hidden size) stage it; the launcher refuses a shape whose
//   block would need more than a block may have. down_proj's K = 18944 would need 303 KB for 8
//   tokens, past the 227 KB limit, so gemv_int4_residual_tokens (o_proj, down_proj) stages
//   nothing: each lane reads its B fragments of x [T, K] straight from global memory
//   (GemvXGlobal: through L1/L2, T·K·2 bytes, 606 KB at most, just written by the kernel
//   before). At the launch shapes of the 7B and 0.5B, o_proj and down_proj give each block one
//   tile (N = hidden size ≤ the resident blocks), so x staged in shared memory would be read
//   once per block anyway: the same bytes from L2, without the barrier. Not timed yet: whether
//   the L2 latency in the MMA chain costs more than a staging would is for the benchmark to say.
//   The single-token kernels stage x as described above.
//   The *_x_tokens kernels (qkv_rope, gate_up_swiglu) take the T rows normalised before by an
//   rmsnorm launch — the same x bits as the fused prologue, rmsnorm.cuh being that kernel's
//   arithmetic — and stage them with independent loads (GemvStageXTokens), where the fused
//   prologue normalises row after row in every block: one launch more per RMSNorm. Measured on
//   the H200 (tools/bench_verify.py --fused, commit 9b514ea, docs/bench), a verify pass of 8
//   tokens costs 1.25 decode steps of the 7B this way and 1.55 fused (0.5B: 1.27 and 1.92), so
//   the verify pass runs these by default (verify_plan's prenorm).
//   Registers (ptxas): at NTOK = 8 each lane accumulates 2 tokens per row instead of 1 and the
//   kernels stay within 128 (two blocks of 256 threads per SM, as the single-token ones). The
//   NTOK = 16 build (-DGEMV_TOKENS=16: two MMAs per k slice, 4 tokens per lane and row) is
//   compiled only for T > 8; its qkv and gate/up kernels need more than 128 (one block per SM).
//
// Requirements (checked by the launchers): K % 128 == 0; 1 ≤ W ≤ K/128 (every warp has at
// least one group); N ≥ 1 (any N: rows past N are loaded from the last row, never stored); for
// qkv_rope, Dh % 16 == 0 (a tile never straddles two heads); pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"        // u32, u64, WARP_SIZE, QUAD_SIZE
#include "ldst.cuh"         // ld_stream_v4, l2_evict_first_policy
#include "mma.cuh"          // mma_m16n8k16_f32_f16
#include "griddep.cuh"      // grid_dependency_wait, grid_launch_dependents
#include "int4_matmul.cuh"  // INT4_GROUP, INT4_TILE_ROWS, int4_a_fragments, int4_segment, swiglu_f16, …
#include "rmsnorm.cuh"      // rmsnorm_inv_rms, rmsnorm_apply4, RMSNORM_WARPS
#include "rope.cuh"         // rope_rotate
#include "kv_cache.cuh"     // kv_offset, PAGE_TOKENS
#include "block_coord.cuh"  // BlockCoord, GridDep

#define GEMV_MAX_WARPS        8                 // K-split warps per block (256 threads)
#define GEMV_WORDS_PER_GROUP  (INT4_GROUP / 8)  // 32-bit words of INT4 per row per group
#define GEMV_CHUNKS_PER_GROUP (INT4_GROUP / 8)  // 16-byte chunks of FP16 x per group
#define GEMV_MMA_TOKENS       8                 // tokens one MMA takes: the N of m16n8k16
// Groups per load batch for one matrix: 4 KB of weights per warp per batch (half as many
// groups for gate/up: two matrices). The next batch is loaded while the current one is
// multiplied, so a warp keeps 4–8 KB in flight; with ≥ 14 warps per SM that covers HBM
// latency (~15 KB per SM). A compile-time knob for tools/bench_gemv.py (-DGEMV_UNROLL=N).
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 4
#endif
#define GEMV_GROUP_UNROLL(MT) ((MT) == 1 ? GEMV_UNROLL : (GEMV_UNROLL > 1 ? GEMV_UNROLL / 2 : 1))
// How a block's items are shared among its warps. 0: each warp takes a contiguous range of the K
// groups and works through it in every tile of the block (the header's work split). Where W does
// not divide the groups — the 7B's 28 groups a row over 8 warps — half the warps have one item a
// tile more than the others, and over a block's tiles they wait for them at the block's
// reduction: gate_up's 5 tiles a block are 20 items for four warps and 15 for the other four.
// 1: the block's (tile, group) items in one flat sequence, group fastest, split into W
// contiguous ranges of ⌊I/W⌋ or ⌈I/W⌉ (17 or 18 of gate_up's 140): a warp's range may begin
// or end inside a tile, and each warp publishes its sums for the tiles its range touches (zeros
// for the others), so the reduction and the epilogue are unchanged. A compile-time knob for
// tools/dev_kernels.py (kernels/dev/gemv_int4/v3_flat_split.cu); the sums are added in another
// grouping than with 0, so the bits differ (within the tests' bounds), not between launches.
// A block of one tile (the 7B's o_proj and down_proj) splits its groups as 0 does: same ranges,
// same bits; the split matters where blocks own several tiles (gate_up 5, qkv_rope 2 at 7B).
// Measured slower at every 7B GEMV (tools/dev_kernels.py gemv_int4 --versions v3, µs: 8.67 /
// 4.83 / 23.33 / 15.03 against 8.34 / 4.50 / 22.61 / 14.15, qkv_rope / o_proj / gate_up / down;
// docs/bench/2026-12-05_e6b8a90_h200_dev_gemv_int4_v3.json): the balance did not pay for its
// counter and extra partial stores. Kept off. At the 0.5B's shapes too (one H100, tools/bench_gemv.py
// --preset 0.5b --gemv down_proj gate_up_swiglu --int4-defines GEMV_FLAT_SPLIT=1 --pdl, µs:
// down_proj, K = 4864's 38 groups over 8 warps, 4.52 against 4.12; gate_up 4.50 against 4.21;
// docs/bench/2026-12-07_3af20d8_h100_bench_gemv_05b_int4_flat_split.json).
#ifndef GEMV_FLAT_SPLIT
#define GEMV_FLAT_SPLIT 0
#endif

// x in shared memory, 16-byte chunks permuted so that the 4 chunks the lanes t = 0..3 read
// together sit in 4 consecutive 16-byte slots (conflict-free; the 8 lanes g share them as a
// broadcast): chunk (group gi, lane t, word i) — inputs 128·gi + 32t + 8i … +8 — lives at
// slot 16·gi + 4i + t.
__device__ __forceinline__ int gemv_x_slot(int chunk) {
    const int gi = chunk / GEMV_CHUNKS_PER_GROUP, c = chunk % GEMV_CHUNKS_PER_GROUP;
    return gi * GEMV_CHUNKS_PER_GROUP + (c % 4) * 4 + c / 4;
}

// x of T tokens in shared memory (the T-token kernels): token j's K/8 chunks, in gemv_x_slot
// order, from chunk j · gemv_x_token_chunks(K). With T tokens the 8 lanes g of a B-fragment read
// take 8 different tokens; K·2 bytes is a multiple of 256, so unpadded they would all hit the
// same 16 banks. GEMV_X_TOKEN_PAD chunks (64 bytes) after each token put tokens g and g + 1
// (one quarter-warp of a 16-byte load) in the two halves of the 32 banks.
#define GEMV_X_TOKEN_PAD 4
template <int NTOK>
__device__ __forceinline__ int gemv_x_token_chunks(int K) { return K / 8 + (NTOK == 1 ? 0 : GEMV_X_TOKEN_PAD); }

// Timing probes of the T-token kernels (NTOK > 1 only; the single-token kernels never see them),
// for tools/bench_gemv.py --tokens --int4-defines: each removes one suspect of the time that grows
// with T. A probe build's results are WRONG by design; time it, never use its outputs.
//   GEMV_PROBE_NO_NORM=1      the RMSNorm prologue stages x = fp16(residual): no sum of squares,
//                             no barrier per row (GemvStageRmsNormT)
//   GEMV_PROBE_NO_EPILOGUE=1  no epilogue per (row, token): the block still adds up its partials,
//                             and thread 0 stores one fold of its sums through the epilogue, so the
//                             main loop stays live (gemv_int4_engine)
#ifndef GEMV_PROBE_NO_NORM
#define GEMV_PROBE_NO_NORM 0
#endif
#ifndef GEMV_PROBE_NO_EPILOGUE
#define GEMV_PROBE_NO_EPILOGUE 0
#endif
// Two more timing probes, of every kernel of the build (the single-token ones too), results WRONG
// by design: together they split a GEMV's time into its memory stream and its arithmetic.
//   GEMV_PROBE_LOADS_ONLY=1   every weight and scale load as in the real kernel, but an item's
//                             unpack → 8 MMAs is replaced by one XOR of its words into the
//                             accumulator (the loads stay live): the time of the load stream alone
//   GEMV_PROBE_NO_LOADS=1     the real unpack → MMA → scale chain, on words and scales made from
//                             the item's index (no weight or scale load): the arithmetic alone
// If the real kernel takes about the larger of the two, its loads and its arithmetic overlap and
// the larger one is the limit; about their sum, each warp waits for one while doing the other.
#ifndef GEMV_PROBE_LOADS_ONLY
#define GEMV_PROBE_LOADS_ONLY 0
#endif
#ifndef GEMV_PROBE_NO_LOADS
#define GEMV_PROBE_NO_LOADS 0
#endif
//   GEMV_PROBE_NO_FIXUP=1     the unpack without its four f16x2 subtractions / FMAs per word
//                             (the lop3 halves 1024 + v and 1024 + 16v go to the MMAs as they
//                             are): what the arithmetic would cost if the codes' offsets were
//                             taken out once per group instead of once per weight pair
#ifndef GEMV_PROBE_NO_FIXUP
#define GEMV_PROBE_NO_FIXUP 0
#endif

// The prologues (x_src in gemv_int4_engine) say where x lies for the B fragments:
//   smem_chunks(K)            16-byte chunks of dynamic shared memory they fill (the partials follow)
//   lane_x(x_smem, tok, t, K) where lane t's chunks of token tok start; chunk (gi, i) of the lane
//                             is lane_x[16·gi + WORD_STEP·i] (inputs 128·gi + 32t + 8i … +8)
//   operator()(x_smem, K)     the staging, after the wait, from every thread (the caller syncs)

// Prologue: x (K fp16, an earlier kernel's output) into the block's shared x_smem in the
// permuted order. Ordinary loads: they stay after griddepcontrol.wait. Every thread takes part;
// the caller syncs.
struct GemvStageX {
    const __half* __restrict__ x;  // [K] fp16
    static constexpr int WORD_STEP = 4;  // gemv_x_slot: word i of lane t is slot 4i + t of its group
    __device__ __forceinline__ int smem_chunks(int K) const { return K / 8; }
    __device__ __forceinline__ const uint4* lane_x(const uint4* x_smem, int, int t, int) const { return x_smem + t; }
    __device__ __forceinline__ void operator()(uint4* x_smem, int K) const {
        const uint4* src = reinterpret_cast<const uint4*>(x);
        for (int chunk = threadIdx.x; chunk < K / 8; chunk += blockDim.x) x_smem[gemv_x_slot(chunk)] = src[chunk];
    }
};

// x = fp16(rmsnorm(residual) · w) of one row (rmsnorm.cuh) into x_dst, in gemv_x_slot order.
// Contains a __syncthreads (the sum of squares, through warp_sums: RMSNORM_WARPS floats of shared
// memory); every thread takes part.
__device__ __forceinline__ void gemv_stage_rmsnorm_row(uint4* x_dst, const float* __restrict__ residual,
                                                       const __half* __restrict__ weight, float eps, int K,
                                                       float* warp_sums) {
    const float4* r4 = reinterpret_cast<const float4*>(residual);
    const uint2* w4 = reinterpret_cast<const uint2*>(weight);
    constexpr int R = 2;  // chunks a thread: the 7B's K = 3584 is 448 chunks over 256 threads
    if (rmsnorm_one_pass<R>(K)) {  // block-uniform: the row read once (rmsnorm.cuh)
        float4 r[R][2];
        uint2 g[R][2];
#pragma unroll
        for (int j = 0; j < R; ++j)  // every load before the sum of squares waits for any
            rmsnorm_load_piece(residual, weight, threadIdx.x + j * blockDim.x, K / 8, r[j], g[j]);
        const float inv_rms = rmsnorm_inv_rms_pieces<R>(r, K, eps, warp_sums);
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const int chunk = threadIdx.x + j * blockDim.x;
            if (chunk < K / 8) {
                const uint2 lo = rmsnorm_apply4(r[j][0], g[j][0], inv_rms);
                const uint2 hi = rmsnorm_apply4(r[j][1], g[j][1], inv_rms);
                x_dst[gemv_x_slot(chunk)] = make_uint4(lo.x, lo.y, hi.x, hi.y);
            }
        }
        return;
    }
    const float inv_rms = rmsnorm_inv_rms(residual, K, eps, warp_sums);
    for (int chunk = threadIdx.x; chunk < K / 8; chunk += blockDim.x) {
        const uint2 lo = rmsnorm_apply4(r4[2 * chunk], w4[2 * chunk], inv_rms);
        const uint2 hi = rmsnorm_apply4(r4[2 * chunk + 1], w4[2 * chunk + 1], inv_rms);
        x_dst[gemv_x_slot(chunk)] = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
}

// Prologue: x = fp16(rmsnorm(residual) · w) of each of the T tokens' rows, straight into x_smem
// (NTOK = 1: one row, K·2 bytes, unpadded). Every row is normalised exactly as the stand-alone
// kernel would (rmsnorm.cuh: the order of the sum does not depend on the block). The rows' sums of
// squares alternate between two buffers: a thread writes row j + 2's sums only after the
// __syncthreads of row j + 1, which every thread reaches after reading row j's. Every thread takes
// part; the caller syncs.
// Row by row, each row costs a few dependent L2 round trips and a barrier. Normalising the T rows
// together instead (every row's loads issued before the butterflies, one barrier, the gain loaded
// once for all rows; same bits) did not pay on the H200, 7B at T = 8, summed over the 28 layers
// (tools/bench_verify.py --kernels, one run each): qkv_rope 707 µs against 784, but gate_up_swiglu
// 1585 against 1414, and at T = 1 471 against 398 and 980 against 911 (the unrolled prologue of
// the NTOK = 8 build runs for every T). Its code is at commit bbfc301.
template <int NTOK>
struct GemvStageRmsNormT {
    const float* __restrict__ residual;  // [T, K] fp32
    const __half* __restrict__ weight;   // [K] fp16 RMSNorm gain
    float eps;
    int n_tok = 1;                       // T ≤ NTOK
    static constexpr int WORD_STEP = 4;
    __device__ __forceinline__ int smem_chunks(int K) const {
        return (NTOK == 1 ? 1 : n_tok) * gemv_x_token_chunks<NTOK>(K);
    }
    __device__ __forceinline__ const uint4* lane_x(const uint4* x_smem, int tok, int t, int K) const {
        return x_smem + tok * gemv_x_token_chunks<NTOK>(K) + t;
    }
    __device__ __forceinline__ void operator()(uint4* x_smem, int K) const {
        if constexpr (NTOK > 1 && GEMV_PROBE_NO_NORM) {  // timing only, wrong x (see the define)
            const uint2 one = make_uint2(0x3c003c00u, 0x3c003c00u);  // gains of fp16 1.0
            for (int tok = 0; tok < n_tok; ++tok) {
                const float4* r4 = reinterpret_cast<const float4*>(residual + (u64)tok * K);
                uint4* dst = x_smem + tok * gemv_x_token_chunks<NTOK>(K);
                for (int chunk = threadIdx.x; chunk < K / 8; chunk += blockDim.x) {
                    const uint2 lo = rmsnorm_apply4(r4[2 * chunk], one, 1.f);
                    const uint2 hi = rmsnorm_apply4(r4[2 * chunk + 1], one, 1.f);
                    dst[gemv_x_slot(chunk)] = make_uint4(lo.x, lo.y, hi.x, hi.y);
                }
            }
            return;
        }
        __shared__ float warp_sums[NTOK == 1 ? 1 : 2][RMSNORM_WARPS];
        for (int tok = 0; tok < (NTOK == 1 ? 1 : n_tok); ++tok)
            gemv_stage_rmsnorm_row(x_smem + tok * gemv_x_token_chunks<NTOK>(K), residual + (u64)tok * K, weight, eps,
                                   K, warp_sums[tok % 2]);
    }
};
using GemvStageRmsNorm = GemvStageRmsNormT<1>;

// "Prologue" of the T-token residual GEMV: nothing staged, lane t reads its B fragments of
// token tok straight from x [T, K] in global memory (through L1/L2; ordinary loads, after the
// wait). Why not shared memory there: see the header, "T tokens".
struct GemvXGlobal {
    const __half* __restrict__ x;  // [T, K] fp16
    static constexpr int WORD_STEP = 1;  // natural order: word i of lane t is chunk 4t + i of its group
    __device__ __forceinline__ int smem_chunks(int) const { return 0; }
    __device__ __forceinline__ const uint4* lane_x(const uint4*, int tok, int t, int K) const {
        return reinterpret_cast<const uint4*>(x) + (u64)tok * (K / 8) + 4 * t;
    }
    __device__ __forceinline__ void operator()(uint4*, int) const {}
};

// Prologue of the *_x_tokens kernels: the T rows of x [T, K] fp16, normalised by an rmsnorm launch
// before (the same bits as GemvStageRmsNormT's: rmsnorm.cuh is that kernel's arithmetic), copied
// into x_smem in the T-token layout. Every load is independent of the others (one flat loop over
// (row, chunk)), where the fused RMSNorm takes a few dependent L2 round trips and a barrier per
// row. Every thread takes part; the caller syncs.
template <int NTOK>
struct GemvStageXTokens {
    const __half* __restrict__ x;  // [T, K] fp16, normalised
    int n_tok;                     // T ≤ NTOK
    static constexpr int WORD_STEP = 4;
    __device__ __forceinline__ int smem_chunks(int K) const { return n_tok * gemv_x_token_chunks<NTOK>(K); }
    __device__ __forceinline__ const uint4* lane_x(const uint4* x_smem, int tok, int t, int K) const {
        return x_smem + tok * gemv_x_token_chunks<NTOK>(K) + t;
    }
    __device__ __forceinline__ void operator()(uint4* x_smem, int K) const {
        const uint4* src = reinterpret_cast<const uint4*>(x);
        const int per_row = K / 8;
        for (int i = threadIdx.x; i < n_tok * per_row; i += blockDim.x) {
            const int tok = i / per_row, chunk = i - tok * per_row;
            x_smem[tok * gemv_x_token_chunks<NTOK>(K) + gemv_x_slot(chunk)] = src[i];
        }
    }
};

// The prologue XS of an item: the fused RMSNorm of the residual, or the normalised x rows.
template <typename XS>
struct GemvIsXTokens { static constexpr bool value = false; };
template <int NTOK>
struct GemvIsXTokens<GemvStageXTokens<NTOK>> { static constexpr bool value = true; };
template <int NTOK, typename XS>
__device__ __forceinline__ XS gemv_x_source(const float* residual, const __half* norm_w, float eps, int n_tok,
                                            const __half* x_normed) {
    if constexpr (GemvIsXTokens<XS>::value) return XS{x_normed, n_tok};
    else return XS{residual, norm_w, eps, n_tok};
}

// Where the words a lane loads for one (tile, group) item lie: lane (g, t) takes words
// 4t … 4t+3 of group gi of the rows behind MMA rows g and g + 8. The device layout
// (int4_matmul.cuh): qweight [tiles, K/128, 16, 16] uint32, the item's 16 rows in MMA row order,
// so MMA row r is slot r of item (tile, gi) whatever the segment's row order. `row` (the matrix
// row, clamped to the last one) is there for layouts that need it (kernels/dev/).
// quad_offset: the offset from qweight in words, in 32-bit arithmetic: < 2^32 for every matrix
// the launchers take (N·K/8 words; the largest, a 152 064 × 3 584 lm_head, is 6.8e7) — int4_tile_item's
// formula without its 64-bit multiplies. quad: the same words as a pointer (kernels/dev/).
struct GemvTileMajor {
    __device__ static __forceinline__ u32 quad_offset(int tile, int r, int gi, int K, int t) {
        return ((u32)tile * (u32)(K / INT4_GROUP) + (u32)gi) * INT4_ITEM_WORDS + (u32)(r * GEMV_WORDS_PER_GROUP + 4 * t);
    }
    __device__ static __forceinline__ const u32* quad(const u32* qweight, int tile, int r, u64 row,
                                                      int gi, int K, int t) {
        return qweight + quad_offset(tile, r, gi, K, t);
    }
};

// One batch of UNROLL (tile, group) items as one lane holds them, as loaded: nothing in it is
// used before the batch is multiplied. The scales stay FP16 bits until then (gemv_scale): a
// conversion at the load would be the load's first use, and the warp would wait there for each
// item's scale — a memory round trip, from HBM at a tile's first group — before it could issue
// the next item's loads, so a batch's loads would go out one item at a time.
template <int MT, int UNROLL>
struct GemvBatch {
    uint4 w[UNROLL][MT][2];  // words 4t … 4t+3 of the group, MMA row g / row g+8, per matrix
    u32 s[UNROLL][MT][2];    // the rows' FP16 scales for the group, in the low 16 bits
};

// A scale as GemvBatch holds it, in FP32 (exact).
__device__ __forceinline__ float gemv_scale(u32 bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// GEMV_ZERO_BATCHES=1 starts a warp's two batches at zero instead of leaving them undefined.
// A batch slot past the warp's last item is never loaded and never multiplied, but the compiler
// cannot tell: to it the slot may be read undefined, so the slot's registers are live from the
// kernel's entry. In a kernel of its own that costs nothing. In a kernel that runs several ops
// one after another (decode_persistent.cu, which defines it), every op's slots would be live
// across every other op: with them undefined, the persistent step at head dim 128 needs 255
// registers and spills its batches' scales inside the GEMV loops; at zero, 207 and no spills
// (ptxas, -Xptxas -v). Not the default: here the zeros cost 7–34 registers and 14–20 % more
// instructions in the main loops, which would leave one block per SM instead of two.
#ifndef GEMV_ZERO_BATCHES
#define GEMV_ZERO_BATCHES 0
#endif

// Up to 3 matrices stacked along N (q, k, v); MT matrices per segment read together (gate, up).
// A segment with rope_dim = Dh > 0 pairs its rows for RoPE (see the header): MMA rows g and
// g + 8 of its tile j-within-a-head are dims 8j + g and 8j + g + Dh/2 of that head.
template <int MT, int NSEG>
struct GemvProblem {
    const u32* qweight[NSEG][MT];     // [ceil(n/16), K/128, 16, 16] uint32 each (the device layout)
    const __half* scales[NSEG][MT];   // [n, K/128] fp16 each
    int n[NSEG];                      // rows of each segment
    int first_tile[NSEG + 1];         // tile index where each segment starts (prefix sums)
    int rope_dim[NSEG];               // Dh for a RoPE-paired segment, 0 for plain row order
};

// Entry `seg` of a per-segment array (first_tile has one more entry than there are segments).
template <int NSEG, typename T, int N>
__device__ __forceinline__ T gemv_field(int seg, const T (&f)[N]) {
    if constexpr (NSEG == 1) return f[0];
    else return int4_pick(seg, f[0], f[1], f[NSEG - 1]);
}

template <int MT, int NSEG>
__device__ __forceinline__ const u32* gemv_qweight(const GemvProblem<MT, NSEG>& p, int seg, int m) {
    if constexpr (NSEG == 1) return p.qweight[0][m];
    else return int4_pick(seg, p.qweight[0][m], p.qweight[1][m], p.qweight[NSEG - 1][m]);
}

template <int MT, int NSEG>
__device__ __forceinline__ const __half* gemv_scales(const GemvProblem<MT, NSEG>& p, int seg, int m) {
    if constexpr (NSEG == 1) return p.scales[0][m];
    else return int4_pick(seg, p.scales[0][m], p.scales[1][m], p.scales[NSEG - 1][m]);
}

// Tokens a lane accumulates per output row in the NTOK-token engine: NTOK = 1 one (every column
// of B is the same x, the lane keeps column 2t); else 2 per MMA, columns 2t and 2t + 1 of each
// of the ceil(NTOK/8) MMAs of a k slice.
template <int NTOK>
struct GemvTokens {
    static constexpr int MMAS = (NTOK + GEMV_MMA_TOKENS - 1) / GEMV_MMA_TOKENS;  // MMAs per k slice
    static constexpr int LANE = NTOK == 1 ? 1 : 2 * MMAS;                        // tokens per lane
    // The token of lane slot l of lane t: column 2t + l % 2 of MMA l / 2.
    __device__ static __forceinline__ int of_slot(int l, int t) {
        return NTOK == 1 ? 0 : GEMV_MMA_TOKENS * (l / 2) + 2 * t + l % 2;
    }
};

// The whole GEMV of one block for T ≤ NTOK tokens at once: its tiles × all K, for MT matrices
// per tile. The block is block bc.bx of a planned grid of bc.gx blocks of bc.threads threads
// (block_coord.cuh): a launch of its own, or an item of the persistent decode step, whose block
// may have more warps than the plan (those take part in the barriers only). Order of work:
// dep.launch_dependents, the first weight batch requested, dep.wait(), then the prologue
// `x_src(x_smem, K)` stages x (where the B fragments come from: x_src.lane_x, see the
// prologues); after the main loop and the block's reduction, epilogue(seg, tile_in_seg, g, tok,
// sums[MT][2]) runs once per (tile, g, token), g < 8, tok < T, from one thread, with sums[m][0]
// the row of MMA row g and sums[m][1] that of MMA row g + 8 (gemv_tile_rows says which rows
// those are; rows ≥ n must not be stored).
// Token tok's sums are, bit for bit, what the NTOK = 1 engine computes for its x alone (the
// header's "T tokens"); NTOK = 1 is the single-token GEMV itself (gemv_int4_block).
// Contains __syncthreads(): call from every thread of the block.
template <int NTOK, int MT, int NSEG, typename Layout, typename Dep, typename XSource, typename Epilogue>
__device__ __forceinline__ void gemv_int4_engine(const GemvProblem<MT, NSEG>& p, int K, int n_tok, const BlockCoord& bc,
                                                 Dep dep, XSource x_src, Epilogue epilogue) {
    constexpr int UNROLL = GEMV_GROUP_UNROLL(MT);
    using Tok = GemvTokens<NTOK>;
    const int T = NTOK == 1 ? 1 : min(n_tok, NTOK);  // 1 ≤ n_tok (the launchers check T ≤ NTOK too)
    extern __shared__ uint4 x_smem[];  // x as x_src stages it (maybe nothing), then the partials
    float* partial = reinterpret_cast<float*>(x_smem + x_src.smem_chunks(K));  // [T_b][MT][W][T][16] fp32

    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int warp = threadIdx.x / WARP_SIZE, n_warps = bc.threads / WARP_SIZE;
    const int n_groups = K / INT4_GROUP;
    // This warp's contiguous, balanced share of the groups (non-empty: W ≤ K/128), in every tile;
    // none for a warp past the plan's W. GEMV_FLAT_SPLIT: every group of a tile (its range of the
    // block's items is below).
    const int gb = warp < n_warps ? (GEMV_FLAT_SPLIT ? 0 : warp * n_groups / n_warps) : 0;
    const int ge = warp < n_warps ? (GEMV_FLAT_SPLIT ? n_groups : (warp + 1) * n_groups / n_warps) : 0;
    // This block's contiguous, balanced share of the tiles.
    const int n_tiles = p.first_tile[NSEG];
    const int tile_b = bc.bx * n_tiles / bc.gx, tile_e = (bc.bx + 1) * n_tiles / bc.gx;
#if GEMV_FLAT_SPLIT
    // This warp's share of the block's items: [ib, ie) of the flat (tile, group) sequence,
    // starting at group gi_0 of tile tile_0.
    const int n_items = (tile_e - tile_b) * n_groups;
    const int ib = warp < n_warps ? warp * n_items / n_warps : 0;
    const int ie = warp < n_warps ? (warp + 1) * n_items / n_warps : 0;
    const int tile_0 = tile_b + ib / n_groups, gi_0 = ib % n_groups;
#else
    const int ib = 0, ie = 0, tile_0 = tile_b, gi_0 = gb;  // unused but for the start
#endif
    const u64 policy = l2_evict_first_policy();
    // The x behind this lane's B fragments: column g of MMA b is token 8b + g (NTOK = 1: the one
    // token in every column). Columns past T repeat token T - 1: finite, never stored, and no
    // select in the loop.
    const uint4* x_lane[Tok::MMAS];
#pragma unroll
    for (int b = 0; b < Tok::MMAS; ++b)
        x_lane[b] = x_src.lane_x(x_smem, NTOK == 1 ? 0 : min(GEMV_MMA_TOKENS * b + g, T - 1), t, K);

    // Every block of this grid is resident in one wave (the launcher sizes G for that), so the
    // next kernel may be scheduled as soon as they have all started.
    dep.launch_dependents();

    // Loads the next UNROLL items (tile, group) that exist, advancing (ld_tile, ld_gi).
    int ld_tile = tile_0, ld_gi = gi_0, ld_left = ie - ib;  // ld_left: GEMV_FLAT_SPLIT's items to go
    auto load = [&](GemvBatch<MT, UNROLL>& b) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (GEMV_FLAT_SPLIT ? ld_left == 0 : (ld_tile >= tile_e || gb >= ge)) break;  // warp-uniform
            const int seg = int4_segment<NSEG>(p.first_tile, ld_tile);
            const int n = gemv_field<NSEG>(seg, p.n), tile = ld_tile - gemv_field<NSEG>(seg, p.first_tile);
            int lo, hi;
            gemv_tile_rows(tile, g, gemv_field<NSEG>(seg, p.rope_dim), lo, hi);
            // Rows past n (last tile of a matrix) load the last row and are never stored.
            const u32 r0 = min(lo, n - 1), r1 = min(hi, n - 1);
            // The item's offsets in 32-bit arithmetic (each a product and an add, then one wide
            // add a pointer): in 64-bit, the address arithmetic took ~55 of the ~280 instructions
            // an item-pair of gate_up (Nsight Compute's SASS counts), most of a block's issue
            // slots where one block of 8 warps an SM is issue-bound.
            const u32 w_off = Layout::quad_offset(tile, g, ld_gi, K, t);
            const u32 s0_off = r0 * (u32)n_groups + (u32)ld_gi, s1_off = r1 * (u32)n_groups + (u32)ld_gi;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const unsigned short* sc = reinterpret_cast<const unsigned short*>(gemv_scales(p, seg, m));
                const u32* qw = gemv_qweight(p, seg, m) + w_off;
                if constexpr (GEMV_PROBE_NO_LOADS) {  // timing only, wrong sums (see the define)
                    const u32 v = 0x88888888u ^ (u32)(ld_gi * 0x01010101u + (u32)r0);
                    b.w[u][m][0] = make_uint4(v, v ^ 1u, v ^ 2u, v ^ 3u);
                    b.w[u][m][1] = make_uint4(v ^ 4u, v ^ 5u, v ^ 6u, v ^ 7u);
                    b.s[u][m][0] = b.s[u][m][1] = 0x3C00u;  // 1.0
                    continue;
                }
                b.w[u][m][0] = ld_stream_v4(qw, policy);
                b.w[u][m][1] = ld_stream_v4(qw + 8 * GEMV_WORDS_PER_GROUP, policy);  // MMA row g + 8
                b.s[u][m][0] = __ldg(sc + s0_off);
                b.s[u][m][1] = __ldg(sc + s1_off);
            }
            if (GEMV_FLAT_SPLIT) --ld_left;
            if (++ld_gi == ge) { ld_gi = gb; ++ld_tile; }
        }
    };

    // The first batch of weights goes out before the wait: its latency overlaps the previous
    // kernel's tail and the staging of x (weights are never written by any kernel).
    GemvBatch<MT, UNROLL> cur, next;
    if constexpr (GEMV_ZERO_BATCHES) cur = next = {};
    load(cur);
    dep.wait();
    x_src(x_smem, K);
    __syncthreads();

    float acc[MT][2][Tok::LANE];  // [matrix][MMA row g, g + 8][lane slot]
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int l = 0; l < Tok::LANE; ++l) acc[m][0][l] = acc[m][1][l] = 0.f;
    // This warp's row sums of a tile into the block's partials: slot [tile][m][warp][token][row],
    // each written by one lane (NTOK = 1: lane t = 0, the 4 lanes t hold the same sums).
    auto publish = [&](int tile) {
        if (NTOK > 1 || t == 0) {
            float* dst = partial + (tile - tile_b) * MT * n_warps * T * INT4_TILE_ROWS;
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int l = 0; l < Tok::LANE; ++l) {
                    const int tok = Tok::of_slot(l, t);
                    if (tok >= T) continue;
                    dst[((m * n_warps + warp) * T + tok) * INT4_TILE_ROWS + g] = acc[m][0][l];
                    dst[((m * n_warps + warp) * T + tok) * INT4_TILE_ROWS + g + 8] = acc[m][1][l];
                }
        }
    };
    // GEMV_FLAT_SPLIT: zeros in this warp's slots of the tiles its range does not reach (the
    // reduction adds every warp's slot). Each slot is written once, here or by the main loop's
    // publish (the tiles are disjoint), and the barrier before the reduction orders it for the
    // reading threads.
    if (GEMV_FLAT_SPLIT && warp < n_warps)
        for (int tl = tile_b; tl < tile_e; ++tl)
            if (ib == ie || tl < tile_0 || tl > tile_b + (ie - 1) / n_groups) publish(tl);
    int c_tile = tile_0, c_gi = gi_0, c_left = ie - ib;  // c_left: GEMV_FLAT_SPLIT's items to go
    while (GEMV_FLAT_SPLIT ? c_left > 0 : (c_tile < tile_e && gb < ge)) {
        load(next);  // in flight while `cur` is multiplied
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (GEMV_FLAT_SPLIT ? c_left == 0 : c_tile >= tile_e) break;  // warp-uniform: every lane takes the same branch
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                float c[Tok::MMAS][4];
#pragma unroll
                for (int b = 0; b < Tok::MMAS; ++b) c[b][0] = c[b][1] = c[b][2] = c[b][3] = 0.f;
                if constexpr (GEMV_PROBE_LOADS_ONLY) {  // timing only, wrong sums (see the define)
                    const uint4 w0 = cur.w[u][m][0], w1 = cur.w[u][m][1];
                    const u32 v = w0.x ^ w0.y ^ w0.z ^ w0.w ^ w1.x ^ w1.y ^ w1.z ^ w1.w;
#pragma unroll
                    for (int b = 0; b < Tok::MMAS; ++b) c[b][0] = c[b][1] = c[b][2] = c[b][3] = __uint_as_float(v & 0x3f7fffffu);
                }
#pragma unroll
                for (int i = 0; i < (GEMV_PROBE_LOADS_ONLY ? 0 : 4); ++i) {
                    u32 a_lo[4], a_hi[4];  // inputs 8i + 0..3 and 8i + 4..7 of rows g, g+8
                    int4_a_fragments<!GEMV_PROBE_NO_FIXUP>(cur.w[u][m][0], cur.w[u][m][1], i, a_lo, a_hi);
#pragma unroll
                    for (int b = 0; b < Tok::MMAS; ++b) {
                        const uint4* x_group = x_lane[b] + c_gi * GEMV_CHUNKS_PER_GROUP;
                        const uint4 xi = x_group[XSource::WORD_STEP * i];  // x[128·gi + 32t + 8i … +8], token of column g
                        mma_m16n8k16_f32_f16(c[b], a_lo, xi.x, xi.y);
                        mma_m16n8k16_f32_f16(c[b], a_hi, xi.z, xi.w);
                    }
                }
                // Lane slot l holds column 2t + l % 2 of MMA l / 2: c[.][0 | 1] of row g, c[.][2 | 3] of row g + 8.
#pragma unroll
                for (int l = 0; l < Tok::LANE; ++l) {
                    const int col = NTOK == 1 ? 0 : l % 2;
                    acc[m][0][l] = fmaf(gemv_scale(cur.s[u][m][0]), c[l / 2][col], acc[m][0][l]);
                    acc[m][1][l] = fmaf(gemv_scale(cur.s[u][m][1]), c[l / 2][2 + col], acc[m][1][l]);
                }
            }
            if (GEMV_FLAT_SPLIT) --c_left;
            auto restart = [&]() {
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int l = 0; l < Tok::LANE; ++l) acc[m][0][l] = acc[m][1][l] = 0.f;
            };
            if (++c_gi == ge) {  // the tile's last group (of this warp's range): publish its row sums, start the next
                publish(c_tile);
                restart();
                c_gi = gb;
                ++c_tile;
            } else if (GEMV_FLAT_SPLIT && c_left == 0) {  // the range ends inside the tile
                publish(c_tile);
                restart();
            }
        }
        cur = next;
    }
    __syncthreads();

    // One thread per (tile, token, g): the W partials of MMA rows g and g + 8 in warp order, then
    // the epilogue.
    constexpr bool no_epilogue = NTOK > 1 && GEMV_PROBE_NO_EPILOGUE;  // timing only (see the define)
    float fold[MT][2] = {};
    for (int o = threadIdx.x; o < (tile_e - tile_b) * T * 8; o += blockDim.x) {
        const int tl = o / (8 * T), tok = o / 8 % T, gg = o % 8;
        const int tile = tile_b + tl;
        const int seg = int4_segment<NSEG>(p.first_tile, tile);
        float sums[MT][2];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float* src = partial + (((tl * MT + m) * n_warps) * T + tok) * INT4_TILE_ROWS + gg + 8 * h;
                float s = 0.f;
                for (int w = 0; w < n_warps; ++w) s += src[w * T * INT4_TILE_ROWS];
                sums[m][h] = s;
            }
        }
        if constexpr (no_epilogue) {
#pragma unroll
            for (int m = 0; m < MT; ++m) fold[m][0] += sums[m][0], fold[m][1] += sums[m][1];
        } else {
            epilogue(seg, tile - gemv_field<NSEG>(seg, p.first_tile), gg, tok, sums);
        }
    }
    // Another thread's fold is stored only if it is exactly 1e30 (practically never), which the
    // compiler cannot rule out: every thread's reduction stays.
    if constexpr (no_epilogue)
        if (tile_b < tile_e && (threadIdx.x == 0 || fold[0][0] == 1e30f)) {
            const int seg = int4_segment<NSEG>(p.first_tile, tile_b);
            epilogue(seg, tile_b - gemv_field<NSEG>(seg, p.first_tile), 0, 0, fold);
        }
}

// The single-token GEMV of one block (the decode step's): gemv_int4_engine with NTOK = 1, and
// epilogue(seg, tile_in_seg, g, sums[MT][2]) once per (tile, g).
template <int MT, int NSEG, typename Layout = GemvTileMajor, typename Dep, typename Prologue, typename Epilogue>
__device__ __forceinline__ void gemv_int4_block(const GemvProblem<MT, NSEG>& p, int K, const BlockCoord& bc,
                                                Dep dep, Prologue stage_x, Epilogue epilogue) {
    gemv_int4_engine<1, MT, NSEG, Layout>(p, K, 1, bc, dep, stage_x,
                                          [&](int seg, int tile, int g, int, const float (&s)[MT][2]) {
        epilogue(seg, tile, g, s);
    });
}

// y = W x, FP16 out (rounded once from the FP32 sum).
// grid (G ≤ ceil(N/16)), block (32·W), dynamic smem (see the header).
#ifndef DEVICE_FUNCTIONS_ONLY  // a file that includes this one for its device functions defines it
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_f16(__half* __restrict__ y,             // [N] fp16, out
              const __half* __restrict__ x,       // [K] fp16
              const u32* __restrict__ qweight,    // [ceil(N/16), K/128, 16, 16] uint32, the device layout
              const __half* __restrict__ scales,  // [N, K/128] fp16
              int N, int K) {
    const GemvProblem<1, 1> p = {{{qweight}}, {{scales}}, {N}, {0, int4_tiles(N)}, {0}};
    gemv_int4_block(p, K, BlockCoord::of_launch(), GridDep{}, GemvStageX{x},
                    [&](int, int tile, int g, const float (&s)[1][2]) {
        gemv_store_rows(tile, g, N, s[0], [&](int row, float v) { y[row] = __float2half_rn(v); });
    });
}
#endif  // DEVICE_FUNCTIONS_ONLY

// The decode step's three GEMVs each come as an argument struct, a device function of one block
// (`…_item`: what a launch's block does, given its BlockCoord and Dep) and the kernel that runs it
// as a launch of its own. The persistent decode step (decode_persistent.cu) runs the same item
// functions on argument structs it reads from its program, packed by the host with the kernel's
// parameter layout: each struct lists the kernel's parameters, in order, with their types
// (tests/test_decode_persistent.py compares the two lists).

// The attention input of one decode step, from the residual stream, in one launch:
//   xn = rmsnorm(residual) · input_layernorm          (prologue, rmsnorm.cuh)
//   [q; k; v] = [Wq; Wk; Wv] xn + [bq; bk; bv]          (q and k tiles RoPE-paired)
//   q_out = rope(q, pos); K cache slot of pos = rope(k, pos); V cache slot of pos = v
// with pos = state[0] and the page from the block table (both read after the wait), so a
// captured graph replays it every step. FP32 until each output's one rounding to FP16, with
// rope_kv.cu's arithmetic. The k/v tiles (32 each at 7B) share the wave with q's 224 instead
// of running in under-filled launches of their own.
struct GemvInt4QkvRopeArgs {
    __half* q_out;           // [Hq·Dh] fp16, out: rotated query
    __half* k_cache;         // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
    __half* v_cache;         // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
    const float* residual;   // [K] fp32, the residual stream
    const __half* norm_w;    // [K] fp16, input_layernorm gain
    const u32* q_qweight;    // [Hq·Dh/16, K/128, 16, 16] uint32, RoPE-paired rows
    const __half* q_scales;  // [Hq·Dh, K/128] fp16
    const u32* k_qweight;    // [Hkv·Dh/16, K/128, 16, 16] uint32, RoPE-paired rows
    const __half* k_scales;  // [Hkv·Dh, K/128] fp16
    const u32* v_qweight;    // [Hkv·Dh/16, K/128, 16, 16] uint32, RoPE-paired rows
    const __half* v_scales;  // [Hkv·Dh, K/128] fp16
    const __half* q_bias;    // [Hq·Dh] fp16
    const __half* k_bias;    // [Hkv·Dh] fp16
    const __half* v_bias;    // [Hkv·Dh] fp16
    const float* inv_freq;   // [Dh/2] fp32 (reference.rope_inv_freq)
    const int* state;        // [3] int32: pos, token, seq_len (reads [0])
    const int* block_table;  // [max_pages] int32: logical → physical page
    int Hq, Hkv, Dh, K;
    float eps;
};

// The item for T ≤ NTOK tokens at positions pos + j (gemv_int4_qkv_rope_tokens): the same
// arguments with a leading token dimension — residual [T, K], q_out [T, Hq·Dh] — and token j's
// K/V in the slot of pos + j (its page from the block table: a chunk may open a page, whose
// entry the host set before). NTOK = 1 is the decode step's item.
// XS: where x comes from — the fused RMSNorm of a.residual (GemvStageRmsNormT, the default), or
// x rows already normalised (GemvStageXTokens: the *_x_tokens kernels).
template <int NTOK, typename Dep, typename XS = GemvStageRmsNormT<NTOK>>
__device__ __forceinline__ void gemv_int4_qkv_rope_tokens_item(const GemvInt4QkvRopeArgs& a, int n_tok,
                                                               const BlockCoord& bc, Dep dep,
                                                               const __half* x_normed = nullptr) {
    const int Dh = a.Dh, Hkv = a.Hkv;
    const int nq = a.Hq * Dh, nkv = Hkv * Dh, tq = int4_tiles(nq), tkv = int4_tiles(nkv);
    const GemvProblem<1, 3> p = {{{a.q_qweight}, {a.k_qweight}, {a.v_qweight}},
                                 {{a.q_scales}, {a.k_scales}, {a.v_scales}},
                                 {nq, nkv, nkv},
                                 {0, tq, tq + tkv, tq + 2 * tkv},
                                 {Dh, Dh, Dh}};  // v paired too: the device layout stores it so
    // The position and its K/V slot: read at once where the state stays fixed (Dep::state_fixed:
    // two dependent L2 loads off the end of the item), else in the epilogue, after the wait.
    int pos_fixed = 0;
    u64 slot_fixed = 0;
    if constexpr (Dep::state_fixed) {
        pos_fixed = a.state[0];
        slot_fixed = kv_offset(a.block_table[pos_fixed / PAGE_TOKENS], 0, pos_fixed % PAGE_TOKENS, Hkv, Dh);
    }
    gemv_int4_engine<NTOK, 1, 3, GemvTileMajor>(p, a.K, n_tok, bc, dep,
                                               gemv_x_source<NTOK, XS>(a.residual, a.norm_w, a.eps, n_tok, x_normed),
                                               [&](int seg, int tile, int g, int tok, const float (&s)[1][2]) {
        const int pos = (Dep::state_fixed ? pos_fixed : a.state[0]) + tok;
        const u64 slot = Dep::state_fixed && NTOK == 1
                             ? slot_fixed
                             : kv_offset(a.block_table[pos / PAGE_TOKENS], 0, pos % PAGE_TOKENS, Hkv, Dh);
        int lo, hi;  // rows of dims i and i + Dh/2 of one head (q, k and v alike)
        gemv_tile_rows(tile, g, Dh, lo, hi);
        const int head = lo / Dh, i = lo % Dh;
        if (seg == 2) {  // v: bias only
            __half* dst = a.v_cache + slot + (u64)head * PAGE_TOKENS * Dh;
            dst[i] = __float2half_rn(s[0][0] + __half2float(a.v_bias[lo]));
            dst[i + Dh / 2] = __float2half_rn(s[0][1] + __half2float(a.v_bias[hi]));
            return;
        }
        const __half* b = seg == 0 ? a.q_bias : a.k_bias;
        float o1, o2;
        rope_rotate(s[0][0] + __half2float(b[lo]), s[0][1] + __half2float(b[hi]), pos, a.inv_freq[i], o1, o2);
        __half* dst = seg == 0 ? a.q_out + (u64)tok * nq + (u64)head * Dh
                               : a.k_cache + slot + (u64)head * PAGE_TOKENS * Dh;
        dst[i] = __float2half_rn(o1);
        dst[i + Dh / 2] = __float2half_rn(o2);
    });
}

template <typename Dep>
__device__ __forceinline__ void gemv_int4_qkv_rope_item(const GemvInt4QkvRopeArgs& a, const BlockCoord& bc, Dep dep) {
    gemv_int4_qkv_rope_tokens_item<1>(a, 1, bc, dep);
}

// grid (G ≤ ceil(Nq/16) + 2·ceil(Nkv/16)), block (32·W), dynamic smem (see the header).
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_qkv_rope(__half* __restrict__ q_out, __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                   const float* __restrict__ residual, const __half* __restrict__ norm_w,
                   const u32* __restrict__ q_qweight, const __half* __restrict__ q_scales,
                   const u32* __restrict__ k_qweight, const __half* __restrict__ k_scales,
                   const u32* __restrict__ v_qweight, const __half* __restrict__ v_scales,
                   const __half* __restrict__ q_bias, const __half* __restrict__ k_bias,
                   const __half* __restrict__ v_bias, const float* __restrict__ inv_freq,
                   const int* __restrict__ state, const int* __restrict__ block_table,
                   int Hq, int Hkv, int Dh, int K, float eps) {  // GemvInt4QkvRopeArgs says what each is
    gemv_int4_qkv_rope_item(GemvInt4QkvRopeArgs{q_out, k_cache, v_cache, residual, norm_w, q_qweight, q_scales,
                                                k_qweight, k_scales, v_qweight, v_scales, q_bias, k_bias, v_bias,
                                                inv_freq, state, block_table, Hq, Hkv, Dh, K, eps},
                            BlockCoord::of_launch(), GridDep{});
}
#endif  // DEVICE_FUNCTIONS_ONLY

// residual += W x in FP32 (the residual stream is FP32: docs/numerics.md#the-residual-stream-is-fp32).
// Each row is read and written by one thread of one block, so the read-modify-write needs no
// atomics; it happens after the wait, like every read of an earlier kernel's output.
struct GemvInt4ResidualArgs {
    float* residual;        // [N] fp32, in/out
    const __half* x;        // [K] fp16
    const u32* qweight;     // [ceil(N/16), K/128, 16, 16] uint32
    const __half* scales;   // [N, K/128] fp16
    int N, K;
};

// The item for T ≤ NTOK tokens (gemv_int4_residual_tokens): residual [T, N], x [T, K]. One token
// stages x in shared memory; T tokens read it from global memory (the header's "T tokens").
template <int NTOK, typename Dep>
__device__ __forceinline__ void gemv_int4_residual_tokens_item(const GemvInt4ResidualArgs& a, int n_tok,
                                                               const BlockCoord& bc, Dep dep) {
    const int N = a.N;
    const GemvProblem<1, 1> p = {{{a.qweight}}, {{a.scales}}, {N}, {0, int4_tiles(N)}, {0}};
    auto epilogue = [&](int, int tile, int g, int tok, const float (&s)[1][2]) {
        float* residual = a.residual + (u64)tok * N;
        gemv_store_rows(tile, g, N, s[0], [&](int row, float v) { residual[row] += v; });
    };
    if constexpr (NTOK == 1) gemv_int4_engine<1, 1, 1, GemvTileMajor>(p, a.K, 1, bc, dep, GemvStageX{a.x}, epilogue);
    else gemv_int4_engine<NTOK, 1, 1, GemvTileMajor>(p, a.K, n_tok, bc, dep, GemvXGlobal{a.x}, epilogue);
}

template <typename Dep>
__device__ __forceinline__ void gemv_int4_residual_item(const GemvInt4ResidualArgs& a, const BlockCoord& bc, Dep dep) {
    gemv_int4_residual_tokens_item<1>(a, 1, bc, dep);
}

// grid (G ≤ ceil(N/16)), block (32·W), dynamic smem (see the header).
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_residual(float* __restrict__ residual, const __half* __restrict__ x, const u32* __restrict__ qweight,
                   const __half* __restrict__ scales, int N, int K) {  // GemvInt4ResidualArgs says what each is
    gemv_int4_residual_item(GemvInt4ResidualArgs{residual, x, qweight, scales, N, K}, BlockCoord::of_launch(),
                            GridDep{});
}
#endif  // DEVICE_FUNCTIONS_ONLY

// h = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual) · post_attention_layernorm (prologue):
// each tile is the same 16 rows of gate_proj and up_proj, so the SwiGLU needs no extra launch
// and no FP16 round trip of g and u (swiglu_f16, int4_matmul.cuh).
struct GemvInt4GateUpSwigluArgs {
    __half* h;                  // [F] fp16, out
    const float* residual;      // [K] fp32, the residual stream
    const __half* norm_w;       // [K] fp16, post_attention_layernorm gain
    const u32* gate_qweight;    // [F/16, K/128, 16, 16] uint32
    const __half* gate_scales;  // [F, K/128] fp16
    const u32* up_qweight;      // [F/16, K/128, 16, 16] uint32
    const __half* up_scales;    // [F, K/128] fp16
    int F, K;
    float eps;
};

// The item for T ≤ NTOK tokens (gemv_int4_gate_up_swiglu_tokens): residual [T, K], h [T, F].
template <int NTOK, typename Dep, typename XS = GemvStageRmsNormT<NTOK>>
__device__ __forceinline__ void gemv_int4_gate_up_swiglu_tokens_item(const GemvInt4GateUpSwigluArgs& a, int n_tok,
                                                                     const BlockCoord& bc, Dep dep,
                                                                     const __half* x_normed = nullptr) {
    const int F = a.F;
    const GemvProblem<2, 1> p = {{{a.gate_qweight, a.up_qweight}}, {{a.gate_scales, a.up_scales}},
                                 {F}, {0, int4_tiles(F)}, {0}};
    gemv_int4_engine<NTOK, 2, 1, GemvTileMajor>(p, a.K, n_tok, bc, dep,
                                               gemv_x_source<NTOK, XS>(a.residual, a.norm_w, a.eps, n_tok, x_normed),
                                               [&](int, int tile, int g, int tok, const float (&s)[2][2]) {
        const int lo = tile * INT4_TILE_ROWS + g;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = lo + 8 * r;
            if (row >= F) continue;
            a.h[(u64)tok * F + row] = swiglu_f16(s[0][r], s[1][r]);
        }
    });
}

template <typename Dep>
__device__ __forceinline__ void gemv_int4_gate_up_swiglu_item(const GemvInt4GateUpSwigluArgs& a, const BlockCoord& bc,
                                                              Dep dep) {
    gemv_int4_gate_up_swiglu_tokens_item<1>(a, 1, bc, dep);
}

// grid (G ≤ ceil(F/16)), block (32·W), dynamic smem (see the header).
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_gate_up_swiglu(__half* __restrict__ h, const float* __restrict__ residual,
                         const __half* __restrict__ norm_w, const u32* __restrict__ gate_qweight,
                         const __half* __restrict__ gate_scales, const u32* __restrict__ up_qweight,
                         const __half* __restrict__ up_scales, int F, int K, float eps) {  // …Args says what each is
    gemv_int4_gate_up_swiglu_item(GemvInt4GateUpSwigluArgs{h, residual, norm_w, gate_qweight, gate_scales, up_qweight,
                                                           up_scales, F, K, eps},
                                  BlockCoord::of_launch(), GridDep{});
}
#endif  // DEVICE_FUNCTIONS_ONLY

// ---- T tokens at once (the verify pass of speculative decoding; the header's "T tokens") ----
// The three GEMVs above for T ≤ GEMV_TOKENS tokens, n_tokens = T at run time: every buffer of
// the single-token kernel that holds one token's vector holds T of them, token-major (residual
// [T, D|N], q_out [T, Hq·Dh], x [T, K], h [T, F]); token j of gemv_int4_qkv_rope_tokens is at
// position state[0] + j. Launched with the single-token kernel's grid and block (launchers/
// gemv_int4.py, n_tokens), each token's outputs are bit for bit the single-token kernel's.
// GEMV_TOKENS, the compile-time bound, is 8 (one MMA per k slice) unless built with 16 (two).
#ifndef GEMV_TOKENS
#define GEMV_TOKENS 8
#endif
static_assert(GEMV_TOKENS >= 2 && GEMV_TOKENS <= 2 * GEMV_MMA_TOKENS, "GEMV_TOKENS: 2 … 16");

// grid and block as gemv_int4_qkv_rope's, dynamic smem (see the header, "T tokens").
// Each parameter list below is the single-token kernel's plus n_tokens, spelled out rather than
// made by a macro: the declaration is what launchers/signatures.py (and a reader) takes it from.
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_qkv_rope_tokens(__half* __restrict__ q_out, __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                          const float* __restrict__ residual, const __half* __restrict__ norm_w,
                          const u32* __restrict__ q_qweight, const __half* __restrict__ q_scales,
                          const u32* __restrict__ k_qweight, const __half* __restrict__ k_scales,
                          const u32* __restrict__ v_qweight, const __half* __restrict__ v_scales,
                          const __half* __restrict__ q_bias, const __half* __restrict__ k_bias,
                          const __half* __restrict__ v_bias, const float* __restrict__ inv_freq,
                          const int* __restrict__ state, const int* __restrict__ block_table,
                          int Hq, int Hkv, int Dh, int K, float eps, int n_tokens) {  // q_out, residual: [T, …]
    gemv_int4_qkv_rope_tokens_item<GEMV_TOKENS>(
        GemvInt4QkvRopeArgs{q_out, k_cache, v_cache, residual, norm_w, q_qweight, q_scales, k_qweight, k_scales,
                            v_qweight, v_scales, q_bias, k_bias, v_bias, inv_freq, state, block_table, Hq, Hkv, Dh, K,
                            eps},
        n_tokens, BlockCoord::of_launch(), GridDep{});
}

// grid and block as gemv_int4_residual's, dynamic smem (see the header, "T tokens").
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_residual_tokens(float* __restrict__ residual, const __half* __restrict__ x,
                          const u32* __restrict__ qweight, const __half* __restrict__ scales, int N, int K,
                          int n_tokens) {  // residual [T, N], x [T, K]
    gemv_int4_residual_tokens_item<GEMV_TOKENS>(GemvInt4ResidualArgs{residual, x, qweight, scales, N, K}, n_tokens,
                                                BlockCoord::of_launch(), GridDep{});
}

// grid and block as gemv_int4_gate_up_swiglu's, dynamic smem (see the header, "T tokens").
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_gate_up_swiglu_tokens(__half* __restrict__ h, const float* __restrict__ residual,
                                const __half* __restrict__ norm_w, const u32* __restrict__ gate_qweight,
                                const __half* __restrict__ gate_scales, const u32* __restrict__ up_qweight,
                                const __half* __restrict__ up_scales, int F, int K, float eps,
                                int n_tokens) {  // h [T, F], residual [T, K]
    gemv_int4_gate_up_swiglu_tokens_item<GEMV_TOKENS>(
        GemvInt4GateUpSwigluArgs{h, residual, norm_w, gate_qweight, gate_scales, up_qweight, up_scales, F, K, eps},
        n_tokens, BlockCoord::of_launch(), GridDep{});
}

// The qkv and gate/up T-token kernels on x [T, K] fp16 normalised before (an rmsnorm launch of
// the T rows: the same x bits as their fused prologue), staged with independent loads
// (GemvStageXTokens); everything else as gemv_int4_qkv_rope_tokens / _gate_up_swiglu_tokens,
// whose parameter lists these are with residual, norm_w and eps replaced by x.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_qkv_rope_x_tokens(__half* __restrict__ q_out, __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                            const __half* __restrict__ x,
                            const u32* __restrict__ q_qweight, const __half* __restrict__ q_scales,
                            const u32* __restrict__ k_qweight, const __half* __restrict__ k_scales,
                            const u32* __restrict__ v_qweight, const __half* __restrict__ v_scales,
                            const __half* __restrict__ q_bias, const __half* __restrict__ k_bias,
                            const __half* __restrict__ v_bias, const float* __restrict__ inv_freq,
                            const int* __restrict__ state, const int* __restrict__ block_table,
                            int Hq, int Hkv, int Dh, int K, int n_tokens) {  // q_out, x: [T, …]
    gemv_int4_qkv_rope_tokens_item<GEMV_TOKENS, GridDep, GemvStageXTokens<GEMV_TOKENS>>(
        GemvInt4QkvRopeArgs{q_out, k_cache, v_cache, nullptr, nullptr, q_qweight, q_scales, k_qweight, k_scales,
                            v_qweight, v_scales, q_bias, k_bias, v_bias, inv_freq, state, block_table, Hq, Hkv, Dh, K,
                            0.f},
        n_tokens, BlockCoord::of_launch(), GridDep{}, x);
}

extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_gate_up_swiglu_x_tokens(__half* __restrict__ h, const __half* __restrict__ x,
                                  const u32* __restrict__ gate_qweight, const __half* __restrict__ gate_scales,
                                  const u32* __restrict__ up_qweight, const __half* __restrict__ up_scales, int F,
                                  int K, int n_tokens) {  // h [T, F], x [T, K]
    gemv_int4_gate_up_swiglu_tokens_item<GEMV_TOKENS, GridDep, GemvStageXTokens<GEMV_TOKENS>>(
        GemvInt4GateUpSwigluArgs{h, nullptr, nullptr, gate_qweight, gate_scales, up_qweight, up_scales, F, K, 0.f},
        n_tokens, BlockCoord::of_launch(), GridDep{}, x);
}
#endif  // DEVICE_FUNCTIONS_ONLY
