// kernels/gemm_int4.cu — prefill GEMMs over INT4 (layout id 1) weights: Y = X Wᵀ for M tokens,
// on Hopper's warpgroup MMA (wgmma) with the activations staged by TMA.
//
//   gemm_int4_f32            out fp32[M, N]            = X Wᵀ                (tests, tools)
//   gemm_int4_qkv            qkv fp32[M, Nq+2·Nkv]     = X [Wq; Wk; Wv]ᵀ     (bias + RoPE: rope_kv_rows)
//   gemm_int4_qkv_rope       q fp16[M, Hq, Dh], the K/V cache slots of the chunk's positions
//                                                      = rope(X Wqᵀ + bq), rope(X Wkᵀ + bk), X Wvᵀ + bv
//   gemm_int4_residual       residual fp32[M, N]      += X Wᵀ                (o_proj, down_proj)
//   gemm_int4_gate_up_swiglu h fp16[M, F]              = silu(X Wgᵀ) ⊙ (X Wuᵀ)
//   gemm_q4k_qkv_rope, gemm_q4k_stacked_rows, gemm_q4k_residual, gemm_q4k_gate_up_swiglu,
//   gemm_q5k_qkv_rope, gemm_q5k_stacked_rows, gemm_q5k_residual, gemm_q5k_gate_up_swiglu,
//   gemm_q6k_rows, gemm_q6k_residual: the same mainloop over Q4_K, Q5_K and Q6_K weights as the GGUF
//   stores them (bottom of the file; every tile build, Q6_K's 256-token one with two stages)
//   gemm_q4g32_qkv_rope, gemm_q4g32_stacked_rows, gemm_q4g32_residual, gemm_q4g32_gate_up_swiglu,
//   and gemm_q5g32_*, gemm_q8g32_* likewise: the same over Q4_0, Q5_0 and Q8_0 (the GGUF's bytes:
//   4-bit codes, with a high-bit plane, or bytes; an FP16 scale per 32 inputs; every build, Q8_0's
//   256-token one with two stages); gemm_q4g32min_*, gemm_q5g32min_*: Q4_1 and Q5_1 (an FP16
//   offset per 32 inputs beside the scale)
//
// X is FP16 [M, K] row-major (the normed hidden states of the prompt's tokens, the attention
// output, or h), W is INT4 [N, K] with one FP16 scale per 128 inputs (format/quant.py, layout
// id 1: 8 nibbles per uint32 in NIBBLE_ORDER, ptx/int4_unpack.cuh) in the decode GEMVs' device
// layout (int4_matmul.cuh: tile-major, q/k/v RoPE-paired), so that one copy of the weights
// serves both; the K-quant and Q4/5/8_0 kernels at the bottom read their formats as stored.
//
// The limit: tensor-core math. At the 7B shape with a 512-token prompt, per layer:
//   qkv     2·512·4608·3584   = 16.9 GFLOP   weights  8.3 MB
//   o_proj  2·512·3584·3584   = 13.2 GFLOP   weights  6.4 MB
//   gate_up 2·512·37888·3584  = 139  GFLOP   weights 67.9 MB
//   down    2·512·3584·18944  = 69.5 GFLOP   weights 33.9 MB
//   = 239 GFLOP per layer, 6.68 TFLOP for 28 layers: at the H200's ~990 TFLOP/s dense FP16 peak
//   the floor is ~7 ms. Only wgmma reaches that rate on Hopper; the mma.sync (Ampere) form of
//   this GEMM topped out at ~190 TFLOP/s here (measurements below).
//
// Work split
// ----------
//   tile     = GEMM_BM tokens × 128 weight rows (for gate/up: 64 features of both matrices).
//              The file is built with GEMM_BM = 64, 128 (the default) and 256 — wgmma m64n64,
//              m64n128, m64n256 — and the launcher picks the build per GEMM shape
//              (launchers/gemm_int4.py: gemm_tiling): a larger tile shares each unpacked weight
//              among more tokens, a smaller one gives a GEMM of few row blocks more tiles than SMs
//              and wastes less of a short prompt. The kernel is persistent, its work shared out
//              by the stream-K schedule (gemm_split_k.cuh): grid = P ≤ the SM count blocks, and
//              block b takes one contiguous range of the W = tiles × groups (tile, 128-input group)
//              pairs of the ceil(M/GEMM_BM) × row-block tiles the live M gives (row block
//              fastest: the blocks on each token block pass the same weight slices together). With
//              a scratch a range may end inside a tile: the block holding the tile's first group
//              adds the other blocks' partial sums and runs the epilogue; without one the ranges
//              are whole tiles. Every block then runs ~W/P groups: no round of the SMs half
//              empty (the launcher picks P and the tile together, gemm_tiling; for the INT4
//              and K-quant GEMMs with a long K it takes one wave of whole tiles where that fills
//              most of the grid: lockstep_tiling, whose comment has the measurement).
//   block    = 12 warps: two consumer warpgroups (warps 0–3, 4–7), each 64 weight rows × the
//              tile's GEMM_BM tokens, and a producer warpgroup (warps 8–11) that gives its
//              registers to them (setmaxnreg: 72 and 216 a thread at GEMM_BM 256, whose 128
//              accumulators a consumer thread the 168 of a 384-thread launch cannot hold; 104 and
//              200 at 128 and 64). Its first warp works, the other three exit.
//   producer = one warp fills a ring of GEMM_STAGES stages (4; 3 of 72 KB at GEMM_BM 256; 2 for the
//              formats whose larger stages do not fit three: gemm_stages), one
//              128-input group each, guarded by mbarriers (full: the bytes landed; x_empty,
//              w_empty: the consumers are done with the stage's X, its weights):
//              lane 0 issues the TMA copies of X (tensor map: box GEMM_BM tokens × 64 inputs,
//              128-byte swizzle — the layout wgmma reads; two boxes, 32 KB at 128), and every lane copies 16-byte
//              pieces of the tile's 128 weight rows (64 B each, 8 KB; in the INT4 device layout a
//              warp tile's 16 rows are one contiguous 1 KiB item, or two 512-byte halves where
//              they come from two matrices or tiles: gate_up, the FP32 qkv) with cp.async, which
//              arrives on the same full barrier when it lands. It runs on into the next tile while
//              the consumers are in the epilogue.
//   consumer = the weights are wgmma's A operand, from registers: lane (g, t) reads the 64 bytes
//              of its rows g and g+8 from the stage and unpacks nibble pair t of every word:
//              inputs (16s + 2t, +1) and (16s + 8 + 2t, +9) of k step s — exactly the k positions
//              of the A fragment (ptx/wgmma.cuh), because B, the activations, comes from shared
//              memory in its natural order. The exact codes are multiplied by the row's group
//              scale (loaded one group ahead) in FP16 — one rounding of each scaled weight,
//              relative ≤ 2⁻¹¹, docs/numerics.md — so the tensor cores sum all of K into one FP32
//              accumulator with no per-group rescaling.
//              Per group: 8 × wgmma m64nNk16, N = GEMM_BM (B: the stage, through a descriptor), one
//              commit, one wait; the two warpgroups interleave, one unpacking while the other's
//              MMAs run.
//   epilogue = lane (g, t) owns rows g, g+8 × tokens 8j + 2t, +1 (j < GEMM_BM/8): each output element
//              is written by exactly one lane (the residual read-modify-write needs no atomics,
//              the result is bit-reproducible); tokens ≥ M and rows ≥ N are not written. For
//              gate/up, row g of a warp's 16 is gate feature f and row g+8 is up feature f, so
//              the SwiGLU happens in registers. For qkv_rope, rows g and g+8 are dims i and
//              i + Dh/2 of one head (a RoPE pair), so the rotation, the bias and the FP16 writes
//              of q and of the K/V cache happen in registers too (below the kernel's rows_of).
//
// Barriers and phases (each initialised once by thread 0, then fence + the kernel's only
// __syncthreads(), before the role branch). `it` counts the groups a block has run over all its
// tiles, the same in the producer and in every consumer warp; group it uses stage s = it % STAGES
// in round r = it / STAGES.
//   full[s]   count GEMM_FULL_ARRIVALS = 33: lane 0's arrive.expect_tx (+ the 32 KB of X the two
//             TMA boxes deliver as transactions) and one cp.async.mbarrier.arrive.noinc per
//             producer lane, which arrives only once that lane's 16 weight copies have landed
//             (with Q6_K's high-bit plane, 32 for lanes t < 2: also their 16-byte half of the
//             32 B of high bits of each of the same 16 rows, in the same stage behind the code
//             words, under the same barriers; with Q5_0's, 32 for lanes t = 0: the 16 B of
//             each row; with Q8_0's second 64 B of codes, 32 for every lane).
//             Q8_0's rows are 128 B a group: the code rows hold the first 64 B, the high part
//             the rest.
//             Phase r completes when round r's X tile and all 128 weight rows are in shared
//             memory; nothing else arrives on it. (Without .noinc each lane's arrival is
//             "zero-net" and the barrier counts only lane 0: ptx/cp_async.cuh.)
//   w_empty[s] count 256: every consumer lane, once its MMAs are issued (its loads of the weight
//             words are long done: they fed the A fragments). Each lane releases its own reads,
//             so the order is one the memory model states and racecheck sees; lane 0 arriving
//             for its warp after a __syncwarp() is as sound but racecheck reports the other
//             lanes' reads as racing the next cp.async (measured below). Arriving after the
//             commit, not before the MMAs, keeps the 32 arrivals off the MMA issue path.
//   x_empty[s] count 8: lane 0 of every consumer warp after its wgmma.wait_group 0 — X is read by
//             the MMAs (the async proxy), which are complete for the warp once the wait returns.
//   Phase r of each completes when every consumer is done with that part of round r.
//   Why it cannot race: the producer lanes write the weights of stage s for round r ≥ 1
//   (cp.async) only after w_empty[s] phase r−1, lane 0 its X (TMA) only after x_empty[s] phase
//   r−1: after every read of round r−1 (WAR); a consumer reads round r only after full[s] phase r
//   (acquire), after every write of round r landed (RAW). Arrivals never spill into the wrong
//   phase: every one of round r's 33 full arrivals is issued after the producer's wait on
//   w_empty[s] phase r−1, which implies full[s] phase r−1 had completed.
//   Why parities suffice: full[s] is at most one phase ahead of a consumer's wait (round r+1
//   cannot be armed before that consumer released round r), and each empty at most one phase
//   ahead of the producer's (round r cannot be released before it was filled), so r & 1 names
//   the phase.
//   The producer waits for its own last copies (commit_group, wait_group 0) before it exits.
// MMA turns (GEMM_MMA_TURNS, on): the two consumer warpgroups issue their groups' MMAs
// in turns, 0, 1, 0, 1 … — a warpgroup waits on named barrier 2 + wg (bar.sync, 256 threads:
// its own 128 and the other's 128 arrivals) before its 8 wgmma, and arrives on the other's
// (bar.arrive) right after its commit. Left alone, both warpgroups wait on the same full barrier,
// unpack side by side and issue together, so the tensor pipe runs their MMAs interleaved and
// both then unpack with it idle; in turns, one's MMAs queue whole behind the other's and its
// next unpack runs under them (FlashAttention-3's warpgroup ping-pong, CUTLASS's ordered
// sequence barrier). Why it cannot deadlock: both warpgroups run the same units and groups (one
// `it` for the block), so each has as many turns as the other; warpgroup 1 hands over the first
// turn before its loop (one bar.arrive on barrier 2) and warpgroup 0 takes the last hand-over
// after its loop (one bar.sync on barrier 2), so every phase of both barriers gets its 256
// arrivals; a wait on a turn needs only the other warpgroup's issue of its previous group, never
// a barrier that warpgroup reaches later (full[s] is the producer's; the split-K fix-up's
// barrier 1 comes after both have issued their unit's last group). Why the phases cannot mix:
// warpgroup 1 arrives on barrier 2 for turn n + 1 only after its own turn n, which began after
// warpgroup 0's turn n completed, so at most one phase of a turn barrier is ever open. The
// barriers order instruction issue only: no shared-memory access depends on them.
// Measured (docs/bench/2026-12-04_{cd50467,5f8cc14}_h200_gemm7b_*.json, tools/bench_gemm.py
// --grid persistent --reps 20 --samples 7, in turns with the build before): gate_up 222.7 and
// 221.8 µs against 241.7 and 239.4, down_proj 120.1 / 119.4 against 128.0 / 126.6, the 28 layers
// 11.6 / 11.5 ms against 12.3 / 12.4. The TTFT(512) of the synthetic 7B gains less than run-to-run
// spread: medians of 30 prefills, six pairs in turns, 12.53–12.62 ms against 12.52–12.73
// (…_syn7b_int4_{ordered,parent}_{4..9}.json); the 0.5B and the 7B in Q4_K_M or Q5_K_M show no
// difference either (…_syn05b_int4_*, …_syn7b_q4_k_m_*, …_syn7b_q5_k_m_* in the same files'
// runs). The build before took 12.3 ms for its GEMMs replayed alone, twenty calls of one
// back to back, and 12.5 ms for the whole prefill: inside the prefill its GEMMs already ran
// faster than alone, so what the turns remove shows mostly in the replays.
//
// The row count M is read from device memory (prefill_state[1]): the launch list of a prompt
// chunk is built once per row capacity and reused. The tensor map covers the buffer's capacity
// rows: tokens past M are read (stale or NaN: they are other columns of the MMA) but never
// written; rows past the capacity read as zero.
//
// Shared memory: GEMM_STAGES × (2·GEMM_BM·128 B of X + 8 KB of weights) + 1 KB (to align the
// ring to the 1024-byte swizzle atom) + barriers — 97, 161 and 217 KB at GEMM_BM 64, 128, 256:
// 1 block per SM. Registers: GEMM_BM/2 accumulators + 32 A fragments per consumer lane, 168 a
// thread at launch for every kernel and build (ptxas; the launcher checks the count, which the
// setmaxnreg moves assume), no spills after the moves. The ring's base is an offset
// added to the shared array, so the consumers' weight reads compile to LDS.128 (a pointer rebuilt
// from an integer gave generic LD.E.128); the synthetic 7B's TTFT with it: 17.3 ms
// (docs/bench/2026-12-01_4929493_h200_syn7b_int4_prefill_gemm_int4.json; 17.4 ms before, in
// another run: within run-to-run spread).
//
// Measured on the H200 (`PYTHONPATH=src python3 tools/dev_kernels.py gemm_int4`: 7B shapes at
// M = 512, graph replay of 20 calls, median of 5, every version checked against the reference
// first; docs/bench/2026-12-01_d1f479d_h200_dev_kernels.json; µs and TFLOP/s):
//   | GEMM (N × K)                    | this file    | mma.sync (dev v1) |
//   | qkv_proj (4608 × 3584)          |  63.1   268  | 135.4   125       |
//   | o_proj (3584 × 3584)            |  33.6   392  |  82.3   160       |
//   | gate_up_swiglu (2·18944 × 3584) | 272.0   511  | 658.7   211       |
//   | down_proj (3584 × 18944)        | 160.7   433  | 395.0   176       |
//   | 28 layers                       | 14.8 ms      | 35.6 ms           |
//   (mma.sync: the previous cp.async + mma.m16n8k16 form of this file, kept as
//   kernels/dev/gemm_int4/v1_mma_sync.cu.) tools/bench_gemm.py on the same commit in another run:
//   15.6 ms (docs/bench/2026-12-01_d1f479d_h200_gemm7b_m512.json); runs differ by ~±0.4 ms, most
//   of it down_proj. qkv at M = 512 is 36 × 4 = 144 tiles on 132 SMs: 1.09 waves.
// Tried and measured slower: clusters of 2 CTAs along the weight rows sharing each stage by a
// multicast TMA copy (half the activation traffic from L2): 24.9 ms against 16.5 ms for the 28
// layers at M = 512 (kernels/dev/gemm_int4/v2_wgmma_cluster2.cu, built with GEMM_CLUSTER=2 and
// =1; the same run as the table above; re-run with `tools/dev_kernels.py gemm_int4 --versions v2`). L2 bandwidth is not the
// limit; a stage shared by two CTAs can be refilled only when both are done with it, and the
// coupling stalls both.
// The 9-warp form above (one producer warp, 128-token tiles only) is what this file was before
// the producer warpgroup; its tables and the barrier protocols below were measured on it. With
// the 12-warp block and the three tile builds (kernels/dev/gemm_int4/v6_n256_setmaxnreg.cu,
// where they were first built; same run, docs/bench/2026-12-02_a3a56cb_h200_dev_kernels_v6.json,
// the 9-warp file's figures in the first column):
//   | GEMM at M = 512, µs             | 9 warps, 128 | 12 warps, 256 | 128   | 64    |
//   | 7B qkv_proj                     |  56.1        |  48.7         |  68.9 |  93.7 |
//   | 7B o_proj                       |  32.2        |  43.7         |  27.4 |  39.1 |
//   | 7B gate_up_swiglu               | 267.6        | 233.1         | 277.5 | 372.5 |
//   | 7B down_proj                    | 148.3        | 198.6         | 123.7 | 190.1 |
//   | 0.5B qkv_proj                   |  10.6        |  16.4         |  12.3 |  11.1 |
//   | 0.5B o_proj                     |  12.3        |  17.5         |  11.3 |   8.4 |
//   | 0.5B gate_up_swiglu             |  33.5        |  34.0         |  30.6 |  33.0 |
//   | 0.5B down_proj (whole, S = 1)   |  41.4        |  56.4         |  34.5 |  26.3 |
// No tile wins everywhere: 256 where the tiles fill the GPU (the unpack of a group feeds twice
// the MMA work), 128 or 64 where a GEMM has few row blocks — hence the builds and the launcher's
// choice. Lost there: the consumers storing the unpacked weights into shared memory for SS
// wgmma, one group's MMAs in flight while the next is unpacked (GEMM_A_SMEM=1: 18.0 ms for the
// 7B's 28 layers against 14.1) — the stores, the proxy fence and the warpgroup barrier of each
// group cost more than the overlap gives. Lost as well: warps of their own unpacking each stage's
// weights into an FP16 A tile (stmatrix, 128-byte swizzle, one more mbarrier a stage) so that the
// consumers issue SS wgmma only — a fourth warpgroup (512 threads: no 256-token build, its 128
// accumulators do not compile in 128 registers) or the producer warpgroup's three idle warps.
// Correct in every check of the dev runner, slower at every GEMM (µs, 7B at M = 512, whole tiles,
// one H100 run, production beside it; docs/bench/2026-12-06_0242140_h100_dev_gemm_int4_unpack_warps.json,
// the code at commit 0242140, dev versions 7 and 8 there):
//   | build                            | qkv   | o_proj | gate_up | down  | 28 layers |
//   | this file (its tiles)            |  68.4 |  27.6  |  216.5  | 124.3 | 12.23 ms  |
//   | fourth warpgroup, 128 tokens     | 119.2 |  34.4  |  320.9  | 162.7 | 17.84 ms  |
//   | producer's 3 warps, 128 tokens   |  99.0 |  36.7  |  316.1  | 171.8 | 17.46 ms  |
//   | producer's 3 warps, 256 tokens   |  55.1 |  50.2  |  270.5  | 243.5 | 17.34 ms  |
// The reading: three or four unpack warps, one a scheduler, have each a 64-pair unpack and 8
// stmatrix a warp tile and group as one dependent chain, where the consumers of this file hide
// the same chain behind the other warpgroup's MMAs with eight warps; and the A tile costs a
// stage of the ring (2 stages at 256 tokens). What limits now is still the mainloop (~50–60% of
// the tensor-core peak at 128 tokens, 60% at 256).
// Where the time goes (Nsight Compute, 7B at M = 512 in the prefill's tiling,
// docs/bench/2026-12-04_aff46cd_h200_gemm7b_ncu.json): the tensor pipe is busy 75% of gate_up's
// active cycles and 80% of down_proj's, 54% and 46% of qkv's and o_proj's. The most-sampled
// instruction is the consumers' wgmma.wait_group 0 (a third of gate_up's warp samples): a
// warpgroup waits for its own 8 MMAs before it unpacks the next group, and the other
// warpgroup's MMAs cover only part of that. The blocks do not finish together: SM active cycles
// min / mean / max 146k / 161k / 189k of 195k elapsed in down_proj, whose tile owners add the
// partial sums and run the residual epilogue after the others are done (13% of its warp
// samples), 51k / 58k / 67k of 71k in qkv. L2 throughput (38–53% of its peak) and issue slots
// (20–29% busy) are not what limits.
// Tried and lost there: each group's A fragments in two (or four) parts, each its own commit
// group, a consumer waiting only for the previous group's same part (wgmma.wait_group 1) before
// rewriting its registers — the k-block pipelining of CUTLASS's mixed-input RS mainloop. Wrong
// as well as slower: the SASS computes the next part into the registers of MMAs still in flight
// (ptxas places the unpack above the WARPGROUP.DEPBAR; an empty asm pinning the registers after
// the wait never reaches ptxas), and the 256-token build wrote NaN in tests/test_kernel_gemm_int4.py;
// even one part with the X release moved into the next group failed at every tile size. Timed
// anyway, the 7B's gate_up took 271 and 261 µs against 220 and 224 in turns (a four-part build in
// the same run no faster; docs/bench/2026-12-04_{053477b,aff46cd}_h200_gemm7b_a_parts_*.json).
// Hence wait_group 0.
//
// Tried and lost as well: the producer warp asking L2 for the first 4 groups of its block's
// first unit (prefetch.global.L2 of the rows' code lines) before griddepcontrol.wait, from a
// guess of M read before the wait (commit d1a3818): 7B INT4 TTFT 12.153 / 12.145 ms against
// 12.132 / 12.092 in turns (`drvqwen bench --mode graph --prefill-reps 30 --new-tokens 16`,
// docs/bench/2026-12-04_{d1a3818,55cba63}_h200_syn7b_int4_l2_prefetch_*.json): the first
// stage's wait on HBM is not what a launch boundary here costs.
//
// Barrier protocols measured (tools/bench_gemm.py --reps 20, M = 512, 28 layers in ms, two runs
// each, the old one in the same run; docs/bench/2026-12-01_h200_gemm_int4_barrier_protocols.json;
// the "dev" column names the version kept in kernels/dev/gemm_int4/, re-run beside this file with
// `PYTHONPATH=src python3 tools/dev_kernels.py gemm_int4 --versions v3 v4 v5`):
//   | full barrier                          | release of a stage                 | ms          | sanitizers        | dev |
//   | count 1, lanes' arrivals without .noinc | lane 0 per warp                  | 15.0 15.1   | synccheck overflow, racecheck hazards | |
//   | count 33, .noinc                      | lane 0 after __syncwarp            | 15.1 15.2   | racecheck 24 hazards | v3 |
//   | count 33, each lane arrives after cp.async.wait_group 1 (one group late) | lane 0 after __syncwarp | 14.6 14.5 | racecheck 24 hazards | v4 |
//   | count 33, one group late              | every lane, after the wait          | 15.3 15.4   | clean |     |
//   | count 33, .noinc                      | every lane, after the wait          | 15.4 15.4   | clean | v5  |
//   | count 33, one group late              | w_empty every lane before the MMAs, x_empty lane 0 | 16.5 16.5 | clean | |
//   | count 33, .noinc                      | w_empty every lane before the MMAs, x_empty lane 0 | 15.4 15.7 | clean | |
//   | count 33, one group late              | w_empty every lane after the commit, x_empty lane 0 | 15.4 15.3 | clean | |
//   | count 33, .noinc (this file)          | w_empty every lane after the commit, x_empty lane 0 | 15.0 14.8 | clean | |
// Every lane arriving costs where it sits on the MMA path: right after the commit it overlaps the
// MMAs. The fastest form there (lane 0 after __syncwarp, one group late) is sound by the memory
// model, but racecheck cannot see it, and a protocol the sanitizers cannot check is one no change
// can be checked against. In the dev runner's run of the table above the versions kept ran 15.6
// (v3), 15.7 (v4) and 16.3 ms (v5) against this file's 14.8 ms.
//
// K-quant weights (the GGUF's Q4_K, Q5_K and Q6_K bytes, bottom of the file): the same mainloop
// with the consumer's scaling as a policy (GemmInt4Scales, GemmQ4kScales, GemmQ5kScales,
// GemmQ6kScales; the INT4 kernels' SASS is the same with it). Q4_K's codes are the INT4 words
// (layout id 1); the 6-bit (sc, m) of a group's four 32-input sub-blocks come from global memory
// one group ahead and are decoded in FP16 pairs (the 1024 magic number, one mul.rn.f16x2 for two
// sub-blocks). Q6_K adds its high-bit plane to each stage (the producer copies 32 B a row beside
// the 64 B of codes) and one int8 scale per k step. Bytes: Q4_K 144 per 256 weights (4.5 bits),
// Q6_K 210 (6.56 bits) — the 7B's gate_up at 512 tokens reads 76 MB of Q4_K in ~246 µs, ~6 % of the
// HBM bandwidth. The limit is the consumer's unpack beside the tensor cores: a group is 8 MMAs and
// 338–341 SASS instructions a warp for Q4_K, 390–393 for Q5_K, 366–368 for Q6_K (INT4: 240–257;
// the consumers' group loop at GEMM_BM 128, cuobjdump of NVRTC's cubin, NOPs not counted), so the
// other warpgroup's MMAs hide less of it; the 256-token tile, which doubles the MMA work per
// unpacked group, gains the most. Barriers: the file's protocol unchanged — the high-bit words are
// part of the stage the full and w_empty barriers guard (above). Per layer of the synthetic 7B in
// llama.cpp's Q4_K_M layout at 512 tokens, µs, one eager prefill's event pairs (`drvqwen bench
// --kernels`, docs/bench/2026-12-03_*_syn7b_q4_k_m_*):
//   | kernel                          | this file  | gemm_fmt_wgmma.cu | INT4 (bench_gemm, 2a2a007) |
//   | q | k (Q4_K, stacked)            |  36.1      | 51.4 + 22.5       | qkv 39.0 (with v)          |
//   | o_proj (Q4_K)                   |  41.3      | 55.8              | 30.7                       |
//   | gate_up_swiglu (Q4_K)           | 245.8      | 445.4             | 219.9                      |
//   | down_proj (Q4_K / Q6_K)         | 131.1 / 198.0 | 230.8 / 266.3  | 118.2                      |
//   | v_proj (Q4_K / Q6_K)            |  16.4 / 19.0  | 22.6 / 29.7    | –                          |
// The 7B's TTFT(512) 14.7 ms against 23.9 on gemm_fmt_wgmma.cu in the same run
// (2026-12-03_b9df302_h200_syn7b_q4_k_m_kquant_*.json). On the way: the Q4_K scales decoded per
// value in FP32 (wf_scales, then a conversion to FP16) made the mainloop 450 SASS instructions a
// group against INT4's ~250 and the TTFT 20.5 ms; in FP16 pairs 325 and 16.9 ms (b850434, the two
// in the same run); Q6_K's v/down here too 16.3 ms (c6c8fbb); and the FP16 pairs freed the
// registers the 256-token build needed: 14.7 ms (b9df302). Q6_K: at GEMM_BM 256 its ring has two
// stages (gemm_stages: three with the high-bit plane need 229 KB): 14.0 ms against the INT4 7B's
// 12.3 in turns (docs/bench/2026-12-03_0a6300c_h200_syn7b_*.json).
// Q5_0 and Q8_0 (bottom of the file) are the same mainloop with an FP16 scale per 32-input chunk:
// the residual kernels are 2237 and 2004 SASS instructions in all at GEMM_BM 128 (INT4's 1998;
// cuobjdump of NVRTC's cubin, NOPs not counted). The synthetic 7B in llama.cpp's Q5_0 layout
// prefills 512 tokens in 14.9 ms (23.8 on gemm_fmt_wgmma.cu), in its Q8_0 layout in 14.2–14.7 ms
// with the 256-token build on two stages (18.4–18.6 without it; 27.9 on gemm_fmt_wgmma.cu), the
// INT4 7B 12.3–12.5 ms in the same runs
// (docs/bench/2026-12-03_{635fd11,0a6300c}_h200_syn7b_*.json); the synthetic 0.5B in the real
// 0.5B's formats 2.94 ms against 4.01 (…_32ada4d_h200_syn05b_q4_k_m_q32_*.json).
// Q4_0 (gemm_q4g32_*, the INT4 unpack with a scale per chunk): the 7B in llama.cpp's Q4_0 layout
// 12.9 ms against INT4's 12.5 in turns, 19.6 on gemm_fmt_wgmma.cu (…_b4a74ff_h200_syn7b_*.json).
//
// Requirements (asserted by the launchers): K % 128 == 0; for qkv, Nq and Nkv multiples of 16
// (a warp's 16 rows lie in one matrix); any N ≥ 1 (rows past N read row N-1, never stored);
// X's rows 16-byte aligned (TMA).
#include <cuda_fp16.h>

