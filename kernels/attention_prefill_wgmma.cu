// kernels/attention_prefill_wgmma.cu — causal GQA attention of a prompt chunk over the paged KV
// cache, on wgmma: the same function as attention_prefill.cu (whose header states it, the KV
// splits and their combine), with the query heads of a KV head packed into the MMA's M.
//
//   attention_prefill_wgmma_hd64 / _hd128                the split schedule
//   attention_prefill_wgmma_ranges_hd64 / _hd128         the range schedule (engine wgmma-ranges)
//     out[r, h, :] = softmax(q[r, h] · K[0 : p_r + 1]ᵀ / √Dh) · V[0 : p_r + 1]
//
// The limit: tensor-core issue and the latency between the two MMAs of a KV tile, not bytes (a
// 512-token prompt reads 1 MiB of K/V a layer at the 7B shape, from L2). attention_prefill.cu on
// mma.sync reaches ~190 TFLOP/s on long chunks: its warps spend their issue slots on ldmatrix
// and MMA instructions of 16 rows each. wgmma takes both operands' 64 × 64 (S) and 64 × Dh (O)
// blocks for a warpgroup in one instruction per k16 step, the K and V tiles read by the tensor
// cores straight from shared memory.
//
// Packed rows (GQA)
// -----------------
// A KV head serves G = Hq / Hkv query heads (7 for every Qwen2.5-Coder size but 1.5B/14B/32B).
// The M dimension of the MMAs is the chunk's (query, head) pairs of one KV head, query-major:
// packed row R = r · G + j is query row r of head kv_head · G + j. All G heads read the same K
// and V, so a block's 128 packed rows (18 queries at G = 7) share every K/V byte it stages, and
// n_rows · G packed rows leave no padding but the last tile's (512 · 7 = 28 tiles of 128).
//
// Work split
// ----------
//   unit    = one query tile (128 packed rows) of one KV head; its steps: the 64-position tiles
//             of K/V its last query sees.
//   grid    = split schedule: (ceil(rows_max · G / 128), Hkv, S), a block per (unit, split z);
//             query tiles in reverse, as attention_prefill.cu (the tiles that walk the most
//             positions start first). Range schedule: one block per slot of the SMs, each a
//             contiguous run of the launch's steps, units laid end to end (stream-K over the
//             steps: attention_prefill_wgmma_ranges below) — at position 0 the split schedule's
//             wave lasts as long as its longest unit (8 steps at 512 rows) where the 504 steps
//             of the 7B's launch give each of 132 SMs 3.8.
//   block   = 2 warpgroups (8 warps); warpgroup w owns packed rows 64w … 64w+63 of the tile, warp
//             i of it rows 16i … 16i+15 (the wgmma A/accumulator layout: ptx/wgmma.cuh).
//   kv loop = positions 0 … kv_len − 1 that the tile's last query sees, in tiles of 64 (4 pages),
//             cut into ns ≤ S splits exactly as attention_prefill.cu (block z walks split z).
//     S = QKᵀ : 8 (Dh/16) × wgmma m64n64k16, A = the warpgroup's Q fragments in registers
//               (loaded once), B = the K tile, K-major (rows = tokens, 64 dims a swizzled row).
//     softmax : attention_prefill.cu's online softmax on the accumulators (same layout as
//               mma.sync's per warp: rows g and g+8, quad-shared), causal by each packed row's
//               query position.
//     O += PV : 4 × wgmma m64nDhk16, A = P rounded to FP16 from the S accumulators (their layout
//               is A's), B = the V tile N-major (rows = tokens = k, dims contiguous = n): the cache's
//               own [token][dim] order, read transposed by the tensor core (imm-trans-b).
//   out     = O / l, FP16, rows r < n_rows only; with ns > 1 the unit's last split combines first.
//
// Shared memory: APW_STAGES stages of (K, V) tiles, each Dh/64 column blocks of 64 tokens × 128
// bytes in the 128-byte swizzle the wgmma descriptors read (16-byte chunk c of token row t at
// chunk c ^ (t % 8); 1024-byte atoms of 8 tokens). cp.async writes them chunk by chunk, so paged
// K/V needs no tensor map: each thread copies one 16-byte column of the tile's rows (4 page
// offsets loaded once), K and V from one offset. Dh = 128: 4 × 32 KiB; Dh = 64: 4 × 16 KiB.
//
// The pipeline and why it cannot race. Tile i goes to stage i % APW_STAGES (4) in cp.async commit
// group i, two tiles ahead. Iteration i issues S_i = Q K_iᵀ and then O += P_{i−1} V_{i−1} as two
// wgmma groups, waits for the first (wait_group 1: groups complete in order), runs the softmax
// of S_i while P_{i−1} V_{i−1} is still on the tensor cores, waits for the second, rescales O and
// packs P_i; tile 0's S runs before the loop, the last tile's PV after it. So iteration i reads
// K of tile i and V of tile i − 1. Its start: wait for group i (cp.async.wait_group
// APW_STAGES − 3); fence.proxy.async (each thread's cp.async writes are generic-proxy writes and
// the tensor cores read through the async proxy: the fence orders this thread's landed copies
// before later async-proxy reads); __syncthreads (every thread's copies and fences of tile i are
// done, and every warpgroup has finished iteration i − 1, whose final wait_group 0 saw the last
// reads of tile i − 2: its K at iteration i − 2, its V at i − 1); only then is tile i + 2 issued,
// into tile i − 2's stage. Each iteration waits for an MMA group before it touches that group's
// accumulators or A registers (S before the softmax; O and P only after wait_group 0), and
// fences (wgmma.fence) before MMAs that read registers it wrote.
// The KV splits' store, counter and combine: attention_prefill.cu's protocol (ptx/flags.cuh
// split_arrive_last), with 8 warps a block instead of G.
//
// Registers: O (Dh/2 FP32 a lane), S (32), P (16 u32), the Q fragments (Dh/4 u32): 178 at Dh = 128,
// 125 at Dh = 64 (ptxas of NVRTC 13.0, no spills; 180 and 127 when first written); one block of
// 8 warps per SM (__launch_bounds__(256, 1)). The range schedule's loop over pieces: 224 and 174
// (234 and 182 then; one piece alone: 183 and 122; a pointer made opaque per piece — every
// launch value, measured again since — `#pragma unroll 1` or a non-inlined piece did not bring
// it down): still one block an SM at Dh = 128; at Dh = 64 it loses the second block a
// 125-register build fits (capped at 128 it spilled 348 bytes).
//
// Measured on the H200 (tools/bench_attention_prefill.py --engines mma wgmma, graph replay, µs per
// call, a 512-row chunk at position START; docs/bench/2026-12-03_c0bd149_h200_attention_prefill_wgmma.json;
// "first form": this file at 28ece2a, S and PV one after the other with a wait between, 3 stages,
// an earlier run of the same tool, docs/bench/2026-12-03_h200_attention_prefill_wgmma_first_form.json):
//   | shape, START, S   | mma.sync | first form | now   | TFLOP/s now |
//   | 0.5B, 0, 2        |   11.75  |   10.77    | 10.54 |             |
//   | 0.5B, 7680, 4     |   91.8   |   76.2     | 73.0  |    199      |
//   | 0.5B, 31744, 4    |  338.7   |  276.7     | 264.4 |    222      |
//   | 7B, 0, 1          |   24.27  |   19.45    | 18.40 |    102      |
//   | 7B, 7680, 1       |  311.5   |  232.1     | 218.4 |    267      |
//   | 7B, 31744, 1      | 1223     |  920.6     | 886.1 |    265      |
//   | 7B, 31744, 4      | 1213     |  927.2     | 845.7 |    278      |
// (mma.sync at its best S for the 0.5B: 2 at position 0, 4 later; the launcher's S for the 7B is 1.)
// In the prefill (drvqwen bench, graph, docs/bench/2026-12-03_c0bd149_h200_syn*_512_*.json): the
// 0.5B's 512-token TTFT 2.69 → 2.46 ms (median of ten, each engine in its own run); the 7B's
// 12.76 → 12.80 (its 28 attention launches, timed one by one, 765 → 622 µs); a 7B prompt of
// 8 192 tokens 262.5 → 244.5 ms, of 32 000 1811 → 1510 ms
// (docs/bench/2026-12-03_2801626_h200_syn7b_32000_*.json). On the stream the 7B's attention
// launches cost more than timed one by one: leaving them out of a 512-token prefill saves
// 0.82 ms for 27 launches, ~30 µs each against 22 timed alone in the list and 18.4 in the table
// above (docs/bench/2026-12-03_d8b7c43_h200_syn7b_512_prefill_roles_left_out.json). At position
// 0 the 112 (query tile, KV head) units are one wave on 132 SMs, and the wave lasts as long as
// its longest unit: the last query tile's 8 KV steps, where the 504 steps of the launch would
// give each SM 3.8; o_proj, persistent on every SM, starts in full only when that unit's SM is
// free. Uniform splits (S = 2, 4) cut every unit and add a second wave.
// The range schedule (attention_prefill_wgmma_ranges: each block a contiguous run of the launch's
// steps, cut units combined by their last piece) against the split schedule, µs per call
// (tools/bench_attention_prefill.py --engines wgmma wgmma-ranges --splits 1 4, two runs:
// docs/bench/2026-12-03_3c658ea_h200_attention_prefill_ranges{,_positions}.json; S = 4 is the
// ranges' cap on a unit's pieces, S = 1 whole units):
//   | shape, START    | split, S = 1 | split, S = 4 | ranges, S = 1 | ranges, S = 4 |
//   | 7B, 0           |   18.47      |   27.51      |   20.88       |   23.16       |
//   | 7B, 512         |   32.64      |   41.89      |   35.37       |   34.99       |
//   | 7B, 1024        |   46.52      |   55.62      |   50.09       |   46.68       |
//   | 7B, 2048        |   73.76      |   82.69      |   78.48       |   68.93       |
//   | 7B, 4096        |  125.67      |  135.38      |  130.65       |  113.76       |
//   | 7B, 7680        |  215.28      |  226.82      |  222.24       |  191.80       |
//   | 7B, 31744       |  837.15      |  844.83      |  870.40       |  735.62       |
//   | 0.5B, 0         |   14.04      |   10.85      |   16.57       |   16.58       |
//   | 0.5B, 7680      |  169.07      |   72.56      |  173.18       |   80.60       |
// Each block of the ranges walks ~W/P steps, but every piece pays the Q load, the pipeline's
// fill and drain, and a cut one its partial store and the combine: at 512 rows from position 0
// (3.8 steps a block, two or three pieces) that costs more than the longest unit's 8 steps; at
// 1 024 positions the two tie, from 2 048 on (7B) the balance wins, 12 % on long chunks. Whole units on the ranges'
// code (S = 1) run 3–13 % slower than the split kernel's: the loop over pieces holds 234
// registers where one piece takes 183 (below), and at Dh = 64 the ranges kernel fits one block
// an SM where the split one fits two — the 0.5B loses everywhere. In the prefill (drvqwen bench
// --prefill-attention wgmma | wgmma-ranges, the 7B; docs/bench/2026-12-03_3c658ea_h200_syn7b_*):
// 8 192 tokens 234.3 → 230.1 ms, 32 000 tokens 1436.7 → 1357.6 ms. The prefill now runs the range
// schedule for the chunks from 2 048 positions on at Dh = 128 and the split one before them
// (prefill.py, LATE_ATTENTION_FROM): 32 000 tokens 1430.8 → 1364.1 ms, 8 192 tokens 234.6 → 230.1
// (docs/bench/2026-12-03_2a2a007_h200_syn7b_*_late_*.json).
// Lost, same run: the two warpgroups taking turns to issue their MMA groups (ping-pong through
// two named barriers, FlashAttention-3's scheduling; its compile-time switch lives at 5ee4e79): 7B
// at 31 744 876.8 µs against 845.7 (S = 4), at 7 680 235.2 against 218.4; the 0.5B within 1 %.
// With the per-tile __syncthreads of the cp.async staging both warpgroups start each tile
// together, so an ordered issue only delays the second. Next: K/V by TMA from a producer warp
// with mbarriers (no staging work in the MMA warps, no block-wide barrier per tile), 128-position
// tiles.
//
// The main loop's instructions (the limit measured last: Nsight Compute at 31 744 positions, the
// 7B's split schedule, showed issue slots 45 % busy with 2 warps a scheduler, L2 hit rate 95 %,
// DRAM 2 % — instruction-bound, not bytes; docs/benchmarks.md): 796 SASS instructions a warp and
// KV step, ~400 now on the tiles the mask skips. The softmax: ex2.approx.ftz by name (exp2f
// without fast math wraps MUFU.EX2 in a range check and two multiplies), the scale in the same
// FFMA as the max's subtraction, the mask only on tiles past the block's first query, O's
// rescale skipped where a warp's rows kept their maxima. The staging: each thread's slot,
// swizzled offset and in-page offset fixed for the piece (its rows are ROWS apart, ROWS a
// multiple of the page and of the swizzle's 8 rows), one block-table entry and one multiply a
// pass. µs per call against the kernel before them, in turns in one run (tools/bench_attention_prefill.py;
// docs/bench/2026-12-03_26c1a62_h200_attention_prefill_lean_loop.json and …_29dcf20_…_in_turns_with_26c1a62.json):
//   | shape, START, schedule | before | now   |
//   | 7B, 0, split S = 1     |  18.32 | 15.96 |
//   | 7B, 2048, split S = 1  |  74.20 | 57.15 |
//   | 7B, 7680, ranges S = 4 | 192.06 | 154.68 |
//   | 7B, 31744, ranges S = 4| 730.77 | 573.48 (400 TFLOP/s) |
//   | 0.5B, 31744, split S = 4 | 265.38 | 186.53 |
// In the prefill (drvqwen bench, the 7B, in turns): 8 192 tokens 232.6 → 224.0 ms, 32 000 tokens
// 1388 → 1271 ms; 512 tokens 12.53 / 12.54 → 12.44 / 12.48 ms (within the runs' spread).
//
// Lost: a producer warp (a third warpgroup, setmaxnreg 224 / 56) staging K/V with cp.async
// into an mbarrier ring — each lane fencing its landed copies to the async proxy and arriving
// on the stage's full barrier, lane 0 of each MMA warp releasing it on an empty barrier — so
// that the MMA warpgroups ran without a block barrier a tile (commit 523fb96): 7B at position
// 0 22.2 µs against 18.3, at 31 744 1086 against 838 (split, S = 1; docs/bench/2026-12-03_523fb96_h200_attention_prefill_producer_warp.json
// against …_29dcf20_…_block_staging.json). One warp's copies, each awaited before its tile is
// announced, keep fewer bytes in flight than 256 threads' do, and the MMA warps were not limited
// by the barrier but by their own instructions (above).
// Lost too: 128-position KV tiles (S = QKᵀ one m64n128 wgmma a k16 step; 3 stages): within
// ±3 % of 64 on the 7B, 15–20 % slower on the 0.5B's split launches (same tool, one run).
//
// Lost too: cutting only the units the launch's balance needs cut (a unit of n steps into
// ⌈n / cap⌉ ≤ S pieces, cap = ⌈W / slots⌉, where the longest unit walks more than twice a slot's
// average W / slots; the 7B's 512 rows at position 0: the 14 query tiles past 4 steps in two, S = 3)
// — 26.3 µs a call against 18.5 whole (uniform S = 3: 26.5), and in the prefill the 7B's TTFT(512)
// 12.71 / 12.60 ms against 12.42 / 12.53 whole (in turns, one run; its 28 launches timed one by
// one 817 against 614 µs); the 0.5B cut so ran 12.8 µs at position 0 against the uniform S = 4's
// 11.1 (tools/bench_attention_prefill.py and drvqwen bench at ccbbd29, whose kernels are 89c9560's;
// docs/bench/2026-12-03_ccbbd29_h200_*). A cut piece costs more than the steps it moves: the
// 7B's whole tiles at position 0 are not bound by their longest unit alone.
// Lost too: K/V by TMA (commit 8dc9818, engines wgmma-tma and wgmma-ranges-tma): warp 0 copies
// each page of a tile as [16, 64] boxes in the 128-byte swizzle (one cp.async.bulk.tensor a lane,
// the block-table entries loaded a tile ahead) into a ring of 6 stages, 4 tiles in flight, with
// full/empty mbarriers (every thread releasing a stage after its last MMA on it) in place of 256
// threads' cp.async and a block barrier a tile; V's rows past kv_len zeroed in the unit's last
// tile. Correct (the tests' 520 TMA cases, NaN-poisoned spare pages) but slower at every shape:
// the 7B's range schedule at 1024 rows from position 2048 143.9 µs against 114.9 (S = 4), at 512
// rows from 31 744 693.3 against 595.8 (S = 1: 869.0 against 657.6); lane 0 of each warp
// releasing (a compile-time switch of that commit) or 3 tiles in flight: the same (tools/bench_attention_prefill.py,
// one run; docs/bench/2026-12-04_8dc9818_h200_attention_prefill_tma.json). Nsight Compute at 31 744
// (…_tma_ncu.json): 7.6 cycles a warp between issues against 5.3, eligible warps 0.31 against 0.48
// a scheduler, the same DRAM throughput (1.44 against 1.49 TB/s) — the MMA warps wait longer, not
// on bytes; which wait (the full barrier's try_wait, warp 0's copies inside warpgroup 0's MMA
// issue, the lost lockstep of the two warpgroups) was not sampled. FlashAttention-3's form, a
// producer warp of its own (setmaxnreg) with the two MMA warpgroups taking turns, is what is left
// of this direction.
// Lost too: a deeper cp.async pipeline (APW_STAGES = 5 or 6: 3 or 4 tiles in flight instead of
// 2): the 7B's range schedule at 512 rows from 31 744 586.6 / 576.5 µs against 573.5 (S = 4), at
// 1024 rows from 7168 292.8 / 290.1 against 287.5, the split schedule 1–4 % slower too, the 0.5B
// within ±2 % (tools/bench_attention_prefill.py --variant, one run;
// docs/bench/2026-12-04_3eee408_h200_attention_prefill_stages.json): with 40 % of the K/V reads
// past L2 at 31 744 positions (the Nsight Compute file above), more bytes in flight still buy
// nothing — the loop waits on its own instructions, not on the loads.
// Lost too: each row's softmax sum l by the tensor cores (commit ac81b11, a compile-time switch): P·V 8
// columns wider (m64n136k16) over a column block of FP16 ones staged after V, so O's last columns
// hold Σ P — 70 fewer FADD in the main loop's SASS (84 → 14), no quad sum; correct (its 80 test
// cases), but no faster: the 7B's split schedule within 1 % (31 744, S = 1: 632.8 µs against
// 634.1), the range schedule slower (31 744, S = 4: 620.7 against 576.9; 7168 at 1024 rows 294.0
// against 289.6), the 0.5B within 2 % (tools/bench_attention_prefill.py --variant, one run;
// docs/bench/2026-12-04_ac81b11_h200_attention_prefill_row_sums_by_mma.json). The FADDs were not
// on the critical path. Not a way on sm_90 either: the exponentials two at a time
// (ex2.approx.f16x2) — ptxas makes it two MUFU.EX2.F16 and a PRMT, no SFU instruction saved.
// Builds: more warps a scheduler. With Q read from shared memory (APW_Q_SMEM: the QKᵀ MMAs in
// the SS form, the block's packed rows staged with its first tile), ptxas gives the Dh = 128
// split kernel 142 registers instead of 178 and the range kernel 213 instead of 224, so a third
// MMA warpgroup fits 384 threads' 168 (APW_WARPGROUPS=3: 192 packed rows a block, K/V staged by
// the first 256 threads; the split kernel 142 registers, the range kernel 168 with 144 bytes
// spilled). Measured on the H200 (tools/bench_attention_prefill.py --variant
// qs:APW_Q_SMEM=1 --variant wg3:APW_WARPGROUPS=3,APW_Q_SMEM=1, one run,
// docs/bench/2026-12-04_135e37a_h200_attention_prefill_builds.json and _builds_short.json):
//   7B, range schedule S = 4: 2048:1024 114.7 µs → 110.8 (qs alone 113.7), 7168:1024 290.5 →
//   266.7, 31 744:512 634.8 → 582.2: three warps a scheduler hide what two could not;
//   7B, split schedule S = 1: 0:1024 38.5 → 34.1, but 0:512 15.8 → 20.5 and 1024:1024 77.9 →
//   83.0 — 192 rows a block leave 19 blocks a KV head (76 of 132 SMs at 512 rows);
//   0.5B (Dh = 64, where 384 threads × 112 registers make one block an SM, against two): split
//   0:512 at its S = 2 9.7 → 12.2; range S = 4 2048:1024 52.9 → 47.8.
// In the prefill (drvqwen bench, 7B, both schedules in the build, turns with the default,
// docs/bench/2026-12-04_135e37a_h200_syn7b_ttft_wg3_*.json): 32 000 tokens 1210.4 ms → 1158.9,
// 8192 208.95 / 209.8 → 208.5 / 209.3, 512 12.63 / 12.17 → 12.30 / 12.08 (noise at 512). So the
// range schedule runs the three-warpgroup build (launchers/attention_prefill.py ENGINE_BUILDS),
// the split schedule the two-warpgroup one; tests/test_kernel_attention_prefill.py's builds test
// checks all three builds on both.
// Requirements (asserted by the launcher): Hq % Hkv == 0; Dh ∈ {64, 128}; pointers 16-byte
// aligned; block_table valid for every page < ceil((start + n_rows) / 16); with S > 1 the scratch
// (launchers/attention_prefill.py: tile_splits_needed).
#include <cuda_fp16.h>

