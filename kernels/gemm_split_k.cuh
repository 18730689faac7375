// kernels/gemm_split_k.cuh — split-K for the persistent wgmma prefill GEMMs (gemm_int4.cu,
// gemm_fmt_wgmma.cu): a tile's K range cut into S splits that run on different blocks, and the
// last split of a tile to finish adding the S partial sums in a fixed order.
//
// Why: a GEMM with few output tiles and a long K leaves most SMs idle. The 0.5B's down_proj
// at a 512-token prompt is 4 token blocks × 7 row blocks = 28 tiles of 38 groups of 128 inputs
// on 132 SMs: 28 SMs each walk the whole K while 104 wait. Cut into S = 4 splits of 10 groups,
// 112 blocks run a quarter of the K each. The launcher (launchers/gemm_int4.py: k_splits_for)
// picks S from the tile count, the group count and the grid; S = 1 is the plain GEMM and never
// touches the buffers below.
//
// Work units: unit u of the launch is (token block u % TB, split (u / TB) % S, row block
// u / (TB·S)) — token block fastest, as the tiles were — and covers groups [split·P,
// min(G, (split+1)·P)), P = ceil(G / S) (the launcher keeps every split non-empty). The
// persistent blocks take units b, b + grid, … exactly as they took tiles.
//
// Bytes: each unit of a split tile writes its GEMM_ACC accumulators per consumer thread — the
// whole 128-row × GEMM_BM-token FP32 tile, 64 KiB at GEMM_BM = 128 — to `partials`, and the last
// one reads all S back (its own too, below): S tiles written and S read per tile, from L2 where the tile's units
// run close together (consecutive unit numbers: the same round of the persistent blocks, but
// for a tile whose splits straddle two rounds).
//
//   partials  fp32 [tiles · S, GEMM_ACC/4, 256, 4]: unit (tile, split)'s accumulators 4j … 4j+3 of
//             consumer thread c at [(tile·S + split), j, c] — consecutive threads, consecutive float4.
//   counters  int32 [tiles]: how many of the tile's S units have stored their partial; 0
//             between launches (the buffer starts zeroed and the last unit sets it back).
//
// The protocol, and why nothing reads a partial before it is complete (ptx/flags.cuh states the
// memory-model pattern): the 256 consumer threads of the unit store their partials, meet at a
// named barrier (bar.sync 1, 256: the producer warp(s) run ahead into the next unit and are not
// part of it), then thread 0 adds 1 to counters[tile] with one atom.acq_rel.gpu. Its release
// half publishes, through the barrier's causality order, every thread's stores; the unit whose
// add returns S − 1 is the last, and its acquire half synchronizes with every earlier add (the
// counter changes only by these read-modify-writes: one release sequence), so each earlier
// unit's stores happen before the last unit's loads, which come after a second named barrier.
// The last unit resets the counter; no other unit touches it again in this launch (a tile's S
// units each add once). The next launch that uses the buffers touches them only after its
// griddepcontrol.wait, which returns once this grid has completed: the prefill launches these
// GEMMs as programmatic dependents, and every kernel between two of them waits before it can
// finish (every block of each waits, none exits before its wait), so completion runs in stream
// order. A launch that never completes (a fault) leaves counters non-zero: the buffers are then
// as dead as the context. The partials are read with ld.cg (L2), written by other SMs in this
// launch: never through L1 or the non-coherent path.
// Shared memory: one int (`is_last`), written by thread 0 between the two barriers and read by
// all after the second; thread 0 writes it again only after the next unit's first barrier,
// which every consumer thread reaches after its read.
//
// Determinism: the sum is partial 0 + partial 1 + … in split order whichever unit is last (all S
// read back from memory, its own too), so a launch gives the same bits every time; with S > 1
// they differ from the S = 1 sums by FP32 reassociation only
// (tests: the reference's tolerance, and S = 1 against S > 1).
#pragma once

#include "types.cuh"  // u32, u64
#include "flags.cuh"  // split_arrive_last
#include "gemm_epilogue.cuh"  // GEMM_ACC

#define GEMM_SPLIT_THREADS 256  // the consumer threads of a block: two warpgroups, threads 0 … 255
#define GEMM_SPLIT_BARRIER 1    // named barrier id (0 is __syncthreads)
#define GEMM_SPLIT_MAX 4        // the launchers never pick more (launchers/gemm_int4.py mirrors it)

// The split-K arguments of a launch: S = splits (1: no split; the pointers may be null).
struct GemmSplitK {
    float* partials;   // [tiles · S, GEMM_ACC/4, 256, 4] fp32 scratch
    int* counters;     // [tiles] int32, zero between launches
    int splits;        // S
};

