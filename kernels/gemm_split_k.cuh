// kernels/gemm_split_k.cuh — how the persistent wgmma prefill GEMMs (gemm_int4.cu,
// gemm_fmt_wgmma.cu) share their work among blocks: each block takes one contiguous range of the
// GEMM's (tile, 128-input group) work — the stream-K schedule (Osama, Merrill, Cecka, Garland,
// Owens: "Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication on
// the GPU", PPoPP 2023) — and a tile whose groups fall into the ranges of several blocks is
// finished by the block holding its first group, which adds the others' partial sums.
//
// Why: a GEMM whose tiles do not fill a whole number of rounds of the SMs idles them. The 7B's
// gate_up_swiglu at a 512-token prompt is 592 tiles of 256 tokens on 132 SMs, 4.48 rounds: in
// the fifth, 64 SMs work and 68 wait; its qkv_proj is 72 tiles, one round on 72 SMs; the 0.5B's
// down_proj is 28 tiles of 38 groups. Here every block runs W / P of the W = tiles × G groups
// (G = K / 128 a tile), so the GEMM takes the time of ceil(W / P) groups and one fix-up, whatever
// the tile count. A range boundary that falls inside a tile costs a partial sum stored by one
// block and read back by another (below); the launcher (launchers/gemm_int4.py: gemm_tiling)
// picks the block count P with that cost counted, and P = tiles, or no scratch, keeps every tile
// whole.
// Measured (H200, tools/bench_gemm.py --grid persistent whole --samples 7, M = 512, graph replay
// of 20 calls, samples in turns across the two columns; docs/bench/2026-12-03_05aa4ae_h200_
// gemm{7b,05b}_stream_k_interleaved.json), µs, stream-K ranges against the same grid in whole
// tiles:
//   | 7B   qkv 40.8 / 55.1 | o_proj 31.9 / 30.6 | gate_up 229.3 / 233.7 | down 122.0 / 133.5 |
//   | 0.5B qkv  9.8 / 11.2 | o_proj  8.9 /  8.4 | gate_up  28.7 /  30.8 | down  17.4 /  26.9 |
// 28 layers of the 7B 11.9 ms against 12.7, 24 of the 0.5B 1.55 against 1.86. The 7B's gate_up
// gains 2% where the balance alone promises 10% (126 groups a block against 140): a group takes
// ~1.8 µs in stream-K ranges against ~1.67 in whole tiles — whole tiles keep every block at the
// same group of its tile at the same time, ranges do not — but that is not the cause: tried and
// lost, the first (T/P − 1)·P tiles whole in step (block b taking b, b + P, …) and the ranges
// over the last P … 2P − 1 tiles only (tiles numbered token block fastest): gate_up 229.7 against
// 235.9 µs whole in the same run, the same 2.6%, and the prefills in drvqwen bench 13.24 (7B)
// and 2.80 ms (0.5B) against 12.72 and 2.54 (docs/bench/2026-12-03_d844433_h200_*: a run after
// sustained GEMMs, but the 0.5B's gate_up alone took 42.7 µs a layer against 32.7).
//
// The work
// --------
// Position x = tile · G + group, tiles numbered row block fastest (tile = token block · RB + row
// block, TB = ceil(M / GEMM_BM) token blocks, RB row blocks): the blocks working on token block 1
// are P / TB blocks further on, at the same row blocks at the same time as those on token block 0,
// so each weight slice is fetched from HBM once for all TB of them. (Against token block fastest,
// each the first column of its run: gate_up 218.1 against 222.2 µs — within the spread of runs,
// docs/bench/2026-12-03_c89dec0_h200_gemm7b_stream_k.json, …_e47fb8f_…). W = tiles · G; with a scratch
// the quantum q is 1 group (a range may cut a tile anywhere), without one q = G (whole tiles).
// P = min(gridDim.x, W / q) blocks take ranges: block b < P takes positions
// [start(b), start(b + 1)), start(b) = floor(b · (W/q) / P) · q; blocks b ≥ P exit at once. P ≤ W/q
// makes every range non-empty (start strictly increases).
// A unit is a range's part inside one tile: groups [g0, g1) of it. Three kinds:
//   whole  g0 = 0, g1 = G   the block runs the epilogue.
//   tail   g0 > 0           a later part of a tile begun by an earlier block. A range reaches the
//                           inside of a tile only at its start, so a tail is the first unit of
//                           its block: every block stores at most one partial, in slot b.
//   head   g0 = 0, g1 < G   the tile's first part; a range ends inside a tile only at its end,
//                           so a head is its block's last unit. The block (the tile's owner) adds
//                           the partials of the blocks b+1 … last that hold the rest of the tile
//                           — last = the block of position tile · G + G − 1 — in that order, then
//                           runs the epilogue. Every block owns at most one split tile: counter b.
//
//   partials  fp32 [P, GEMM_ACC/4, 256, 4]: block b's tail, its consumer thread c's accumulators
//             4j … 4j+3 at [b, j, c] — consecutive threads, consecutive float4 (a warp stores 512
//             contiguous bytes).
//   counters  int32 [P]: counters[b] counts the tails stored for block b's head; 0 between
//             launches (the buffer starts zeroed and the owner sets it back).
//
// The protocol, and why nothing reads a partial before it is complete (ptx/flags.cuh states the
// memory-model pattern): a tail's 256 consumer threads store their partial, meet at a named
// barrier (bar.sync 1, 256: the producer runs ahead and is not part of it), then thread 0 adds 1
// to counters[owner] with red.release.gpu. The owner's thread 0 polls counters[b] with relaxed
// loads until it reads the number of tails, reads it once more with ld.acquire.gpu, resets it,
// and the owner's consumers meet at the named barrier before any of them loads a partial. The
// counter changes in this launch only by those release adds (one release sequence), so the
// acquire synchronizes with every one, and every tail's stores happen before the owner's loads.
// No other block touches counters[b] after the owner's reset in this launch (its tails have each
// added once). The next launch that uses the buffers touches them only after its
// griddepcontrol.wait, which returns once this grid has completed: the prefill launches these
// GEMMs as programmatic dependents, and every kernel between two of them waits before it can
// finish, so completion runs in stream order. The partials are read with ld.cg (L2): written by
// other SMs in this launch, never read through L1 or the non-coherent path.
// Why the wait cannot deadlock: only an owner waits, at its last unit; the blocks it waits for
// store their tail as their first unit, before they wait for anything. And every block the owner
// waits for runs: the grid is at most one block per SM (plan_launch refuses more where ranges
// cut tiles, a forced P included), each SM holds one (one block of the kernel fits an SM), and the next kernel's blocks start only once every block of this one has
// started (griddepcontrol.launch_dependents, issued first thing). A counter that never fills (a
// bug) ends the kernel with a trap after GEMM_SPLIT_TIMEOUT_NS instead of hanging the GPU.
// Shared memory: none (the named barriers only).
//
// Determinism: the owner's sum is its own accumulators + the tail of block b+1 + that of b+2 …,
// the same order whichever block finishes first, so a launch gives the same bits every time;
// tiles cut by a range differ from whole ones by FP32 reassociation only (tests: the reference's
// tolerance, and stream-K against whole tiles).
#pragma once