#include "types.cuh"     // u32, u64, WARP_SIZE, QUAD_SIZE, F32_NEG_INF, F32_LOG2E
#include "wgmma.cuh"     // wgmma_m64n64k16_rs / _ss, wgmma_m64n128k16_rs (N-major B), descriptors, fences
#include "cp_async.cuh"  // cp_async_16, cp_async_commit, cp_async_wait
#include "warp.cuh"      // quad_max, quad_sum, FULL_WARP_MASK
#include "ex2.cuh"       // ex2_approx_ftz
#include "kv_cache.cuh"  // PAGE_TOKENS, kv_offset
#include "griddep.cuh"   // grid_dependency_wait, grid_launch_dependents
#include "flags.cuh"     // split_arrive_last

#define APW_WG_ROWS    64                               // packed rows per warpgroup (wgmma M)
// Builds (the header's "Builds"), the macro default in brackets: APW_WARPGROUPS [2] MMA
// warpgroups a block (3: 12 warps, three a scheduler, where 2 leave the schedulers idle 62 % of
// the cycles at long positions; needs APW_Q_SMEM to fit 168 registers a thread); APW_Q_SMEM [0]:
// QKᵀ reads Q from shared memory (SS wgmma; the block's 64·WG packed rows staged with the first
// tile) instead of 32 registers a lane (at Dh = 128) holding its fragments.
#ifndef APW_WARPGROUPS
#define APW_WARPGROUPS 2
#endif
#ifndef APW_Q_SMEM
#define APW_Q_SMEM 0
#endif
#define APW_ROWS       (APW_WG_ROWS * APW_WARPGROUPS)   // packed rows per block
#define APW_THREADS    (APW_WARPGROUPS * 128)
#define APW_WARPS      (APW_THREADS / WARP_SIZE)        // 8: the split partials' slots per block
#define APW_STAGE_THREADS 256                           // the threads that stage K/V (the first 8 warps)
static_assert(APW_WARPGROUPS == 2 || (APW_WARPGROUPS == 3 && APW_Q_SMEM),
              "a third warpgroup fits 168 registers a thread only with Q in shared memory");