#include "types.cuh"        // u32, u64, WARP_SIZE, QUAD_SIZE
#include "tma.cuh"          // CUtensorMap, tma_load_2d, tma_prefetch_map
#include "mbarrier.cuh"     // mbarrier_init, mbarrier_arrive(_expect_tx), mbarrier_wait_parity
#include "wgmma.cuh"        // wgmma_*, wgmma_desc_sw128, the m64nNk16 RS forms (N = 64, 128, 256)
#include "setmaxnreg.cuh"   // setmaxnreg_inc, setmaxnreg_dec, block_index, live_rows
#include "cp_async.cuh"     // cp_async_16, cp_async_wait, cp_async_mbarrier_arrive_noinc
#include "int4_unpack.cuh"  // lop3_and_or, INT4_MASK_LO, FP16X2_1024, FP16X2_1032
#include "int4_matmul.cuh"  // INT4_GROUP, INT4_TILE_ROWS, swiglu_f16
#include "gemm_epilogue.cuh" // GEMM_BM, GEMM_ACC, gemm_each_token, GemmResidualAdd
#include "gemm_split_k.cuh"  // GemmSplitK, GemmWork, gemm_work, gemm_unit_at, gemm_split_k_finish
#include "griddep.cuh"       // grid_dependency_wait, grid_launch_dependents
#include "kv_cache.cuh"      // PAGE_TOKENS, kv_offset, kv_page_elems
#include "rope.cuh"          // rope_apply
#include "weight_formats.cuh" // wf_word (the Q6_K kernels' high words)
#include "named_barrier.cuh"  // named_barrier_sync, named_barrier_arrive (the consumers' turns)

#define GEMM_CONSUMER_WGS   2
#define GEMM_WG_ROWS        64                                 // weight rows per warpgroup (wgmma M)
#define GEMM_BLOCK_ROWS     (GEMM_CONSUMER_WGS * GEMM_WG_ROWS)  // 128
#define GEMM_CONSUMER_WARPS (GEMM_CONSUMER_WGS * 4)
#define GEMM_THREADS        ((GEMM_CONSUMER_WGS + 1) * 4 * WARP_SIZE)  // + the producer warpgroup: 384
// 3 stages × 72 KB at GEMM_BM 256 (a fourth does not fit the 227 KB); 4 × 40 KB at 128, 4 × 24 KB at 64.
#define GEMM_STAGES         (GEMM_BM == 256 ? 3 : 4)
#define GEMM_BOX_INPUTS     64                                 // 128 B of FP16: one swizzle row
#define GEMM_BOX_BYTES      (GEMM_BM * GEMM_BOX_INPUTS * 2)    // GEMM_BM tokens × 64 inputs: 16 KB at 128
#define GEMM_X_STAGE_BYTES  (2 * GEMM_BOX_BYTES)               // one 128-input group of X: 32 KB at 128
#define GEMM_W_ROW_BYTES    (INT4_GROUP / 2)                   // one group of one weight row: 64 B
#define GEMM_W_STAGE_BYTES  (GEMM_BLOCK_ROWS * GEMM_W_ROW_BYTES)  // 8 KB
#define GEMM_STAGE_BYTES    (GEMM_X_STAGE_BYTES + GEMM_W_STAGE_BYTES)  // 40 KB at 128 (a multiple of 1024)
// Registers a thread after the setmaxnreg moves, balanced at the 168 every thread has at launch
// (384 · 168 = 64 512 of the SM's 65 536; the launcher refuses a build with another count: the
// consumers' setmaxnreg.inc would wait for registers that never come): 2 · 128 · 216 + 128 · 72
// at GEMM_BM 256 (128 accumulators), 2 · 128 · 200 + 128 · 104 at 128 and 64.
#define GEMM_REGS_AT_LAUNCH 168
#define GEMM_CONSUMER_REGS  (GEMM_BM == 256 ? 216 : 200)
#define GEMM_PRODUCER_REGS  (GEMM_BM == 256 ? 72 : 104)
static_assert(2 * 128 * GEMM_CONSUMER_REGS + 128 * GEMM_PRODUCER_REGS == GEMM_THREADS * GEMM_REGS_AT_LAUNCH,
              "the register moves balance");
#define GEMM_K_STEPS        (INT4_GROUP / 16)                  // 8 wgmma k16 steps per group
// The consumers issue their groups' MMAs in turns, warpgroup 0 then 1 then 0 …: named barriers
// GEMM_TURN_BARRIER + wg (2 and 3; 1 is the split-K fix-up's), 256 threads each — the 128 of the
// warpgroup whose turn it is (bar.sync) and the 128 of the other one, which arrive (bar.arrive)
// right after they have issued theirs (the header: "MMA turns").
#ifndef GEMM_MMA_TURNS
#define GEMM_MMA_TURNS 1
#endif
#define GEMM_TURN_BARRIER   2
// Timing probes (wrong results by design; tools/bench_gemm.py --kquant-variant): where a format's
// time over Q4_K's goes. GEMM_PROBE_NO_HIGH_COPY=1: the producer copies no high part (the stage's
// high bytes are whatever an earlier group left there), so the format costs the producer and the
// L2 what Q4_K does. GEMM_PROBE_LOW_ONLY=1: Q5_K's consumers unpack the low nibbles alone, as
// Q4_K's do (no high bit merged). 0 builds the same machine code.
// Measured at the 7B's shapes, 512 rows, one H100 in one run (bench_gemm.py --kquant q4_k q5_k
// --kquant-variant …; docs/bench/2026-12-07_e77fde8_h100_gemm7b_m512_q5k_probes.json), µs:
//   | GEMM     | INT4  | Q4_K  | Q5_K  | Q5_K no high copy | Q5_K low nibbles only |
//   | gate_up  | 197.0 | 217.2 | 233.8 | 241.3             | 232.6                 |
//   | down     | 119.9 | 141.0 | 142.2 | 149.8             | 144.5                 |
//   | o_proj   |  32.7 |  36.1 |  40.9 |  39.0             |  41.3                 |
//   | qkv      |  42.3 |  45.2 |  48.2 |  46.2             |  50.9                 |
// Neither takes Q5_K to Q4_K's time (gate_up 8 % over it, o_proj 13 %): that is not the high
// plane's copies, nor its unpack, each alone. Both probes together do (another H100, one run,
// gate_up µs: Q5_K 246.5, both probes 225.6, Q4_K 223.7; 28 layers of GEMMs 13.7 / 12.7 / 12.6
// ms; docs/bench/2026-12-07_fdc24d0_h100_gemm7b_m512_desc_bcast_probes.json): the producer's
// extra copies and the consumers' extra unpack each cover the other, so either alone made cheaper
// changes nothing. Tried in the same run and not kept (two timing switches of commit fdc24d0):
// the wgmma descriptor made once a group, the k steps added as offsets (the consumers' group loop
// 21–24 SASS instructions shorter, INT4 gate_up 247 → 226) — INT4 gate_up 205.6 → 205.7, Q4_K
// 223.7 → 223.4, Q5_K 246.5 → 243.7 — and with it the Q4_K/Q5_K scale pairs left packed, each
// HFMA2 taking one half of them (9–17 fewer): Q4_K 222.0, Q5_K 243.1, 1 % at most. Not built: the producer's lane 0 copying the warp tiles' 8-row halves by
// cp.async.bulk (16–32 a group) instead of every lane's 16-byte cp.async — each bulk copy's
// operands go to uniform registers under an elect loop: ~93 instructions a warp tile, ~740 a
// group, in its SASS (Q5_K gate_up at 256 tokens, cuobjdump), where the lanes' pieces take the
// producer's group loop 163 (INT4) to 378 (Q5_K) instructions. Tried and not kept: the high
// part's copies spread over the quad's four lanes (lane t: tile 4k + t's rows g, g+8 for Q5_K,
// two tiles a copy for Q6_K) so that every copy instruction has all 32 lanes busy — the Q5_K
// gate_up producer loop 251 → 181 instructions, 34 → 22 copies — gave no time: 28 layers Q5_K
// 13.01 → 13.18 ms, Q6_K 3.68 → 3.71 at 512 tokens, 24.6 → 24.7 and 6.95 → 7.00 at 1024
// (H100; docs/bench/2026-12-07_d715c85_h100_gemm7b_m{512,1024}_high_spread.json) — alone. Beside
// the low-nibble probe (the consumers' share gone) it does (one run, whole tiles of 256 tokens,
// gate_up µs: Q5_K 239.8, low nibbles only 229.3, with the spread 223.9, Q4_K 221.0; 28 layers
// 13.32 / 12.99 / 12.81 / 12.50 ms; docs/bench/2026-12-07_8d454a2_h100_gemm7b_m512_spread_low.json):
// the producer's copies are half the gap and the spread takes most of it, but only once the
// consumers' unpack no longer covers them. So Q5_K reaches Q4_K's time only with both: the spread
// and a 5-bit unpack as cheap as Q4_K's.
#ifndef GEMM_PROBE_NO_HIGH_COPY
#define GEMM_PROBE_NO_HIGH_COPY 0
#endif
#ifndef GEMM_PROBE_LOW_ONLY
#define GEMM_PROBE_LOW_ONLY 0
#endif
// GEMM_PROBE_SCALES_NO_LOAD=1: the Q4_K and Q5_K consumers make each group's scale words from
// the group number instead of loading them from global memory (GemmQ4kScales::load; the decode
// into FP16 pairs unchanged), so the format costs what its scale loads' latency does not. Its
// question: whether those loads are why Q4_K's down_proj GEMM takes longer than Q6_K's at the
// 7B's shape (Q6_K's consumers load 4 scale words a group, Q4_K's 8; their group loops 368 and
// 345 SASS instructions). They are, mostly: on one H100 (tools/bench_gemm.py --rows 512 --grid
// persistent --kquant q4_k q5_k q6_k --kquant-variant noscl:GEMM_PROBE_SCALES_NO_LOAD=1;
// docs/bench/2026-12-07_a86b9cd_h100_gemm7b_scale_probe_m512.json) Q4_K's down_proj 140.0 →
// 121.5 µs (INT4 118.7, Q6_K 129.7), its layer's GEMMs 12.16 → 11.13 ms (INT4 10.82), Q5_K's
// 12.89 → 12.06; at 1024 rows Q4_K 21.97 → 21.60 ms (…_m1024.json). 0 builds the same machine code.
#ifndef GEMM_PROBE_SCALES_NO_LOAD
#define GEMM_PROBE_SCALES_NO_LOAD 0
#endif
#define GEMM_TURN_THREADS   (GEMM_CONSUMER_WGS * 4 * WARP_SIZE)
// Arrivals per phase of a full barrier: lane 0's arrive.expect_tx (the X bytes) and one
// cp.async.mbarrier.arrive.noinc per producer lane (its weight copies), below.
#define GEMM_FULL_ARRIVALS  (1 + WARP_SIZE)
#define GEMM_SMEM_BYTES     (GEMM_STAGES * GEMM_STAGE_BYTES + 1024 + 3 * GEMM_STAGES * 8)  // launchers mirror it
// A format with a high-bit plane (Q6_K: bits 4–5 of each code, 32 B a row and group) adds it to
// every stage behind the code words: the stage of policy Sc (below) is gemm_stage_bytes<Sc>().
#define GEMM_HIGH_ROW_BYTES 32
#define GEMM_HIGH_MAX       4   // 16-byte pieces of a row's high part in a stage, at most (Q8_0: its second 64 B)
static_assert(GEMM_SMEM_BYTES <= 227 * 1024, "shared memory");

// Nibble pair t of word w (inputs 2t, 2t+1 of its 8) → half2 of the exact codes, times the
// scale s2 (both halves the row's group scale). See ptx/int4_unpack.cuh for the magic number.
__device__ __forceinline__ u32 gemm_int4_pair(u32 w, int shift, u32 s2) {
    const u32 biased = lop3_and_or(w >> shift, INT4_MASK_LO, FP16X2_1024);  // (1024 + v0, 1024 + v1)
    u32 q, out;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(q) : "r"(biased), "r"(FP16X2_1032));  // exact codes
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(q), "r"(s2));
    return out;
}

__device__ __forceinline__ u32 gemm_word(const uint4 (&q)[4], int j) {
    const uint4& v = q[j / 4];
    return (j & 3) == 0 ? v.x : (j & 3) == 1 ? v.y : (j & 3) == 2 ? v.z : v.w;
}

// The A fragments of one group (8 k steps × 4 registers) from the words of rows g and g+8.
__device__ __forceinline__ void gemm_a_fragments(const uint4 (&ra)[4], const uint4 (&rb)[4], int shift,
                                                  __half sa, __half sb, u32 (&frag)[GEMM_K_STEPS][4]) {
    const __half2 sa2 = __half2half2(sa), sb2 = __half2half2(sb);
    const u32 sa_u = *reinterpret_cast<const u32*>(&sa2), sb_u = *reinterpret_cast<const u32*>(&sb2);
#pragma unroll
    for (int s = 0; s < GEMM_K_STEPS; ++s) {
        frag[s][0] = gemm_int4_pair(gemm_word(ra, 2 * s), shift, sa_u);
        frag[s][1] = gemm_int4_pair(gemm_word(rb, 2 * s), shift, sb_u);
        frag[s][2] = gemm_int4_pair(gemm_word(ra, 2 * s + 1), shift, sa_u);
        frag[s][3] = gemm_int4_pair(gemm_word(rb, 2 * s + 1), shift, sb_u);
    }
}

// Two weight rows — g and g+8 of a 16-row warp tile — as rows of their matrices (clamped into
// them: rows past the end are read, never stored).
struct GemmLaneRows {
    const u32* wa;    const u32* wb;      // the rows' INT4 words
    const __half* sa; const __half* sb;   // the rows' group scales
};

// Row r (clamped into the matrix already) of a tile-major plane of W words a row and 128-input
// group: a per-tensor format's 4–6-bit codes (W = 16) or its high bits (W = 4·HB), which the
// GPU holds tile-major with rows in plain order (weight_formats.cuh: Wf<F>::TILED; the INT4
// device layout without the RoPE pairing): its words of group 0, slot r % 16 of tile r / 16 —
// group grp's are 16·W words on, one item further (the policies' CODE_STRIDE, HIGH_STRIDE).
// The word offset in 32 bits (the launchers keep a plane under 2^32 words: FmtWeight.check),
// widened once: a 64-bit product per row would take registers the stacked Q4_K GEMM's producer
// does not have.
template <int W, typename Row>
__device__ __forceinline__ const u32* gemm_tiled_row(const u32* plane, Row r, int K) {
    const u32 row = (u32)r;
    return plane + ((row / INT4_TILE_ROWS) * (u32)(K / INT4_GROUP) * INT4_TILE_ROWS + row % INT4_TILE_ROWS) * W;
}
template <typename Row>
__device__ __forceinline__ const u32* gemm_code_row(const u32* qweight, Row r, int K) {
    return gemm_tiled_row<INT4_GROUP / 8>(qweight, r, K);
}

// How a consumer lane scales its rows' codes — the one place the weight format enters the
// mainloop. Group: what one 128-input group needs, loaded one group ahead (load), and
// fragments(): the group's A fragments from the words of rows g and g+8.
// INT4 (layout id 1): one FP16 scale per row and group, w = (c − 8)·s.
struct GemmInt4Scales {
    static constexpr int CODE_STRIDE = INT4_ITEM_WORDS;  // words between a row's groups: tile-major items (int4_matmul.cuh)
    static constexpr int HIGH_ROW_BYTES = 0;        // no high-bit plane in the stage
    static constexpr int HIGH_STRIDE = 0;           // words between a row's groups in the high plane
    static constexpr bool ROWS_EACH_GROUP = false;  // the producer's row pointers may be hoisted
    struct Group {
        __half a, b;
    };
    __device__ static __forceinline__ Group load(const GemmLaneRows& r, int grp) { return Group{r.sa[grp], r.sb[grp]}; }
    __device__ static __forceinline__ void fragments(const uint4 (&ra)[4], const uint4 (&rb)[4], const uint4 (&)[GEMM_HIGH_MAX],
                                                     const uint4 (&)[GEMM_HIGH_MAX], int shift, const Group& s,
                                                     u32 (&frag)[GEMM_K_STEPS][4]) {
        gemm_a_fragments(ra, rb, shift, s.a, s.b, frag);
    }
};

// Q4_K (weight_formats.cuh, id 10): the GGUF's two levels kept — codes in layout id 1 (the INT4
// words, so the same lop3 picks a lane's pair), per 256-input super-block eight 6-bit (sc, m)
// and the FP16 pair (d, dmin) in 16 bytes (on the GPU as lane words, weight_formats.cuh);
// w = (d·sc)·c − dmin·m per 32-input sub-block. A group of 128 inputs is half a super-block:
// 4 sub-blocks, k steps 2j and 2j + 1 in sub-block j.
struct GemmLaneRowsQ4k {
    const u32* wa;  const u32* wb;    // the rows' code words
    const uint4* sca; const uint4* scb;  // the rows' lane words: 4 a super-block, one vector (weight_formats.cuh)
};

// The lane's scales of one group: S = d·sc and −O = −dmin·m of each sub-block and row as FP16
// pairs, and the unpack c·S − O as one fma.rn.f16x2 of the exact code: two roundings (S, O) and
// the fma's, where gemm_fmt_wgmma.cu rounds the FP32 weight once (docs/numerics.md: within the
// GEMMs' tolerance). Computed by every lane of a quad for its two rows (the quad shares them).
// The decode stays in FP16 pairs: the four sub-blocks' sc (and m) of a group gathered into the
// four bytes of one word, each 6-bit value turned into an exact FP16 by the magic
// number (0x64 above the byte: 1024 + v, then − 1024), and one mul.rn.f16x2 by (d, d) or
// (−dmin, −dmin) gives two sub-blocks' S or −O, each the exact product rounded once: the values
// wf_scales<WF_Q4_K> computes in FP32 and rounds to FP16, in a quarter of the instructions (the
// per-value FP32 route, with its conversions, was half of this kernel's mainloop over the INT4
// one's, by cuobjdump's instruction count).
// Four bytes b of v4 as the values b − (MAGIC − 1024), each times the FP16 f (both halves of f2):
// (x·f, x·f) in o0 … o3. The byte under 0x64 is the FP16 1024 + b; one sub.f16x2 of MAGIC makes
// x exact, one mul.rn.f16x2 rounds x·f once — two values per instruction, then each broadcast
// to both halves (the A fragments' pairs share a row). MAGIC 1024 reads unsigned bytes; 1152
// reads int8 biased by 128 (x ^ 0x80).
template <u32 MAGIC>
__device__ __forceinline__ void gemm_scale_pairs(u32 v4, u32 f2, u32& o0, u32& o1, u32& o2, u32& o3) {
    u32 lo = __byte_perm(v4, 0x64646464u, 0x4140);  // (1024 + b0, 1024 + b1): 0x64 above each byte
    u32 hi = __byte_perm(v4, 0x64646464u, 0x4342);  // (1024 + b2, 1024 + b3)
    asm("sub.f16x2 %0, %0, %1;" : "+r"(lo) : "r"(MAGIC));
    asm("sub.f16x2 %0, %0, %1;" : "+r"(hi) : "r"(MAGIC));
    asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(lo) : "r"(f2));
    asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(hi) : "r"(f2));
    o0 = __byte_perm(lo, 0, 0x1010);
    o1 = __byte_perm(lo, 0, 0x3232);
    o2 = __byte_perm(hi, 0, 0x1010);
    o3 = __byte_perm(hi, 0, 0x3232);
}

