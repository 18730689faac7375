// kernels/decode_persistent.cu — the decode step from the embedding through the last layer as one
// persistent kernel: every block works through the step's launches as a program, and blocks wait
// for each other on completion counters in global memory instead of at kernel boundaries.
//
// Why: a launch of the per-launch step costs the GPU ~2–4 µs of drain and ramp-up whatever its
// size (the 0.5B's 149 launches are nearly its whole step; a 7B layer spends ~66 µs where its
// bytes need 28). Here the step is one launch; between two ops a block waits only for the
// counter of the op before, and a GEMV requests its first weights before that wait, as it does
// before griddepcontrol.wait as a launch of its own.
//
// The program is the launch list. The host (launchers/decode_persistent.py) packs each planned
// launch of the step — embedding, per layer qkv_rope, attention (split and combine), o_proj,
// gate_up_swiglu, down_proj — into a PersistentOp: its kind, its planned grid
// and block, and its arguments in the kernel's own parameter layout. Each op's items are the
// blocks of that planned launch, and an item runs the device function a block of the launch runs
// (`…_item` in gemv_int4.cu, embedding.cu, attention_decode.cu) with the launch's
// BlockCoord (block_coord.cuh): the same split of the work, the same reduction order, so every
// value is bit for bit the per-launch step's (eager mode, `drvqwen step` and the kernel tests run
// that step). Only where bytes wait differs.
//
// Bytes and the limit: the bytes of the launches it stands in for (the weights once — 3.37 GB
// of INT4 at 7B, docs/benchmarks.md#bytes-per-token — plus the K/V read and the activations),
// and per step its program (32 B per op + each op's arguments: ~16–19 KB, L2-resident after the
// first step) and 4 B per op of counters. It is built around HBM bandwidth with no gaps between
// ops: the limit it removes is the per-launch drain and ramp-up; what it reaches is said below.
//
// Work split
// ----------
//   grid   = every block resident at once: SMs × blocks per SM (the launcher asks the driver).
//            A block that waits for a counter spins until blocks that are running produce it;
//            a block that is not resident could never run, so the grid must fit in one wave.
//   block  = DP_THREADS = 256 threads = 8 warps. A planned block of fewer warps (a GEMV of W < 8
//            warps, the 4-warp attention block) runs on the first warps; the others join the
//            barriers only. Op by op:
//              embedding, GEMVs               item = one planned block
//              attention split                item = two planned blocks (8 splits) of one KV head:
//                                             what a split computes depends only on (split, NS,
//                                             KV head), not on the block it runs in
//              attention combine              item = one planned block (h, c): a quarter of
//                                             head h's dims (the launch's blocks are 1024 / 4 =
//                                             DP_THREADS threads; attention_combine_dims)
//              L2 prefetch (where planned)    item = one planned block: thread 0 asks L2 for its
//                                             chunks of the next ops' weights, then the item waits
//                                             for the op before like any other (l2_prefetch.cu)
//   order  = block b takes items i ≡ b − first (mod grid) of each op, first = the items of all
//            ops before (so small ops land on different blocks step after step of the program),
//            ops in program order.
//
// Dependencies and why nothing runs ahead of its inputs
// ------------------------------------------------------
// counters[op] counts the items of op finished in this step. An item of op k + 1 waits (dep.wait,
// where a launch would call griddepcontrol.wait) until counters[k] = items of op k, so it starts
// after every item of op k has finished, and, by induction, after every item of every op before
// k. That is the order kernel boundaries give, for every hazard: an item reads what earlier ops
// wrote (read after write) and overwrites only what earlier ops read (write after read: q, attn,
// h and the partials are rewritten layer after layer). Release and acquire: ptx/flags.cuh.
// Before the wait a GEMV item loads only weights (never written by any op), and qkv_rope and the
// combine read the step's position, K/V slot and length (state, block table: written before
// this kernel is launched, by no op of it — Dep::state_fixed, block_coord.cuh); the attention
// items read the length and block table too, and ask L2 for their first K/V page (dp_attention:
// a prefetch, which reads nothing into the SM and changes no value). The first op waits for the previous kernel on the stream
// (griddepcontrol.wait: a no-op without programmatic launch). The wait itself: thread 0 polls
// the counter with relaxed loads, then one acquire load (ptx/flags.cuh), then a block barrier.
// No deadlock: every block is resident; the lowest op with unfinished items has its inputs
// complete, and each block reaches its items of that op after finishing its items of earlier ops,
// which are complete — so some item always progresses.
// Reset: the last block to finish (counters[n_ops] counts finished blocks) zeroes every counter;
// every other block has finished all its waits by then, and the next step's launch starts after
// this one ends (stream order).
// A counter that never fills (a bug) ends the kernel with a trap after DP_TIMEOUT_NS instead of
// hanging the GPU.
//
// Loads that other blocks' writes must reach: ordinary loads after the acquire. The bodies are
// written for launches of their own, where `const __restrict__` lets the compiler read an input
// through the non-coherent path (LDG.CONSTANT); here an input may have been written by another
// SM during this kernel, so `__restrict__` is defined away for the included files. Their explicit
// non-coherent loads read weights (never written) and the K/V cache with L1::no_allocate (no L1
// line to go stale; the slot this step writes is read only by ops after the one writing it).
//
// Stress mode (-DDP_STRESS=1): each block sleeps a pseudo-random 0–20 µs before each item, so
// blocks reach their items in orders a quiet GPU never shows; graph == eager must still hold
// (tests/test_decode_persistent.py). racecheck and synccheck see shared memory and block
// barriers only, not the ordering between blocks: this mode is that check.
//
// Where it stands (H200, synthetic models, graph ITL, the per-launch step in the same run:
// docs/bench/2026-12-02_d602176_h200_syn{05b,7b}{,_persistent}.json): bit for bit the per-launch
// step, normal and stress builds; a hand-off between ops costs ~0.26 µs (the trace: last
// release of one op → first wait over of the next), but
//   - 0.5B: 0.742 ms against 0.636. The launches are gone, the ops' latency is not: an item of
//     a small GEMV is one chain of dependent loads (residual → norm → weights → MMA → reduce →
//     epilogue), 2–5 µs, and each op waits for all of the one before. A launch of the
//     per-launch step overlaps the next kernel's ramp-up with its own drain (PDL, two blocks
//     per SM); here a block is busy until its item ends.
//   - 7B: 2.669 ms against 2.161. The GEMV items run at one block of 8 warps per SM: gate_up
//     takes 29.6 µs per layer, down 19 µs, against ~22 and ~15 as launches of two blocks per
//     SM. The per-launch gate_up planned at one block per SM takes as long (Nsight Compute:
//     29.98 µs, 2.41 TB/s, warps stalled at the first use of their weight and scale loads), so
//     the item's code is not the difference; the warps per SM are. More bytes in flight per warp
//     did not help (an L2 prefetch of the tiles ahead, a deeper register pipeline:
//     kernels/gemv_int4.cu's header, docs/bench/2026-12-02_h200_gemv_int4_variants.json).
//   - Since (e6b8a90; graph ITL, 64 tokens after a 512-token prompt, the per-launch step right
//     before on the same machine; docs/bench/2026-12-05_e6b8a90_h200_syn7b_per_launch.json,
//     docs/bench/2026-12-05_e6b8a90_h200_syn7b_persistent_1block.json,
//     docs/bench/2026-12-05_e6b8a90_h200_syn7b_persistent_2blocks.json,
//     docs/bench/2026-12-05_e6b8a90_h200_syn7b_persistent_2blocks_unroll2.json, the 0.5B's the same
//     with syn05b): 7B 2.460 ms at one
//     block per SM, 3.092 at two, 2.456 at two with the spill-free GEMV build (GEMV_UNROLL=2,
//     GEMV_ZERO_BATCHES=1), against 2.131 per launch; 0.5B 0.677 / 0.762 / 0.672 against 0.639.
//     The trace at one block (7B, layer 5, from the last wait over to the op's end): qkv_rope
//     9.2 µs, attention 4.0, combine 2.9 (four items a head), o_proj 4.5, gate_up 30.1, down
//     17.3. The per-launch gate_up forced to the same 132 blocks takes 25.1–25.4 µs with PDL
//     (gemv_int4.cu's header, …_gemv_int4_vs_6d38835_{1,2}.json), so here an item of the same
//     shape is ~5 µs slower.
//   - At a430afa on an H100 (graph ITL, 64 tokens after a 512-token prompt, the per-launch step
//     right before; docs/bench/2026-12-06_a430afa_h100_syn7b_persistent.json and its three
//     siblings):
//     7B 2.499 ms against 2.172, 0.5B 0.699 against 0.653. The trace's items (medians over the
//     layers): gate_up 27.1 µs at one item an SM (the launch alone, two blocks an SM: 25.1);
//     down 17.2; qkv_rope 9.2 in 96 items of 3 tiles (the launch, built to fit three blocks an
//     SM, runs 288 blocks of one tile: 7.5 alone). What the launches have and one block of 8
//     warps an SM has not is warps (kernels/gemv_int4.cu's header: the dev rings at one block an
//     SM trail production at every shape).
//   - In per-tensor formats (ops 8–11), at ef68c28 on an H100, in turns with the per-launch step
//     (graph ITL, 128 tokens after a 512-token prompt;
//     docs/bench/2026-12-07_ef68c28_h100_syn7b_q4_k_m_persistent_1.json and its siblings): the
//     7B in llama.cpp's Q4_K_M layout 2.600–2.639 ms against 2.080–2.089, the 0.5B in the real
//     0.5B's formats 0.772 / 0.795 against 0.669 / 0.669: the INT4 build's loss, with its cause (one
//     block of 8 warps an SM for the GEMV items, above).
//   - Those runs' step read more than its weights from DRAM (Nsight Compute after a cache flush,
//     7B, one step; docs/bench/2026-12-05_e6b8a90_h200_persistent_l2_ncu.json): 4.10 GB for
//     3.36 GB (at two blocks per SM 4.66 GB, with 2.5 GB of spill stores into L2). The probes
//     as --persistent-define under the same counters (H100;
//     docs/bench/2026-12-05_7ac45fc_h100_persistent_dram_probes.json) put the excess on the GEMVs'
//     weight loads: with them alone (GEMV_PROBE_LOADS_ONLY=1) the step reads the same 4.10 GB,
//     without them (GEMV_PROBE_NO_LOADS=1) 72 k sectors miss L2, the attention's page prefetch
//     left out changes nothing, and leaving ops out (DP_PROBE_SKIP) puts 0.29 GB on qkv_rope
//     (0.24 of weights), 1.41 on o_proj and down_proj (1.17) and 2.64 on gate_up (1.96). The
//     per-launch step, counted without flushes between its launches, reads the same excess
//     (gate_up 114.6 MB a launch for 70.0, down_proj 47.1 for 35.0), where each GEMV launch
//     profiled alone after a flush reads its nominal bytes (gemv_int4.cu's header). Its source:
//     a .L2::256B prefetch size on the weight loads, whose evict-first lines leave a full L2
//     before they are read (ptx/ldst.cuh). Without it, as now, this kernel reads 3.366 GB and
//     the step takes 2.644 ms against 2.819 on an H100, the per-launch step 2.36–2.41 against
//     2.62–2.63 (…_ea6f914_h100_persistent_ld_stream_ncu.json, ptx/ldst.cuh). The L2 prefetch
//     ops inside this kernel (--l2-prefetch-mb 8 / 24 --l2-prefetch-qkv) lose there too: 3.074 /
//     3.008 ms against 2.814 / 2.807 without them (…_7ac45fc_h100_syn7b_persistent_{1,2}.json,
//     …_persistent_l2_prefetch_{8,24}mb.json), and still once the loads carry no prefetch size:
//     2.754 / 2.724 and 2.926 / 2.933 ms against 2.642 / 2.620 (the per-launch step's L2
//     prefetch launches: 2.367 / 2.368 and 2.439 / 2.409 against 2.364 / 2.367), two blocks per
//     SM spill-free 2.680 against 2.639 at one (H100, in turns;
//     docs/bench/2026-12-05_194fb36_h100_l2pf_*.json, …_rows_syn7b_persistent_*.json).
// What lost (docs/bench/2026-12-01_h200_persistent_dev_runs.json, and the two-blocks log of the
// variants file): two blocks per SM (128 registers; the ops inlined into one switch spill, and compiled
// apart, -DDP_NOINLINE=1, pay the ABI's saves): 0.86 / 3.41 ms, gate_up 44 µs; GEMV_UNROLL=2 to
// fit them: no better; polling relaxed with one acquire per wait: still 3.37–3.53 ms, gate_up
// 44–45 µs, with no spills in the GEMV ops' loops (SASS) — why an item at two blocks per SM takes
// twice the per-launch kernel's time at the same grid is not known. This file's two-blocks build
// now spills inside the GEMV ops' main loops, 40–68 local loads and stores an iteration
// (tools/sass_loops.py; 50–64 before GEMV_ZERO_BATCHES:
// docs/bench/2026-12-05_{3be003f,43eb6ea}_cpu_sass_decode_persistent_hd128_2blocks.json). A
// two-blocks build whose GEMV loops do not spill: GEMV_UNROLL=2 with GEMV_ZERO_BATCHES=1 (no
// local operation in them at head dim 64, one at 128, where the attention's page loop keeps 41;
// docs/bench/2026-12-05_6f3d3c1_cpu_sass_decode_persistent_hd{64,128}_2blocks_unroll2.json;
// `drvqwen bench --decode persistent --persistent-blocks 2 --persistent-define GEMV_UNROLL=2
// --persistent-define GEMV_ZERO_BATCHES=1`), timed beside it: 2.456 ms against 3.092 at 7B, 0.672
// against 0.762 at 0.5B (above), and Nsight Compute counts the spilling build's local stores at
// 2.5 GB a step into L2 (…_persistent_l2_ncu.json) — here the spills were the loss. Spill-free,
// two blocks per SM only match one block (2.460 / 0.677). The
// one-block build at head dim 128 had 12–16 until GEMV_ZERO_BATCHES (below): its batches' scales
// spilled, each store right after its load, so the warp waited for the load there — the stall
// gemv_int4.cu's batches exist to avoid. Why a GEMV op needs more registers here than as a
// launch of its own is not settled either: compiled into this kernel alone (the switch cut to one
// kind) it still spills at two blocks per SM, while a kernel that runs the same item from a
// pointer to its arguments, with a runtime BlockCoord, in a loop over items, fits 128 registers
// (ptxas). With GEMV_ZERO_BATCHES (the one-block default at head dim 128) and the two-blocks
// spill-free build measured: above. A gpu-scope fence on either
// side of the counters besides the release/acquire: +0.1 ms on the 0.5B (ptx/flags.cuh says why
// they are not needed); polling without nanosleep: no change.
// Where an item's time goes at one block an SM (Nsight Compute over gate_up, H100;
// docs/bench/2026-12-06_12b2766_h100_gemv_gate_up_ncu_issue.json): ~161 warp instructions a 1 KiB
// item at ~1.35 a cycle an SM, the warp samples spread over fixed-latency dependencies, loads and
// issuing — with two warps a scheduler, the item's instruction chain, not its bytes (its weights
// already in shared memory, kernels/dev/gemv_int4/v4_bulk_ring.cu, take as long). ~75 of the 161
// are the unpack; 32-bit item offsets took 617 → 546 instructions from gate_up's loop
// (kernels/gemv_int4.cu's header). A quarter fewer instructions an item did not pay either: x
// rounded to int8 and dp4a on the masked nibbles (kernels/dev/gemv_int4/v5_int8_x.cu, ~104
// instructions an item and matrix in gate_up's loop against ~136) took gate_up at one block an
// SM to 25.33 µs from production's 26.14, down to 16.14 from 16.36 (H100, one run;
// docs/bench/2026-12-08_4bb4fcd_h100_dev_gemv_int4_int8_x.json) — 88 % of copy bandwidth at one
// block an SM either way. On an H100 the GEMV items are within ~10 % of what the launches give;
// the step's loss is elsewhere (the small ops and the hand-offs, below).
// Next: more bytes in flight per SM without registers — a loader warp that streams each item's
// weights (and the next op's, while the current one drains) into a shared-memory ring with bulk
// copies — and finer dependencies than "all of the op before" for the small ops. A first step of
// the second half, not yet measured: the step's L2 prefetch launches (plan_decode(l2_prefetch_
// bytes=…, l2_prefetch_qkv=True)) run here as ops, so a block that has finished its qkv_rope items
// asks for o_proj's and gate_up's weights before it waits, instead of only waiting.
// And the combine, one head an item until the launch split a head's dims over four blocks (its 14
// items at a median of 5.49 µs, of the 28.0 µs between two layers' qkv_rope waits, in the trace
// of docs/bench/2026-12-02_d602176_h200_syn05b_persistent.json: op 3, while the other 118 blocks
// waited): now four items a head, the launch's 256-thread blocks (attention_combine_dims), each
// a quarter of the loads a thread: 2.9 µs an op at 7B (the trace above).
//
// Requirements (checked by the launcher): the ops below only — the INT4 layers, or the
// per-tensor formats' (gemv_fmt.cu's GEMVs and embedding, in a build with the model's
// WF_FORMATS) —, the plain attention kernel of head dim DP_HEAD_DIM, every planned block ≤ 256
// threads (the combine's = 256). The final
// norm, the lm_head and the token's choice stay launches of their own after this kernel.
#include <cuda_fp16.h>