#define APW_KV_TILE    64                               // positions per pipeline step (4 pages)
#ifndef APW_STAGES
#define APW_STAGES     4                                // V of the tile before, K of this one, two in flight
#endif
#define APW_MAX_SPLITS 4
#define APW_COMBINE_CHUNK 4

#define APW_COL_BYTES  (APW_KV_TILE * 128)              // one 64-dim column block of a tile: 8 KiB

template <int HEAD_DIM>
struct ApwShape {
    static constexpr int COLS = HEAD_DIM / 64;                    // 64-dim column blocks
    static constexpr int TILE_BYTES = COLS * APW_COL_BYTES;       // K (or V) of one step
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;            // K then V
    static constexpr int Q_OFFSET = APW_STAGES * STAGE_BYTES;     // APW_Q_SMEM: each warpgroup's Q, COLS blocks
    static constexpr int Q_BYTES = APW_Q_SMEM ? APW_WARPGROUPS * COLS * APW_COL_BYTES : 0;
    static constexpr int SMEM_BYTES = APW_STAGES * STAGE_BYTES + Q_BYTES + 1024;  // + slack to align to 1 KiB
    static_assert(SMEM_BYTES <= 227 * 1024, "more shared memory than a block may have");
    static constexpr int CHUNKS = HEAD_DIM / 8;                   // 16-byte chunks per token row
    static constexpr int KSTEPS = HEAD_DIM / 16;                  // k16 steps of QKᵀ
    static constexpr int OACC = HEAD_DIM / 2;                     // O accumulators a lane (m64nDh)
    static constexpr int ONS = HEAD_DIM / 8;                      // of them, float4 groups (n8 blocks)
};