#include "types.cuh"  // u32, u64
#include "flags.cuh"  // red_release_gpu_add, ld_relaxed_gpu_u32, ld_acquire_gpu_u32, global_timer_ns
#include "setmaxnreg.cuh"  // thread_index: read after the role split, not held across it
#include "gemm_epilogue.cuh"  // GEMM_ACC

#define GEMM_SPLIT_THREADS 256  // the consumer threads of a block: two warpgroups, threads 0 … 255
#define GEMM_SPLIT_BARRIER 1    // named barrier id (0 is __syncthreads)
#ifndef GEMM_SPLIT_CJ
#define GEMM_SPLIT_CJ 8
#endif
#define GEMM_SPLIT_TIMEOUT_NS 10000000000ull  // 10 s: far beyond any GEMM, even under compute-sanitizer

// The scratch of a launch whose ranges may cut tiles; both null: whole tiles only.
struct GemmSplitK {
    float* partials;   // [P, GEMM_ACC/4, 256, 4] fp32
    int* counters;     // [P] int32, zero between launches
};

// A launch's work: the header's W, q and P for the live M.
struct GemmWork {
    int token_blocks;  // TB
    int row_blocks;    // RB
    int n_groups;      // G
    int quanta;        // W / q
    int quantum;       // q: 1 or G
    int ranges;        // P
};