#include "types.cuh"  // u32, u64
#include "flags.cuh"  // ld_relaxed_gpu_u32, ld_acquire_gpu_u32, red_release_gpu_add, global_timer_ns, sm_id, nanosleep

#define __restrict__            // see the header: no non-coherent loads of inputs written here
#define ATTN_SMEM_WARPS 8       // one p/alpha buffer per warp of the block (attention_decode.cu)
#define DEVICE_FUNCTIONS_ONLY   // the included files' own kernels are not built into this module
#ifndef DP_HEAD_DIM
#define DP_HEAD_DIM 64          // the attention's head dim: one instantiation per build
#endif
#ifndef DP_MIN_BLOCKS
#define DP_MIN_BLOCKS 1  // blocks per SM the registers are sized for (__launch_bounds__)
#endif
#define ATTN_PREFETCH (DP_HEAD_DIM < 128 && DP_MIN_BLOCKS == 1)  // else the second page buffer spills (attention_decode.cu)
#ifndef RMSNORM_ALL_WARPS
#define RMSNORM_ALL_WARPS 1     // rmsnorm.cuh's every virtual warp: skipping the empty ones costs 8 bytes of spills at 255 registers here
#endif
#ifndef RMSNORM_ONE_PASS
#define RMSNORM_ONE_PASS 0      // the GEMV prologues read the row twice here: once costs 28 bytes of spills at 255 registers
#endif
#include "embedding.cu"         // EmbeddingArgs, embedding_item
// The GEMV ops' batch registers defined at each item's start (gemv_int4.cu: GEMV_ZERO_BATCHES), so
// they are live in their op only. At head dim 128 the step needs it: with its batches undefined,
// ptxas needs 255 registers and spills the GEMV loops' scales, 16 local loads and stores an
// iteration; with it, 207 registers and none. At head dim 64 the ops fit without (255, no
// spills), and the zeros would only add moves to the loops (tools/sass_loops.py:
// docs/bench/2026-12-05_{3be003f,43eb6ea}_cpu_sass_decode_persistent_hd128.json).
#ifndef GEMV_ZERO_BATCHES
#define GEMV_ZERO_BATCHES (DP_HEAD_DIM >= 128)
#endif
#include "gemv_int4.cu"         // GemvInt4…Args, gemv_int4_…_item
// A model in per-tensor formats: the launcher defines WF_FORMATS (the model's format mask, as its
// gemv_fmt.cu build has it: launchers/gemv_fmt.format_defines), and the format GEMVs' and the
// embedding's items join the ops. An INT4 build does not include the file (the same machine code
// as before formats could be ops).
#ifdef WF_FORMATS
#define DP_FORMATS 1
#ifndef GF_ZERO_BATCHES
#define GF_ZERO_BATCHES 1       // as GEMV_ZERO_BATCHES above: the format GEMVs' batches live in their op only
#endif
#include "gemv_fmt.cu"          // GemvFmt…Args, gemv_fmt_…_item, EmbeddingFmtArgs, embedding_fmt_item
#else
#define DP_FORMATS 0
#endif
#include "attention_decode.cu"  // AttentionDecodeArgs, attention_decode_args_split, AttentionCombineArgs, …
#include "l2_prefetch.cu"       // L2PrefetchArgs, l2_prefetch_block