struct ApwSplit {
    float4* part_o;   // [units, S, 8 warps, Dh/8, 32] float4: a warp's O accumulators, lane-major
    float4* part_ml;  // [units, S, 8 warps, 32] float4: (m row g, m row g+8, l row g, l row g+8)
    u32* counters;    // [units] u32: splits of the unit that have stored; 0 between launches
};

__device__ __forceinline__ u32 apw_pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
}

// O += P·V for one k16 step: the head dimension picks the wgmma's N.
template <int HEAD_DIM>
__device__ __forceinline__ void apw_pv(float (&o)[HEAD_DIM / 2], const u32 (&pa)[4], u64 v_desc) {
    if constexpr (HEAD_DIM == 128) wgmma_m64n128k16_rs<1>(o, pa, v_desc, 1);
    else wgmma_m64n64k16_rs<1>(o, pa, v_desc, 1);
}

// One piece of work: KV steps [t_begin, t_begin + n_steps) of the unit (query tile q_tile, KV
// head kv_head). pieces = 1: the unit whole, its rows written to `out`; pieces > 1: this is
// piece `slot` of the unit's `pieces`, stored as a partial in slot unit · stride + slot, and the
// piece whose counter add comes last combines them all and writes `out`.
struct ApwPiece {
    int q_tile, kv_head, t_begin, n_steps;
    int pieces, slot, stride;
    int unit;  // index of the unit's counter and partial slots
};

// Positions query tile q_tile reads: up to the position of its last valid packed row's query.
__device__ __forceinline__ int apw_kv_len(int start, int packed, int group, int q_tile) {
    return start + (min(packed, (q_tile + 1) * APW_ROWS) - 1) / group + 1;
}