struct GemmQ4kScales {
    static constexpr int CODE_STRIDE = INT4_ITEM_WORDS;  // tile-major codes (gemm_code_row)
    static constexpr int HIGH_ROW_BYTES = 0;
    static constexpr int HIGH_STRIDE = 0;
    static constexpr bool ROWS_EACH_GROUP = GEMM_BM == 256;  // the producer's 72 registers
    struct Group {
        u32 s[2][4], o[2][4];  // [row g, g+8][sub-block] half2 (S, S), (−O, −O)
    };
    __device__ static __forceinline__ Group load(const GemmLaneRowsQ4k& r, int grp) {
        Group G;
        const int sb = grp >> 1;  // the super-block; grp & 1: its sub-blocks 0-3 or 4-7
#pragma unroll
        for (int row = 0; row < 2; ++row) {
#if GEMM_PROBE_SCALES_NO_LOAD  // timing only: words made from the group number, no load
            const u32 w0 = 0x3C3C0000u ^ (u32)grp, w1 = w0 + 1u, w2 = w0 + 2u, w3 = w0 ^ (u32)row;
#else
            const uint4 lw = (row ? r.scb : r.sca)[sb];  // the super-block's lane words: one 16-byte load
            const u32 w0 = lw.x, w1 = lw.y, w2 = lw.z, w3 = lw.w;
#endif
            // The super-block's lane words (weight_formats.cuh): sub-block 4h + i's (sc | m << 6)
            // is bits 12h … 12h + 11 of word i, h = grp & 1, and (d, dmin) the words' top bytes.
            // One prmt puts words i, i + 1's bits 8h … 8h + 15 in the two 16-bit halves and a
            // shift by 4h brings the fields to bit 0 of each half; one more prmt gathers the four
            // fields' low bytes (sc, and after a shift by 6 m) into byte i, and a mask keeps 6 bits.
            const u32 sel = (grp & 1) ? 0x6521u : 0x5410u, sh = (grp & 1) ? 4u : 0u;
            const u32 f01 = __byte_perm(w0, w1, sel) >> sh, f23 = __byte_perm(w2, w3, sel) >> sh;
            const u32 sc = __byte_perm(f01, f23, 0x6420u) & 0x3F3F3F3Fu;
            const u32 m = __byte_perm(f01 >> 6, f23 >> 6, 0x6420u) & 0x3F3F3F3Fu;
            const u32 d2 = __byte_perm(w0, w1, 0x7373u);                 // (d, d): bytes D_0, D_1 twice
            const u32 nm2 = __byte_perm(w2, w3, 0x7373u) ^ 0x80008000u;  // (−dmin, −dmin)
            gemm_scale_pairs<FP16X2_1024>(sc, d2, G.s[row][0], G.s[row][1], G.s[row][2], G.s[row][3]);
            gemm_scale_pairs<FP16X2_1024>(m, nm2, G.o[row][0], G.o[row][1], G.o[row][2], G.o[row][3]);
        }
        return G;
    }
    // Nibble pair t of word w as the exact codes (1024 + c − 1024), then c·S − O.
    __device__ static __forceinline__ u32 pair(u32 w, int shift, u32 s2, u32 o2) {
        const u32 biased = lop3_and_or(w >> shift, INT4_MASK_LO, FP16X2_1024);
        u32 c, out;
        asm("sub.f16x2 %0, %1, %2;" : "=r"(c) : "r"(biased), "r"(FP16X2_1024));
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(c), "r"(s2), "r"(o2));
        return out;
    }
    __device__ static __forceinline__ void fragments(const uint4 (&ra)[4], const uint4 (&rb)[4], const uint4 (&)[GEMM_HIGH_MAX],
                                                     const uint4 (&)[GEMM_HIGH_MAX], int shift, const Group& G,
                                                     u32 (&frag)[GEMM_K_STEPS][4]) {
#pragma unroll
        for (int s = 0; s < GEMM_K_STEPS; ++s) {
            const int j = s / 2;  // the sub-block of k step s
            frag[s][0] = pair(gemm_word(ra, 2 * s), shift, G.s[0][j], G.o[0][j]);
            frag[s][1] = pair(gemm_word(rb, 2 * s), shift, G.s[1][j], G.o[1][j]);
            frag[s][2] = pair(gemm_word(ra, 2 * s + 1), shift, G.s[0][j], G.o[0][j]);
            frag[s][3] = pair(gemm_word(rb, 2 * s + 1), shift, G.s[1][j], G.o[1][j]);
        }
    }
};

// Row `row` (clamped into the matrix) of a Q4_K weight [n, K]: its code words and lane words.
__device__ __forceinline__ void gemm_q4k_lane_row(const u32* qweight, const uint4* scales, int row, int n, int K,
                                                  const u32*& w, const uint4*& sc) {
    const int r = min(row, n - 1);
    w = gemm_code_row(qweight, r, K);
    sc = scales + (u64)r * (K / 256);
}

// Q6_K (weight_formats.cuh, id 12): the codes c = v + 16h, v the low nibble in layout id 1 (the
// INT4 words: the same lop3 picks a lane's pair) and h two high bits in the qhigh plane — for
// nibble p of code word j, bits 4p + 2(j % 2) of high word j/2, at the nibble's own position —
// one int8 sc per 16-input sub-block (one k step) and the FP16 d per 256-input super-block:
// w = (d·sc)(c − 32). The high words travel with the codes through the stage (the producer copies
// 32 B a row and group); the scales are read from global memory one group ahead, as Q4_K's.
#define FP16X2_1152 0x64806480u  // (1024 + 128, 1024 + 128): the magic number and the int8 bias

// The 5- and 6-bit unpack (Q6_K here, Q5_K, Q5_0 and Q5_1 below). Code word i of a chunk (of a k
// step for Q6_K, i = 0 or 2) has the high bits of the lane's nibbles at bit i (and 16 + i) of the
// high word shifted right by the lane's shift. Rather than move each word's high bits down to its
// nibble pair (a shift a pair), the pair moves up to them: the code word is rotated right by
// shift − i (shf.r.wrap, the amount taken mod 32), so the pair sits at bits i … i + 3 and
// 16 + i … 19 + i, and the high word is rotated once a chunk and row, right by shift − 4
// (gemm_high_word), which puts every word's high bits right above its pair, at 4 + i and 20 + i.
// The magic number moves with the position: the FP16 2^(10−i) is 2^(10−i)·(1 + m/1024), so its
// mantissa bit i weighs 1 and (hpos & high mask << i) | (the rotated word & 0x000F000F << i) under
// it is 2^(10−i) + c, exact (c < 64: the code stays in the mantissa's bits i … i + 5 ≤ 8).
// One sub.f16x2 of 2^(10−i) + z then gives the exact c − z, the same FP16 value as shifting the
// pair to bit 0 under 1024, bit for bit. A pair costs a rotate, two lop3, the sub and the
// scaling's mul or fma: 5 instructions, and the high word's rotate is shared by its 4 words
// (Q6_K: 2). Measured against the form with a shift a pair (6 instructions), in turns on the
// H200: the 7B in Q5_K_M 15.35 / 15.35 ms against 15.55 / 15.35, the 0.5B in it (Q5_1 ×133)
// 2.98 / 2.90 against 2.89 / 2.87 (docs/bench/2026-12-04_{72f378b,d21f986}_h200_syn*_q5_k_m_unpack*.json):
// TTFT within the spread, so the Q5 prefill's limit is not the consumers' instruction count alone.
// Nsight Compute on the 7B's gate_up at 512 tokens (…_d85c648_h200_gate_up_q5k_int4_ncu.json):
// Q5_K 257.0 µs against INT4's 210.3, the tensor pipe busy 59 % of the elapsed cycles against 72 %,
// yet issue slots only 31 % busy (INT4: 27 %) and an eligible warp in 32 % of the cycles: the
// consumers wait rather than issue — on their stage, or on the scales they read from global memory
// a group ahead, which the Q5_K (and Q4_K) stage does not carry. The warp samples per instruction
// say which (the same GEMM on an H100, 257.6 µs against INT4's 209.5;
// docs/bench/2026-12-06_e467d60_h100_gate_up_q5k_int4_stalls.json): long-scoreboard stalls are
// 16.6 % of Q5_K's samples against 7.0 % of INT4's, and after the turn barrier and the wgmma wait
// the most-sampled instructions are GemmQ4kScales::load's shifts and masks of the odd groups'
// scale words — the decode of the next group's scales waits on the loads issued just before it
// in the same iteration, so "a group ahead" holds for the loads but not for their use. Decoding
// them a group later (the words fetched a group ahead, decoded at the group's start), and once a
// quad instead of once a lane (lane t decodes sub-block t of both rows, the fragments gather them
// by shfl.idx; Q6_K's int8 scales the same way), cut the Q5_K gate_up loop to 385 instructions
// and gave no time: the 7B in Q5_K_M, TTFT(512) 16.25 / 16.50 ms (Q6_K too: 16.15 / 16.17)
// against 16.25 / 15.79 in turns, gate_up 6947–6985 µs a prefill against 6912–6934
// (H100; docs/bench/2026-12-06_{e467d60,618ceda,982705b}_h100_syn7b_q5_k_m_scales_*.json).
// (2^(10−i) + z, 2^(10−i) + z): exponent 25 − i (bias 15), z in units of the ulp 2^−i.
__host__ __device__ constexpr u32 gemm_fp16x2_at(int i, int z) { return (((25u - i) << 10) | ((u32)z << i)) * 0x10001u; }
static_assert(gemm_fp16x2_at(0, 0) == FP16X2_1024 && gemm_fp16x2_at(0, 32) == 0x64206420u &&
              gemm_fp16x2_at(1, 16) == 0x60206020u && gemm_fp16x2_at(2, 32) == 0x5C805C80u &&
              gemm_fp16x2_at(3, 16) == 0x58805880u, "1024 + 32, 512 + 16, 256 + 32, 128 + 16");
// The high word of a chunk (Q6_K: of a k step) rotated so that word i's high bits sit at 4 + i.
__device__ __forceinline__ u32 gemm_high_word(u32 h, int shift) { return __funnelshift_r(h, h, shift - 4); }
// The lane's codes of code word w, word i of its chunk, as (2^(10−i) + c0, 2^(10−i) + c1),
// exact: its nibble pair rotated to bit i, OR-ed with the high bits of hpos (gemm_high_word)
// under high_mask << i (the mask at i = 0: one bit, or Q6_K's two) and the magic number 2^(10−i).
__device__ __forceinline__ u32 gemm_high_biased(u32 w, u32 hpos, int shift, int i, u32 high_mask) {
    const u32 m = lop3_and_or(hpos, high_mask << i, gemm_fp16x2_at(i, 0));  // (2^(10−i) + 16h0, …)
    return lop3_and_or(__funnelshift_r(w, w, shift - i), INT4_MASK_LO << i, m);
}
struct GemmLaneRowsQ6k {
    const u32* wa;  const u32* wb;    // the rows' code words
    const u32* ha;  const u32* hb;    // the rows' high-bit words
    const u32* sca; const u32* scb;   // the rows' int8 sc, four a word: two words a group
    const unsigned short* da; const unsigned short* db;  // the rows' FP16 d, one per super-block
};

// The lane's scales of one group: S = d·sc of each k step and row as FP16 pairs (the exact
// product rounded once, gemm_scale_pairs on the int8 biased by 128), and the unpack
// (c − 32)·S: the codes at their rotated position under the magic number 2^(10−i)
// (gemm_high_biased: word 2s of k step s at i = 0, word 2s + 1 at i = 2, the k step's high word
// rotated once), the exact c − 32 by one sub.f16x2 of 2^(10−i) + 32, one mul.rn.f16x2 — two
// roundings (S, the product), as Q4_K's (docs/numerics.md).
struct GemmQ6kScales {
    static constexpr int CODE_STRIDE = INT4_ITEM_WORDS;  // tile-major codes (gemm_code_row)
    static constexpr int HIGH_ROW_BYTES = GEMM_HIGH_ROW_BYTES;
    static constexpr int HIGH_STRIDE = INT4_TILE_ROWS * GEMM_HIGH_ROW_BYTES / 4;  // tile-major: one item
    static constexpr bool ROWS_EACH_GROUP = true;
    struct Group {
        u32 s[2][GEMM_K_STEPS];  // [row g, g+8][k step] half2 (S, S)
    };
    __device__ static __forceinline__ Group load(const GemmLaneRowsQ6k& r, int grp) {
        Group G;
#pragma unroll
        for (int row = 0; row < 2; ++row) {
            const uint2 sc = *reinterpret_cast<const uint2*>((row ? r.scb : r.sca) + 2 * grp);  // 8-byte aligned
            const u32 d = (row ? r.db : r.da)[grp >> 1];
            const u32 d2 = d | (d << 16);  // (d, d)
            u32* o = G.s[row];
            gemm_scale_pairs<FP16X2_1152>(sc.x ^ 0x80808080u, d2, o[0], o[1], o[2], o[3]);
            gemm_scale_pairs<FP16X2_1152>(sc.y ^ 0x80808080u, d2, o[4], o[5], o[6], o[7]);
        }
        return G;
    }
    // Nibble pair t of code word w, at i = 0 or 2 in its k step, with its high bits (hpos: the k
    // step's high word, gemm_high_word) as (c − 32, c − 32) exact, then times S.
    __device__ static __forceinline__ u32 pair(u32 w, u32 hpos, int shift, int i, u32 s2) {
        const u32 biased = gemm_high_biased(w, hpos, shift, i, 0x00300030u);  // 2^(10−i) + c, c ≤ 63
        u32 q, out;
        asm("sub.f16x2 %0, %1, %2;" : "=r"(q) : "r"(biased), "r"(gemm_fp16x2_at(i, 32)));
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(q), "r"(s2));
        return out;
    }
    __device__ static __forceinline__ void fragments(const uint4 (&ra)[4], const uint4 (&rb)[4], const uint4 (&ha)[GEMM_HIGH_MAX],
                                                     const uint4 (&hb)[GEMM_HIGH_MAX], int shift, const Group& G,
                                                     u32 (&frag)[GEMM_K_STEPS][4]) {
#pragma unroll
        for (int s = 0; s < GEMM_K_STEPS; ++s) {
            // k step s: code words 2s, 2s+1 and high word s; pair t's high bits at 4t + {0, 2}, so
            // i = 0 and 2 (after the rotate at 4–5 and 6–7, above the pairs at 0–3 and 2–5)
            const u32 hA = gemm_high_word(wf_word(ha[s / 4], s % 4), shift);
            const u32 hB = gemm_high_word(wf_word(hb[s / 4], s % 4), shift);
            frag[s][0] = pair(gemm_word(ra, 2 * s), hA, shift, 0, G.s[0][s]);
            frag[s][1] = pair(gemm_word(rb, 2 * s), hB, shift, 0, G.s[1][s]);
            frag[s][2] = pair(gemm_word(ra, 2 * s + 1), hA, shift, 2, G.s[0][s]);
            frag[s][3] = pair(gemm_word(rb, 2 * s + 1), hB, shift, 2, G.s[1][s]);
        }
    }
};

// Row `row` (clamped into the matrix) of a Q6_K weight [n, K] into the lane-rows slot `which`
// (0: row g, 1: row g+8).
__device__ __forceinline__ void gemm_q6k_lane_row(const u32* qweight, const u32* qhigh, const u32* scales,
                                                  const unsigned short* aux, int row, int n, int K, int which,
                                                  GemmLaneRowsQ6k& out) {
    const u64 r = (u64)min(row, n - 1);
    (which ? out.wb : out.wa) = gemm_code_row(qweight, r, K);
    (which ? out.hb : out.ha) = gemm_tiled_row<GEMM_HIGH_ROW_BYTES / 4>(qhigh, r, K);
    (which ? out.scb : out.sca) = scales + r * (K / 64);
    (which ? out.db : out.da) = aux + r * (K / 256);
}

// Row `row` of a plain-order INT4 matrix of n rows (clamped to the last) in the device layout
// (int4_matmul.cuh): w its words of group 0 — group grp's are CODE_STRIDE words on, one item
// further —, s its scales.
__device__ __forceinline__ void gemm_lane_row(const u32* qweight, const __half* scales, int row, int n, int K,
                                              const u32*& w, const __half*& s) {
    const int r = min(row, n - 1);
    w = int4_tile_item(qweight, r / INT4_TILE_ROWS, 0, K) + (r % INT4_TILE_ROWS) * (INT4_GROUP / 8);
    s = scales + (u64)r * (K / INT4_GROUP);
}

// The same for a RoPE-paired matrix (q, k, v) of head dim Dh: row = head·Dh + dim, the head by
// one multiply-high (div_by, Dh_rcp = div_reciprocal(Dh)), not a division, since the producer
// takes its rows again every group.
__device__ __forceinline__ void gemm_paired_lane_row(const u32* qweight, const __half* scales, int row, int n, int K,
                                                     int Dh, u32 Dh_rcp, const u32*& w, const __half*& s) {
    const int r = min(row, n - 1), head = div_by(r, Dh_rcp);
    int tile, slot;
    int4_head_dim_slot(head, r - head * Dh, Dh, tile, slot);
    w = int4_tile_item(qweight, tile, 0, K) + slot * (INT4_GROUP / 8);
    s = scales + (u64)r * (K / INT4_GROUP);
}

// The tile's MMA, wgmma m64nNk16 with N = GEMM_BM, chosen by the accumulator count (A: the
// unpacked weights from registers, B: the stage's X through a descriptor of GEMM_BM K-major rows).
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const u32 (&a)[4], u64 b) { wgmma_m64n64k16_rs(d, a, b, 1); }
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const u32 (&a)[4], u64 b) { wgmma_m64n128k16_rs(d, a, b, 1); }
__device__ __forceinline__ void wgmma_rs(float (&d)[128], const u32 (&a)[4], u64 b) { wgmma_m64n256k16_rs(d, a, b, 1); }

// One 128-input group of a consumer warp: wait for the stage, read the group's words of the
// lane's rows from it and unpack them into the A fragments (the scales come from registers,
// loaded one group ahead), issue the 8 MMAs and wait for them, then release the stage. The wait
// is for all of them (wait_group 0): rewriting A registers while an MMA that reads any A
// register is in flight makes ptxas serialise every wgmma of the kernel (its C7513 "Potential
// Performance Loss"), and waiting for fewer lets ptxas unpack the next group into registers the
// MMAs still read (the header: tried and lost), so the unpack of the next group overlaps the
// other warpgroup's MMAs.
// The bytes of one stage under policy Sc: X, the code words, and the high-bit plane if Sc has one
// (a multiple of 1024 either way: the swizzle atoms of the next stage's X).
template <typename Sc>
__host__ __device__ constexpr int gemm_stage_bytes() { return GEMM_STAGE_BYTES + GEMM_BLOCK_ROWS * Sc::HIGH_ROW_BYTES; }
// The ring's stages under policy Sc: GEMM_STAGES where they fit in shared memory, else 2 — the
// 256-token build of the formats whose stage carries more than the codes (Q6_K: 3 × 76 KB, Q8_0:
// 3 × 80 KB do not fit the 227 KB). Two stages still let the producer fill one group while the
// consumers multiply the other; the barrier protocol (the header) holds for any count ≥ 2.
template <typename Sc>
__host__ __device__ constexpr int gemm_stages() {
    return GEMM_STAGES * gemm_stage_bytes<Sc>() + 1024 + 3 * GEMM_STAGES * 8 <= 227 * 1024 ? GEMM_STAGES : 2;
}
// The dynamic shared memory of a launch under policy Sc (launchers mirror it): the ring, 1 KB to
// align it to the swizzle atom, 3 mbarriers a stage.
template <typename Sc>
__host__ __device__ constexpr int gemm_smem_bytes() { return gemm_stages<Sc>() * (gemm_stage_bytes<Sc>() + 3 * 8) + 1024; }

template <typename Sc>
__device__ __forceinline__ void gemm_group(int it, int local, int lane, int shift, const typename Sc::Group& sc,
                                           const unsigned char* smem, u64* full, u64* x_empty, u64* w_empty,
                                           u32 (&frag)[GEMM_K_STEPS][4], float (&acc)[GEMM_ACC]) {
    constexpr int STAGES = gemm_stages<Sc>();
    const int s = it % STAGES;  // it: the block's running group count over all its tiles
    mbarrier_wait_parity(&full[s], (it / STAGES) & 1);
    const unsigned char* st = smem + s * gemm_stage_bytes<Sc>();
    // Rows local and local+8 of the stage's weights, 64 B each. The 8 rows g of one instruction
    // are 64 B apart: each 8-lane phase of a 16-byte load reads 2 addresses, conflict-free.
    const uint4* w = reinterpret_cast<const uint4*>(st + GEMM_X_STAGE_BYTES + local * GEMM_W_ROW_BYTES);
    uint4 ra[4], rb[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        ra[i] = w[i];
        rb[i] = w[8 * GEMM_W_ROW_BYTES / 16 + i];
    }
    // Rows local and local+8 of the high part behind the code words (Q6_K's 32 B and Q5_0's 16 B
    // of high bits, Q8_0's second 64 B of codes), for the formats that have one: the same
    // 2-addresses-a-phase pattern as the codes.
    uint4 ha[GEMM_HIGH_MAX] = {}, hb[GEMM_HIGH_MAX] = {};
    if constexpr (Sc::HIGH_ROW_BYTES > 0) {
        const uint4* h = reinterpret_cast<const uint4*>(st + GEMM_STAGE_BYTES + local * Sc::HIGH_ROW_BYTES);
#pragma unroll
        for (int i = 0; i < Sc::HIGH_ROW_BYTES / 16; ++i) {
            ha[i] = h[i];
            hb[i] = h[8 * Sc::HIGH_ROW_BYTES / 16 + i];
        }
    }
    Sc::fragments(ra, rb, ha, hb, shift, sc, frag);
#pragma unroll
    for (int i = 0; i < GEMM_ACC; ++i) wgmma_fence_operand(acc[i]);
#if GEMM_MMA_TURNS
    const int wg = local / GEMM_WG_ROWS;
    named_barrier_sync<GEMM_TURN_THREADS>(GEMM_TURN_BARRIER + wg);  // this warpgroup's turn
#endif
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < GEMM_K_STEPS; ++k) {
        const u64 desc = wgmma_desc_sw128(st + (k / 4) * GEMM_BOX_BYTES + (k % 4) * 32);
        wgmma_rs(acc, frag[k], desc);
    }
    wgmma_commit_group();
#if GEMM_MMA_TURNS
    named_barrier_arrive<GEMM_TURN_THREADS>(GEMM_TURN_BARRIER + (wg ^ 1));  // the other's turn next
#endif
    mbarrier_arrive(&w_empty[s]);  // every lane: its reads of this stage's weights are done
    wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < GEMM_ACC; ++i) wgmma_fence_operand(acc[i]);
    if (lane == 0) mbarrier_arrive(&x_empty[s]);  // the warp's MMAs are done reading X
}

// K / 128, computed again after the role split (the asm hides that it is the value before):
// held across setmaxnreg it had to sit where both roles' register budgets reach it, and the
// GEMM_BM 256 build of gemm_int4_gate_up_swiglu spilled it (4 B, ptxas), as block_index and
// live_rows (ptx/setmaxnreg.cuh) would be.
__device__ __forceinline__ int groups_of(int K) {
    asm volatile("" : "+r"(K));
    return K / INT4_GROUP;
}