#define DP_THREADS 256
// A trace record's first word: op << 32 | SM << DP_TRACE_ITEM_BITS | item (an op has fewer items
// than 2^DP_TRACE_ITEM_BITS, the launcher checks; an SM id < 2^12).
#define DP_TRACE_ITEM_BITS 20
#ifndef DP_ATTN_PREFETCH
#define DP_ATTN_PREFETCH 1  // the attention items' first K/V page asked of L2 before their wait (dp_attention)
#endif
#ifndef DP_STRESS
#define DP_STRESS 0
#endif
#define DP_TIMEOUT_NS 10000000000ull  // 10 s: far beyond any step, even under compute-sanitizer
// Nanoseconds a waiting thread sleeps between polls: it leaves its scheduler's issue slots to
// the other warps of its SM (polling without the sleep measured the same step time).
#ifndef DP_SPIN_NS
#define DP_SPIN_NS 32
#endif

// Op kinds (launchers/decode_persistent.py mirrors them).
#define DP_EMBEDDING 1
#define DP_QKV_ROPE  2
#define DP_RESIDUAL  3
#define DP_GATE_UP   4
#define DP_ATTENTION 5
#define DP_COMBINE   6
#define DP_L2_PREFETCH 7
#define DP_EMBEDDING_FMT 8  // the per-tensor formats' ops (DP_FORMATS builds)
#define DP_QKV_ROPE_FMT  9
#define DP_RESIDUAL_FMT  10
#define DP_GATE_UP_FMT   11