// Runs one piece (ApwPiece) with every thread of the block: the block's barriers are inside, so
// the caller's control flow around it must be block-uniform. On return every warpgroup has
// waited for its last MMA; the caller syncs before the next piece refills the stages.
template <int HEAD_DIM>
__device__ __forceinline__ void apw_run_piece(
    unsigned char* smem, __half* __restrict__ out, const __half* __restrict__ q, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_table, int start, int n_rows, int Hq, int Hkv,
    const ApwPiece& pc, const ApwSplit& sp) {
    using S = ApwShape<HEAD_DIM>;
    __shared__ int apw_is_last;
    const int group = Hq / Hkv;
    const int packed = n_rows * group;  // valid packed rows of the chunk
    const int q_tile = pc.q_tile, kv_head = pc.kv_head;
    const int p0 = q_tile * APW_ROWS;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int kv_len = apw_kv_len(start, packed, group, q_tile);
    const int t_begin = pc.t_begin, n_steps = pc.n_steps;

    // This lane's two packed rows (accumulator rows g and g + 8 of its warp), their query row,
    // head and position; rows past the chunk take the last query's position (never stored).
    const int pr[2] = {p0 + 16 * warp + g, p0 + 16 * warp + g + 8};
    int qrow[2], head[2], qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        qrow[h] = pr[h] / group;
        head[h] = kv_head * group + pr[h] % group;
        qpos[h] = start + min(qrow[h], n_rows - 1);
    }

    // Q fragments (A of QKᵀ; k = dims 16j … 16j+15), zero past the chunk.
    u32 qa[S::KSTEPS][4];
    if constexpr (!APW_Q_SMEM) {
        const __half* q0 = q + ((u64)qrow[0] * Hq + head[0]) * HEAD_DIM + 2 * t;
        const __half* q1 = q + ((u64)qrow[1] * Hq + head[1]) * HEAD_DIM + 2 * t;
        const bool v0 = pr[0] < packed, v1 = pr[1] < packed;
#pragma unroll
        for (int j = 0; j < S::KSTEPS; ++j) {
            qa[j][0] = v0 ? *reinterpret_cast<const u32*>(q0 + 16 * j) : 0u;
            qa[j][1] = v1 ? *reinterpret_cast<const u32*>(q1 + 16 * j) : 0u;
            qa[j][2] = v0 ? *reinterpret_cast<const u32*>(q0 + 16 * j + 8) : 0u;
            qa[j][3] = v1 ? *reinterpret_cast<const u32*>(q1 + 16 * j + 8) : 0u;
        }
    }

    // Stage the K/V of positions [64·tile, 64·tile + 64) into `stage`, swizzled; past kv_len:
    // zeros. Thread x copies 16-byte column c = x % CHUNKS of token rows x / CHUNKS, + 256 / CHUNKS …
    // The thread's share of every tile, fixed for the piece: 16-byte column col of token rows
    // row, row + ROWS, … (ROWS = 256 / CHUNKS: 16 at Dh = 128, 32 at Dh = 64, a multiple of the
    // page's 16 slots and of the swizzle's 8 rows). So its slot in the page (row % 16), its
    // swizzled 16 bytes in each row (chunk col ^ (row % 8)) and its element offset within a page
    // are the same in every tile: per tile and pass it loads one block-table entry and adds
    // page · page_elems to its K and V pointers — no per-token address arithmetic on the MMA
    // warps' issue slots.
    constexpr int ROWS = APW_STAGE_THREADS / S::CHUNKS;
    static_assert(APW_STAGE_THREADS % S::CHUNKS == 0 && ROWS % PAGE_TOKENS == 0, "every thread keeps one column and slot");
    static_assert(APW_THREADS >= APW_STAGE_THREADS, "the staging threads are the block's first");
    const int col = threadIdx.x % S::CHUNKS, row = threadIdx.x / S::CHUNKS;
    const u32 dst0 = (col / 8) * APW_COL_BYTES + row * 128 + (((col % 8) ^ (row % 8)) * 16);
    const __half* k_row = k_cache + kv_offset(0, kv_head, row % PAGE_TOKENS, Hkv, HEAD_DIM) + 8 * col;
    const __half* v_row = v_cache + kv_offset(0, kv_head, row % PAGE_TOKENS, Hkv, HEAD_DIM) + 8 * col;
    const int page_elems = kv_page_elems(Hkv, HEAD_DIM);
    auto issue = [&](int tile, int stage) {
        if (APW_THREADS > APW_STAGE_THREADS && threadIdx.x >= APW_STAGE_THREADS) return;  // the third warpgroup
        unsigned char* dst = smem + stage * S::STAGE_BYTES + dst0;
        const int pos0 = tile * APW_KV_TILE + row;  // this thread's token of pass 0
#pragma unroll
        for (int k = 0; k < APW_KV_TILE / ROWS; ++k) {
            const int pos = pos0 + k * ROWS;
            const bool valid = pos < kv_len;
            const u64 off = valid ? (u64)__ldg(block_table + pos / PAGE_TOKENS) * page_elems : 0;
            cp_async_16(dst + k * ROWS * 128, k_row + off, valid);
            cp_async_16(dst + S::TILE_BYTES + k * ROWS * 128, v_row + off, valid);
        }
    };
    static_assert(APW_STAGES >= 3, "V of the tile before, K of this one, one in flight");

    const float scale_log2 = rsqrtf((float)HEAD_DIM) * F32_LOG2E;
    float o[S::OACC];  // O[row g | g+8][dims 8n + 2t, +1] at o[4n + 0, 1 | 2, 3]
#pragma unroll
    for (int i = 0; i < S::OACC; ++i) o[i] = 0.f;
    float m_run[2] = {F32_NEG_INF, F32_NEG_INF};  // per row (g, g+8), log2 units, quad-uniform
    float l_run[2] = {0.f, 0.f};                  // per row, this lane's share (quad-summed at the end)

    // APW_Q_SMEM: the block's packed rows of Q, warpgroup w's 64 in its own K-major 128-byte-swizzled
    // blocks (as the K tiles), zeros past the chunk, in the first tile's commit group: sync_stage(0)
    // waits for them before any QKᵀ. The previous piece's MMAs, the last readers, have completed
    // (each warpgroup's final wait_group 0, then the schedule's barrier between pieces).
    if constexpr (APW_Q_SMEM) {
        for (int i = threadIdx.x; i < APW_ROWS * S::CHUNKS; i += APW_THREADS) {
            const int r = i / S::CHUNKS, c = i % S::CHUNKS, pr_i = p0 + r;  // block row, 16-byte chunk
            const bool valid = pr_i < packed;
            const __half* src = valid ? q + ((u64)(pr_i / group) * Hq + kv_head * group + pr_i % group) * HEAD_DIM + 8 * c
                                      : q;
            cp_async_16(smem + S::Q_OFFSET + (r / APW_WG_ROWS) * S::COLS * APW_COL_BYTES + (c / 8) * APW_COL_BYTES
                            + (r % APW_WG_ROWS) * 128 + (((c % 8) ^ (r % 8)) * 16), src, valid);
        }
    }
    // The pipeline (the header's "The pipeline"): tiles t_begin + i into stage i % APW_STAGES,
    // one commit group each; APW_STAGES − 2 of them issued ahead.