// The GEMM's tiles — GEMM_BM tokens × one block of weight rows, `row_blocks` of them per GEMM_BM
// tokens — shared out persistently: block b runs the units of its stream-K range (gemm_split_k.cuh:
// whole tiles, or a tile's groups [g0, g1) where the range cuts it). Persistence lets the
// producer fetch the next unit's first stages while the consumers run the current one's epilogue.
// rows_of(row_block, local) → the two rows (local, local + 8) of the warp tile holding `local`
// (called by the producer, which copies them, and by the consumers, which read their scales);
// then epilogue(acc, m0, M, t) with the lane's GEMM_ACC accumulators (gemm_each_token walks them).
// Sc: the weights' scale policy (GemmInt4Scales; GemmQ4kScales for Q4_K), rows_of returning its
// lane-rows type. Contains the block's only __syncthreads(): call from every thread.
// part: the blocks that run this GEMM (gemm_split_k.cuh: GemmWholeGrid, or a GemmGridPart in a
// launch of two GEMMs), sk its part of the scratch.
template <typename RowsOf, typename Epilogue, typename Sc = GemmInt4Scales, typename Part = GemmWholeGrid>
__device__ __forceinline__ void gemm_int4_block(const CUtensorMap& x_map, const int* __restrict__ prefill_state,
                                                int K, int row_blocks, const GemmSplitK& sk, RowsOf rows_of,
                                                Epilogue epilogue, Sc = Sc(), Part part = Part()) {
    extern __shared__ unsigned char gemm_smem_raw[];
    // The ring starts at the first 1024-byte boundary (swizzle atoms). An offset added to the
    // shared array itself, not a pointer rebuilt from an integer, keeps it a shared-memory
    // pointer as far as the compiler sees: the consumers' weight reads are ld.shared (LDS.128),
    // where a rebuilt pointer gave generic loads (LD.E.128, a 64-bit address each) on the
    // mainloop's critical path.
    const u32 raw = static_cast<u32>(__cvta_generic_to_shared(gemm_smem_raw));
    unsigned char* smem = gemm_smem_raw + ((1024u - (raw & 1023u)) & 1023u);
    constexpr int STAGES = gemm_stages<Sc>();
    u64* full = reinterpret_cast<u64*>(smem + STAGES * gemm_stage_bytes<Sc>());
    u64* x_empty = full + STAGES;
    u64* w_empty = x_empty + STAGES;

    // Launched as a programmatic dependent: X, the residual, prefill_state and the split-K
    // scratch are earlier kernels' (nothing is read or written before the wait).
    grid_launch_dependents();
    grid_dependency_wait();
    // ld.global.cg, not __ldg: ptxas may issue a non-coherent load before griddepcontrol.wait.
    // Blocks past the ranges the live M gives (gemm_split_k.cuh: P) leave, the whole block,
    // before any barrier.
    if ((int)blockIdx.x - part.first() >= gemm_work(__ldcg(prefill_state + 1), GEMM_BM, row_blocks, K / INT4_GROUP,
                                                    sk, part.count()).ranges) return;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&full[s], GEMM_FULL_ARRIVALS);    // the protocol in the header
            mbarrier_init(&x_empty[s], GEMM_CONSUMER_WARPS);  // lane 0 of every consumer warp
            mbarrier_init(&w_empty[s], GEMM_CONSUMER_WARPS * WARP_SIZE);  // every consumer lane
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the last block-wide barrier: the roles part here

    if (warp >= GEMM_CONSUMER_WARPS) {  // ---- producer warpgroup --------------------------------
        // The whole warpgroup gives its registers back (setmaxnreg is per warpgroup); its first
        // warp works, the other three leave. Every lane copies 16 B (quad t) of rows g and g+8 of
        // each warp tile per group with cp.async; lane 0 also issues the TMA copies of X. One full
        // barrier per stage covers both.
        setmaxnreg_dec<GEMM_PRODUCER_REGS>();
        if (warp != GEMM_CONSUMER_WARPS) return;
        if (lane == 0) tma_prefetch_map(&x_map);
        const GemmWork work = gemm_work(live_rows(prefill_state), GEMM_BM, row_blocks, groups_of(K), sk, part.count());
        const int b = block_index() - part.first(), end = gemm_range_start(work, b + 1);
        int it = 0;
        for (int x = gemm_range_start(work, b); x < end;) {
            const GemmUnit un = gemm_unit_at(work, x, end);
            x += un.g1 - un.g0;
            const int m0 = un.tb * GEMM_BM;
            for (int grp = un.g0; grp < un.g1; ++grp, ++it) {
                const int s = it % STAGES;
                if (it >= STAGES) mbarrier_wait_parity(&w_empty[s], ((it / STAGES) - 1) & 1);
                unsigned char* st = smem + s * gemm_stage_bytes<Sc>();
                unsigned char* w_st = st + GEMM_X_STAGE_BYTES + g * GEMM_W_ROW_BYTES + 16 * t;
                int rb = un.rb;
                // Where Sc says so, the 8 warp tiles' row pointers would be hoisted out of the
                // group loop past the producer's registers (Q6_K's four a tile: 88 B spilled in
                // 104; two matrices' at GEMM_BM 256 in 72: 136 B, ptxas); hiding rb's value each
                // group keeps them computed where they are used.
                if constexpr (Sc::ROWS_EACH_GROUP) asm volatile("" : "+r"(rb));
#pragma unroll
                for (int w = 0; w < GEMM_CONSUMER_WARPS; ++w) {
                    // The rows again each group, not held across the loop: held, the 8 warp
                    // tiles' pointers spill in the 72 registers of the GEMM_BM 256 build (48–56 B
                    // in two kernels, ptxas); the producer has time to spare for the arithmetic
                    // as long as rows_of stays a few instructions a warp tile: one item address
                    // (int4_plain_row, int4_pair_row). Through four divisions by the head dim a
                    // row, qkv_rope's group loop was 1292 instructions (172 now;
                    // `tools/sass_loops.py gemm_int4 --copies`: the loop with 18 copies;
                    // docs/bench/2026-12-06_{dbffe69,d82f791}_cpu_sass_gemm_int4_bm128.json)
                    // and the synthetic 7B's TTFT(512) 13.84 ms against 11.99 (H100, in turns,
                    // docs/bench/2026-12-05_{dbffe69,033f04b}_h100_syn7b_*item_rows_*.json).
                    const auto r = rows_of(rb, w * INT4_TILE_ROWS + g);
                    cp_async_16(w_st + (w * INT4_TILE_ROWS) * GEMM_W_ROW_BYTES, r.wa + grp * Sc::CODE_STRIDE + 4 * t, true);
                    cp_async_16(w_st + (w * INT4_TILE_ROWS + 8) * GEMM_W_ROW_BYTES, r.wb + grp * Sc::CODE_STRIDE + 4 * t, true);
                    if constexpr (Sc::HIGH_ROW_BYTES > 0 && !GEMM_PROBE_NO_HIGH_COPY) {
                        // The rows' high part of the group (Q6_K's 32 B and Q5_0's 16 B of high
                        // bits, Q8_0's second 64 B of codes): lanes t < HIGH_ROW_BYTES / 16 of the
                        // quad, 16 B each.
                        unsigned char* h_st = st + GEMM_STAGE_BYTES + g * Sc::HIGH_ROW_BYTES + 16 * t;
                        if (t < Sc::HIGH_ROW_BYTES / 16) {
                            cp_async_16(h_st + (w * INT4_TILE_ROWS) * Sc::HIGH_ROW_BYTES, r.ha + grp * Sc::HIGH_STRIDE + 4 * t, true);
                            cp_async_16(h_st + (w * INT4_TILE_ROWS + 8) * Sc::HIGH_ROW_BYTES, r.hb + grp * Sc::HIGH_STRIDE + 4 * t, true);
                        }
                    }
                }
                cp_async_mbarrier_arrive_noinc(&full[s]);  // arrives when this lane's copies land
                if (lane == 0) {
                    if (it >= STAGES) mbarrier_wait_parity(&x_empty[s], ((it / STAGES) - 1) & 1);
                    mbarrier_arrive_expect_tx(&full[s], GEMM_X_STAGE_BYTES);
                    tma_load_2d(st, &x_map, grp * INT4_GROUP, m0, &full[s]);
                    tma_load_2d(st + GEMM_BOX_BYTES, &x_map, grp * INT4_GROUP + GEMM_BOX_INPUTS, m0, &full[s]);
                }
            }
        }
        // Leave only when this lane's last copies have landed: no asynchronous write into the
        // block's shared memory outlives the thread that issued it. wait_group counts committed
        // groups only, so the copies (tracked by the full barriers, never committed) are closed
        // into one group first.
        cp_async_commit();
        cp_async_wait<0>();
        return;
    }

    // ---- consumers --------------------------------------------------------------------------
    setmaxnreg_inc<GEMM_CONSUMER_REGS>();
    const int M = live_rows(prefill_state);
    const GemmWork work = gemm_work(M, GEMM_BM, row_blocks, groups_of(K), sk, part.count());
    const int b = block_index() - part.first(), end = gemm_range_start(work, b + 1);
    const int local = (warp / 4) * GEMM_WG_ROWS + (warp % 4) * INT4_TILE_ROWS + g;
    const int shift = 4 * t;  // nibble pair t: bits 4t … 4t+3 of each 16-bit half
#if GEMM_MMA_TURNS
    // The first turn is warpgroup 0's: warpgroup 1 hands it over before any group (the header).
    if (warp / 4 == 1) named_barrier_arrive<GEMM_TURN_THREADS>(GEMM_TURN_BARRIER);
#endif
    int it = 0;
#pragma unroll 1
    for (int x = gemm_range_start(work, b); x < end;) {
        const GemmUnit un = gemm_unit_at(work, x, end);
        x += un.g1 - un.g0;
        const int m0 = un.tb * GEMM_BM;
        const auto r = rows_of(un.rb, local);
        float acc[GEMM_ACC];
#pragma unroll
        for (int i = 0; i < GEMM_ACC; ++i) acc[i] = 0.f;
        u32 frag[GEMM_K_STEPS][4];
        typename Sc::Group sc = Sc::load(r, un.g0);
#pragma unroll 1
        for (int grp = un.g0; grp < un.g1; ++grp, ++it) {
            // next group's scales now: their latency passes during this group's MMAs
            const typename Sc::Group nx = Sc::load(r, min(grp + 1, un.g1 - 1));
            gemm_group<Sc>(it, local, lane, shift, sc, smem, full, x_empty, w_empty, frag, acc);
            sc = nx;
        }
        // A tile cut by a range: its owner adds the other parts and runs the epilogue.
        if (!gemm_split_k_finish(sk, work, un, b, acc)) continue;
        epilogue(acc, m0, M, t);
    }
#if GEMM_MMA_TURNS
    // Warpgroup 1's last hand-over is still pending on barrier 0's turn: take it, so that every
    // arrival on the turn barriers is matched before the block exits.
    if (warp / 4 == 0) named_barrier_sync<GEMM_TURN_THREADS>(GEMM_TURN_BARRIER);
#endif
}

// rows_of for a GEMM over one matrix (f32, residual): local row `local` of row block rb is row
// rb·128 + local of W; the lane's row g is also written to *ra, where the epilogue finds it.
struct GemmOneMatrixRows {
    const u32* qweight;
    const __half* scales;
    int N, K;
    int* ra;
    __device__ __forceinline__ GemmLaneRows operator()(int rb, int local) const {
        // Rows ra and ra + 8 are slots g and g + 8 of one item (int4_plain_row): one address.
        GemmLaneRows r;
        *ra = rb * GEMM_BLOCK_ROWS + local;
        r.wa = int4_plain_row(qweight, *ra, int4_tiles(N), K);
        r.wb = r.wa + 8 * (INT4_GROUP / 8);
        r.sa = scales + (u64)min(*ra, N - 1) * (K / INT4_GROUP);
        r.sb = scales + (u64)min(*ra + 8, N - 1) * (K / INT4_GROUP);
        return r;
    }
};

// out = X Wᵀ in FP32. Tiles: ceil(M/128) × ceil(N/128); grid ≤ the SM count (persistent),
// block 288, smem GEMM_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_int4_f32(float* __restrict__ out,                  // [M, N] fp32, out
              const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]: box 128 × 64, 128-B swizzle
              const u32* __restrict__ qweight,          // [N/16, K/128, 16, 16] uint32, the device layout
              const __half* __restrict__ scales,        // [N, K/128] fp16
              const int* __restrict__ prefill_state,    // [2] int32: start (unused here), M
              float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
              int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
              int N, int K) {
    int ra = 0;
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters}, GemmOneMatrixRows{qweight, scales, N, K, &ra}, gemm_each_token([&](int token, float va, float vb) {
        if (ra < N) out[(u64)token * N + ra] = va;
        if (ra + 8 < N) out[(u64)token * N + ra + 8] = vb;
    }));
}

// [q | k | v] = X [Wq; Wk; Wv]ᵀ in FP32, one launch for the three stacked along N (bias, RoPE
// and the FP16 rounding happen once, in rope_kv_rows). Tiles: ceil(M/128) × ceil((Nq+2·Nkv)/128).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_int4_qkv(float* __restrict__ qkv,                   // [M, Nq + 2·Nkv] fp32, out: q | k | v per row
              const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden states)
              const u32* __restrict__ q_qweight,          // [Nq/16, K/128, 16, 16] uint32, RoPE-paired (Dh)
              const __half* __restrict__ q_scales,        // [Nq, K/128] fp16
              const u32* __restrict__ k_qweight,          // [Nkv/16, K/128, 16, 16] uint32, RoPE-paired (Dh)
              const __half* __restrict__ k_scales,        // [Nkv, K/128] fp16
              const u32* __restrict__ v_qweight,          // [Nkv/16, K/128, 16, 16] uint32, RoPE-paired (Dh)
              const __half* __restrict__ v_scales,        // [Nkv, K/128] fp16
              const int* __restrict__ prefill_state,      // [2] int32: start (unused here), M
              float* __restrict__ split_partials,         // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
              int* __restrict__ split_counters,           // [grid] int32, zero between launches, or null
              int Nq, int Nkv, int K, int Dh) {  // Dh: the heads' dim, the q/k/v row order (gemm_paired_lane_row)
    const int ld = Nq + 2 * Nkv;
    const u32 Dh_rcp = div_reciprocal(Dh);
    int ra = 0;  // the stacked row (= output column) of the lane's row g; row g+8 is ra + 8
    gemm_int4_block(x_map, prefill_state, K, (ld + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters}, [&](int rb, int local) {
        GemmLaneRows r;
        ra = rb * GEMM_BLOCK_ROWS + local;
        // Nq and Nkv are multiples of 16: rows ra and ra+8 (one warp tile) lie in one matrix.
        // Their RoPE-paired slots: the head by one multiply-high (gemm_paired_lane_row).
        const int seg = ra < Nq ? 0 : ra < Nq + Nkv ? 1 : 2;
        const int first = seg == 0 ? 0 : seg == 1 ? Nq : Nq + Nkv;
        const u32* qw = seg == 0 ? q_qweight : seg == 1 ? k_qweight : v_qweight;
        const __half* sc = seg == 0 ? q_scales : seg == 1 ? k_scales : v_scales;
        const int n = seg == 0 ? Nq : Nkv;
        gemm_paired_lane_row(qw, sc, ra - first, n, K, Dh, Dh_rcp, r.wa, r.sa);
        gemm_paired_lane_row(qw, sc, ra + 8 - first, n, K, Dh, Dh_rcp, r.wb, r.sb);
        return r;
    }, gemm_each_token([&](int token, float va, float vb) {
        if (ra < ld) qkv[(u64)token * ld + ra] = va;
        if (ra + 8 < ld) qkv[(u64)token * ld + ra + 8] = vb;
    }));
}

// [q | k | v] = X [Wq; Wk; Wv]ᵀ with the bias, the RoPE and the FP16 writes in the epilogue:
// what gemm_int4_qkv and rope_kv_rows do in two launches and an FP32 round trip through qkv
// (7B at 512 tokens: 9.4 MB written and read back per layer, and ~12 µs of rope_kv_rows).
//
// Rows are taken in RoPE pairs. Pair p of the stacked heads (Hq query, Hkv key, Hkv value heads,
// Dh/2 pairs each) is (head p / (Dh/2), dim i = p % (Dh/2)) and covers stacked rows
// head·Dh + i and head·Dh + i + Dh/2; row block rb holds pairs 64·rb … 64·rb + 63, and warp tile
// w of it pairs 64·rb + 8·w + g (g < 8) with dim i in row g and dim i + Dh/2 in row g+8. So lane
// (g, t) ends the tile holding x1 and x2 of its pair for its 32 tokens — the rotation's two
// inputs — and rounds each output to FP16 once, after the FP32 bias add and rotation, exactly as
// rope_kv_rows does on gemm_int4_qkv's FP32 output: the same rotation (rope.cuh's rope_apply) by
// the same cos and sin, computed once per chunk by rope_table_rows (kernels/rope_kv.cu: why),
// the same order of operations — the two paths give the same bits, which
// tests/test_kernel_gemm_int4.py checks.
// Value heads take the bias only. Pairs past the last (p ≥ (Hq + 2·Hkv)·Dh/2) read the last
// pair's rows and are not written.
// Positions are start + token (prefill_state[0]); the block table must hold a page for each.
// Tiles: ceil(M/128) × ceil((Hq + 2·Hkv)·Dh / 128). Work split, ring and barriers: the file's
// (gemm_int4_block; the header argues why they cannot race) — only the rows a warp takes and the
// epilogue differ, and the epilogue touches no shared memory. Bytes per call beyond the GEMM's
// weights and X: the FP16 outputs, 2 B × (Hq + 2·Hkv)·Dh per token (9.4 MB → 2.4 MB at 7B and
// 512 tokens against gemm_int4_qkv's FP32 row), and 8 B of the table per pair and token (L2).
// The limit: as the file's, tensor-core math in the mainloop; the epilogue is issue-bound
// (~18 instructions a token and lane in a whole tile, ~20 in a chunk's last; ~25 before the
// whole-tile loop, the unsigned positions and the per-dim pointers) on the SMs that hold tiles.
// Those three measured against their parent (H100, in turns; docs/bench/2026-12-06_{48d7351,
// 2fdbc70}_h100_*epilogue*.json): this GEMM alone at the 7B's 512 tokens 41.0 / 40.6 / 40.8 µs
// against 41.0 / 41.2 / 41.1; TTFT(512) of the 0.5B, whose 36 tiles leave the epilogue on the
// critical path, 2.30 / 2.29 / 2.31 ms against 2.49 / 2.32 / 2.37; the 7B's within its spread (12.30
// against 12.29 ms, medians of five rounds).
// Measured (H100, `drvqwen bench --kernels --prefill-rope epilogue|apart`, 512 tokens, GPU µs
// summed over the layers, docs/bench/2026-12-02_81f037f_h100_syn{05b,7b}_rope_*.json):
//   | model | this kernel + rope_table_rows | gemm_int4_qkv + rope_kv_rows | TTFT, graph medians |
//   | 7B    | 1877 + 4                      | 1652 + 335                   | 15.90 against 16.10 ms |
//   | 0.5B  |  425 + 4                      |  339 + 163                   |  3.00 against 2.98 ms  |
// The epilogue costs ~3.5 µs a layer more than the FP32 one: on the 0.5B the QKV GEMM is 36
// tiles, one per SM on 36 SMs, so its epilogue (~25 instructions and two 2-byte stores per token
// and lane) runs on a quarter of the GPU where rope_kv_rows spreads over all of it. Lost before
// this form: sincosf per element in the epilogue (H200, 0.5B 621 µs, 7B 2204 µs: ~30 accurate
// sincosf per lane, each behind a branch; docs/bench/2026-12-02_b80f3a3_h200_syn{05b,7b}_rope_
// epilogue.json), and the table read one token at a time (H100, 0.5B 579 µs against 336 + 177,
// 7B 2130 against 1652 + 335; docs/bench/2026-12-02_bccea49_h100_syn{05b,7b}_rope_*.json).
// The RoPE pair a lane's rows hold (gemm_int4_qkv_rope, gemm_q4k_qkv_rope): pair p of the stacked
// heads is head p / (Dh/2), dim i = p % (Dh/2); seg 0, 1, 2 for q, k, v, h the head within its
// matrix — rows h·Dh + i and h·Dh + i + Dh/2 of that matrix.
struct GemmRopePair {
    int seg, h, i;
    // p / half_dim as one multiply-high (div_by: reciprocal = div_reciprocal(half_dim), exact for
    // p < 2³²/half_dim, far above any pair count): the GEMM's producer takes its 8 warp tiles'
    // pairs again every group, and a division by a runtime value is some 20 instructions.
    __device__ __forceinline__ GemmRopePair(int p, int half_dim, u32 reciprocal, int Hq, int Hkv) {
        const int head = div_by(p, reciprocal);
        i = p - head * half_dim;
        seg = head < Hq ? 0 : head < Hq + Hkv ? 1 : 2;
        h = seg == 0 ? head : seg == 1 ? head - Hq : head - Hq - Hkv;
    }
};

// The lane's pair from rows_of's (rb, local): local = 16·(warp tile) + g for g < 8 is pair
// 8·(warp tile) + g of row block rb (GEMM_BLOCK_ROWS / 2 pairs a block).
__device__ __forceinline__ int gemm_rope_pair_of(int rb, int local) {
    return rb * (GEMM_BLOCK_ROWS / 2) + (local / INT4_TILE_ROWS) * 8 + local % INT4_TILE_ROWS;
}

// The qkv_rope epilogue (header of gemm_int4_qkv_rope): bias, rotation and the FP16 writes of the
// lane's pair (*pair, set by rows_of) for its GEMM_BM/8 · 2 tokens.
struct GemmQkvRopeEpilogue {
    __half* q_out;
    __half* k_cache;
    __half* v_cache;
    const __half* q_bias;
    const __half* k_bias;
    const __half* v_bias;
    const float2* rope_cs;
    const int* prefill_state;
    const int* block_table;
    int Hq, Hkv, Dh;
    const int* pair;
    __device__ __forceinline__ void operator()(const float (&acc)[GEMM_ACC], int m0, int M, int t) const {
        const int half_dim = Dh / 2;
        if (*pair >= (Hq + 2 * Hkv) * half_dim) return;
        const int start = __ldcg(prefill_state);  // after the kernel's griddepcontrol.wait
        const GemmRopePair rp(*pair, half_dim, div_reciprocal(half_dim), Hq, Hkv);
        // A tile whose every token is < M (all but a chunk's last) takes the loop without the
        // per-token bound: one uniform branch here instead of a divergent one around each
        // token's stores (a BSSY/BRA/BSYNC and a compare each, 64 a lane at 256-token tiles).
        if (m0 + GEMM_BM <= M) tokens<true>(acc, m0, M, t, rp, start);
        else tokens<false>(acc, m0, M, t, rp, start);
    }