// One op of the program, 32 bytes, packed by the host.
struct PersistentOp {
    u32 kind;      // DP_*
    u32 n_items;   // items of this op (see the header's work split)
    u32 gx;        // planned grid x (blocks; attention: S, its grid's y is the KV heads)
    u32 threads;   // planned block size
    u64 args;      // device address of the argument struct (the kernel's parameter layout)
    u32 first;     // items of the ops before this one (where its item numbering starts)
    u32 wait;      // items of the op before (its counter's value once all are done); 0 for op 0
};
static_assert(sizeof(PersistentOp) == 32, "the host packs 32-byte ops");

// The dependency of one item: wait until *counter ≥ target (none for the first op: the previous
// kernel on the stream). Every thread of the block calls wait().
struct CounterDep {
    // The persistent kernel is launched after the step's state and block-table writes have
    // completed (no programmatic launch) and no op writes them: they are read before the wait.
    static constexpr bool state_fixed = true;
    // A block of this kernel has DP_THREADS threads, an item's planned block may have fewer: its
    // warps past the plan take no work (gemv_fmt.cu's gf_block).
    __device__ static constexpr bool exact_block() { return false; }
    const u32* counter;
    u32 target;
    u64* waited;  // where thread 0 stamps %globaltimer once the wait is over (null: no trace)
    __device__ __forceinline__ void wait() const {
        if (counter == nullptr) {
            grid_dependency_wait();
        } else if (threadIdx.x == 0) {
            // Poll relaxed, then one acquire: an acquire per poll invalidates the SM's L1 each time
            // (CCTL.IVALL), under the feet of another block of the SM that is working. The acquire
            // reads a value ≥ target (the counter only grows within a step), so it synchronizes
            // with every release up to the last item of the op before.
            const u64 t0 = global_timer_ns();
            while (ld_relaxed_gpu_u32(counter) < target) {
                if (DP_SPIN_NS) nanosleep(DP_SPIN_NS);
                if (global_timer_ns() - t0 > DP_TIMEOUT_NS) __trap();
            }
            (void)ld_acquire_gpu_u32(counter);
        }
        if (waited != nullptr && threadIdx.x == 0) *waited = global_timer_ns();
        if (counter != nullptr) __syncthreads();
    }
    __device__ __forceinline__ void launch_dependents() const {}
};