#pragma unroll
    for (int i = 0; i < APW_STAGES - 2; ++i) {
        if (i < n_steps) issue(t_begin + i, i);
        cp_async_commit();
    }
    // Iteration i: S_i = Q K_iᵀ and O += P_{i−1} V_{i−1} issued together, then the softmax of S_i
    // while P_{i−1} V_{i−1} runs on the tensor cores. Tile 0's S runs alone before the loop and
    // the last tile's PV after it, so that inside the loop both MMA groups are always in flight
    // (ptxas tracks which accumulators a wait_group frees only without branches around them).
    u32 pa[APW_KV_TILE / 16][4];  // P of the previous tile, A fragments of its 4 k16 steps
    float s[32];                   // S: s[4n + e] = scores of tokens 8n + 2t + (e & 1), rows g (e < 2), g + 8
    float alpha[2];

    // Wait for tile `step`, free the stage of tile step − 2 and refill it (the header's argument).
    auto sync_stage = [&](int step) {
        cp_async_wait<APW_STAGES - 3>();  // tile `step` has landed (tile step + 1 may fly)
        fence_proxy_async_shared();
        __syncthreads();
        if (step + APW_STAGES - 2 < n_steps)
            issue(t_begin + step + APW_STAGES - 2, (step + APW_STAGES - 2) % APW_STAGES);
        cp_async_commit();
    };
    auto stage_of = [&](int step) { return smem + (step % APW_STAGES) * S::STAGE_BYTES; };
    auto issue_s = [&](int step) {
        const unsigned char* ks = stage_of(step);
        const unsigned char* qs = smem + S::Q_OFFSET + (warp / 4) * S::COLS * APW_COL_BYTES;  // APW_Q_SMEM
#pragma unroll
        for (int j = 0; j < S::KSTEPS; ++j) {
            const u64 kd = wgmma_desc_sw128(ks + (j / 4) * APW_COL_BYTES + (j % 4) * 32);
            if constexpr (APW_Q_SMEM) wgmma_m64n64k16_ss(s, wgmma_desc_sw128(qs + (j / 4) * APW_COL_BYTES + (j % 4) * 32), kd, j > 0);
            else wgmma_m64n64k16_rs(s, qa[j], kd, j > 0);
        }
        wgmma_commit_group();
    };
    auto issue_pv = [&](int step) {  // O += P · V of tile `step`
        const unsigned char* vs = stage_of(step) + S::TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < APW_KV_TILE / 16; ++kk)
            apw_pv<HEAD_DIM>(o, pa[kk], wgmma_desc_sw128_nmajor(vs + kk * 2048, APW_COL_BYTES));
        wgmma_commit_group();
    };
    // The causal mask and the online softmax of S (attention_prefill.cu's arithmetic, with the
    // scale folded into the exponent). The scores stay unscaled: the row maximum is scaled once
    // (max(x)·c = max(x·c) for c > 0, in FP32 too: rounding is monotone) and each weight is
    // 2^(x·c − m) in one FFMA and one MUFU.EX2 (ptx/ex2.cuh). The mask runs only on the tiles
    // that reach past the block's first query (the diagonal ones): a tile wholly at or before
    // it is visible to every row of the block — the condition is block-uniform, no divergence.
    const int qpos_min = start + p0 / group;  // the block's smallest query position (p0 < packed)
    auto softmax = [&](int step) {
#pragma unroll
        for (int i = 0; i < 32; ++i) wgmma_fence_operand(s[i]);
        const int tile = t_begin + step;
        float row_max[2] = {F32_NEG_INF, F32_NEG_INF};
        if ((tile + 1) * APW_KV_TILE - 1 <= qpos_min) {
#pragma unroll
            for (int i = 0; i < 32; ++i) row_max[(i % 4) / 2] = fmaxf(row_max[(i % 4) / 2], s[i]);
        } else {
#pragma unroll
            for (int n = 0; n < APW_KV_TILE / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int pos = tile * APW_KV_TILE + 8 * n + 2 * t + (e & 1);
                    float& x = s[4 * n + e];
                    x = pos <= qpos[e / 2] ? x : F32_NEG_INF;
                    row_max[e / 2] = fmaxf(row_max[e / 2], x);
                }
        }
        float m_use[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m_new = fmaxf(m_run[h], quad_max(row_max[h]) * scale_log2);
            // alpha is exactly 1 where the maximum stays (most tiles past the first few), which
            // lets rescale_pack skip O's multiply for a warp whose rows all kept theirs.
            alpha[h] = m_run[h] == F32_NEG_INF ? 0.f : m_new == m_run[h] ? 1.f : ex2_approx_ftz(m_run[h] - m_new);
            m_run[h] = m_new;
            m_use[h] = m_new == F32_NEG_INF ? 0.f : m_new;
        }
        float p_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const float p = ex2_approx_ftz(fmaf(s[i], scale_log2, -m_use[(i % 4) / 2]));  // exactly 0 where masked
            s[i] = p;
            p_sum[(i % 4) / 2] += p;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + p_sum[h];
    };
    // After the previous PV: O rescaled to this tile's max (a warp whose rows all kept their
    // maximum multiplies by 1: skipped, warp-uniformly), P packed as the next PV's A.
    auto rescale_pack = [&]() {
        if (__any_sync(FULL_WARP_MASK, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < S::OACC; ++i) o[i] *= alpha[(i % 4) / 2];
        }
#pragma unroll
        for (int kk = 0; kk < APW_KV_TILE / 16; ++kk) {
            pa[kk][0] = apw_pack_half2(s[8 * kk + 0], s[8 * kk + 1]);  // row g,   tokens 16kk + 2t, +1
            pa[kk][1] = apw_pack_half2(s[8 * kk + 2], s[8 * kk + 3]);  // row g+8
            pa[kk][2] = apw_pack_half2(s[8 * kk + 4], s[8 * kk + 5]);  // row g,   tokens 16kk + 8 + 2t, +1
            pa[kk][3] = apw_pack_half2(s[8 * kk + 6], s[8 * kk + 7]);  // row g+8
        }
    };

    // n_steps ≥ 1: a block with no tile returned above.
    sync_stage(0);
    wgmma_fence();
    issue_s(0);
    wgmma_wait_group<0>();
    softmax(0);
    rescale_pack();
    for (int step = 1; step < n_steps; ++step) {
        sync_stage(step);
        wgmma_fence();
        issue_s(step);
        issue_pv(step - 1);
        wgmma_wait_group<1>();  // S's group completes first (groups complete in order)
        softmax(step);
        wgmma_wait_group<0>();  // P_{i−1} V_{i−1} done: O and pa are ours again
#pragma unroll
        for (int i = 0; i < S::OACC; ++i) wgmma_fence_operand(o[i]);
        rescale_pack();
    }
    wgmma_fence();
    issue_pv(n_steps - 1);
    wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < S::OACC; ++i) wgmma_fence_operand(o[i]);

    float l_tot[2] = {quad_sum(l_run[0]), quad_sum(l_run[1])};

    const int ns = pc.pieces, split = pc.slot;
    if (ns > 1) {
        // Store this split's partial, count it, let the unit's last split combine (the protocol:
        // attention_prefill.cu, "KV splits").
        const int unit = pc.unit;
        const u64 slot0 = (u64)unit * pc.stride * APW_WARPS + warp;
        float4* po = sp.part_o + slot0 * S::ONS * WARP_SIZE + lane;
        float4* pml = sp.part_ml + slot0 * WARP_SIZE + lane;
#pragma unroll
        for (int n = 0; n < S::ONS; ++n)
            __stcg(po + ((u64)split * APW_WARPS * S::ONS + n) * WARP_SIZE,
                   make_float4(o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3]));
        __stcg(pml + (u64)split * APW_WARPS * WARP_SIZE, make_float4(m_run[0], m_run[1], l_tot[0], l_tot[1]));
        __syncthreads();  // every thread's stores before thread 0's release
        if (threadIdx.x == 0) apw_is_last = split_arrive_last(sp.counters + unit, ns);
        __syncthreads();  // thread 0's acquire before every thread's loads below
        if (!apw_is_last) return;

        float4 ml[APW_MAX_SPLITS];