    // The lane's GEMM_BM/8 · 2 tokens of its pair; WHOLE: the tile has no token ≥ M.
    // Addresses are 32-bit element offsets from two per-lane pointers, one per dim of the pair
    // (dims i and i + Dh/2: one IMAD.WIDE a store), and positions are unsigned, so the page and
    // slot of start + token are a shift and a mask (a signed / and % by 16 take 2 and 4
    // instructions more for the sign). This epilogue runs once per tile on its owner, after the
    // mainloop, and is issue-bound (the header's ncu figures): the instructions a store are its time.
    template <bool WHOLE>
    __device__ __forceinline__ void tokens(const float (&acc)[GEMM_ACC], int m0, int M, int t,
                                           const GemmRopePair& rp, int start) const {
        const int half_dim = Dh / 2;
        const int seg = rp.seg, h = rp.h, i = rp.i;
        const __half* bias = (seg == 0 ? q_bias : seg == 1 ? k_bias : v_bias) + h * Dh;
        const float b1 = __half2float(bias[i]), b2 = __half2float(bias[i + half_dim]);
        // Where the lane's two dims go: q_out row `token`, or the cache slot of pos = start + token
        // (kv_cache.cuh: page · page_elems + (h·16 + slot)·Dh) — the per-token part in 32 bits
        // (< 2³¹ elements: the launcher bounds rows · Hq · Dh and a layer's cache).
        __half* const base1 = seg == 0 ? q_out + h * Dh + i
                                       : (seg == 1 ? k_cache : v_cache) + kv_offset(0, h, 0, Hkv, Dh) + i;
        __half* const base2 = base1 + half_dim;
        const int q_row = Hq * Dh, page_elems = kv_page_elems(Hkv, Dh);
        // 8 tokens at a time: their cos/sin (L2) and pages are loaded together, before any store,
        // then rotated and stored — 4 round trips per lane instead of one per token (a load inside
        // each token's branch waits out one L2 latency per token, ~32 a lane: slower than
        // gemm_int4_qkv + rope_kv_rows, the header's figures). Tokens ≥ M load row M−1's.
#pragma unroll
        for (int j0 = 0; j0 < GEMM_BM / 8; j0 += 4) {
            float2 cs[4][2];
            int page[4][2];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int token = WHOLE ? m0 + 8 * (j0 + jj) + 2 * t + c : min(m0 + 8 * (j0 + jj) + 2 * t + c, M - 1);
                    cs[jj][c] = seg != 2 ? __ldcg(rope_cs + token * half_dim + i) : make_float2(1.f, 0.f);
                    page[jj][c] = seg != 0 ? block_table[(u32)(start + token) / PAGE_TOKENS] : 0;
                }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int token = m0 + 8 * (j0 + jj) + 2 * t + c;
                    if (!WHOLE && token >= M) continue;
                    float o1 = acc[4 * (j0 + jj) + c] + b1, o2 = acc[4 * (j0 + jj) + 2 + c] + b2;
                    if (seg != 2) rope_apply(o1, o2, cs[jj][c].x, cs[jj][c].y, o1, o2);
                    const int off = seg == 0 ? token * q_row
                                             : page[jj][c] * page_elems + (int)((u32)(start + token) % PAGE_TOKENS) * Dh;
                    base1[off] = __float2half_rn(o1);
                    base2[off] = __float2half_rn(o2);
                }
        }
    }
};

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_int4_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                   __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                   __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                   const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                   const u32* __restrict__ q_qweight,        // [Hq·Dh/16, K/128, 16, 16] uint32, RoPE-paired
                   const __half* __restrict__ q_scales,      // [Hq·Dh, K/128] fp16
                   const u32* __restrict__ k_qweight,        // [Hkv·Dh/16, K/128, 16, 16] uint32, RoPE-paired
                   const __half* __restrict__ k_scales,      // [Hkv·Dh, K/128] fp16
                   const u32* __restrict__ v_qweight,        // [Hkv·Dh/16, K/128, 16, 16] uint32, RoPE-paired
                   const __half* __restrict__ v_scales,      // [Hkv·Dh, K/128] fp16
                   const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                   const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                   const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                   const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                   const int* __restrict__ prefill_state,    // [2] int32: start position, M
                   const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                   float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                   int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                   int Hq, int Hkv, int Dh, int K) {
    const int half_dim = Dh / 2;
    const int n_pairs = (Hq + 2 * Hkv) * half_dim;
    constexpr int PB = GEMM_BLOCK_ROWS / 2;  // pairs per row block
    // The lane's pair (set by rows_of; its head and dim are derived again in the epilogue, so
    // that one register, not the epilogue's pointers, stays live across the mainloop).
    int pair = 0;
    const u32 half_dim_rcp = div_reciprocal(half_dim);
    gemm_int4_block(x_map, prefill_state, K, (n_pairs + PB - 1) / PB, GemmSplitK{split_partials, split_counters},
                    [&](int rb, int local) {
        GemmLaneRows r;
        pair = gemm_rope_pair_of(rb, local);
        const GemmRopePair rp(min(pair, n_pairs - 1), half_dim, half_dim_rcp, Hq, Hkv);
        const int seg = rp.seg;
        const u32* qw = seg == 0 ? q_qweight : seg == 1 ? k_qweight : v_qweight;
        const __half* sc = seg == 0 ? q_scales : seg == 1 ? k_scales : v_scales;
        // The pair's two rows, dims i and i + Dh/2 of head h, are one item's slots i % 8 and
        // i % 8 + 8 (int4_pair_row): no row → (tile, slot) divisions by the head dim.
        r.wa = int4_pair_row(qw, rp.h, rp.i, Dh, K);
        r.wb = r.wa + 8 * (INT4_GROUP / 8);
        r.sa = sc + (u64)(rp.h * Dh + rp.i) * (K / INT4_GROUP);
        r.sb = r.sa + (u64)half_dim * (K / INT4_GROUP);
        return r;
    }, GemmQkvRopeEpilogue{q_out, k_cache, v_cache, q_bias, k_bias, v_bias, rope_cs, prefill_state, block_table,
                           Hq, Hkv, Dh, &pair});
}

// residual += X Wᵀ in FP32 (the residual stream is FP32, docs/numerics.md#the-residual-stream-is-fp32).
// Each element is read and written by one lane: no atomics. Tiles: ceil(M/128) × ceil(N/128).
// The read-modify-write goes through GemmResidualAdd (below), not the per-element epilogue: a
// load of residual after a store to residual may alias it as far as the compiler knows, so
// element-by-element it would wait out 64 dependent global round trips per lane.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_int4_residual(float* __restrict__ residual,           // [M, N] fp32, in/out
                   const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                   const u32* __restrict__ qweight,        // [N/16, K/128, 16, 16] uint32
                   const __half* __restrict__ scales,      // [N, K/128] fp16
                   const int* __restrict__ prefill_state,  // [2] int32: start (unused here), M
                   float* __restrict__ split_partials,     // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                   int* __restrict__ split_counters,       // [grid] int32, zero between launches, or null
                   int N, int K) {
    int ra = 0;
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters}, GemmOneMatrixRows{qweight, scales, N, K, &ra},
                    GemmResidualAdd{residual, N, &ra});
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ): in each warp's 16 rows, row g is gate_proj's feature f and row g+8
// is up_proj's feature f, so the SwiGLU happens in registers (swiglu_f16, as in the decode GEMV).
// A tile covers 64 features. Tiles: ceil(M/128) × ceil(F/64).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_int4_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                         const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden)
                         const u32* __restrict__ gate_qweight,      // [F/16, K/128, 16, 16] uint32
                         const __half* __restrict__ gate_scales,    // [F, K/128] fp16
                         const u32* __restrict__ up_qweight,        // [F/16, K/128, 16, 16] uint32
                         const __half* __restrict__ up_scales,      // [F, K/128] fp16
                         const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                         float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                         int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                         int F, int K) {
    int f = 0;
    constexpr int FB = GEMM_BLOCK_ROWS / 2;  // features per row block
    gemm_int4_block(x_map, prefill_state, K, (F + FB - 1) / FB, GemmSplitK{split_partials, split_counters},
                    [&](int rb, int local) {
        // local = 16·(warp tile) + g for g < 8: feature 8·(warp tile) + g.
        GemmLaneRows r;
        f = rb * FB + (local / INT4_TILE_ROWS) * 8 + local % INT4_TILE_ROWS;
        gemm_lane_row(gate_qweight, gate_scales, f, F, K, r.wa, r.sa);
        gemm_lane_row(up_qweight, up_scales, f, F, K, r.wb, r.sb);
        return r;
    }, gemm_each_token([&](int token, float gate, float up) {
        if (f < F) h[(u32)token * (u32)F + f] = swiglu_f16_approx(gate, up);
    }));
}

// ---- Q4_K weights (the GGUF's own bytes) on the same mainloop --------------------------------
// gemm_int4_block with GemmQ4kScales: the producer copies the code words as for INT4 (the same
// 64 B a row and group), the consumers unpack them with the sub-block scales (above). Built at
// every GEMM_BM: the group's 16 scale pairs, held one group ahead, fit beside the 256-token
// tile's 128 accumulators in the consumers' 216 registers (no spills, ptxas) since their decode
// stays in FP16 pairs. Weights [N, K], K a multiple of 256:
//   qweight u32 [N, K/8] (layout id 1, tile-major), scales uint4 [N, K/256]: each super-block's 4
//   lane words, one 16-byte vector (weight_formats.cuh: (sc, m) and the bytes of (d, dmin)).

// rows_of for one Q4_K matrix (residual); the lane's row g is also written to *ra.
struct GemmQ4kOneMatrixRows {
    const u32* qweight;
    const uint4* scales;
    int N, K;
    int* ra;
    __device__ __forceinline__ GemmLaneRowsQ4k operator()(int rb, int local) const {
        GemmLaneRowsQ4k r;
        *ra = rb * GEMM_BLOCK_ROWS + local;
        gemm_q4k_lane_row(qweight, scales, *ra, N, K, r.wa, r.sca);
        gemm_q4k_lane_row(qweight, scales, *ra + 8, N, K, r.wb, r.scb);
        return r;
    }
};

// residual += X Wᵀ in FP32, W in Q4_K (o_proj, down_proj). As gemm_int4_residual.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4k_residual(float* __restrict__ residual,           // [M, N] fp32, in/out
                  const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                  const u32* __restrict__ qweight,        // [N, K/8] uint32, Q4_K codes (layout id 1), tile-major
                  const uint4* __restrict__ scales,       // [N, K/256] uint4: each super-block's 4 lane words
                  const int* __restrict__ prefill_state,  // [2] int32: start (unused here), M
                  float* __restrict__ split_partials,     // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                  int* __restrict__ split_counters,       // [grid] int32, zero between launches, or null
                  int N, int K) {
    int ra = 0;
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters}, GemmQ4kOneMatrixRows{qweight, scales, N, K, &ra},
                    GemmResidualAdd{residual, N, &ra}, GemmQ4kScales{});
}

// out[token, col0 + n] = X [W0; W1]ᵀ in FP32 for one or two Q4_K matrices stacked along N (N1 = 0:
// one): a layer's q and k — and v, alone — into their columns of qkv (llama.cpp's Q4_K_M keeps q
// and k in Q4_K, v in Q6_K on some layers and Q4_K on the others). Tiles: ceil(M/GEMM_BM) ×
// ceil((N0+N1)/128). Rows g and g+8 of a warp tile may lie in different matrices: each row
// picks its own. (A third matrix's pointers spilled 20 bytes in the producer's registers.)
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4k_stacked_rows(float* __restrict__ out,                   // [M, ldo] fp32, columns col0 … col0+N0+N1-1 written
                      const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden states)
                      const u32* __restrict__ w0_qweight,        // [N0, K/8] uint32
                      const uint4* __restrict__ w0_scales,       // [N0, K/256] uint4: each super-block's 4 lane words
                      const u32* __restrict__ w1_qweight,        // [N1, …] (N1 = 0: unused)
                      const uint4* __restrict__ w1_scales,
                      const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                      float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                      int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                      int N0, int N1, int K, int ldo, int col0) {
    const int N = N0 + N1;
    int ra = 0;  // the stacked row of the lane's row g; row g+8 is ra + 8
    // Row `row` of the stack (clamped into it) in its matrix: (codes, lane words).
    auto one = [&](int row) {
        const int r = min(row, N - 1);
        const bool second = r >= N0;
        const u64 i = (u64)(second ? r - N0 : r);
        const u32* qw = second ? w1_qweight : w0_qweight;
        const uint4* sc = second ? w1_scales : w0_scales;
        return GemmLaneRowsQ4k{gemm_code_row(qw, i, K), nullptr, sc + i * (K / 256), nullptr};
    };
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters}, [&](int rb, int local) {
        ra = rb * GEMM_BLOCK_ROWS + local;
        const GemmLaneRowsQ4k a = one(ra), b = one(ra + 8);
        return GemmLaneRowsQ4k{a.wa, b.wa, a.sca, b.sca};
    }, gemm_each_token([&](int token, float va, float vb) {
        if (ra < N) out[(u64)token * ldo + col0 + ra] = va;
        if (ra + 8 < N) out[(u64)token * ldo + col0 + ra + 8] = vb;
    }), GemmQ4kScales{});
}

// q, k and v in Q4_K with the bias, the RoPE and the FP16 writes in the epilogue: gemm_int4_qkv_rope
// over Q4_K (its rows, pairs and epilogue; the layers of llama.cpp's Q4_K_M whose v is Q4_K too).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4k_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                  __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                  __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                  const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                  const u32* __restrict__ q_qweight,        // [Hq·Dh, K/8] uint32
                  const uint4* __restrict__ q_scales,       // [Hq·Dh, K/256] uint4: each super-block's 4 lane words
                  const u32* __restrict__ k_qweight,        // [Hkv·Dh, K/8] uint32
                  const uint4* __restrict__ k_scales,       // [Hkv·Dh, K/256] uint4: each super-block's 4 lane words
                  const u32* __restrict__ v_qweight,        // [Hkv·Dh, K/8] uint32
                  const uint4* __restrict__ v_scales,       // [Hkv·Dh, K/256] uint4: each super-block's 4 lane words
                  const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                  const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                  const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                  const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                  const int* __restrict__ prefill_state,    // [2] int32: start position, M
                  const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                  float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                  int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                  int Hq, int Hkv, int Dh, int K) {
    const int half_dim = Dh / 2;
    const int n_pairs = (Hq + 2 * Hkv) * half_dim;
    constexpr int PB = GEMM_BLOCK_ROWS / 2;  // pairs per row block
    int pair = 0;  // the lane's pair, set by rows_of (as gemm_int4_qkv_rope's)
    const u32 half_dim_rcp = div_reciprocal(half_dim);
    gemm_int4_block(x_map, prefill_state, K, (n_pairs + PB - 1) / PB, GemmSplitK{split_partials, split_counters},
                    [&](int rb, int local) {
        GemmLaneRowsQ4k r;
        pair = gemm_rope_pair_of(rb, local);
        const GemmRopePair rp(min(pair, n_pairs - 1), half_dim, half_dim_rcp, Hq, Hkv);
        const int seg = rp.seg;
        const u32* qw = seg == 0 ? q_qweight : seg == 1 ? k_qweight : v_qweight;
        const uint4* sc = seg == 0 ? q_scales : seg == 1 ? k_scales : v_scales;
        const int n = (seg == 0 ? Hq : Hkv) * Dh;
        gemm_q4k_lane_row(qw, sc, rp.h * Dh + rp.i, n, K, r.wa, r.sca);
        gemm_q4k_lane_row(qw, sc, rp.h * Dh + rp.i + half_dim, n, K, r.wb, r.scb);
        return r;
    }, GemmQkvRopeEpilogue{q_out, k_cache, v_cache, q_bias, k_bias, v_bias, rope_cs, prefill_state, block_table,
                           Hq, Hkv, Dh, &pair}, GemmQ4kScales{});
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ), gate and up in Q4_K. As gemm_int4_gate_up_swiglu.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4k_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                        const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden)
                        const u32* __restrict__ gate_qweight,      // [F, K/8] uint32
                        const uint4* __restrict__ gate_scales,     // [F, K/256] uint4: each super-block's 4 lane words
                        const u32* __restrict__ up_qweight,        // [F, K/8] uint32
                        const uint4* __restrict__ up_scales,       // [F, K/256] uint4: each super-block's 4 lane words
                        const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                        float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                        int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                        int F, int K) {
    int f = 0;
    constexpr int FB = GEMM_BLOCK_ROWS / 2;  // features per row block
    gemm_int4_block(x_map, prefill_state, K, (F + FB - 1) / FB, GemmSplitK{split_partials, split_counters},
                    [&](int rb, int local) {
        GemmLaneRowsQ4k r;
        f = rb * FB + (local / INT4_TILE_ROWS) * 8 + local % INT4_TILE_ROWS;
        gemm_q4k_lane_row(gate_qweight, gate_scales, f, F, K, r.wa, r.sca);
        gemm_q4k_lane_row(up_qweight, up_scales, f, F, K, r.wb, r.scb);
        return r;
    }, gemm_each_token([&](int token, float gate, float up) {
        if (f < F) h[(u32)token * (u32)F + f] = swiglu_f16_approx(gate, up);
    }), GemmQ4kScales{});
}

// ---- Q5_K weights (the GGUF's own bytes) on the same mainloop --------------------------------
// Q5_K (weight_formats.cuh, id 11) is Q4_K with a fifth bit: the same (sc, m) and (d, dmin) per
// super-block (lane words on the GPU), w = (d·sc)·c − dmin·m, and codes c = v + 16h, v the low nibble in
// layout id 1 (the INT4 words) and h one high bit in the qhigh plane as Q5_0 has it (bit 4p + i
// of chunk j's word for nibble p of code word i of the chunk). So GemmQ5kScales is Q4_K's
// scales (GemmQ4kScales::load, decoded in FP16 pairs one group ahead) with Q5_0's unpack: code
// word i of a chunk rotated so that the lane's pair sits at bit i, the high bit OR-ed in above it
// under the magic number 2^(10−i) (gemm_high_biased; the chunk's high word rotated once), so
// 2^(10−i) + c is exact for c ≤ 31, one sub.f16x2 of 2^(10−i) makes c exact, one fma.rn.f16x2
// gives c·S − O. The high words travel with the codes through the stage (16 B a row and group
// behind the code words, lane t = 0 of each quad copies them, as Q5_0's). Why that cannot race:
// the high words are part of the stage, so they land before the full barrier's phase completes
// (the lane's cp.async.mbarrier.arrive.noinc covers its copies) and are rewritten only after
// w_empty's, which every consumer lane passes once its reads are done — the file's protocol with
// no new barrier. Work split: the file's (tiles, stream-K ranges, two consumer warpgroups); the
// limit, as for Q4_K, is the consumers' unpack beside the tensor cores (one more lop3 a pair than
// Q4_K for the high bit, one rotate of the high word a chunk and row). Bytes: 176 per 256 weights
// (5.5 bits) read once per tile row of X. Weights [N, K], K a multiple of 256: qweight u32
// [N, K/8], qhigh u32 [N, K/32] (both tile-major), scales uint4 [N, K/256] (the lane
// words, as Q4_K's).
#define GEMM_Q5K_HIGH_ROW_BYTES 16  // one high word per 32-input chunk: 4 a group
struct GemmLaneRowsQ5k : GemmLaneRowsQ4k {
    const u32* ha; const u32* hb;     // the rows' high-bit words
};

struct GemmQ5kScales : GemmQ4kScales {
    static constexpr int HIGH_ROW_BYTES = GEMM_Q5K_HIGH_ROW_BYTES;
    static constexpr int HIGH_STRIDE = INT4_TILE_ROWS * GEMM_Q5K_HIGH_ROW_BYTES / 4;  // tile-major: one item
    static constexpr bool ROWS_EACH_GROUP = true;  // the producer's row pointers: recomputed each group
    // Nibble pair t of code word w, word i of its chunk, with its high bits (hpos: the chunk's high
    // word, gemm_high_word) as (c, c) exact, then c·S − O.
    __device__ static __forceinline__ u32 pair(u32 w, u32 hpos, int shift, int i, u32 s2, u32 o2) {
        const u32 biased = gemm_high_biased(w, hpos, shift, i, 0x00100010u);  // 2^(10−i) + c, c ≤ 31
        u32 c, out;
        asm("sub.f16x2 %0, %1, %2;" : "=r"(c) : "r"(biased), "r"(gemm_fp16x2_at(i, 0)));
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(c), "r"(s2), "r"(o2));
        return out;
    }
    __device__ static __forceinline__ void fragments(const uint4 (&ra)[4], const uint4 (&rb)[4],
                                                     const uint4 (&ha)[GEMM_HIGH_MAX],
                                                     const uint4 (&hb)[GEMM_HIGH_MAX], int shift, const Group& G,
                                                     u32 (&frag)[GEMM_K_STEPS][4]) {
        if constexpr (GEMM_PROBE_LOW_ONLY) {
            GemmQ4kScales::fragments(ra, rb, ha, hb, shift, G, frag);
            return;
        }
#pragma unroll
        for (int s = 0; s < GEMM_K_STEPS; ++s) {
            // k step s: code words 2s, 2s+1 = words i0 = 2(s % 2), i0 + 1 of chunk j = s / 2 — the
            // sub-block of the scales too — whose high bits for the lane's nibbles t and t + 4 are
            // bits 4t + i and 4t + 16 + i of high word j (GemmQ5g32Scales::fragments).
            const int j = s / 2, i0 = 2 * (s % 2);
            const u32 hA = gemm_high_word(wf_word(ha[0], j), shift), hB = gemm_high_word(wf_word(hb[0], j), shift);
            frag[s][0] = pair(gemm_word(ra, 2 * s), hA, shift, i0, G.s[0][j], G.o[0][j]);
            frag[s][1] = pair(gemm_word(rb, 2 * s), hB, shift, i0, G.s[1][j], G.o[1][j]);
            frag[s][2] = pair(gemm_word(ra, 2 * s + 1), hA, shift, i0 + 1, G.s[0][j], G.o[0][j]);
            frag[s][3] = pair(gemm_word(rb, 2 * s + 1), hB, shift, i0 + 1, G.s[1][j], G.o[1][j]);
        }
    }
};
#define GEMM_Q5K_SMEM_BYTES (gemm_smem_bytes<GemmQ5kScales>())  // launchers mirror it
static_assert(GEMM_Q5K_SMEM_BYTES <= 227 * 1024, "shared memory");

// Row `row` (clamped into the matrix) of a Q5_K weight [n, K] into the lane-rows slot `which`
// (0: row g, 1: row g+8).
__device__ __forceinline__ void gemm_q5k_lane_row(const u32* qweight, const u32* qhigh, const uint4* scales, int row,
                                                  int n, int K, int which, GemmLaneRowsQ5k& out) {
    const u64 r = (u64)min(row, n - 1);
    (which ? out.wb : out.wa) = gemm_code_row(qweight, r, K);
    (which ? out.hb : out.ha) = gemm_tiled_row<GEMM_Q5K_HIGH_ROW_BYTES / 4>(qhigh, r, K);
    (which ? out.scb : out.sca) = scales + r * (K / 256);
}

// residual += X Wᵀ in FP32, W in Q5_K (o_proj, down_proj). As gemm_q4k_residual.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5k_residual(float* __restrict__ residual,           // [M, N] fp32, in/out
                  const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                  const u32* __restrict__ qweight,        // [N, K/8] uint32, the low nibbles (layout id 1), tile-major
                  const u32* __restrict__ qhigh,          // [N, K/32] uint32 tile-major, the high bits
                  const uint4* __restrict__ scales,       // [N, K/256] uint4: each super-block's 4 lane words
                  const int* __restrict__ prefill_state,  // [2] int32: start (unused here), M
                  float* __restrict__ split_partials,     // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                  int* __restrict__ split_counters,       // [grid] int32, zero between launches, or null
                  int N, int K) {
    int ra = 0;
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters}, [&](int rb, int local) {
        GemmLaneRowsQ5k r;
        ra = rb * GEMM_BLOCK_ROWS + local;
        gemm_q5k_lane_row(qweight, qhigh, scales, ra, N, K, 0, r);
        gemm_q5k_lane_row(qweight, qhigh, scales, ra + 8, N, K, 1, r);
        return r;
    }, GemmResidualAdd{residual, N, &ra}, GemmQ5kScales{});
}

// out[token, col0 + n] = X [W0; W1]ᵀ in FP32 for one or two Q5_K matrices stacked along N (N1 = 0:
// one): a layer's q and k — and v, alone. As gemm_q4k_stacked_rows.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5k_stacked_rows(float* __restrict__ out,                   // [M, ldo] fp32, columns col0 … col0+N0+N1-1 written
                      const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden states)
                      const u32* __restrict__ w0_qweight,        // [N0, K/8] uint32
                      const u32* __restrict__ w0_qhigh,          // [N0, K/32] uint32 tile-major
                      const uint4* __restrict__ w0_scales,       // [N0, K/256] uint4: each super-block's 4 lane words
                      const u32* __restrict__ w1_qweight,        // [N1, …] (N1 = 0: unused)
                      const u32* __restrict__ w1_qhigh,
                      const uint4* __restrict__ w1_scales,
                      const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                      float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                      int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                      int N0, int N1, int K, int ldo, int col0) {
    const int N = N0 + N1;
    int ra = 0;  // the stacked row of the lane's row g; row g+8 is ra + 8
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters}, [&](int rb, int local) {
        GemmLaneRowsQ5k r;
        ra = rb * GEMM_BLOCK_ROWS + local;
#pragma unroll
        for (int which = 0; which < 2; ++which) {  // row g, then g + 8, each in its own matrix
            const int row = min(ra + 8 * which, N - 1);
            const bool second = row >= N0;
            gemm_q5k_lane_row(second ? w1_qweight : w0_qweight, second ? w1_qhigh : w0_qhigh,
                              second ? w1_scales : w0_scales, second ? row - N0 : row,
                              second ? N1 : N0, K, which, r);
        }
        return r;
    }, gemm_each_token([&](int token, float va, float vb) {
        if (ra < N) out[(u64)token * ldo + col0 + ra] = va;
        if (ra + 8 < N) out[(u64)token * ldo + col0 + ra + 8] = vb;
    }), GemmQ5kScales{});
}