// The dependency already waited for (the attention items wait before their warps split up).
struct NoDep {
    static constexpr bool state_fixed = true;  // inside this kernel, as for CounterDep
    __device__ static constexpr bool exact_block() { return false; }
    __device__ __forceinline__ void wait() const {}
    __device__ __forceinline__ void launch_dependents() const {}
};

template <typename T>
__device__ __forceinline__ const T& dp_args(const PersistentOp& op) {
    return *reinterpret_cast<const T*>(op.args);
}

// One function per kind. Inlined by default: compiled on their own (-DDP_NOINLINE=1) every call
// pays the ABI's register saves (64–320 bytes of local memory per thread and item at 128
// registers, ptxas), but each op's registers are allocated on their own — the choice to
// measure at two blocks per SM, where the inlined switch spills.
#ifndef DP_NOINLINE
#define DP_NOINLINE 0
#endif
#if DP_NOINLINE
#define DP_OP_FN __device__ __noinline__
#else
#define DP_OP_FN __device__ __forceinline__
#endif
DP_OP_FN void dp_embedding(const PersistentOp& op, int item, CounterDep dep) {
    embedding_item(dp_args<EmbeddingArgs>(op), BlockCoord{item, 0, (int)op.gx, (int)op.threads}, dep);
}
DP_OP_FN void dp_qkv_rope(const PersistentOp& op, int item, CounterDep dep) {
    gemv_int4_qkv_rope_item(dp_args<GemvInt4QkvRopeArgs>(op), BlockCoord{item, 0, (int)op.gx, (int)op.threads}, dep);
}
DP_OP_FN void dp_residual(const PersistentOp& op, int item, CounterDep dep) {
    gemv_int4_residual_item(dp_args<GemvInt4ResidualArgs>(op), BlockCoord{item, 0, (int)op.gx, (int)op.threads}, dep);
}
DP_OP_FN void dp_gate_up(const PersistentOp& op, int item, CounterDep dep) {
    gemv_int4_gate_up_swiglu_item(dp_args<GemvInt4GateUpSwigluArgs>(op),
                                  BlockCoord{item, 0, (int)op.gx, (int)op.threads}, dep);
}
#if DP_FORMATS
DP_OP_FN void dp_embedding_fmt(const PersistentOp& op, int item, CounterDep dep) {
    embedding_fmt_item(dp_args<EmbeddingFmtArgs>(op), BlockCoord{item, 0, (int)op.gx, (int)op.threads}, dep);
}
DP_OP_FN void dp_qkv_rope_fmt(const PersistentOp& op, int item, CounterDep dep) {
    gemv_fmt_qkv_rope_item(dp_args<GemvFmtQkvRopeArgs>(op), BlockCoord{item, 0, (int)op.gx, (int)op.threads}, dep);
}
DP_OP_FN void dp_residual_fmt(const PersistentOp& op, int item, CounterDep dep) {
    gemv_fmt_residual_item(dp_args<GemvFmtResidualArgs>(op), BlockCoord{item, 0, (int)op.gx, (int)op.threads}, dep);
}
DP_OP_FN void dp_gate_up_fmt(const PersistentOp& op, int item, CounterDep dep) {
    gemv_fmt_gate_up_swiglu_item(dp_args<GemvFmtGateUpSwigluArgs>(op),
                                 BlockCoord{item, 0, (int)op.gx, (int)op.threads}, dep);
}
#endif
// Item = planned blocks 2p and 2p + 1 of KV head kv: warp w takes split 8p + w. Before the wait,
// lane 0 of a warp whose split has pages asks L2 for the first page's K and V (2 × 16 · Dh · 2 B,
// cp.async.bulk.prefetch.L2): the step's length and block table are fixed in this kernel
// (CounterDep::state_fixed), and the page's HBM latency then passes while qkv_rope's items run
// instead of after them. It changes no value: L2 is where every SM's writes land, so a prefetch
// of the page qkv_rope is writing (the current position's) fetches nothing stale. DP_ATTN_PREFETCH=0
// builds it without, to measure.
DP_OP_FN void dp_attention(const PersistentOp& op, int item, CounterDep dep) {
    const int gx = (int)op.gx, pairs = (gx + 1) / 2, kv_head = item / pairs, p = item % pairs;
    const int warp = threadIdx.x / WARP_SIZE, split = 8 * p + warp, n_splits = gx * ATTN_WARPS;
#if DP_ATTN_PREFETCH
    if (split < n_splits && threadIdx.x % WARP_SIZE == 0) {
        const AttentionDecodeArgs& a = dp_args<AttentionDecodeArgs>(op);
        const int n_pages = (a.state[2] + PAGE_TOKENS - 1) / PAGE_TOKENS;
        const int page = split * attn_pages_per_split(n_pages, n_splits);
        if (page < n_pages) {
            const u64 offset = kv_offset(a.block_table[page], kv_head, 0, a.Hkv, DP_HEAD_DIM);
            bulk_prefetch_l2(a.k_cache + offset, PAGE_TOKENS * DP_HEAD_DIM * sizeof(__half));
            bulk_prefetch_l2(a.v_cache + offset, PAGE_TOKENS * DP_HEAD_DIM * sizeof(__half));
        }
    }
#endif
    dep.wait();
    if (split < n_splits)
        attention_decode_args_split<DP_HEAD_DIM>(dp_args<AttentionDecodeArgs>(op), split, n_splits, kv_head, warp);
}
DP_OP_FN void dp_combine(const PersistentOp& op, int item, CounterDep dep) {
    // Item = one planned block (h, c) of the launch's grid (Hq, C), numbered x first: the
    // launch's blocks are ATTN_COMBINE_THREADS / C = DP_THREADS threads (the launcher checks C).
    attention_combine_dims(dp_args<AttentionCombineArgs>(op), item % op.gx, item / op.gx, op.n_items / op.gx, dep);
}