#pragma unroll
        for (int z = 0; z < APW_MAX_SPLITS; ++z)
            if (z < ns) ml[z] = __ldcg(pml + (u64)z * APW_WARPS * WARP_SIZE);
        float mx[2] = {F32_NEG_INF, F32_NEG_INF};
#pragma unroll
        for (int z = 0; z < APW_MAX_SPLITS; ++z)
            if (z < ns) { mx[0] = fmaxf(mx[0], ml[z].x); mx[1] = fmaxf(mx[1], ml[z].y); }
        float w[APW_MAX_SPLITS][2];
        l_tot[0] = l_tot[1] = 0.f;
#pragma unroll
        for (int z = 0; z < APW_MAX_SPLITS; ++z)
            if (z < ns) {
                w[z][0] = ml[z].x == F32_NEG_INF ? 0.f : exp2f(ml[z].x - mx[0]);
                w[z][1] = ml[z].y == F32_NEG_INF ? 0.f : exp2f(ml[z].y - mx[1]);
                l_tot[0] += w[z][0] * ml[z].z;
                l_tot[1] += w[z][1] * ml[z].w;
            }
#pragma unroll
        for (int n0 = 0; n0 < S::ONS; n0 += APW_COMBINE_CHUNK) {
            float4 p[APW_MAX_SPLITS][APW_COMBINE_CHUNK];
#pragma unroll
            for (int z = 0; z < APW_MAX_SPLITS; ++z)
#pragma unroll
                for (int e = 0; e < APW_COMBINE_CHUNK; ++e)
                    if (z < ns) p[z][e] = __ldcg(po + ((u64)z * APW_WARPS * S::ONS + n0 + e) * WARP_SIZE);
#pragma unroll
            for (int e = 0; e < APW_COMBINE_CHUNK; ++e) {
                float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                for (int z = 0; z < APW_MAX_SPLITS; ++z)
                    if (z < ns) {
                        sum.x += w[z][0] * p[z][e].x; sum.y += w[z][0] * p[z][e].y;
                        sum.z += w[z][1] * p[z][e].z; sum.w += w[z][1] * p[z][e].w;
                    }
                const int n = n0 + e;
                o[4 * n] = sum.x; o[4 * n + 1] = sum.y; o[4 * n + 2] = sum.z; o[4 * n + 3] = sum.w;
            }
        }
    }


    // out = O / l for the rows of the chunk.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (pr[h] >= packed) continue;
        const float inv_l = 1.f / l_tot[h];
        __half* dst = out + ((u64)qrow[h] * Hq + head[h]) * HEAD_DIM + 2 * t;
#pragma unroll
        for (int n = 0; n < S::ONS; ++n)
            *reinterpret_cast<u32*>(dst + 8 * n) = apw_pack_half2(o[4 * n + 2 * h] * inv_l, o[4 * n + 2 * h + 1] * inv_l);
    }
}

// The split schedule: block (query tile counted from the last, KV head, z) runs split z of its
// unit's positions cut into min(S, steps) even pieces, as attention_prefill.cu's KV splits.
template <int HEAD_DIM>
__device__ __forceinline__ void attention_prefill_wgmma_splits(
    unsigned char* smem, __half* __restrict__ out, const __half* __restrict__ q, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ prefill_state,
    int Hq, int Hkv, const ApwSplit& sp) {
    // ld.global.cg: see attention_prefill.cu (never hoisted above griddepcontrol.wait).
    const int start = __ldcg(prefill_state), n_rows = __ldcg(prefill_state + 1);
    const int group = Hq / Hkv, packed = n_rows * group;
    const int q_tile = gridDim.x - 1 - blockIdx.x;
    if (q_tile * APW_ROWS >= packed) return;  // whole block, before any barrier
    const int n_tiles = (apw_kv_len(start, packed, group, q_tile) + APW_KV_TILE - 1) / APW_KV_TILE;
    const int ns = min((int)gridDim.z, n_tiles), split = blockIdx.z;
    if (split >= ns) return;                  // whole block, before any barrier
    const int t_begin = split * n_tiles / ns, t_end = (split + 1) * n_tiles / ns;
    const int kv_head = blockIdx.y;
    apw_run_piece<HEAD_DIM>(smem, out, q, k_cache, v_cache, block_table, start, n_rows, Hq, Hkv,
                            ApwPiece{q_tile, kv_head, t_begin, t_end - t_begin, ns, split, (int)gridDim.z,
                                     kv_head * (int)gridDim.x + q_tile}, sp);
}