// q, k and v in Q5_K with the bias, the RoPE and the FP16 writes in the epilogue: gemm_q4k_qkv_rope
// over Q5_K.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5k_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                  __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                  __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                  const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                  const u32* __restrict__ q_qweight,        // [Hq·Dh, K/8] uint32
                  const u32* __restrict__ q_qhigh,          // [Hq·Dh, K/32] uint32 tile-major
                  const uint4* __restrict__ q_scales,       // [Hq·Dh, K/256] uint4: each super-block's 4 lane words
                  const u32* __restrict__ k_qweight,        // [Hkv·Dh, K/8] uint32
                  const u32* __restrict__ k_qhigh,          // [Hkv·Dh, K/32] uint32 tile-major
                  const uint4* __restrict__ k_scales,       // [Hkv·Dh, K/256] uint4: each super-block's 4 lane words
                  const u32* __restrict__ v_qweight,        // [Hkv·Dh, K/8] uint32
                  const u32* __restrict__ v_qhigh,          // [Hkv·Dh, K/32] uint32 tile-major
                  const uint4* __restrict__ v_scales,       // [Hkv·Dh, K/256] uint4: each super-block's 4 lane words
                  const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                  const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                  const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                  const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                  const int* __restrict__ prefill_state,    // [2] int32: start position, M
                  const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                  float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                  int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                  int Hq, int Hkv, int Dh, int K) {
    const int half_dim = Dh / 2;
    const int n_pairs = (Hq + 2 * Hkv) * half_dim;
    constexpr int PB = GEMM_BLOCK_ROWS / 2;  // pairs per row block
    int pair = 0;  // the lane's pair, set by rows_of (as gemm_int4_qkv_rope's)
    const u32 half_dim_rcp = div_reciprocal(half_dim);
    gemm_int4_block(x_map, prefill_state, K, (n_pairs + PB - 1) / PB, GemmSplitK{split_partials, split_counters},
                    [&](int rb, int local) {
        GemmLaneRowsQ5k r;
        pair = gemm_rope_pair_of(rb, local);
        const GemmRopePair rp(min(pair, n_pairs - 1), half_dim, half_dim_rcp, Hq, Hkv);
        const int seg = rp.seg;
        const u32* qw = seg == 0 ? q_qweight : seg == 1 ? k_qweight : v_qweight;
        const u32* qh = seg == 0 ? q_qhigh : seg == 1 ? k_qhigh : v_qhigh;
        const uint4* sc = seg == 0 ? q_scales : seg == 1 ? k_scales : v_scales;
        const int n = (seg == 0 ? Hq : Hkv) * Dh;
        gemm_q5k_lane_row(qw, qh, sc, rp.h * Dh + rp.i, n, K, 0, r);
        gemm_q5k_lane_row(qw, qh, sc, rp.h * Dh + rp.i + half_dim, n, K, 1, r);
        return r;
    }, GemmQkvRopeEpilogue{q_out, k_cache, v_cache, q_bias, k_bias, v_bias, rope_cs, prefill_state, block_table,
                           Hq, Hkv, Dh, &pair}, GemmQ5kScales{});
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ), gate and up in Q5_K. As gemm_q4k_gate_up_swiglu.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5k_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                        const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden)
                        const u32* __restrict__ gate_qweight,      // [F, K/8] uint32
                        const u32* __restrict__ gate_qhigh,        // [F, K/32] uint32 tile-major
                        const uint4* __restrict__ gate_scales,     // [F, K/256] uint4: each super-block's 4 lane words
                        const u32* __restrict__ up_qweight,        // [F, K/8] uint32
                        const u32* __restrict__ up_qhigh,          // [F, K/32] uint32 tile-major
                        const uint4* __restrict__ up_scales,       // [F, K/256] uint4: each super-block's 4 lane words
                        const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                        float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                        int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                        int F, int K) {
    int f = 0;
    constexpr int FB = GEMM_BLOCK_ROWS / 2;  // features per row block
    gemm_int4_block(x_map, prefill_state, K, (F + FB - 1) / FB, GemmSplitK{split_partials, split_counters},
                    [&](int rb, int local) {
        GemmLaneRowsQ5k r;
        f = rb * FB + (local / INT4_TILE_ROWS) * 8 + local % INT4_TILE_ROWS;
        gemm_q5k_lane_row(gate_qweight, gate_qhigh, gate_scales, f, F, K, 0, r);
        gemm_q5k_lane_row(up_qweight, up_qhigh, up_scales, f, F, K, 1, r);
        return r;
    }, gemm_each_token([&](int token, float gate, float up) {
        if (f < F) h[(u32)token * (u32)F + f] = swiglu_f16_approx(gate, up);
    }), GemmQ5kScales{});
}

// ---- Q6_K weights (the GGUF's own bytes) on the same mainloop --------------------------------
// gemm_int4_block with GemmQ6kScales: each stage also holds the tile rows' high-bit words (32 B a
// row and group, 4 KB: GEMM_Q6K_SMEM_BYTES), copied by the producer beside the code words and
// released by the same barriers; at GEMM_BM 256 two stages (gemm_stages: three of 76 KB need 229
// KB of the 227). Weights [N, K], K a
// multiple of 256: qweight u32 [N, K/8] (layout id 1 tile-major, the low nibbles), qhigh u32 [N, K/16] (tile-major),
// scales int8 [N, K/16] (read as u32 words), aux fp16 [N, K/256] (d).
#define GEMM_Q6K_SMEM_BYTES (gemm_smem_bytes<GemmQ6kScales>())  // launchers mirror it
static_assert(GEMM_Q6K_SMEM_BYTES <= 227 * 1024, "shared memory");

// rows_of for one Q6_K matrix; the lane's row g is also written to *ra.
struct GemmQ6kOneMatrixRows {
    const u32* qweight;
    const u32* qhigh;
    const u32* scales;
    const unsigned short* aux;
    int N, K;
    int* ra;
    __device__ __forceinline__ GemmLaneRowsQ6k operator()(int rb, int local) const {
        GemmLaneRowsQ6k r;
        *ra = rb * GEMM_BLOCK_ROWS + local;
        gemm_q6k_lane_row(qweight, qhigh, scales, aux, *ra, N, K, 0, r);
        gemm_q6k_lane_row(qweight, qhigh, scales, aux, *ra + 8, N, K, 1, r);
        return r;
    }
};

// residual += X Wᵀ in FP32, W in Q6_K (down_proj in llama.cpp's Q4_K_M on some layers). As
// gemm_int4_residual.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q6k_residual(float* __restrict__ residual,            // [M, N] fp32, in/out
                  const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                  const u32* __restrict__ qweight,         // [N, K/8] uint32, the low nibbles (layout id 1), tile-major
                  const u32* __restrict__ qhigh,           // [N, K/16] uint32 tile-major, the high bits
                  const u32* __restrict__ scales,          // [N, K/16] int8 sc, as [N, K/64] uint32
                  const unsigned short* __restrict__ aux,  // [N, K/256] fp16 d
                  const int* __restrict__ prefill_state,   // [2] int32: start (unused here), M
                  float* __restrict__ split_partials,      // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                  int* __restrict__ split_counters,        // [grid] int32, zero between launches, or null
                  int N, int K) {
    int ra = 0;
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters},
                    GemmQ6kOneMatrixRows{qweight, qhigh, scales, aux, N, K, &ra}, GemmResidualAdd{residual, N, &ra},
                    GemmQ6kScales{});
}

// out[token, col0 + n] = X Wᵀ in FP32, W in Q6_K: v_proj into its columns of qkv (llama.cpp's
// Q4_K_M keeps v in Q6_K on some layers). Tiles: ceil(M/GEMM_BM) × ceil(N/128).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q6k_rows(float* __restrict__ out,                   // [M, ldo] fp32, columns col0 … col0+N-1 written
              const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K]
              const u32* __restrict__ qweight,           // [N, K/8] uint32
              const u32* __restrict__ qhigh,             // [N, K/16] uint32 tile-major
              const u32* __restrict__ scales,            // [N, K/64] uint32 (int8 sc)
              const unsigned short* __restrict__ aux,    // [N, K/256] fp16 d
              const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
              float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
              int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
              int N, int K, int ldo, int col0) {
    int ra = 0;
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters},
                    GemmQ6kOneMatrixRows{qweight, qhigh, scales, aux, N, K, &ra},
                    gemm_each_token([&](int token, float va, float vb) {
        if (ra < N) out[(u64)token * ldo + col0 + ra] = va;
        if (ra + 8 < N) out[(u64)token * ldo + col0 + ra + 8] = vb;
    }), GemmQ6kScales{});
}

// ---- q and k in Q4_K or Q5_K, v in Q6_K: one QKV-RoPE launch ------------------------------------
// llama.cpp's Q4_K_M and Q5_K_M keep v_proj in Q6_K on some layers (the 7B: 14 of its 28) and q,
// k in Q4_K / Q5_K. One launch for such a layer, with gemm_q4k_qkv_rope's rows, pairs and
// epilogue (the bias, the RoPE, the FP16 q and K/V cache writes): the grid in two parts
// (gemm_split_k.cuh: GemmGridPart) — blocks 0 … P − v_blocks − 1 run the row blocks of q's and
// k's pairs under the q/k format's policy, blocks P − v_blocks … P − 1 those of v's pairs under
// GemmQ6kScales, each part its own stream-K ranges and its own slots and counters of the scratch.
// A block runs one part, so one policy and one ring (its stages' bytes and count); the launch's
// dynamic shared memory is the larger of the two rings (launchers/gemm_kquant.py). The pairs of
// q and k fill whole row blocks (64 pairs a block; the launcher checks (Hq + Hkv)·Dh/2 % 64 = 0),
// so no row block holds both formats.
// Bytes and the limit: those of the two GEMMs it stands in for — q's and k's K-quant bytes and v's
// Q6_K bytes once per token tile, X once per row block — with the q/k part's FP32 round trip and
// rope_kv_rows' launch gone; each part is limited as its mainloop is (the consumers' unpack beside
// the tensor cores, the header), so the parts are sized by their tiles (launchers/gemm_kquant.py:
// plan_parts).
// Why: apart, such a layer ran qk_proj, v_proj into FP32 qkv and rope_kv_rows, 54.0 + 18.1 + 12.7
// µs at a 512-token chunk against 56.3 for qkv_rope on the all-Q5_K layers (H100, Q5_K_M 7B,
// docs/bench/2026-12-06_1c5acea_h100_syn7b_q5_k_m_qkv_pick_1.json: prefill_kernels).
// Barriers: each part is gemm_int4_block as every other launch of it runs, on its blocks alone
// (the part's first block is its range 0); the only block-wide barrier inside is taken by every
// thread of a block, whose part is a function of blockIdx alone.
template <typename ScQk, typename QkRows, typename V>
__device__ __forceinline__ void gemm_qkv_rope_v_q6k(const GemmQkvRopeEpilogue& epilogue_in, int* pair,
                                                    const CUtensorMap& x_map, QkRows qk_rows, V v,
                                                    const int* __restrict__ prefill_state, float* split_partials,
                                                    int* split_counters, int Hq, int Hkv, int Dh, int K,
                                                    int v_blocks) {
    const int half_dim = Dh / 2;
    constexpr int PB = GEMM_BLOCK_ROWS / 2;  // pairs per row block
    const int qk_row_blocks = (Hq + Hkv) * half_dim / PB, n_pairs = (Hq + 2 * Hkv) * half_dim;
    const u32 half_dim_rcp = div_reciprocal(half_dim);
    const int first_v = (int)gridDim.x - v_blocks;
    const GemmQkvRopeEpilogue epilogue = epilogue_in;
    if (block_index() < first_v) {
        gemm_int4_block(x_map, prefill_state, K, qk_row_blocks, GemmSplitK{split_partials, split_counters},
                        [&](int rb, int local) {
            *pair = gemm_rope_pair_of(rb, local);  // below (Hq + Hkv)·Dh/2: whole row blocks
            return qk_rows(GemmRopePair(*pair, half_dim, half_dim_rcp, Hq, Hkv));
        }, epilogue, ScQk{}, GemmGridPart{0, first_v});
    } else {
        // The v part's slots and counters follow the q/k part's (the launcher's scratch holds P).
        const GemmSplitK sk{split_partials ? split_partials + (u64)first_v * GEMM_ACC * GEMM_SPLIT_THREADS : nullptr,
                            split_counters ? split_counters + first_v : nullptr};
        gemm_int4_block(x_map, prefill_state, K, (n_pairs - qk_row_blocks * PB + PB - 1) / PB, sk,
                        [&](int rb, int local) {
            GemmLaneRowsQ6k r;
            *pair = gemm_rope_pair_of(rb + qk_row_blocks, local);
            const GemmRopePair rp(min(*pair, n_pairs - 1), half_dim, half_dim_rcp, Hq, Hkv);
            gemm_q6k_lane_row(v.qweight, v.qhigh, v.scales, v.aux, rp.h * Dh + rp.i, Hkv * Dh, K, 0, r);
            gemm_q6k_lane_row(v.qweight, v.qhigh, v.scales, v.aux, rp.h * Dh + rp.i + half_dim, Hkv * Dh, K, 1, r);
            return r;
        }, epilogue, GemmQ6kScales{}, GemmGridPart{first_v, v_blocks});
    }
}

// v's Q6_K planes, as gemm_q6k_rows takes them.
struct GemmQ6kPlanes {
    const u32* qweight;
    const u32* qhigh;
    const u32* scales;
    const unsigned short* aux;
};

// q and k in Q4_K, v in Q6_K (llama.cpp's Q4_K_M on its v-in-Q6_K layers): gemm_q4k_qkv_rope's
// outputs in one launch of two parts (above).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4k_q6k_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                      __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                      __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                      const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                      const u32* __restrict__ q_qweight,        // [Hq·Dh, K/8] uint32
                      const uint4* __restrict__ q_scales,       // [Hq·Dh, K/256] uint4: each super-block's 4 lane words
                      const u32* __restrict__ k_qweight,        // [Hkv·Dh, K/8] uint32
                      const uint4* __restrict__ k_scales,       // [Hkv·Dh, K/256] uint4: each super-block's 4 lane words
                      const u32* __restrict__ v_qweight,        // [Hkv·Dh, K/8] uint32, Q6_K's low nibbles, tile-major
                      const u32* __restrict__ v_qhigh,          // [Hkv·Dh, K/16] uint32 tile-major
                      const u32* __restrict__ v_scales,         // [Hkv·Dh, K/64] uint32 (int8 sc)
                      const unsigned short* __restrict__ v_aux, // [Hkv·Dh, K/256] fp16 d
                      const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                      const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                      const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                      const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                      const int* __restrict__ prefill_state,    // [2] int32: start position, M
                      const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                      float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                      int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                      int Hq, int Hkv, int Dh, int K,
                      int v_blocks) {                           // the blocks of v's part, 1 … grid − 1
    int pair = 0;  // the lane's pair, set by rows_of
    gemm_qkv_rope_v_q6k<GemmQ4kScales>(
        GemmQkvRopeEpilogue{q_out, k_cache, v_cache, q_bias, k_bias, v_bias, rope_cs, prefill_state, block_table,
                            Hq, Hkv, Dh, &pair}, &pair, x_map, [&](const GemmRopePair& rp) {
            GemmLaneRowsQ4k r;
            const bool q = rp.seg == 0;
            const u32* qw = q ? q_qweight : k_qweight;
            const uint4* sc = q ? q_scales : k_scales;
            const int n = (q ? Hq : Hkv) * Dh;
            gemm_q4k_lane_row(qw, sc, rp.h * Dh + rp.i, n, K, r.wa, r.sca);
            gemm_q4k_lane_row(qw, sc, rp.h * Dh + rp.i + Dh / 2, n, K, r.wb, r.scb);
            return r;
        }, GemmQ6kPlanes{v_qweight, v_qhigh, v_scales, v_aux}, prefill_state, split_partials, split_counters,
        Hq, Hkv, Dh, K, v_blocks);
}

// q and k in Q5_K, v in Q6_K (llama.cpp's Q5_K_M on its v-in-Q6_K layers): as gemm_q4k_q6k_qkv_rope.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5k_q6k_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                      __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                      __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                      const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                      const u32* __restrict__ q_qweight,        // [Hq·Dh, K/8] uint32
                      const u32* __restrict__ q_qhigh,          // [Hq·Dh, K/32] uint32 tile-major
                      const uint4* __restrict__ q_scales,       // [Hq·Dh, K/256] uint4: each super-block's 4 lane words
                      const u32* __restrict__ k_qweight,        // [Hkv·Dh, K/8] uint32
                      const u32* __restrict__ k_qhigh,          // [Hkv·Dh, K/32] uint32 tile-major
                      const uint4* __restrict__ k_scales,       // [Hkv·Dh, K/256] uint4: each super-block's 4 lane words
                      const u32* __restrict__ v_qweight,        // [Hkv·Dh, K/8] uint32, Q6_K's low nibbles, tile-major
                      const u32* __restrict__ v_qhigh,          // [Hkv·Dh, K/16] uint32 tile-major
                      const u32* __restrict__ v_scales,         // [Hkv·Dh, K/64] uint32 (int8 sc)
                      const unsigned short* __restrict__ v_aux, // [Hkv·Dh, K/256] fp16 d
                      const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                      const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                      const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                      const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                      const int* __restrict__ prefill_state,    // [2] int32: start position, M
                      const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                      float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                      int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                      int Hq, int Hkv, int Dh, int K,
                      int v_blocks) {                           // the blocks of v's part, 1 … grid − 1
    int pair = 0;  // the lane's pair, set by rows_of
    gemm_qkv_rope_v_q6k<GemmQ5kScales>(
        GemmQkvRopeEpilogue{q_out, k_cache, v_cache, q_bias, k_bias, v_bias, rope_cs, prefill_state, block_table,
                            Hq, Hkv, Dh, &pair}, &pair, x_map, [&](const GemmRopePair& rp) {
            GemmLaneRowsQ5k r;
            const bool q = rp.seg == 0;
            const u32* qw = q ? q_qweight : k_qweight;
            const u32* qh = q ? q_qhigh : k_qhigh;
            const uint4* sc = q ? q_scales : k_scales;
            const int n = (q ? Hq : Hkv) * Dh;
            gemm_q5k_lane_row(qw, qh, sc, rp.h * Dh + rp.i, n, K, 0, r);
            gemm_q5k_lane_row(qw, qh, sc, rp.h * Dh + rp.i + Dh / 2, n, K, 1, r);
            return r;
        }, GemmQ6kPlanes{v_qweight, v_qhigh, v_scales, v_aux}, prefill_state, split_partials, split_counters,
        Hq, Hkv, Dh, K, v_blocks);
}


// ---- Q4_0, Q5_0 and Q8_0 weights (the GGUF's own bytes) on the same mainloop ---------------
// The GGUF's 32-input block formats with one FP16 scale per block (ggml's QK = 32): a 128-input
// group is 4 chunks, k steps 2j and 2j + 1 in chunk j, and 4 scales (8 B) a row, which come from
// global memory one group ahead, one 8-byte load a row (GemmG32Scales).
//   Q4_0 (weight_formats.cuh, id 2 "q4_g32"): the INT4 words (layout id 1), w = (c − 8)·s — the
//        INT4 mainloop's unpack (gemm_int4_pair) with the chunk's scale in place of the group's.
//   Q5_0 (weight_formats.cuh, id 5 "q5_g32"): c = v + 16h, v the low nibble in layout id 1 (the
//        INT4 words: the same lop3 picks a lane's pair), h one high bit in the qhigh plane — for
//        nibble p of code word i of a chunk, bit 4p + i of the chunk's high word; w = (c − 16)·s.
//        The high words travel with the codes through the stage (16 B a row and group, lane
//        t = 0 of each quad copies them).
//   Q8_0 (id 9 "q8_g32"): c one byte, byte i of word j is input 4j + i; w = (c − 128)·s. A group
//        is 128 B a row: the stage's code rows hold its first 64 B and its high part the second
//        64 B (copied by all four lanes of a quad from the same row, 64 B further on); two
//        stages at GEMM_BM 256 (gemm_stages: three of 80 KB need 240 KB).
// Why these formats here: llama.cpp's K-quant recipes give every tensor whose K is not a multiple
// of 256 Q5_0 in place of Q4_K and Q8_0 in place of Q6_K — on Qwen2.5-Coder-0.5B (K = 896) all of
// its projections but down_proj, 144 of its 168 projections — and Q4_0, Q5_0 and Q8_0 are GGUF
// quantizations of their own at every size (the official Qwen2.5-Coder GGUFs come in Q4_0 and
// Q8_0 among others).
// Bytes: 18, 22 and 34 per 32 weights (4.5, 5.5, 8.5 bits) — the 7B's gate_up at 512 tokens reads
// 76 MB (Q4_0) to 144 MB (Q8_0); in the ~0.22 ms its 139 GFLOP take at INT4's rate that is at most
// 14 % of the HBM bandwidth. The limit is, as for the K-quants, the consumer's unpack beside the
// tensor cores (the other warpgroup's MMAs hide it): Q4_0 is INT4's unpack with one scale per
// k-step pair, Q5_0 adds a lop3 a pair for the high bit and a rotate of the high word a chunk and
// row (gemm_high_biased), Q8_0 replaces the shift by a prmt. Work split, producer, consumers and
// epilogues are the file's; so is the barrier protocol (header): the high part sits in the stage
// under the same full and w_empty barriers (each producer lane arrives once, after all its copies
// of the stage landed), and with two stages (Q8_0 at GEMM_BM 256) the parity argument holds
// unchanged — it needs only that a barrier is never more than one phase ahead of its waiter.
// Measured: the README's format rows and this header's K-quant paragraph.
struct GemmLaneRowsG32 {
    const u32* wa;  const u32* wb;    // the rows' code words
    const u32* ha;  const u32* hb;    // the rows' high part: Q5_0's high-bit words, Q8_0's codes 64 B on
    const uint2* sa; const uint2* sb; // the rows' FP16 scales, four (one group's) an element
};

// The FP16 scale of each chunk of a group: S = (s, s) of each chunk and row. Each weight is then
// the exact c − z times S in one mul.rn.f16x2: the exact product (at most 8 × 11 significant bits)
// rounded once — the FP16 value of the reference's FP32 weight, bit for bit, as
// wf_dequant_pairs gives gemm_fmt_wgmma.cu.
struct GemmG32Scales {
    using Scales = const __half*;   // a matrix's scale plane, as the kernels take it
    using Rows = GemmLaneRowsG32;   // what rows_of returns
    struct Group {
        u32 s[2][4];  // [row g, g+8][chunk] half2 (s, s)
    };
    __device__ static __forceinline__ Group load(const GemmLaneRowsG32& r, int grp) {
        Group G;
#pragma unroll
        for (int row = 0; row < 2; ++row) {
            const uint2 v = (row ? r.sb : r.sa)[grp];  // chunks 0, 1 in v.x; 2, 3 in v.y
            G.s[row][0] = __byte_perm(v.x, 0, 0x1010);
            G.s[row][1] = __byte_perm(v.x, 0, 0x3232);
            G.s[row][2] = __byte_perm(v.y, 0, 0x1010);
            G.s[row][3] = __byte_perm(v.y, 0, 0x3232);
        }
        return G;
    }
};

// Q4_0: the INT4 words and zero point; each k step's pair times its chunk's scale.
struct GemmQ4g32Scales : GemmG32Scales {
    static constexpr int CODE_STRIDE = INT4_ITEM_WORDS;  // tile-major codes (gemm_code_row)
    static constexpr int HIGH_ROW_BYTES = 0;
    static constexpr int HIGH_STRIDE = 0;
    static constexpr bool ROWS_EACH_GROUP = true;
    __device__ static __forceinline__ void lane_row(const u32* qweight, const u32*, const __half* scales, int row,
                                                    int n, int K, int which, GemmLaneRowsG32& out) {
        const u64 r = (u64)min(row, n - 1);
        (which ? out.wb : out.wa) = gemm_code_row(qweight, r, K);
        (which ? out.sb : out.sa) = reinterpret_cast<const uint2*>(scales + r * (K / 32));
    }
    __device__ static __forceinline__ void fragments(const uint4 (&ra)[4], const uint4 (&rb)[4],
                                                     const uint4 (&)[GEMM_HIGH_MAX], const uint4 (&)[GEMM_HIGH_MAX],
                                                     int shift, const Group& G, u32 (&frag)[GEMM_K_STEPS][4]) {
#pragma unroll
        for (int s = 0; s < GEMM_K_STEPS; ++s) {
            const int j = s / 2;  // the chunk of k step s
            frag[s][0] = gemm_int4_pair(gemm_word(ra, 2 * s), shift, G.s[0][j]);
            frag[s][1] = gemm_int4_pair(gemm_word(rb, 2 * s), shift, G.s[1][j]);
            frag[s][2] = gemm_int4_pair(gemm_word(ra, 2 * s + 1), shift, G.s[0][j]);
            frag[s][3] = gemm_int4_pair(gemm_word(rb, 2 * s + 1), shift, G.s[1][j]);
        }
    }
};