// Item = planned block `item` of the prefetch launch: its chunks asked of L2 by thread 0, then
// the wait for the op before (l2_prefetch.cu: the wait is what keeps the counters' order
// transitive). Its offsets are 32-bit arithmetic on purpose: with 64-bit division (a called
// subroutine) ptxas spilled 16 bytes in this kernel's build for head dim 64, which spills none.
DP_OP_FN void dp_l2_prefetch(const PersistentOp& op, int item, CounterDep dep) {
    l2_prefetch_block(dp_args<L2PrefetchArgs>(op), (u32)item, op.gx, dep);
}

// Timing probe (default 0), results WRONG by design: DP_PROBE_SKIP is a mask of op kinds
// (bit DP_…) whose items only wait for the op before and then count as finished — the step
// without those ops' work, order and waits unchanged — so that what one kind of op costs the
// step in time and in DRAM bytes can be told apart from the rest (`drvqwen bench --decode
// persistent --persistent-define DP_PROBE_SKIP=16` leaves gate_up out; o_proj and down_proj
// share DP_RESIDUAL; in a build for per-tensor formats the GEMVs are bits 9–11, DP_…_FMT).
// 0 builds the same machine code as without the probe.
#ifndef DP_PROBE_SKIP
#define DP_PROBE_SKIP 0
#endif