// The work of a GEMM run by `blocks` blocks (the grid, or a part of it: GemmGridPart).
__device__ __forceinline__ GemmWork gemm_work(int M, int tile_tokens, int row_blocks, int n_groups,
                                              const GemmSplitK& sk, int blocks) {
    GemmWork w;
    w.token_blocks = (M + tile_tokens - 1) / tile_tokens;
    w.row_blocks = row_blocks;
    w.n_groups = n_groups;
    w.quantum = sk.partials != nullptr ? 1 : n_groups;
    w.quanta = w.token_blocks * row_blocks * (n_groups / w.quantum);
    w.ranges = min(blocks, w.quanta);
    return w;
}

// The work of a GEMM the whole grid runs.
__device__ __forceinline__ GemmWork gemm_work(int M, int tile_tokens, int row_blocks, int n_groups,
                                              const GemmSplitK& sk) {
    return gemm_work(M, tile_tokens, row_blocks, n_groups, sk, (int)gridDim.x);
}

// The blocks of a launch that run one GEMM: blocks first … first + blocks − 1, block
// first + b taking range b of that GEMM's P = min(blocks, W / q) (the header's P with `blocks`
// for the grid). A launch of two GEMMs in two weight formats (gemm_int4.cu: the QKV whose v is
// Q6_K) gives each its part of the grid and its part of the scratch: slots and counters
// first … first + blocks − 1 (GemmSplitK offset by `first`), so the two never touch the same
// counter or partial, and the header's argument holds within each part unchanged (every block
// of the launch is resident, so every block an owner waits for runs).
struct GemmGridPart {
    int first_block, blocks;
    __device__ __forceinline__ int first() const { return first_block; }
    __device__ __forceinline__ int count() const { return blocks; }
};

// The whole grid as a part: block 0 first, gridDim.x blocks (every launch of one GEMM; the
// constants leave such a launch's code as it is without parts).
struct GemmWholeGrid {
    __device__ __forceinline__ int first() const { return 0; }
    __device__ __forceinline__ int count() const { return (int)gridDim.x; }
};

// First position of block b's range (b ≤ P; b = P: W). 32-bit: the launcher keeps W · P < 2³²
// (a 64-bit division is a subroutine call whose saved registers spilled in gemm_fmt_wgmma.cu).
__device__ __forceinline__ int gemm_range_start(const GemmWork& w, int b) {
    return (int)((u32)b * (u32)w.quanta / (u32)w.ranges) * w.quantum;
}

// The block whose range holds position x (quantum 1): the largest b with start(b) ≤ x.
__device__ __forceinline__ int gemm_range_of(const GemmWork& w, int x) {
    return (int)(((u32)(x + 1) * (u32)w.ranges - 1u) / (u32)w.quanta);
}

// The unit at position x of a range ending at `end`: token block, row block, tile, groups.
struct GemmUnit {
    int tb, rb, tile, g0, g1;
};