// Q5_0: code word i of a chunk rotated so that the lane's pair sits at bit i, its high bit OR-ed
// in right above it under the magic number 2^(10−i) (gemm_high_biased; the chunk's high word
// rotated once a chunk and row): 2^(10−i) + v + 16h is an exact FP16, one sub.f16x2 of
// 2^(10−i) + 16 makes c − 16 exact.
struct GemmQ5g32Scales : GemmG32Scales {
    static constexpr int CODE_STRIDE = INT4_ITEM_WORDS;  // tile-major codes (gemm_code_row)
    static constexpr int HIGH_ROW_BYTES = 16;
    static constexpr int HIGH_STRIDE = INT4_TILE_ROWS * 4;  // tile-major high bits: one item
    static constexpr bool ROWS_EACH_GROUP = true;  // the producer's row pointers: recomputed each group
    // Row `row` (clamped into the matrix) of a weight [n, K] into the lane-rows slot `which`.
    __device__ static __forceinline__ void lane_row(const u32* qweight, const u32* qhigh, const __half* scales,
                                                    int row, int n, int K, int which, GemmLaneRowsG32& out) {
        const u64 r = (u64)min(row, n - 1);
        (which ? out.wb : out.wa) = gemm_code_row(qweight, r, K);
        (which ? out.hb : out.ha) = gemm_tiled_row<4>(qhigh, r, K);
        (which ? out.sb : out.sa) = reinterpret_cast<const uint2*>(scales + r * (K / 32));  // 8-byte aligned: K % 128 == 0
    }
    // Nibble pair t of code word w, word i of its chunk, with its high bits (hpos: the chunk's high
    // word, gemm_high_word) as (c − 16, c − 16) exact, then times S.
    __device__ static __forceinline__ u32 pair(u32 w, u32 hpos, int shift, int i, u32 s2) {
        const u32 biased = gemm_high_biased(w, hpos, shift, i, 0x00100010u);  // 2^(10−i) + c, c ≤ 31
        u32 q, out;
        asm("sub.f16x2 %0, %1, %2;" : "=r"(q) : "r"(biased), "r"(gemm_fp16x2_at(i, 16)));
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(q), "r"(s2));
        return out;
    }
    __device__ static __forceinline__ void fragments(const uint4 (&ra)[4], const uint4 (&rb)[4],
                                                     const uint4 (&ha)[GEMM_HIGH_MAX],
                                                     const uint4 (&hb)[GEMM_HIGH_MAX], int shift, const Group& G,
                                                     u32 (&frag)[GEMM_K_STEPS][4]) {
#pragma unroll
        for (int s = 0; s < GEMM_K_STEPS; ++s) {
            // k step s: code words 2s, 2s+1 = words i0 = 2(s % 2), i0 + 1 of chunk j = s / 2, whose
            // high bits for the lane's nibbles t and t + 4 are bits 4t + i and 4t + 16 + i of high
            // word j: rotated right by 4t − 4 (once for the chunk's four words), they sit at
            // 4 + i and 20 + i, right above the pair of word i rotated to bits i and 16 + i.
            const int j = s / 2, i0 = 2 * (s % 2);
            const u32 hA = gemm_high_word(wf_word(ha[0], j), shift), hB = gemm_high_word(wf_word(hb[0], j), shift);
            frag[s][0] = pair(gemm_word(ra, 2 * s), hA, shift, i0, G.s[0][j]);
            frag[s][1] = pair(gemm_word(rb, 2 * s), hB, shift, i0, G.s[1][j]);
            frag[s][2] = pair(gemm_word(ra, 2 * s + 1), hA, shift, i0 + 1, G.s[0][j]);
            frag[s][3] = pair(gemm_word(rb, 2 * s + 1), hB, shift, i0 + 1, G.s[1][j]);
        }
    }
};

// Q8_0: the lane's two bytes of a pair — inputs 16s + 2t, +1 are bytes 2t, 2t + 1 of the words
// (4s, 4s + 1) taken as 8 bytes, inputs 16s + 8 + 2t, +9 the same of (4s + 2, 4s + 3) — one prmt
// puts them in the low bytes of the halves, one lop3 sets 0x64 above each (1024 + c, exact), one
// sub.f16x2 of 1024 + 128 makes c − 128 exact.
struct GemmQ8g32Scales : GemmG32Scales {
    static constexpr int CODE_STRIDE = INT4_GROUP / 4;  // 128 B a row and group
    static constexpr int HIGH_ROW_BYTES = 64;           // the group's second 64 inputs
    static constexpr int HIGH_STRIDE = INT4_GROUP / 4;
    static constexpr bool ROWS_EACH_GROUP = true;
    __device__ static __forceinline__ void lane_row(const u32* qweight, const u32*, const __half* scales, int row,
                                                    int n, int K, int which, GemmLaneRowsG32& out) {
        const u64 r = (u64)min(row, n - 1);
        const u32* w = qweight + r * (K / 4);
        (which ? out.wb : out.wa) = w;
        (which ? out.hb : out.ha) = w + INT4_GROUP / 8;  // 64 B on: inputs 64–127 of each group
        (which ? out.sb : out.sa) = reinterpret_cast<const uint2*>(scales + r * (K / 32));
    }
    __device__ static __forceinline__ u32 pair(u32 lo, u32 hi, u32 sel, u32 s2) {
        const u32 b = __byte_perm(lo, hi, sel);                    // the two code bytes at bits 0–7, 16–23
        const u32 biased = lop3_and_or(b, 0x00FF00FFu, FP16X2_1024);  // (1024 + c0, 1024 + c1)
        u32 q, out;
        asm("sub.f16x2 %0, %1, %2;" : "=r"(q) : "r"(biased), "r"(FP16X2_1152));
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(q), "r"(s2));
        return out;
    }
    __device__ static __forceinline__ void fragments(const uint4 (&ra)[4], const uint4 (&rb)[4],
                                                     const uint4 (&ha)[GEMM_HIGH_MAX],
                                                     const uint4 (&hb)[GEMM_HIGH_MAX], int shift, const Group& G,
                                                     u32 (&frag)[GEMM_K_STEPS][4]) {
        const int t = shift / 4;
        const u32 sel = (u32)(2 * t) | ((u32)(2 * t + 1) << 8);  // bytes 2t, 2t + 1 of (lo, hi) to bytes 0, 2
#pragma unroll
        for (int s = 0; s < GEMM_K_STEPS; ++s) {
            const int j = s / 2;
            const uint4 a = s < 4 ? ra[s] : ha[s - 4], b = s < 4 ? rb[s] : hb[s - 4];  // words 4s … 4s+3 of each row
            frag[s][0] = pair(a.x, a.y, sel, G.s[0][j]);
            frag[s][1] = pair(b.x, b.y, sel, G.s[1][j]);
            frag[s][2] = pair(a.z, a.w, sel, G.s[0][j]);
            frag[s][3] = pair(b.z, b.w, sel, G.s[1][j]);
        }
    }
};

// Q4_1 and Q5_1 (weight_formats.cuh ids 3 and 6): Q4_0's and Q5_0's codes, unsigned (no zero
// point), with an FP16 offset per 32-input chunk beside the scale: w = c·s + o. Each weight is the
// exact c, then one fma.rn.f16x2 by (s, s) and (o, o): c·s + o rounded once, to FP16, where the
// reference rounds it to FP32 first (c·s is exact in either; the two differ only where the FP32
// sum sits on an FP16 rounding tie — within the GEMMs' tolerance, docs/numerics.md).
struct GemmLaneRowsG32Min : GemmLaneRowsG32 {
    const uint2* oa; const uint2* ob; // the rows' FP16 offsets, four (one group's) an element
};
struct GemmG32MinScales {
    struct Scales {                   // a matrix's scale and offset planes, as the kernels take them
        const __half* s;
        const __half* o;
    };
    using Rows = GemmLaneRowsG32Min;
    struct Group {
        u32 s[2][4], o[2][4];  // [row g, g+8][chunk] half2 (s, s), (o, o)
    };
    __device__ static __forceinline__ Group load(const GemmLaneRowsG32Min& r, int grp) {
        Group G;
#pragma unroll
        for (int row = 0; row < 2; ++row) {
            const uint2 v = (row ? r.sb : r.sa)[grp], w = (row ? r.ob : r.oa)[grp];  // chunks 0, 1 in .x; 2, 3 in .y
            G.s[row][0] = __byte_perm(v.x, 0, 0x1010);
            G.s[row][1] = __byte_perm(v.x, 0, 0x3232);
            G.s[row][2] = __byte_perm(v.y, 0, 0x1010);
            G.s[row][3] = __byte_perm(v.y, 0, 0x3232);
            G.o[row][0] = __byte_perm(w.x, 0, 0x1010);
            G.o[row][1] = __byte_perm(w.x, 0, 0x3232);
            G.o[row][2] = __byte_perm(w.y, 0, 0x1010);
            G.o[row][3] = __byte_perm(w.y, 0, 0x3232);
        }
        return G;
    }
    // Row `row` (clamped into the matrix): its code words and the scale and offset of its groups.
    __device__ static __forceinline__ void lane_row_min(const u32* qweight, Scales so, int row, int n, int K,
                                                        int which, GemmLaneRowsG32Min& out) {
        const u64 r = (u64)min(row, n - 1);
        (which ? out.wb : out.wa) = gemm_code_row(qweight, r, K);
        (which ? out.sb : out.sa) = reinterpret_cast<const uint2*>(so.s + r * (K / 32));  // 8-byte aligned: K % 128 == 0
        (which ? out.ob : out.oa) = reinterpret_cast<const uint2*>(so.o + r * (K / 32));
    }
    // (c, c) exact from the biased pair (magic + c0, magic + c1), then c·S + O.
    __device__ static __forceinline__ u32 fma_pair(u32 biased, u32 magic, u32 s2, u32 o2) {
        u32 c, out;
        asm("sub.f16x2 %0, %1, %2;" : "=r"(c) : "r"(biased), "r"(magic));
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(c), "r"(s2), "r"(o2));
        return out;
    }
};

// Q4_1: the INT4 words, c ≤ 15.
struct GemmQ4g32MinScales : GemmG32MinScales {
    static constexpr int CODE_STRIDE = INT4_ITEM_WORDS;  // tile-major codes (gemm_code_row)
    static constexpr int HIGH_ROW_BYTES = 0;
    static constexpr int HIGH_STRIDE = 0;
    static constexpr bool ROWS_EACH_GROUP = true;
    __device__ static __forceinline__ void lane_row(const u32* qweight, const u32*, Scales so, int row, int n, int K,
                                                    int which, GemmLaneRowsG32Min& out) {
        lane_row_min(qweight, so, row, n, K, which, out);
    }
    __device__ static __forceinline__ u32 pair(u32 w, int shift, u32 s2, u32 o2) {
        return fma_pair(lop3_and_or(w >> shift, INT4_MASK_LO, FP16X2_1024), FP16X2_1024, s2, o2);
    }
    __device__ static __forceinline__ void fragments(const uint4 (&ra)[4], const uint4 (&rb)[4],
                                                     const uint4 (&)[GEMM_HIGH_MAX], const uint4 (&)[GEMM_HIGH_MAX],
                                                     int shift, const Group& G, u32 (&frag)[GEMM_K_STEPS][4]) {
#pragma unroll
        for (int s = 0; s < GEMM_K_STEPS; ++s) {
            const int j = s / 2;  // the chunk of k step s
            frag[s][0] = pair(gemm_word(ra, 2 * s), shift, G.s[0][j], G.o[0][j]);
            frag[s][1] = pair(gemm_word(rb, 2 * s), shift, G.s[1][j], G.o[1][j]);
            frag[s][2] = pair(gemm_word(ra, 2 * s + 1), shift, G.s[0][j], G.o[0][j]);
            frag[s][3] = pair(gemm_word(rb, 2 * s + 1), shift, G.s[1][j], G.o[1][j]);
        }
    }
};

// Q5_1: Q5_0's high-bit plane in the stage beside the codes (16 B a row and group), c ≤ 31, and
// its unpack (GemmQ5g32Scales: the pair rotated to bit i under the magic number 2^(10−i)).
struct GemmQ5g32MinScales : GemmG32MinScales {
    static constexpr int CODE_STRIDE = INT4_ITEM_WORDS;  // tile-major codes (gemm_code_row)
    static constexpr int HIGH_ROW_BYTES = 16;
    static constexpr int HIGH_STRIDE = INT4_TILE_ROWS * 4;  // tile-major high bits: one item
    static constexpr bool ROWS_EACH_GROUP = true;
    __device__ static __forceinline__ void lane_row(const u32* qweight, const u32* qhigh, Scales so, int row, int n,
                                                    int K, int which, GemmLaneRowsG32Min& out) {
        lane_row_min(qweight, so, row, n, K, which, out);
        (which ? out.hb : out.ha) = gemm_tiled_row<4>(qhigh, (u64)min(row, n - 1), K);
    }
    // hpos: the chunk's high word, gemm_high_word; i: w's word of the chunk (GemmQ5g32Scales).
    __device__ static __forceinline__ u32 pair(u32 w, u32 hpos, int shift, int i, u32 s2, u32 o2) {
        return fma_pair(gemm_high_biased(w, hpos, shift, i, 0x00100010u), gemm_fp16x2_at(i, 0), s2, o2);
    }
    __device__ static __forceinline__ void fragments(const uint4 (&ra)[4], const uint4 (&rb)[4],
                                                     const uint4 (&ha)[GEMM_HIGH_MAX],
                                                     const uint4 (&hb)[GEMM_HIGH_MAX], int shift, const Group& G,
                                                     u32 (&frag)[GEMM_K_STEPS][4]) {
#pragma unroll
        for (int s = 0; s < GEMM_K_STEPS; ++s) {
            const int j = s / 2, i0 = 2 * (s % 2);  // as GemmQ5g32Scales::fragments
            const u32 hA = gemm_high_word(wf_word(ha[0], j), shift), hB = gemm_high_word(wf_word(hb[0], j), shift);
            frag[s][0] = pair(gemm_word(ra, 2 * s), hA, shift, i0, G.s[0][j], G.o[0][j]);
            frag[s][1] = pair(gemm_word(rb, 2 * s), hB, shift, i0, G.s[1][j], G.o[1][j]);
            frag[s][2] = pair(gemm_word(ra, 2 * s + 1), hA, shift, i0 + 1, G.s[0][j], G.o[0][j]);
            frag[s][3] = pair(gemm_word(rb, 2 * s + 1), hB, shift, i0 + 1, G.s[1][j], G.o[1][j]);
        }
    }
};

// Shared memory of a build with policy Sc's stages (gemm_smem_bytes; launchers mirror them): Q4_0
// INT4's, Q5_0 three 256-token stages of 74 KB (223 KB), Q8_0 two of 80 KB.
#define GEMM_Q4_SMEM_BYTES (gemm_smem_bytes<GemmQ4g32Scales>())
#define GEMM_Q5_SMEM_BYTES (gemm_smem_bytes<GemmQ5g32Scales>())
#define GEMM_Q8_SMEM_BYTES (gemm_smem_bytes<GemmQ8g32Scales>())
static_assert(GEMM_Q5_SMEM_BYTES <= 227 * 1024, "shared memory");

// The three kernels' bodies, one per policy Sc (the extern "C" kernels below spell out each
// format's parameters). qhigh: Q5_0's high-bit plane; unused by Q4_0 and Q8_0 (null).
template <typename Sc>
__device__ __forceinline__ void gemm_g32_residual(float* residual, const CUtensorMap& x_map, const u32* qweight,
                                                  const u32* qhigh, typename Sc::Scales scales, const int* prefill_state,
                                                  float* split_partials, int* split_counters, int N, int K) {
    int ra = 0;
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters}, [&](int rb, int local) {
        typename Sc::Rows r;
        ra = rb * GEMM_BLOCK_ROWS + local;
        Sc::lane_row(qweight, qhigh, scales, ra, N, K, 0, r);
        Sc::lane_row(qweight, qhigh, scales, ra + 8, N, K, 1, r);
        return r;
    }, GemmResidualAdd{residual, N, &ra}, Sc{});
}

// One to three matrices stacked along N (N1 = N2 = 0: one); rows g and g+8 of a warp tile may lie
// in different matrices: each row picks its own.
template <typename Sc>
__device__ __forceinline__ void gemm_g32_stacked_rows(float* out, const CUtensorMap& x_map, const u32* const (&qw)[3],
                                                      const u32* const (&qh)[3], const typename Sc::Scales (&sc)[3],
                                                      const int* prefill_state, float* split_partials,
                                                      int* split_counters, int N0, int N1, int N2, int K, int ldo,
                                                      int col0) {
    const int N = N0 + N1 + N2;
    int ra = 0;  // the stacked row of the lane's row g; row g+8 is ra + 8
    auto one = [&](int row, int which, typename Sc::Rows& o) {
        const int r = min(row, N - 1);
        const int m = r < N0 ? 0 : r < N0 + N1 ? 1 : 2;
        const int i = r - (m == 0 ? 0 : m == 1 ? N0 : N0 + N1);
        // The matrix by comparisons (int4_pick): qw[m] with a runtime m reads the arrays from
        // local memory, two loads a row every group.
        Sc::lane_row(int4_pick(m, qw[0], qw[1], qw[2]), int4_pick(m, qh[0], qh[1], qh[2]),
                     int4_pick(m, sc[0], sc[1], sc[2]), i, m == 0 ? N0 : m == 1 ? N1 : N2, K, which, o);
    };
    gemm_int4_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmSplitK{split_partials, split_counters}, [&](int rb, int local) {
        typename Sc::Rows r;
        ra = rb * GEMM_BLOCK_ROWS + local;
        one(ra, 0, r);
        one(ra + 8, 1, r);
        return r;
    }, gemm_each_token([&](int token, float va, float vb) {
        if (ra < N) out[(u64)token * ldo + col0 + ra] = va;
        if (ra + 8 < N) out[(u64)token * ldo + col0 + ra + 8] = vb;
    }), Sc{});
}

template <typename Sc>
__device__ __forceinline__ void gemm_g32_gate_up_swiglu(__half* h, const CUtensorMap& x_map, const u32* gate_qweight,
                                                        const u32* gate_qhigh, typename Sc::Scales gate_scales,
                                                        const u32* up_qweight, const u32* up_qhigh,
                                                        typename Sc::Scales up_scales, const int* prefill_state,
                                                        float* split_partials, int* split_counters, int F, int K) {
    int f = 0;
    constexpr int FB = GEMM_BLOCK_ROWS / 2;  // features per row block
    gemm_int4_block(x_map, prefill_state, K, (F + FB - 1) / FB, GemmSplitK{split_partials, split_counters},
                    [&](int rb, int local) {
        typename Sc::Rows r;
        f = rb * FB + (local / INT4_TILE_ROWS) * 8 + local % INT4_TILE_ROWS;
        Sc::lane_row(gate_qweight, gate_qhigh, gate_scales, f, F, K, 0, r);
        Sc::lane_row(up_qweight, up_qhigh, up_scales, f, F, K, 1, r);
        return r;
    }, gemm_each_token([&](int token, float gate, float up) {
        if (f < F) h[(u32)token * (u32)F + f] = swiglu_f16_approx(gate, up);
    }), Sc{});
}

// q, k and v in one of these formats with the bias, the RoPE and the FP16 writes in the epilogue:
// gemm_int4_qkv_rope's rows, pairs and epilogue (GemmRopePair, GemmQkvRopeEpilogue) over Sc.
template <typename Sc>
__device__ __forceinline__ void gemm_g32_qkv_rope(__half* q_out, __half* k_cache, __half* v_cache,
                                                  const CUtensorMap& x_map, const u32* const (&qw)[3],
                                                  const u32* const (&qh)[3], const typename Sc::Scales (&sc)[3],
                                                  const __half* q_bias, const __half* k_bias, const __half* v_bias,
                                                  const float2* rope_cs, const int* prefill_state,
                                                  const int* block_table, float* split_partials, int* split_counters,
                                                  int Hq, int Hkv, int Dh, int K) {
    const int half_dim = Dh / 2;
    const int n_pairs = (Hq + 2 * Hkv) * half_dim;
    constexpr int PB = GEMM_BLOCK_ROWS / 2;  // pairs per row block
    int pair = 0;  // the lane's pair, set by rows_of (as gemm_int4_qkv_rope's)
    const u32 half_dim_rcp = div_reciprocal(half_dim);
    gemm_int4_block(x_map, prefill_state, K, (n_pairs + PB - 1) / PB, GemmSplitK{split_partials, split_counters},
                    [&](int rb, int local) {
        typename Sc::Rows r;
        pair = gemm_rope_pair_of(rb, local);
        const GemmRopePair rp(min(pair, n_pairs - 1), half_dim, half_dim_rcp, Hq, Hkv);
        const int n = (rp.seg == 0 ? Hq : Hkv) * Dh;
        // The matrix by comparisons (int4_pick), not qw[rp.seg]: a runtime index reads the
        // arrays from local memory every group.
        const u32* const w = int4_pick(rp.seg, qw[0], qw[1], qw[2]);
        const u32* const hi = int4_pick(rp.seg, qh[0], qh[1], qh[2]);
        const typename Sc::Scales so = int4_pick(rp.seg, sc[0], sc[1], sc[2]);
        Sc::lane_row(w, hi, so, rp.h * Dh + rp.i, n, K, 0, r);
        Sc::lane_row(w, hi, so, rp.h * Dh + rp.i + half_dim, n, K, 1, r);
        return r;
    }, GemmQkvRopeEpilogue{q_out, k_cache, v_cache, q_bias, k_bias, v_bias, rope_cs, prefill_state, block_table,
                           Hq, Hkv, Dh, &pair}, Sc{});
}

// q, k and v in Q4_0 with the bias, the RoPE and the FP16 writes in the epilogue (gemm_q4k_qkv_rope's
// outputs and contract).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4g32_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                    __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                    __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                    const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                    const u32* __restrict__ q_qweight,        // [Hq·Dh, K/8] uint32
                    const __half* __restrict__ q_scales,      // [Hq·Dh, K/32] fp16
                    const u32* __restrict__ k_qweight,        // [Hkv·Dh, K/8] uint32
                    const __half* __restrict__ k_scales,      // [Hkv·Dh, K/32] fp16
                    const u32* __restrict__ v_qweight,        // [Hkv·Dh, K/8] uint32
                    const __half* __restrict__ v_scales,      // [Hkv·Dh, K/32] fp16
                    const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                    const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                    const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                    const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                    const int* __restrict__ prefill_state,    // [2] int32: start position, M
                    const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                    float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                    int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                    int Hq, int Hkv, int Dh, int K) {
    const u32* const qw[3] = {q_qweight, k_qweight, v_qweight};
    const u32* const qh[3] = {nullptr, nullptr, nullptr};
    const __half* const sc[3] = {q_scales, k_scales, v_scales};
    gemm_g32_qkv_rope<GemmQ4g32Scales>(q_out, k_cache, v_cache, x_map, qw, qh, sc, q_bias, k_bias, v_bias, rope_cs,
                                       prefill_state, block_table, split_partials, split_counters, Hq, Hkv, Dh, K);
}

// residual += X Wᵀ in FP32, W in Q4_0. As gemm_int4_residual.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4g32_residual(float* __restrict__ residual,            // [M, N] fp32, in/out
                    const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                    const u32* __restrict__ qweight,         // [N, K/8] uint32, layout id 1 tile-major
                    const __half* __restrict__ scales,       // [N, K/32] fp16
                    const int* __restrict__ prefill_state,   // [2] int32: start (unused here), M
                    float* __restrict__ split_partials,      // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                    int* __restrict__ split_counters,        // [grid] int32, zero between launches, or null
                    int N, int K) {
    gemm_g32_residual<GemmQ4g32Scales>(residual, x_map, qweight, nullptr, scales, prefill_state, split_partials,
                                       split_counters, N, K);
}