__device__ __forceinline__ void dp_run_item(const PersistentOp& op, int item, CounterDep dep) {
    if (DP_PROBE_SKIP != 0 && ((DP_PROBE_SKIP >> op.kind) & 1u)) {  // timing only (above)
        dep.wait();
        return;
    }
    switch (op.kind) {
    case DP_EMBEDDING: dp_embedding(op, item, dep); break;
#if !DP_FORMATS  // a model in per-tensor formats runs every projection on gemv_fmt.cu (dense FP16 too)
    case DP_QKV_ROPE:  dp_qkv_rope(op, item, dep); break;
    case DP_RESIDUAL:  dp_residual(op, item, dep); break;
    case DP_GATE_UP:   dp_gate_up(op, item, dep); break;
#endif
    case DP_ATTENTION: dp_attention(op, item, dep); break;
    case DP_COMBINE:   dp_combine(op, item, dep); break;
    case DP_L2_PREFETCH: dp_l2_prefetch(op, item, dep); break;
#if DP_FORMATS
    case DP_EMBEDDING_FMT: dp_embedding_fmt(op, item, dep); break;
    case DP_QKV_ROPE_FMT:  dp_qkv_rope_fmt(op, item, dep); break;
    case DP_RESIDUAL_FMT:  dp_residual_fmt(op, item, dep); break;
    case DP_GATE_UP_FMT:   dp_gate_up_fmt(op, item, dep); break;
#endif
    default: __trap();  // the host packs only the kinds above
    }
}