// Unit u of a launch (the header's order): token block, row block, tile index, split, groups.
struct GemmUnit {
    int tb, rb, tile, split, g0, g1;
};

__device__ __forceinline__ GemmUnit gemm_unit(int u, int token_blocks, int n_groups, int splits) {
    GemmUnit w;
    w.tb = u % token_blocks;
    const int r = u / token_blocks;
    w.split = r % splits;
    w.rb = r / splits;
    w.tile = w.rb * token_blocks + w.tb;
    const int per = (n_groups + splits - 1) / splits;
    w.g0 = w.split * per;
    w.g1 = min(n_groups, w.g0 + per);
    return w;
}

// bar.sync id, count: the consumer threads only (PTX ISA "Parallel Synchronization and
// Communication Instructions: bar"); count a multiple of 32.
__device__ __forceinline__ void gemm_consumers_sync() {
    asm volatile("bar.sync %0, %1;" :: "n"(GEMM_SPLIT_BARRIER), "n"(GEMM_SPLIT_THREADS) : "memory");
}

// After a unit's MMAs, by every consumer thread c (0 … 255) with its GEMM_ACC accumulators: store
// them as the unit's partial; return true in the tile's last unit, with acc replaced by the sum
// of the S partials (then the caller runs the epilogue), false in the others (skip it).
// The partial is GEMM_ACC/4 float4 per thread (acc[4j … 4j+3] at float4 [j, c] of the unit's slot:
// a warp's store is 512 contiguous bytes). The last unit reads all S back — its own as well, so
// that its accumulators are dead and their registers take the loads — in GEMM_ACC/8 chunks of 2
// float4, each chunk's loads from every split issued together (the split loop unrolled to
// GEMM_SPLIT_MAX with a predicate: 32 registers in flight): GEMM_ACC/8 L2 round trips whatever S
// is. Chunks of 4 float4 (half the round trips) spilled in the 9-warp form of gemm_int4.cu
// (36–52 B, ptxas), whose mainloop left ~10 registers of its 168; so did keeping the unit's own
// partial in registers while loading the others. A first version that walked the splits one after another, 16 loads at a
// time (S·4 round trips), cost ~13 µs a tile on the H200 at S = 3: more than the split saved.
__device__ __forceinline__ bool gemm_split_k_reduce(const GemmSplitK& sk, const GemmUnit& w, float (&acc)[GEMM_ACC]) {
    __shared__ int is_last;
    const int c = threadIdx.x;
    constexpr int J = GEMM_ACC / 4;                 // float4 per thread
    constexpr u64 SLOT = J * GEMM_SPLIT_THREADS;    // float4 per unit
    float4* slots = reinterpret_cast<float4*>(sk.partials) + (u64)w.tile * sk.splits * SLOT + c;
    float4* mine = slots + w.split * SLOT;
#pragma unroll
    for (int j = 0; j < J; ++j)
        __stcg(mine + j * GEMM_SPLIT_THREADS, make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]));
    gemm_consumers_sync();  // every thread's stores before thread 0's release
    if (c == 0) {
        is_last = split_arrive_last(reinterpret_cast<u32*>(sk.counters + w.tile), sk.splits);
    }
    gemm_consumers_sync();  // thread 0's acquire before every thread's loads below
    if (!is_last) return false;
    // Every split's partial read back, this unit's own too (the bits it stored: its registers
    // are free for the loads).
    constexpr int CJ = 2;  // float4 per chunk
#pragma unroll
    for (int j0 = 0; j0 < J; j0 += CJ) {
        float4 p[GEMM_SPLIT_MAX][CJ];
#pragma unroll
        for (int s = 0; s < GEMM_SPLIT_MAX; ++s)
#pragma unroll
            for (int e = 0; e < CJ; ++e)
                if (s < sk.splits) p[s][e] = __ldcg(slots + s * SLOT + (j0 + e) * GEMM_SPLIT_THREADS);
#pragma unroll
        for (int e = 0; e < CJ; ++e) {
            float4 sum = p[0][e];
#pragma unroll
            for (int s = 1; s < GEMM_SPLIT_MAX; ++s)
                if (s < sk.splits) {
                    sum.x += p[s][e].x; sum.y += p[s][e].y; sum.z += p[s][e].z; sum.w += p[s][e].w;
                }
            const int i = 4 * (j0 + e);
            acc[i] = sum.x; acc[i + 1] = sum.y; acc[i + 2] = sum.z; acc[i + 3] = sum.w;
        }
    }
    return true;
}