// out[token, col0 + n] = X [W0; W1; W2]ᵀ in FP32 for one to three Q4_0 matrices stacked along N.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4g32_stacked_rows(float* __restrict__ out,                   // [M, ldo] fp32, columns col0 … col0+N0+N1+N2-1 written
                        const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden states)
                        const u32* __restrict__ w0_qweight,        // [N0, K/8] uint32
                        const __half* __restrict__ w0_scales,      // [N0, K/32] fp16
                        const u32* __restrict__ w1_qweight,        // [N1, …] (N1 = 0: unused)
                        const __half* __restrict__ w1_scales,
                        const u32* __restrict__ w2_qweight,        // [N2, …] (N2 = 0: unused)
                        const __half* __restrict__ w2_scales,
                        const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                        float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                        int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                        int N0, int N1, int N2, int K, int ldo, int col0) {
    const u32* const qw[3] = {w0_qweight, w1_qweight, w2_qweight};
    const u32* const qh[3] = {nullptr, nullptr, nullptr};
    const __half* const sc[3] = {w0_scales, w1_scales, w2_scales};
    gemm_g32_stacked_rows<GemmQ4g32Scales>(out, x_map, qw, qh, sc, prefill_state, split_partials, split_counters,
                                           N0, N1, N2, K, ldo, col0);
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ), gate and up in Q4_0. As gemm_int4_gate_up_swiglu.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4g32_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                          const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden)
                          const u32* __restrict__ gate_qweight,      // [F, K/8] uint32
                          const __half* __restrict__ gate_scales,    // [F, K/32] fp16
                          const u32* __restrict__ up_qweight,        // [F, K/8] uint32
                          const __half* __restrict__ up_scales,      // [F, K/32] fp16
                          const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                          float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                          int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                          int F, int K) {
    gemm_g32_gate_up_swiglu<GemmQ4g32Scales>(h, x_map, gate_qweight, nullptr, gate_scales, up_qweight, nullptr,
                                             up_scales, prefill_state, split_partials, split_counters, F, K);
}

// q, k and v in Q5_0 with the bias, the RoPE and the FP16 writes in the epilogue (gemm_q4k_qkv_rope's
// outputs and contract).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5g32_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                    __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                    __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                    const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                    const u32* __restrict__ q_qweight,        // [Hq·Dh, K/8] uint32
                    const u32* __restrict__ q_qhigh,          // [Hq·Dh, K/32] uint32 tile-major
                    const __half* __restrict__ q_scales,      // [Hq·Dh, K/32] fp16
                    const u32* __restrict__ k_qweight,        // [Hkv·Dh, K/8] uint32
                    const u32* __restrict__ k_qhigh,          // [Hkv·Dh, K/32] uint32 tile-major
                    const __half* __restrict__ k_scales,      // [Hkv·Dh, K/32] fp16
                    const u32* __restrict__ v_qweight,        // [Hkv·Dh, K/8] uint32
                    const u32* __restrict__ v_qhigh,          // [Hkv·Dh, K/32] uint32 tile-major
                    const __half* __restrict__ v_scales,      // [Hkv·Dh, K/32] fp16
                    const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                    const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                    const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                    const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                    const int* __restrict__ prefill_state,    // [2] int32: start position, M
                    const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                    float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                    int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                    int Hq, int Hkv, int Dh, int K) {
    const u32* const qw[3] = {q_qweight, k_qweight, v_qweight};
    const u32* const qh[3] = {q_qhigh, k_qhigh, v_qhigh};
    const __half* const sc[3] = {q_scales, k_scales, v_scales};
    gemm_g32_qkv_rope<GemmQ5g32Scales>(q_out, k_cache, v_cache, x_map, qw, qh, sc, q_bias, k_bias, v_bias, rope_cs,
                                       prefill_state, block_table, split_partials, split_counters, Hq, Hkv, Dh, K);
}

// residual += X Wᵀ in FP32, W in Q5_0 (o_proj, down_proj). As gemm_int4_residual.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5g32_residual(float* __restrict__ residual,            // [M, N] fp32, in/out
                    const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                    const u32* __restrict__ qweight,         // [N, K/8] uint32, the low nibbles (layout id 1), tile-major
                    const u32* __restrict__ qhigh,           // [N, K/32] uint32 tile-major, the high bits
                    const __half* __restrict__ scales,       // [N, K/32] fp16
                    const int* __restrict__ prefill_state,   // [2] int32: start (unused here), M
                    float* __restrict__ split_partials,      // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                    int* __restrict__ split_counters,        // [grid] int32, zero between launches, or null
                    int N, int K) {
    gemm_g32_residual<GemmQ5g32Scales>(residual, x_map, qweight, qhigh, scales, prefill_state, split_partials,
                                       split_counters, N, K);
}

// out[token, col0 + n] = X [W0; W1; W2]ᵀ in FP32 for one to three Q5_0 matrices stacked along N
// (N1 = N2 = 0: one): a layer's q and k where v is another format (llama.cpp's Q4_K_M on a model
// whose K is not a multiple of 256: v in Q8_0 on the layers that get more bits), or q, k and v in
// one launch where all three are Q5_0 and the RoPE runs apart (by default gemm_q5g32_qkv_rope
// takes those). Tiles: ceil(M/GEMM_BM) × ceil((N0+N1+N2)/128).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5g32_stacked_rows(float* __restrict__ out,                   // [M, ldo] fp32, columns col0 … col0+N0+N1+N2-1 written
                        const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden states)
                        const u32* __restrict__ w0_qweight,        // [N0, K/8] uint32
                        const u32* __restrict__ w0_qhigh,          // [N0, K/32] uint32 tile-major
                        const __half* __restrict__ w0_scales,      // [N0, K/32] fp16
                        const u32* __restrict__ w1_qweight,        // [N1, …] (N1 = 0: unused)
                        const u32* __restrict__ w1_qhigh,
                        const __half* __restrict__ w1_scales,
                        const u32* __restrict__ w2_qweight,        // [N2, …] (N2 = 0: unused)
                        const u32* __restrict__ w2_qhigh,
                        const __half* __restrict__ w2_scales,
                        const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                        float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                        int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                        int N0, int N1, int N2, int K, int ldo, int col0) {
    const u32* const qw[3] = {w0_qweight, w1_qweight, w2_qweight};
    const u32* const qh[3] = {w0_qhigh, w1_qhigh, w2_qhigh};
    const __half* const sc[3] = {w0_scales, w1_scales, w2_scales};
    gemm_g32_stacked_rows<GemmQ5g32Scales>(out, x_map, qw, qh, sc, prefill_state, split_partials, split_counters,
                                           N0, N1, N2, K, ldo, col0);
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ), gate and up in Q5_0. As gemm_int4_gate_up_swiglu.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5g32_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                          const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden)
                          const u32* __restrict__ gate_qweight,      // [F, K/8] uint32
                          const u32* __restrict__ gate_qhigh,        // [F, K/32] uint32 tile-major
                          const __half* __restrict__ gate_scales,    // [F, K/32] fp16
                          const u32* __restrict__ up_qweight,        // [F, K/8] uint32
                          const u32* __restrict__ up_qhigh,          // [F, K/32] uint32 tile-major
                          const __half* __restrict__ up_scales,      // [F, K/32] fp16
                          const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                          float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                          int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                          int F, int K) {
    gemm_g32_gate_up_swiglu<GemmQ5g32Scales>(h, x_map, gate_qweight, gate_qhigh, gate_scales, up_qweight, up_qhigh,
                                             up_scales, prefill_state, split_partials, split_counters, F, K);
}

static_assert(GEMM_Q8_SMEM_BYTES <= 227 * 1024, "shared memory");

// q, k and v in Q8_0 with the bias, the RoPE and the FP16 writes in the epilogue (gemm_q4k_qkv_rope's
// outputs and contract).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q8g32_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                    __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                    __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                    const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                    const u32* __restrict__ q_qweight,        // [Hq·Dh, K/4] uint32
                    const __half* __restrict__ q_scales,      // [Hq·Dh, K/32] fp16
                    const u32* __restrict__ k_qweight,        // [Hkv·Dh, K/4] uint32
                    const __half* __restrict__ k_scales,      // [Hkv·Dh, K/32] fp16
                    const u32* __restrict__ v_qweight,        // [Hkv·Dh, K/4] uint32
                    const __half* __restrict__ v_scales,      // [Hkv·Dh, K/32] fp16
                    const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                    const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                    const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                    const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                    const int* __restrict__ prefill_state,    // [2] int32: start position, M
                    const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                    float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                    int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                    int Hq, int Hkv, int Dh, int K) {
    const u32* const qw[3] = {q_qweight, k_qweight, v_qweight};
    const u32* const qh[3] = {nullptr, nullptr, nullptr};
    const __half* const sc[3] = {q_scales, k_scales, v_scales};
    gemm_g32_qkv_rope<GemmQ8g32Scales>(q_out, k_cache, v_cache, x_map, qw, qh, sc, q_bias, k_bias, v_bias, rope_cs,
                                       prefill_state, block_table, split_partials, split_counters, Hq, Hkv, Dh, K);
}

// residual += X Wᵀ in FP32, W in Q8_0. As gemm_int4_residual.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q8g32_residual(float* __restrict__ residual,            // [M, N] fp32, in/out
                    const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                    const u32* __restrict__ qweight,         // [N, K/4] uint32, the 8-bit codes
                    const __half* __restrict__ scales,       // [N, K/32] fp16
                    const int* __restrict__ prefill_state,   // [2] int32: start (unused here), M
                    float* __restrict__ split_partials,      // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                    int* __restrict__ split_counters,        // [grid] int32, zero between launches, or null
                    int N, int K) {
    gemm_g32_residual<GemmQ8g32Scales>(residual, x_map, qweight, nullptr, scales, prefill_state, split_partials,
                                       split_counters, N, K);
}

// out[token, col0 + n] = X [W0; W1; W2]ᵀ in FP32 for one to three Q8_0 matrices stacked along N:
// v_proj alone where llama.cpp's recipe gives it Q8_0 and q, k Q5_0; q, k and v of a Q8_0 GGUF
// where the RoPE runs apart (by default gemm_q8g32_qkv_rope takes those).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q8g32_stacked_rows(float* __restrict__ out,                   // [M, ldo] fp32, columns col0 … col0+N0+N1+N2-1 written
                        const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden states)
                        const u32* __restrict__ w0_qweight,        // [N0, K/4] uint32
                        const __half* __restrict__ w0_scales,      // [N0, K/32] fp16
                        const u32* __restrict__ w1_qweight,        // [N1, …] (N1 = 0: unused)
                        const __half* __restrict__ w1_scales,
                        const u32* __restrict__ w2_qweight,        // [N2, …] (N2 = 0: unused)
                        const __half* __restrict__ w2_scales,
                        const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                        float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                        int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                        int N0, int N1, int N2, int K, int ldo, int col0) {
    const u32* const qw[3] = {w0_qweight, w1_qweight, w2_qweight};
    const u32* const qh[3] = {nullptr, nullptr, nullptr};
    const __half* const sc[3] = {w0_scales, w1_scales, w2_scales};
    gemm_g32_stacked_rows<GemmQ8g32Scales>(out, x_map, qw, qh, sc, prefill_state, split_partials, split_counters,
                                           N0, N1, N2, K, ldo, col0);
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ), gate and up in Q8_0. As gemm_int4_gate_up_swiglu.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q8g32_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                          const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden)
                          const u32* __restrict__ gate_qweight,      // [F, K/4] uint32
                          const __half* __restrict__ gate_scales,    // [F, K/32] fp16
                          const u32* __restrict__ up_qweight,        // [F, K/4] uint32
                          const __half* __restrict__ up_scales,      // [F, K/32] fp16
                          const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                          float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                          int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                          int F, int K) {
    gemm_g32_gate_up_swiglu<GemmQ8g32Scales>(h, x_map, gate_qweight, nullptr, gate_scales, up_qweight, nullptr,
                                             up_scales, prefill_state, split_partials, split_counters, F, K);
}

// ---- Q4_1 and Q5_1 (an FP16 offset per 32-input chunk) on the same mainloop ------------------
// The bodies above with GemmQ4g32MinScales / GemmQ5g32MinScales: each matrix is (qweight, [qhigh,]
// scales, offsets), the offsets fp16 [N, K/32] beside the scales. Q4_1's stage is Q4_0's, Q5_1's
// Q5_0's (GEMM_Q4_SMEM_BYTES, GEMM_Q5_SMEM_BYTES).

// q, k and v in Q4_1 with the bias, the RoPE and the FP16 writes in the epilogue.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4g32min_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                       __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                       __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                       const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                       const u32* __restrict__ q_qweight,        // [Hq·Dh, K/8] uint32
                       const __half* __restrict__ q_scales,      // [Hq·Dh, K/32] fp16
                       const __half* __restrict__ q_offsets,     // [Hq·Dh, K/32] fp16
                       const u32* __restrict__ k_qweight,        // [Hkv·Dh, K/8] uint32
                       const __half* __restrict__ k_scales,      // [Hkv·Dh, K/32] fp16
                       const __half* __restrict__ k_offsets,     // [Hkv·Dh, K/32] fp16
                       const u32* __restrict__ v_qweight,        // [Hkv·Dh, K/8] uint32
                       const __half* __restrict__ v_scales,      // [Hkv·Dh, K/32] fp16
                       const __half* __restrict__ v_offsets,     // [Hkv·Dh, K/32] fp16
                       const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                       const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                       const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                       const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                       const int* __restrict__ prefill_state,    // [2] int32: start position, M
                       const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                       float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                       int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                       int Hq, int Hkv, int Dh, int K) {
    using S = GemmQ4g32MinScales::Scales;
    const u32* const qw[3] = {q_qweight, k_qweight, v_qweight};
    const u32* const qh[3] = {nullptr, nullptr, nullptr};
    const S sc[3] = {S{q_scales, q_offsets}, S{k_scales, k_offsets}, S{v_scales, v_offsets}};
    gemm_g32_qkv_rope<GemmQ4g32MinScales>(q_out, k_cache, v_cache, x_map, qw, qh, sc, q_bias, k_bias, v_bias,
                                          rope_cs, prefill_state, block_table, split_partials, split_counters, Hq,
                                          Hkv, Dh, K);
}

// residual += X Wᵀ in FP32, W in Q4_1. As gemm_int4_residual.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4g32min_residual(float* __restrict__ residual,            // [M, N] fp32, in/out
                       const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                       const u32* __restrict__ qweight,         // [N, K/8] uint32, layout id 1 tile-major
                       const __half* __restrict__ scales,       // [N, K/32] fp16
                       const __half* __restrict__ offsets,      // [N, K/32] fp16
                       const int* __restrict__ prefill_state,   // [2] int32: start (unused here), M
                       float* __restrict__ split_partials,      // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                       int* __restrict__ split_counters,        // [grid] int32, zero between launches, or null
                       int N, int K) {
    gemm_g32_residual<GemmQ4g32MinScales>(residual, x_map, qweight, nullptr, {scales, offsets}, prefill_state,
                                          split_partials, split_counters, N, K);
}

// out[token, col0 + n] = X [W0; W1; W2]ᵀ in FP32 for one to three Q4_1 matrices stacked along N.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4g32min_stacked_rows(float* __restrict__ out,                   // [M, ldo] fp32, columns col0 … col0+N0+N1+N2-1 written
                           const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden states)
                           const u32* __restrict__ w0_qweight,        // [N0, K/8] uint32
                           const __half* __restrict__ w0_scales,      // [N0, K/32] fp16
                           const __half* __restrict__ w0_offsets,     // [N0, K/32] fp16
                           const u32* __restrict__ w1_qweight,        // [N1, …] (N1 = 0: unused)
                           const __half* __restrict__ w1_scales,
                           const __half* __restrict__ w1_offsets,
                           const u32* __restrict__ w2_qweight,        // [N2, …] (N2 = 0: unused)
                           const __half* __restrict__ w2_scales,
                           const __half* __restrict__ w2_offsets,
                           const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                           float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                           int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                           int N0, int N1, int N2, int K, int ldo, int col0) {
    using S = GemmQ4g32MinScales::Scales;
    const u32* const qw[3] = {w0_qweight, w1_qweight, w2_qweight};
    const u32* const qh[3] = {nullptr, nullptr, nullptr};
    const S sc[3] = {S{w0_scales, w0_offsets}, S{w1_scales, w1_offsets}, S{w2_scales, w2_offsets}};
    gemm_g32_stacked_rows<GemmQ4g32MinScales>(out, x_map, qw, qh, sc, prefill_state, split_partials, split_counters,
                                              N0, N1, N2, K, ldo, col0);
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ), gate and up in Q4_1. As gemm_int4_gate_up_swiglu.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q4g32min_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                             const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden)
                             const u32* __restrict__ gate_qweight,      // [F, K/8] uint32
                             const __half* __restrict__ gate_scales,    // [F, K/32] fp16
                             const __half* __restrict__ gate_offsets,   // [F, K/32] fp16
                             const u32* __restrict__ up_qweight,        // [F, K/8] uint32
                             const __half* __restrict__ up_scales,      // [F, K/32] fp16
                             const __half* __restrict__ up_offsets,     // [F, K/32] fp16
                             const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                             float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                             int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                             int F, int K) {
    gemm_g32_gate_up_swiglu<GemmQ4g32MinScales>(h, x_map, gate_qweight, nullptr, {gate_scales, gate_offsets},
                                                up_qweight, nullptr, {up_scales, up_offsets}, prefill_state,
                                                split_partials, split_counters, F, K);
}

// q, k and v in Q5_1 with the bias, the RoPE and the FP16 writes in the epilogue.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5g32min_qkv_rope(__half* __restrict__ q_out,               // [M, Hq, Dh] fp16, out (rotated queries)
                       __half* __restrict__ k_cache,             // [P, Hkv, 16, Dh] fp16, this layer; the chunk's slots written
                       __half* __restrict__ v_cache,             // [P, Hkv, 16, Dh] fp16, this layer; likewise
                       const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden states)
                       const u32* __restrict__ q_qweight,        // [Hq·Dh, K/8] uint32
                       const u32* __restrict__ q_qhigh,          // [Hq·Dh, K/32] uint32 tile-major
                       const __half* __restrict__ q_scales,      // [Hq·Dh, K/32] fp16
                       const __half* __restrict__ q_offsets,     // [Hq·Dh, K/32] fp16
                       const u32* __restrict__ k_qweight,        // [Hkv·Dh, K/8] uint32
                       const u32* __restrict__ k_qhigh,          // [Hkv·Dh, K/32] uint32 tile-major
                       const __half* __restrict__ k_scales,      // [Hkv·Dh, K/32] fp16
                       const __half* __restrict__ k_offsets,     // [Hkv·Dh, K/32] fp16
                       const u32* __restrict__ v_qweight,        // [Hkv·Dh, K/8] uint32
                       const u32* __restrict__ v_qhigh,          // [Hkv·Dh, K/32] uint32 tile-major
                       const __half* __restrict__ v_scales,      // [Hkv·Dh, K/32] fp16
                       const __half* __restrict__ v_offsets,     // [Hkv·Dh, K/32] fp16
                       const __half* __restrict__ q_bias,        // [Hq·Dh] fp16
                       const __half* __restrict__ k_bias,        // [Hkv·Dh] fp16
                       const __half* __restrict__ v_bias,        // [Hkv·Dh] fp16
                       const float2* __restrict__ rope_cs,       // [rows, Dh/2] fp32 (cos, sin) at start + row (rope_table_rows)
                       const int* __restrict__ prefill_state,    // [2] int32: start position, M
                       const int* __restrict__ block_table,      // [max_pages] int32: logical → physical page
                       float* __restrict__ split_partials,       // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                       int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                       int Hq, int Hkv, int Dh, int K) {
    using S = GemmQ5g32MinScales::Scales;
    const u32* const qw[3] = {q_qweight, k_qweight, v_qweight};
    const u32* const qh[3] = {q_qhigh, k_qhigh, v_qhigh};
    const S sc[3] = {S{q_scales, q_offsets}, S{k_scales, k_offsets}, S{v_scales, v_offsets}};
    gemm_g32_qkv_rope<GemmQ5g32MinScales>(q_out, k_cache, v_cache, x_map, qw, qh, sc, q_bias, k_bias, v_bias,
                                          rope_cs, prefill_state, block_table, split_partials, split_counters, Hq,
                                          Hkv, Dh, K);
}

// residual += X Wᵀ in FP32, W in Q5_1. As gemm_int4_residual.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5g32min_residual(float* __restrict__ residual,            // [M, N] fp32, in/out
                       const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                       const u32* __restrict__ qweight,         // [N, K/8] uint32, layout id 1 tile-major
                       const u32* __restrict__ qhigh,           // [N, K/32] uint32 tile-major
                       const __half* __restrict__ scales,       // [N, K/32] fp16
                       const __half* __restrict__ offsets,      // [N, K/32] fp16
                       const int* __restrict__ prefill_state,   // [2] int32: start (unused here), M
                       float* __restrict__ split_partials,      // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                       int* __restrict__ split_counters,        // [grid] int32, zero between launches, or null
                       int N, int K) {
    gemm_g32_residual<GemmQ5g32MinScales>(residual, x_map, qweight, qhigh, {scales, offsets}, prefill_state,
                                          split_partials, split_counters, N, K);
}

// out[token, col0 + n] = X [W0; W1; W2]ᵀ in FP32 for one to three Q5_1 matrices stacked along N.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5g32min_stacked_rows(float* __restrict__ out,                   // [M, ldo] fp32, columns col0 … col0+N0+N1+N2-1 written
                           const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden states)
                           const u32* __restrict__ w0_qweight,        // [N0, K/8] uint32
                           const u32* __restrict__ w0_qhigh,          // [N0, K/32] uint32 tile-major
                           const __half* __restrict__ w0_scales,      // [N0, K/32] fp16
                           const __half* __restrict__ w0_offsets,     // [N0, K/32] fp16
                           const u32* __restrict__ w1_qweight,        // [N1, …] (N1 = 0: unused)
                           const u32* __restrict__ w1_qhigh,
                           const __half* __restrict__ w1_scales,
                           const __half* __restrict__ w1_offsets,
                           const u32* __restrict__ w2_qweight,        // [N2, …] (N2 = 0: unused)
                           const u32* __restrict__ w2_qhigh,
                           const __half* __restrict__ w2_scales,
                           const __half* __restrict__ w2_offsets,
                           const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                           float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                           int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                           int N0, int N1, int N2, int K, int ldo, int col0) {
    using S = GemmQ5g32MinScales::Scales;
    const u32* const qw[3] = {w0_qweight, w1_qweight, w2_qweight};
    const u32* const qh[3] = {w0_qhigh, w1_qhigh, w2_qhigh};
    const S sc[3] = {S{w0_scales, w0_offsets}, S{w1_scales, w1_offsets}, S{w2_scales, w2_offsets}};
    gemm_g32_stacked_rows<GemmQ5g32MinScales>(out, x_map, qw, qh, sc, prefill_state, split_partials, split_counters,
                                              N0, N1, N2, K, ldo, col0);
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ), gate and up in Q5_1. As gemm_int4_gate_up_swiglu.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_q5g32min_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                             const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden)
                             const u32* __restrict__ gate_qweight,      // [F, K/8] uint32
                             const u32* __restrict__ gate_qhigh,        // [F, K/32] uint32 tile-major
                             const __half* __restrict__ gate_scales,    // [F, K/32] fp16
                             const __half* __restrict__ gate_offsets,   // [F, K/32] fp16
                             const u32* __restrict__ up_qweight,        // [F, K/8] uint32
                             const u32* __restrict__ up_qhigh,          // [F, K/32] uint32 tile-major
                             const __half* __restrict__ up_scales,      // [F, K/32] fp16
                             const __half* __restrict__ up_offsets,     // [F, K/32] fp16
                             const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                             float* __restrict__ split_partials,        // [grid, GEMM_ACC/4, 256, 4] fp32 scratch, or null: whole tiles
                             int* __restrict__ split_counters,          // [grid] int32, zero between launches, or null
                             int F, int K) {
    gemm_g32_gate_up_swiglu<GemmQ5g32MinScales>(h, x_map, gate_qweight, gate_qhigh, {gate_scales, gate_offsets},
                                                up_qweight, up_qhigh, {up_scales, up_offsets}, prefill_state,
                                                split_partials, split_counters, F, K);
}