// The range schedule (stream-K over the launch's KV steps). The units (KV head h, query tile qt)
// are numbered h · Qt + qt and their steps laid end to end: W = Hkv · Σ_qt steps(qt) in all.
// Block b < P takes steps [b·W/P, (b+1)·W/P): a run of whole units and at its ends pieces of
// cut ones, so every block walks W/P steps ±1 where the split schedule's slowest block walks the
// longest unit's. A cut unit's pieces are the blocks its steps fall in (block_of, the same count
// in each piece); piece j stores in slot j, and the last to count combines.
// P = min(blocks, W / need), need = ⌈(steps of the longest unit − 1) / (max_pieces − 1)⌉: every
// block then walks ≥ need steps, so a unit's n ≤ n_max steps meet ≤ ⌈(n − 1)/need⌉ + 1 ≤
// max_pieces blocks — the slots the scratch holds. max_pieces = 1: whole units, block b taking
// units b, b + blocks, …
template <int HEAD_DIM>
__device__ __forceinline__ void attention_prefill_wgmma_ranges(
    unsigned char* smem, __half* __restrict__ out, const __half* __restrict__ q, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_table, const int* __restrict__ prefill_state,
    int Hq, int Hkv, int max_pieces, const ApwSplit& sp) {
    const int start = __ldcg(prefill_state), n_rows = __ldcg(prefill_state + 1);
    const int group = Hq / Hkv, packed = n_rows * group;
    const int qt_count = (packed + APW_ROWS - 1) / APW_ROWS, units = qt_count * Hkv;
    if (units == 0) return;
    auto steps = [&](int qt) { return (apw_kv_len(start, packed, group, qt) + APW_KV_TILE - 1) / APW_KV_TILE; };
    const bool whole = max_pieces <= 1;
    int w_head = 0;  // steps of one KV head's units
    for (int qt = 0; qt < qt_count; ++qt) w_head += steps(qt);
    const int W = Hkv * w_head;  // < 2^31: Hkv · ⌈rows · G / 128⌉ · ⌈max_context / 64⌉ steps
    const int need = whole ? 1 : max(1, (steps(qt_count - 1) - 1 + max_pieces - 2) / (max_pieces - 1));
    const int P = min((int)gridDim.x, whole ? units : W / need);
    const int b = blockIdx.x;
    if (b >= P) return;  // whole block, before any barrier
    // 32-bit products: W · P ≤ 8 KV heads · 224 tiles (4096 rows) · 512 steps (32K positions)
    // · 264 blocks < 2^28.
    const int s0 = b * W / P, s1 = (b + 1) * W / P;
    auto block_of = [&](int st) { return ((st + 1) * P - 1) / W; };  // the last b' with start(b') ≤ st
    // The first unit: block b's whole unit b, or the one holding step s0.
    int u = whole ? b : s0 / w_head * qt_count, qt = whole ? b % qt_count : 0;
    int n = steps(qt), off = whole ? 0 : u / qt_count * w_head;  // off: the unit's first step
    if (!whole)
        while (off + n <= s0) { off += n; n = steps(++qt); ++u; }
    for (int st = s0, first = 1;; first = 0) {
        int tb = 0, te = n, pieces = 1, slot = 0;
        if (whole) {
            if (u >= units) break;
        } else {
            if (st >= s1) break;
            tb = st - off;
            te = min(s1 - off, n);
            if (tb > 0 || te < n) {
                const int first_block = block_of(off);
                pieces = block_of(off + n - 1) - first_block + 1;
                slot = b - first_block;
            }
        }
        if (!first) __syncthreads();  // every warpgroup's last reads of the stages, before refills
        apw_run_piece<HEAD_DIM>(smem, out, q, k_cache, v_cache, block_table, start, n_rows, Hq, Hkv,
                                ApwPiece{qt, u / qt_count, tb, te - tb, pieces, slot, max(1, max_pieces), u}, sp);
        if (whole) {
            u += P;
            qt = u % qt_count;
        } else {
            st = off + te;
            off += n;
            ++u;
            qt = u % qt_count;
        }
        if (u < units) n = steps(qt);
    }
}

// The dynamic shared memory, aligned to the 1024-byte swizzle atom.
__device__ __forceinline__ unsigned char* apw_smem() {
    extern __shared__ unsigned char apw_smem_raw[];
    const u32 raw = static_cast<u32>(__cvta_generic_to_shared(apw_smem_raw));
    return apw_smem_raw + ((1024u - (raw & 1023u)) & 1023u);
}

// grid (ceil(rows_max · Hq/Hkv / 128), Hkv, S), block 256, dynamic smem ApwShape<Dh>::SMEM_BYTES.
#define ATTENTION_PREFILL_WGMMA_KERNEL(NAME, HEAD_DIM)                                             \
    extern "C" __global__ void __launch_bounds__(APW_THREADS, 1) NAME(                            \
        __half* __restrict__ out,               /* [rows, Hq, Dh] fp16, out                    */ \
        const __half* __restrict__ q,           /* [rows, Hq, Dh] fp16, rotated queries       */ \
        const __half* __restrict__ k_cache,     /* [P, Hkv, 16, Dh] fp16, this layer          */ \
        const __half* __restrict__ v_cache,     /* [P, Hkv, 16, Dh] fp16, this layer          */ \
        const int* __restrict__ block_table,    /* [max_pages] int32: logical → physical page */ \
        const int* __restrict__ prefill_state,  /* [2] int32: start position, n_rows          */ \
        int Hq, int Hkv,                                                                       \
        float4* part_o,                         /* [units, S, 8, Dh/8, 32] float4 (S > 1)     */ \
        float4* part_ml,                        /* [units, S, 8, 32] float4 (S > 1)           */ \
        u32* counters) {                        /* [units] u32, zero between launches (S > 1) */ \
        grid_launch_dependents();                                                              \
        grid_dependency_wait(); /* q, this chunk's K/V and prefill_state: earlier kernels */   \
        attention_prefill_wgmma_splits<HEAD_DIM>(apw_smem(), out, q, k_cache, v_cache, block_table, \
                                                 prefill_state, Hq, Hkv, ApwSplit{part_o, part_ml, counters}); \
    }

ATTENTION_PREFILL_WGMMA_KERNEL(attention_prefill_wgmma_hd64, 64)
ATTENTION_PREFILL_WGMMA_KERNEL(attention_prefill_wgmma_hd128, 128)

// grid (blocks: the SMs' slots), block 256, dynamic smem ApwShape<Dh>::SMEM_BYTES.
#define ATTENTION_PREFILL_WGMMA_RANGES_KERNEL(NAME, HEAD_DIM)                                      \
    extern "C" __global__ void __launch_bounds__(APW_THREADS, 1) NAME(                            \
        __half* __restrict__ out,               /* [rows, Hq, Dh] fp16, out                    */ \
        const __half* __restrict__ q,           /* [rows, Hq, Dh] fp16, rotated queries       */ \
        const __half* __restrict__ k_cache,     /* [P, Hkv, 16, Dh] fp16, this layer          */ \
        const __half* __restrict__ v_cache,     /* [P, Hkv, 16, Dh] fp16, this layer          */ \
        const int* __restrict__ block_table,    /* [max_pages] int32: logical → physical page */ \
        const int* __restrict__ prefill_state,  /* [2] int32: start position, n_rows          */ \
        int Hq, int Hkv,                                                                       \
        int max_pieces,                         /* 1 … APW_MAX_SPLITS: slots a unit may use   */ \
        float4* part_o,                         /* [units, max_pieces, 8, Dh/8, 32] float4    */ \
        float4* part_ml,                        /* [units, max_pieces, 8, 32] float4          */ \
        u32* counters) {                        /* [units] u32, zero between launches         */ \
        grid_launch_dependents();                                                              \
        grid_dependency_wait(); /* q, this chunk's K/V and prefill_state: earlier kernels */   \
        attention_prefill_wgmma_ranges<HEAD_DIM>(apw_smem(), out, q, k_cache, v_cache, block_table, \
                                                 prefill_state, Hq, Hkv, max_pieces,           \
                                                 ApwSplit{part_o, part_ml, counters});          \
    }

ATTENTION_PREFILL_WGMMA_RANGES_KERNEL(attention_prefill_wgmma_ranges_hd64, 64)
ATTENTION_PREFILL_WGMMA_RANGES_KERNEL(attention_prefill_wgmma_ranges_hd128, 128)