#if DP_STRESS
// 0–20 µs, different per block, op, item and launch.
__device__ __forceinline__ void dp_stress_delay(int op, int item) {
    if (threadIdx.x == 0) {
        u32 h = (u32)blockIdx.x * 0x9E3779B1u ^ (u32)op * 0x85EBCA77u ^ (u32)item * 0xC2B2AE3Du
                ^ (u32)(global_timer_ns() >> 10);
        h ^= h >> 15; h *= 0x2C1B3C6Du; h ^= h >> 12;
        nanosleep(h % 20000u);
    }
    __syncthreads();
}
#endif

// grid (resident blocks), block (DP_THREADS), dynamic smem: the largest of the ops' planned
// dynamic shared memory (the items of one block run one after another; a __syncthreads() after
// each item separates one item's use of shared memory from the next's).
// trace (optional): per block, trace_items records of 4 u64 — (op << 32 | SM << 20 | item,
// %globaltimer at the item's start, when its wait was over, after its release) — for `drvqwen
// bench --trace` (the SM: which items of an op shared one; an op has < 2^20 items, the launcher checks).
extern "C" __global__ void __launch_bounds__(DP_THREADS, DP_MIN_BLOCKS)
decode_persistent(const PersistentOp* program,  // [n_ops] the step's ops, in order
                  u32* counters,                // [n_ops + 1] uint32, zero between steps
                  u64* trace,                   // [grid, trace_items, 4] uint64, or null
                  int n_ops, int trace_items) {
    u64* rec = trace != nullptr ? trace + (u64)blockIdx.x * trace_items * 4 : nullptr;
    for (int k = 0; k < n_ops; ++k) {
        const u32 P = gridDim.x, n_items = program[k].n_items, first = program[k].first;
        for (u32 item = (blockIdx.x + P - first % P) % P; item < n_items; item += P) {  // ≡ blockIdx.x − first (mod P)
#if DP_STRESS
            dp_stress_delay(k, item);
#endif
            if (rec != nullptr && threadIdx.x == 0) {
                rec[0] = (u64)k << 32 | (u64)sm_id() << DP_TRACE_ITEM_BITS | item;
                rec[1] = global_timer_ns();
            }
            const CounterDep dep = {k == 0 ? nullptr : counters + k - 1, program[k].wait,
                                    rec != nullptr ? rec + 2 : nullptr};
            dp_run_item(program[k], (int)item, dep);
            __syncthreads();  // the item's writes, by every thread, before the release
            if (threadIdx.x == 0) {
                red_release_gpu_add(counters + k, 1u);
                if (rec != nullptr) rec[3] = global_timer_ns();
            }
            if (rec != nullptr) rec += 4;
        }
    }
    // The last block out resets the counters for the next step (header).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(counters + n_ops, 1u) == gridDim.x - 1) {
            for (int k = 0; k <= n_ops; ++k) counters[k] = 0u;
            __threadfence();
        }
    }
}