__device__ __forceinline__ GemmUnit gemm_unit_at(const GemmWork& w, int x, int end) {
    GemmUnit u;
    u.tile = x / w.n_groups;
    u.g0 = x - u.tile * w.n_groups;
    u.g1 = min(w.n_groups, u.g0 + (end - x));
    u.tb = u.tile / w.row_blocks;
    u.rb = u.tile % w.row_blocks;
    return u;
}

// bar.sync id, count: the consumer threads only (PTX ISA "Parallel Synchronization and
// Communication Instructions: bar"); count a multiple of 32.
__device__ __forceinline__ void gemm_consumers_sync() {
    asm volatile("bar.sync %0, %1;" :: "n"(GEMM_SPLIT_BARRIER), "n"(GEMM_SPLIT_THREADS) : "memory");
}

// After a unit's MMAs, by every consumer thread c (0 … 255) of block b with its GEMM_ACC
// accumulators: for a whole tile nothing; for a tail, store it as block b's partial, signal the
// tile's owner and return false (no epilogue here); for a head, wait for the tails, add them to
// acc in block order and return true (the caller runs the epilogue).
// The owner reads each tail in chunks of CJ float4 a thread (GEMM_ACC/(4·CJ) L2 round trips a
// tail) while its own accumulators stay live.
__device__ __forceinline__ bool gemm_split_k_finish(const GemmSplitK& sk, const GemmWork& w, const GemmUnit& un,
                                                    int b, float (&acc)[GEMM_ACC]) {
    const bool tail = un.g0 > 0, head = un.g0 == 0 && un.g1 < w.n_groups;
    if (!tail && !head) return true;
    // The thread index read where it is used, not held: held across the epilogue's values, the
    // GEMM_BM 256 build spilled it (8 B, ptxas).
    constexpr int J = GEMM_ACC / 4;                 // float4 per thread
    constexpr u64 SLOT = J * GEMM_SPLIT_THREADS;    // float4 per block
    if (tail) {
        float4* mine = reinterpret_cast<float4*>(sk.partials) + (u64)b * SLOT + thread_index();
#pragma unroll
        for (int j = 0; j < J; ++j)
            __stcg(mine + j * GEMM_SPLIT_THREADS, make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]));
        gemm_consumers_sync();  // every thread's stores before thread 0's release
        if (thread_index() == 0) red_release_gpu_add(reinterpret_cast<u32*>(sk.counters + gemm_range_of(w, un.tile * w.n_groups)), 1u);
        return false;
    }
    const int last = gemm_range_of(w, un.tile * w.n_groups + w.n_groups - 1);
    if (thread_index() == 0) {
        u32* counter = reinterpret_cast<u32*>(sk.counters + b);
        const u32 tails = (u32)(last - b);
        const u64 t0 = global_timer_ns();
        while (ld_relaxed_gpu_u32(counter) < tails)
            if (global_timer_ns() - t0 > GEMM_SPLIT_TIMEOUT_NS) __trap();
        (void)ld_acquire_gpu_u32(counter);
        *counter = 0;
    }
    gemm_consumers_sync();  // thread 0's acquire before every thread's loads below
    constexpr int CJ = GEMM_SPLIT_CJ;   // float4 per chunk
    static_assert(J % CJ == 0, "chunks");
#pragma unroll 1
    for (int o = b + 1; o <= last; ++o) {
        const float4* p = reinterpret_cast<const float4*>(sk.partials) + (u64)o * SLOT + thread_index();
#pragma unroll
        for (int j0 = 0; j0 < J; j0 += CJ) {
            float4 v[CJ];
#pragma unroll
            for (int e = 0; e < CJ; ++e) v[e] = __ldcg(p + (j0 + e) * GEMM_SPLIT_THREADS);
#pragma unroll
            for (int e = 0; e < CJ; ++e) {
                const int i = 4 * (j0 + e);
                acc[i] += v[e].x; acc[i + 1] += v[e].y; acc[i + 2] += v[e].z; acc[i + 3] += v[e].w;
            }
        }
    }
    return true;
}
