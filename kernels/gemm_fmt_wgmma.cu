// kernels/gemm_fmt_wgmma.cu — the prefill GEMMs over weights in their per-tensor formats
// (weight_formats.cuh: INT4 g128 and the GGUF's Q4_0 … Q6_K, F16) on Hopper's warpgroup MMA,
// both operands from shared memory.
//
//   gemm_fmtw_store_rows          out fp32 [M, ldo] columns col0 … col0+N-1 = X Wᵀ   (q, k, v into qkv)
//   gemm_fmtw_residual_rows       residual fp32 [M, N]                     += X Wᵀ   (o_proj, down_proj)
//   gemm_fmtw_gate_up_swiglu_rows h fp16 [M, F]   = silu(X Wgᵀ) ⊙ (X Wuᵀ)           (gate and up in one format)
//
// X is FP16 [rows, K] row-major, read through a TMA tensor map (box 128 tokens × 64 inputs,
// 128-byte swizzle); M = prefill_state[1] ≤ rows is the live row count, as in gemm_int4.cu.
//
// What it is built around: the tensor cores, and keeping the format's unpacking off their
// path. gemm_int4.cu unpacks INT4 into wgmma's A registers in the same warps that wait for the
// MMAs, and its header measures that as its limit (~50–60% of the tensor-core peak); the
// K-quants' two-level scales and high bits cost several times INT4's unpack per weight. Here a
// producer warpgroup does all of the unpacking: it reads each weight row's chunks in the row's
// own format (wf_load), dequantizes them to FP16 with the reference's arithmetic
// (wf_dequant_pairs: FP32, rounded once — bit for bit gemm_fmt.cu's weights), and stores them
// into shared memory in the layout wgmma reads (K-major, 128-byte swizzle, what TMA writes for
// X). The two consumer warpgroups only issue wgmma with both operands in shared memory (the SS
// form) and run the epilogue. One skeleton for every format: the format is a template
// parameter of the producer only.
//
// Work split
// ----------
//   tile     = 128 tokens × 128 weight rows (gate/up: 64 features of both), persistent as in
//              gemm_int4.cu: grid ≤ SM count, block b takes one contiguous stream-K range of
//              the (tile, group) work of the ceil(M/128) × row-block tiles (row block
//              fastest; gemm_split_k.cuh), whole tiles and, with a scratch, parts of the tiles
//              its range cuts; the producer walks the block's units one stage ahead across
//              their uneven group counts.
//   block    = 12 warps: consumer warpgroups 0 and 1 (warps 0–7; warpgroup w owns weight rows
//              64w … 64w+63 of the tile) and the producer warpgroup (warps 8–11).
//   stage    = 128 inputs: X, 2 TMA boxes of 128 tokens × 64 inputs (32 KB), and W, 128 rows ×
//              128 inputs of FP16 in two 64-input boxes of the same layout (32 KB).
//   producer = thread p (0–127) owns row p of the tile: per stage it loads that row's 4 chunks
//              (4 × 32 inputs) one stage ahead into registers, dequantizes them and stores 4 ×
//              64 B (16 st.shared.v4); thread 0 first issues the stage's TMA copies of X,
//              which land while the weights are dequantized.
//   consumer = per stage 8 × wgmma m64n128k16 (A: its 64 rows of W, B: X, both through
//              descriptors), commit, then wait_group 1: the stage before is complete and is
//              released while this one's MMAs run; the two warpgroups interleave on the tensor
//              cores. A unit's last stage is waited for (wait_group 0) and released before its
//              epilogue reads the accumulators.
//   epilogue = gemm_epilogue.cuh: each output element written by one lane (no atomics).
// Bytes: the whole weight matrix once per 128 tokens (mostly from L2 after the first token
// block), X once per 128 rows.
//
// Barriers and phases (initialised once by thread 0, then the kernel's only __syncthreads()).
// `it` counts the stages a block has run over all its tiles, the same in the producer and in
// every consumer warp; stage s = it % GW_STAGES holds round r = it / GW_STAGES.
//   full[s]   count GW_FULL_ARRIVALS = 129: every producer thread once its 16 stores of round r
//             are done — after fence.proxy.async, which makes those generic-proxy writes
//             visible to the tensor cores' async-proxy reads — and thread 0's arrive.expect_tx
//             for X's 32 KB (right after its wait on empty[s], before its stores), which the TMA
//             copies complete as transactions.
//   empty[s]  count 8: lane 0 of each consumer warp once a wgmma.wait_group that covers round r's
//             group has returned — the wait_group 1 after the next stage's commit, or the
//             wait_group 0 at the unit's end (the MMAs, which alone read the stage, are then
//             complete for its warpgroup). Each consumer warp arrives once per round of every
//             stage it ran, one stage late; with 3 stages the producer can still fill the stage
//             after the one being issued (stage it + 1 needs round it − 2 released, which the
//             wait in iteration it − 1 did), so nothing waits on itself.
//   Why it cannot race: a producer thread writes stage s for round r ≥ 1 (its stores, thread 0
//   the TMA) only after empty[s] phase r−1: after every consumer's MMAs of round r−1 (WAR; the
//   completion of a wgmma is followed by an implicit generic-async proxy fence, PTX ISA "Async
//   Proxy", so the stores need no fence on this side); a consumer's MMAs read round r only
//   after full[s] phase r, which needs every producer store of round r (fenced to the async
//   proxy) and all of X's bytes (RAW). Every arrival of round r
//   on full[s] comes after its thread's wait on empty[s] phase r−1, which itself needed full[s]
//   phase r−1 complete: no arrival spills into the wrong phase. Parities suffice because full[s]
//   runs at most one phase ahead of a consumer's wait and empty[s] one ahead of the producer's.
//
// Measured on the H200 (`drvqwen bench --prefill-gemm …`, 512-token prompt, graph decode; each
// pair in one run, docs/bench/2026-12-01_4929493_h200_*):
//   | model                               | this file | gemm_fmt.cu (mma.sync) | gemm_int4.cu |
//   | synthetic 7B, Q4_K_M layout: TTFT   | 30.7 ms   | 58.5 ms                | —            |
//   | synthetic 7B, INT4 (format 1): TTFT | 24.7 ms   | —                      | 17.3 ms      |
//   | synthetic 0.5B, Q4_K_M layout: TTFT | 6.2 ms    | 6.2 ms (84b2bea's run) | —            |
// INT4 through this skeleton is slower than gemm_int4.cu, whose consumers unpack INT4 into A
// registers themselves: one producer warpgroup dequantizing 128 rows × 128 inputs per stage
// (then 16 stores per thread) is the limit here, not the tensor cores.
// Since then, the GEMMs alone (tools/bench_gemm.py --grid persistent, the 7B's four at M = 512,
// ms for 28 layers, builds alternately twice in one run, means of the two;
// docs/bench/2026-12-02_ca5cffd_h200_gemm_fmt_fp16_dequant.json, …_236142d_…_load_ahead.json):
//   | step                                                        | int4_g128 | q4_k | q6_k | q8_g32 | q5_g32 |
//   | FP32 dequantization, each stage's MMAs waited for           | 21.2      | 25.2 | 28.9 | 28.7   |        |
//   | (c − z)·s as one FP16 multiply (same bits: wf_dequant_pairs) | 19.7      | 25.3 | 28.9 | 28.5   |        |
//   | one stage's MMAs kept in flight (wait_group 1)              | 19.5      | 25.2 | 29.1 | 28.5   |        |
//   | the same, in a second run                                   | 19.2      | 24.7 | 28.9 | 28.7   | 26.0   |
//   | two stages of loads in flight (second run)                  | 19.2      | 25.4 | 27.0 | 27.7   | 23.8   |
//   (gemm_int4.cu in the same runs: 14.3–14.9.) The last row is kept for q5_g32 and q8_g32
// only (gw_loads_two_ahead). What is left is the producer itself: at int4_g128 a stage
// takes ~2 500 cycles where its 16 MMAs need ~1 000, and a producer warp issues ~390
// instructions per stage (the SASS: 64 HMUL2, 64 HADD2/HFMA2, 70 LOP3, 16 STS.128, 4 LDG.128).
// Its fence.proxy.async.shared::cta compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S. A MEMBAR
// orders all of the thread's earlier memory accesses, the loads of the next stage (issued at
// the top of the iteration) among them; if it waits for them to return, each stage pays a full
// load latency whatever the prefetch distance, which would fit two stages ahead changing nothing
// at int4_g128. Measured, and it does not hold (tools/bench_gemm.py --grid persistent, the 7B at
// M = 512, builds of fe0588e — this loop with two switches since removed; one run,
// docs/bench/2026-12-03_fe0588e_h200_gemm_fmt_producer_fence_pingpong.json; ms for 28 layers):
//   | producer                                                   | q4_k | int4_g128 |
//   | this file                                                  | 25.7 | 19.0      |
//   | two register sets in turn, no copy of in-flight loads      | 25.7 | 19.0      |
//   | without the fence (timing only: may read stale weights)    | 25.0 | 18.1      |
//   | both                                                       | 25.0 | 18.8      |
//   (gemm_int4.cu in the same run: 11.3.) The fence costs 3–5 %, the loads' latency nothing
// that a loader warp would win back: the producer's own instructions are the limit — more
// threads dequantizing, or the unpack moved into the consumers' A registers as gemm_int4.cu
// does. Of the Q4_K_M layout's qkv, its three launches (q, k, v: 156 µs a layer at q4_k against
// 37 for gemm_int4.cu's one) cost more than the projection's size says: k and v, 512 rows each,
// are 4 row blocks × 4 token blocks a launch.
//
// Requirements (checked by launchers/gemm_fmt_wgmma.py): K % 128 == 0 and a multiple of the
// format's group (256 for the K-quants); X's rows 16-byte aligned (TMA); pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"           // u32, u64, WARP_SIZE, QUAD_SIZE
#include "tma.cuh"             // CUtensorMap, tma_load_2d, tma_prefetch_map
#include "mbarrier.cuh"        // mbarrier_init, mbarrier_arrive(_expect_tx), mbarrier_wait_parity
#include "wgmma.cuh"           // wgmma_*, wgmma_desc_sw128, fence_proxy_async_shared
#include "ldst.cuh"            // l2_evict_normal_policy
#include "int4_matmul.cuh"     // INT4_TILE_ROWS, swiglu_f16
#include "gemm_epilogue.cuh"   // GEMM_BM, gemm_each_token, GemmResidualAdd
#include "gemm_split_k.cuh"    // GemmSplitK, GemmWork, gemm_work, gemm_unit_at, gemm_split_k_finish
#include "griddep.cuh"         // grid_dependency_wait, grid_launch_dependents
#include "weight_formats.cuh"  // WfWeight, WfRaw, wf_load, wf_dequant_pairs, wf_known, WF_DISPATCH

#define GW_CONSUMER_WARPS 8
#define GW_PRODUCER_THREADS 128                                   // one per weight row of a tile
#define GW_THREADS        (GW_CONSUMER_WARPS * WARP_SIZE + GW_PRODUCER_THREADS)  // 384
#define GW_BLOCK_ROWS     128                                     // weight rows per tile (wgmma M × 2)
#define GW_STAGES         3
#ifndef GW_LOAD_AHEAD
#define GW_LOAD_AHEAD     0   // stages of weight loads the producer keeps in flight: 1, 2, or 0 (by format, below)
#endif
#ifndef GW_MMA_IN_FLIGHT
#define GW_MMA_IN_FLIGHT  1   // 1: a consumer keeps one stage's MMAs in flight (wait_group 1); 0: waits for each
#endif
#define GW_GROUP          128                                     // inputs per stage
#define GW_CHUNKS         (GW_GROUP / WF_CHUNK)                   // 4 chunks per row and stage
#define GW_BOX_INPUTS     64                                      // one 128-byte swizzle row
#define GW_X_BOX_BYTES    (GEMM_BM * GW_BOX_INPUTS * 2)           // 16 KB
#define GW_W_BOX_BYTES    (GW_BLOCK_ROWS * GW_BOX_INPUTS * 2)     // 16 KB
#define GW_X_STAGE_BYTES  (2 * GW_X_BOX_BYTES)                    // 32 KB
#define GW_STAGE_BYTES    (GW_X_STAGE_BYTES + 2 * GW_W_BOX_BYTES) // 64 KB (a multiple of 1024)
#define GW_K_STEPS        (GW_GROUP / 16)                         // 8 wgmma k16 steps per stage
#define GW_FULL_ARRIVALS  (GW_PRODUCER_THREADS + 1)
#define GW_SMEM_BYTES     (GW_STAGES * GW_STAGE_BYTES + 1024 + 2 * GW_STAGES * 8)  // launchers mirror it

// Byte offset of the 16-byte unit j (inputs 8j … 8j+7) of row r in a 128-row box of 128-byte
// rows with the 128-byte swizzle: unit j of row r sits at unit j ^ (r mod 8) of its row, the
// pattern TMA writes for CU_TENSOR_MAP_SWIZZLE_128B and wgmma_desc_sw128 describes (the box is
// 1024-byte aligned, so r mod 8 is the row's place in its 8-row atom).
__device__ __forceinline__ u32 gw_swizzled(int r, int j) {
    return (u32)r * 128u + (u32)((j ^ (r & 7)) << 4);
}

// The producer's row: one weight row of one matrix, clamped into it (rows past the end are
// loaded and multiplied, never stored).
struct GwRow {
    WfWeight w;
    u32 row;
};

// One stage's raw chunks of the producer thread's row.
struct GwRaw {
    WfRaw c[GW_CHUNKS];
};

// Whether format F's producer keeps two stages of weight loads in flight rather than one.
// Measured (tools/bench_gemm.py, the 7B's GEMMs at M = 512, each format compiled alone, both
// builds alternately twice in one run; docs/bench/2026-12-02_236142d_h200_gemm_fmt_load_ahead.json),
// ms for 28 layers, one ahead → two: q5_g32 26.0 → 23.8, q8_g32 28.7 → 27.7, q6_k 28.9 → 27.0,
// int4_g128 19.2 → 19.2, q4_k 24.7 → 25.4. Two ahead where it won and every build stays free of
// spills: q5_g32 and q8_g32. Not q6_k: compiled with q4_k, as a Q4_K_M model is, its third set of
// chunks spills (24 B); not dense (64 B of raw values per chunk); and the other 32-input-group
// formats (q4_g32, q4_g32_min, q5_g32_min, not measured) would make the all-format build spill.
__host__ __device__ constexpr bool gw_loads_two_ahead(int f) {
    return GW_LOAD_AHEAD ? GW_LOAD_AHEAD == 2
                         : f == WF_Q5_G32 || f == WF_Q8_G32;
}

// The producer warpgroup: thread p dequantizes row p of every unit's tile into the ring, thread 0
// also copies X by TMA. row_of(rb, p) → GwRow. Stage `it` is position `at` of the block's range.
template <int F, typename RowOf>
__device__ __forceinline__ void gw_producer(const CUtensorMap& x_map, unsigned char* smem, u64* full, u64* empty,
                                            const GemmWork& work, int K, RowOf row_of) {
    const int p = threadIdx.x - GW_CONSUMER_WARPS * WARP_SIZE;
    const u64 policy = l2_evict_normal_policy();  // re-read by the other token blocks' tiles
    if (p == 0) tma_prefetch_map(&x_map);
    // The block's stages are the positions of its range one after another — stage x is group
    // x % G of tile x / G; where units begin and end matters to the consumers only — so the loads
    // of the next one are in flight while this one is dequantized, across unit boundaries too.
    const int x0 = gemm_range_start(work, blockIdx.x), n = gemm_range_start(work, blockIdx.x + 1) - x0;
    const int G = work.n_groups, RB = work.row_blocks;
    // Where the next load is: group lg of row block lrb (position x0 + loads; row block fastest
    // over the tiles, gemm_split_k.cuh), stepped one group at a time — no division per stage.
    int lrb = x0 / G % RB, lg = x0 % G;
    auto load = [&](GwRaw& raw) {
        const GwRow r = row_of(lrb, p);
#pragma unroll
        for (int j = 0; j < GW_CHUNKS; ++j) raw.c[j] = wf_load<F>(r.w, r.row, lg * GW_CHUNKS + j, K, policy);
        if (++lg == G) {
            lg = 0;
            if (++lrb == RB) lrb = 0;
        }
    };
    // Stage it is position x0 + it (n ≥ 1: a non-empty range, gw_block); `next` holds stage
    // it + 1. With two stages ahead, `next2` (it + 2) is issued at the top of each iteration and
    // `next` was loaded one iteration early: each load has two stages' time to land.
    constexpr bool TWO_AHEAD = gw_loads_two_ahead(F);
    GwRaw cur, next, next2;
    load(cur);
    if constexpr (TWO_AHEAD) {
        if (1 < n) load(next);
    }
    for (int it = 0; it < n; ++it) {
        if constexpr (TWO_AHEAD) {
            if (it + 2 < n) load(next2);
        } else {
            if (it + 1 < n) load(next);
        }
        const int at = x0 + it;
        const int s = it % GW_STAGES, grp = at % G;
        if (it >= GW_STAGES) mbarrier_wait_parity(&empty[s], ((it / GW_STAGES) - 1) & 1);
        unsigned char* st = smem + s * GW_STAGE_BYTES;
        unsigned char* wst = st + GW_X_STAGE_BYTES;
        if (p == 0) {  // X first: its copy lands while the stage's weights are dequantized
            const int m0 = at / G / RB * GEMM_BM;
            mbarrier_arrive_expect_tx(&full[s], GW_X_STAGE_BYTES);
            tma_load_2d(st, &x_map, grp * GW_GROUP, m0, &full[s]);
            tma_load_2d(st + GW_X_BOX_BYTES, &x_map, grp * GW_GROUP + GW_BOX_INPUTS, m0, &full[s]);
        }
#pragma unroll
        for (int j = 0; j < GW_CHUNKS; ++j) {
            u32 w[16];
            wf_dequant_pairs<F>(cur.c[j], grp * GW_CHUNKS + j, w);
            // Chunk j = inputs 32j … 32j+31 of the stage: box j / 2, units 4 (j % 2) … +3.
            unsigned char* box = wst + (j / 2) * GW_W_BOX_BYTES;
#pragma unroll
            for (int u = 0; u < 4; ++u)
                *reinterpret_cast<uint4*>(box + gw_swizzled(p, 4 * (j % 2) + u)) =
                    make_uint4(w[4 * u], w[4 * u + 1], w[4 * u + 2], w[4 * u + 3]);
        }
        fence_proxy_async_shared();  // these stores, before the tensor cores read them
        mbarrier_arrive(&full[s]);
        cur = next;
        if constexpr (TWO_AHEAD) next = next2;
    }
}

// The GEMM's tiles, handed out persistently: row_of(rb, p) → the producer's GwRow of local row
// p of row block rb; epilogue(acc, rb, local, m0, M, t) with the consumer lane's accumulators,
// `local` its row g in the tile (rows local and local + 8). Contains the block's only
// __syncthreads(): call from every thread, with a format this build reads (block-uniform).
template <int F, typename RowOf, typename Epilogue>
__device__ __forceinline__ void gw_block(const CUtensorMap& x_map, int M, int K, int row_blocks,
                                         const GemmSplitK& sk, RowOf row_of, Epilogue epilogue) {
    extern __shared__ unsigned char gw_smem_raw[];
    // The ring starts at the first 1024-byte boundary (swizzle atoms). An offset added to the
    // shared array itself, not a pointer rebuilt from an integer, keeps it a shared-memory pointer
    // as far as the compiler sees: the producer's stores are st.shared (STS.128), where a rebuilt
    // pointer gives generic stores (ST.E.128, a 64-bit address each).
    const u32 raw = static_cast<u32>(__cvta_generic_to_shared(gw_smem_raw));
    unsigned char* smem = gw_smem_raw + ((1024u - (raw & 1023u)) & 1023u);
    u64* full = reinterpret_cast<u64*>(smem + GW_STAGES * GW_STAGE_BYTES);
    u64* empty = full + GW_STAGES;

    const GemmWork work = gemm_work(M, GEMM_BM, row_blocks, K / GW_GROUP, sk);
    if ((int)blockIdx.x >= work.ranges) return;  // the whole block, before any barrier
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;

    if (threadIdx.x == 0) {
        for (int s = 0; s < GW_STAGES; ++s) {
            mbarrier_init(&full[s], GW_FULL_ARRIVALS);   // the protocol in the header
            mbarrier_init(&empty[s], GW_CONSUMER_WARPS);  // lane 0 of every consumer warp
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the last block-wide barrier: the roles part here

    if (warp >= GW_CONSUMER_WARPS) {
        gw_producer<F>(x_map, smem, full, empty, work, K, row_of);
        return;
    }

    // ---- consumers --------------------------------------------------------------------------
    const int wg = warp / 4, g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int local = wg * 64 + (warp % 4) * INT4_TILE_ROWS + g;
    const int b = blockIdx.x, end = gemm_range_start(work, b + 1);
    int it = 0;
#pragma unroll 1
    for (int x = gemm_range_start(work, b); x < end;) {
        const GemmUnit un = gemm_unit_at(work, x, end);
        x += un.g1 - un.g0;
        const int m0 = un.tb * GEMM_BM;
        float acc[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
        // One stage's MMAs stay in flight while the next stage's are issued (wait_group 1): the
        // tensor cores get the next batch without waiting for this warp to see the last one end.
        // A stage is released once the wait that covers its group has returned.
#pragma unroll 1
        for (int grp = un.g0; grp < un.g1; ++grp, ++it) {
            const int s = it % GW_STAGES;
            mbarrier_wait_parity(&full[s], (it / GW_STAGES) & 1);
            const unsigned char* st = smem + s * GW_STAGE_BYTES;
            const unsigned char* wst = st + GW_X_STAGE_BYTES + wg * 64 * 128;  // this warpgroup's 64 rows
#pragma unroll
            for (int i = 0; i < 64; ++i) wgmma_fence_operand(acc[i]);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < GW_K_STEPS; ++k) {
                const u64 a_desc = wgmma_desc_sw128(wst + (k / 4) * GW_W_BOX_BYTES + (k % 4) * 32);
                const u64 b_desc = wgmma_desc_sw128(st + (k / 4) * GW_X_BOX_BYTES + (k % 4) * 32);
                wgmma_m64n128k16_ss(acc, a_desc, b_desc, 1);
            }
            wgmma_commit_group();
#if GW_MMA_IN_FLIGHT
            wgmma_wait_group<1>();  // the previous stage's group is complete
#pragma unroll
            for (int i = 0; i < 64; ++i) wgmma_fence_operand(acc[i]);
            if (grp > un.g0 && lane == 0) mbarrier_arrive(&empty[(it + GW_STAGES - 1) % GW_STAGES]);
#else
            wgmma_wait_group<0>();
#pragma unroll
            for (int i = 0; i < 64; ++i) wgmma_fence_operand(acc[i]);
            if (lane == 0) mbarrier_arrive(&empty[s]);  // this warpgroup's MMAs are done with the stage
#endif
        }
#if GW_MMA_IN_FLIGHT
        wgmma_wait_group<0>();  // the unit's last group, before its accumulators are read
#pragma unroll
        for (int i = 0; i < 64; ++i) wgmma_fence_operand(acc[i]);
        if (lane == 0) mbarrier_arrive(&empty[(it + GW_STAGES - 1) % GW_STAGES]);
#endif
        // A tile cut by a range: its owner adds the other parts and runs the epilogue.
        if (!gemm_split_k_finish(sk, work, un, b, acc)) continue;
        epilogue(acc, un.rb, local, m0, M, t);
    }
}

// One matrix's row: local row p of row block rb is row rb·128 + p of W.
struct GwOneMatrix {
    WfWeight w;
    int N;
    __device__ __forceinline__ GwRow operator()(int rb, int p) const {
        return GwRow{w, (u32)min(rb * GW_BLOCK_ROWS + p, N - 1)};
    }
};

// out[token, col0 + n] = Σ_k X[token, k] W[n, k] for tokens < M (q, k and v into their columns
// of qkv). Tiles: ceil(M/128) × ceil(N/128); grid ≤ the SM count, block 384, smem GW_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(GW_THREADS, 1)
gemm_fmtw_store_rows(float* __restrict__ out,                  // [rows, ldo] fp32, columns col0 … col0+N-1 written
                     const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]: box 128 × 64, 128-B swizzle
                     const u32* __restrict__ w_qweight,        // [N, K] in format fmt: codes (weight_formats.cuh)
                     const u32* __restrict__ w_qhigh,          // high bits, or null
                     const void* __restrict__ w_scales,        // scales (fp16 | uint8 | int8, by format)
                     const void* __restrict__ w_aux,           // offsets | superscales, or null
                     const int* __restrict__ prefill_state,    // [2] int32: start, n_rows (M = [1])
                     float* __restrict__ split_partials,       // [grid, 16, 256, 4] fp32 scratch, or null: whole tiles
                     int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                     int N, int K, int ldo, int col0, int fmt) {
    grid_launch_dependents();
    grid_dependency_wait();      // X, the outputs, prefill_state, the scratch: earlier kernels'
    // An unknown format ends the whole grid, before any barrier — after the wait, so that even
    // then this grid completes only after the one before it (the chain gemm_split_k.cuh needs).
    if (!wf_known(fmt)) return;
    // ld.global.cg, not __ldg: ptxas may issue a non-coherent load before griddepcontrol.wait.
    const int M = __ldcg(prefill_state + 1);
    const GwOneMatrix rows{WfWeight{w_qweight, w_qhigh, w_scales, w_aux}, N};
    const GemmSplitK sk{split_partials, split_counters};
    WF_DISPATCH(fmt, F, gw_block<F>(x_map, M, K, (N + GW_BLOCK_ROWS - 1) / GW_BLOCK_ROWS, sk, rows,
                                    [&](const float (&acc)[64], int rb, int local, int m0, int M_, int t) {
                                        const int ra = rb * GW_BLOCK_ROWS + local;
                                        gemm_each_token([&](int token, float va, float vb) {
                                            if (ra < N) out[(u64)token * ldo + col0 + ra] = va;
                                            if (ra + 8 < N) out[(u64)token * ldo + col0 + ra + 8] = vb;
                                        })(acc, m0, M_, t);
                                    });)
}

// residual[token, n] += Σ_k X[token, k] W[n, k] for tokens < M (o_proj, down_proj). Tiles and
// launch as gemm_fmtw_store_rows.
extern "C" __global__ void __launch_bounds__(GW_THREADS, 1)
gemm_fmtw_residual_rows(float* __restrict__ residual,            // [rows, N] fp32, in/out
                        const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                        const u32* __restrict__ w_qweight,       // [N, K] in format fmt: codes
                        const u32* __restrict__ w_qhigh,         // high bits, or null
                        const void* __restrict__ w_scales,       // scales (by format)
                        const void* __restrict__ w_aux,          // offsets | superscales, or null
                        const int* __restrict__ prefill_state,   // [2] int32: start, n_rows (M = [1])
                        float* __restrict__ split_partials,      // [grid, 16, 256, 4] fp32 scratch, or null: whole tiles
                        int* __restrict__ split_counters,        // [grid] int32, zero between launches, or null
                        int N, int K, int fmt) {
    grid_launch_dependents();
    grid_dependency_wait();      // as above
    if (!wf_known(fmt)) return;
    // ld.global.cg, not __ldg: ptxas may issue a non-coherent load before griddepcontrol.wait.
    const int M = __ldcg(prefill_state + 1);
    const GwOneMatrix rows{WfWeight{w_qweight, w_qhigh, w_scales, w_aux}, N};
    const GemmSplitK sk{split_partials, split_counters};
    WF_DISPATCH(fmt, F, gw_block<F>(x_map, M, K, (N + GW_BLOCK_ROWS - 1) / GW_BLOCK_ROWS, sk, rows,
                                    [&](const float (&acc)[64], int rb, int local, int m0, int M_, int t) {
                                        int ra = rb * GW_BLOCK_ROWS + local;
                                        GemmResidualAdd{residual, N, &ra}(acc, m0, M_, t);
                                    });)
}

// h[token, f] = silu(X Wgᵀ) · (X Wuᵀ) for tokens < M, rounded once to FP16 (swiglu_f16). In each
// warp's 16 rows, row g is gate_proj's feature f and row g+8 up_proj's (as gemm_int4.cu), so the
// SwiGLU happens in registers; a tile covers 64 features. Tiles: ceil(M/128) × ceil(F/64).
extern "C" __global__ void __launch_bounds__(GW_THREADS, 1)
gemm_fmtw_gate_up_swiglu_rows(__half* __restrict__ h,                   // [rows, F] fp16, out
                              const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K] (normed hidden)
                              const u32* __restrict__ gate_qweight,     // [F, K] in format fmt: codes
                              const u32* __restrict__ gate_qhigh,       // high bits, or null
                              const void* __restrict__ gate_scales,     // scales (by format)
                              const void* __restrict__ gate_aux,        // offsets | superscales, or null
                              const u32* __restrict__ up_qweight,       // [F, K] in format fmt: codes
                              const u32* __restrict__ up_qhigh,         // high bits, or null
                              const void* __restrict__ up_scales,       // scales (by format)
                              const void* __restrict__ up_aux,          // offsets | superscales, or null
                              const int* __restrict__ prefill_state,    // [2] int32: start, n_rows (M = [1])
                              float* __restrict__ split_partials,       // [grid, 16, 256, 4] fp32 scratch, or null: whole tiles
                              int* __restrict__ split_counters,         // [grid] int32, zero between launches, or null
                              int F, int K, int fmt) {
    grid_launch_dependents();
    grid_dependency_wait();      // as above
    if (!wf_known(fmt)) return;
    // ld.global.cg, not __ldg: ptxas may issue a non-coherent load before griddepcontrol.wait.
    const int M = __ldcg(prefill_state + 1);
    constexpr int FB = GW_BLOCK_ROWS / 2;  // features per row block
    const WfWeight gate{gate_qweight, gate_qhigh, gate_scales, gate_aux}, up{up_qweight, up_qhigh, up_scales, up_aux};
    // Local row p: warp tile p / 16, row p % 16 of it: < 8 the gate row of feature
    // rb·64 + 8·(p / 16) + p % 16, else the up row of feature … + p % 16 − 8.
    auto row_of = [&](int rb, int p) {
        const int i = p % INT4_TILE_ROWS, f = rb * FB + (p / INT4_TILE_ROWS) * 8 + (i & 7);
        return GwRow{i < 8 ? gate : up, (u32)min(f, F - 1)};
    };
    const GemmSplitK sk{split_partials, split_counters};
    WF_DISPATCH(fmt, FM, gw_block<FM>(x_map, M, K, (F + FB - 1) / FB, sk, row_of,
                                      [&](const float (&acc)[64], int rb, int local, int m0, int M_, int t) {
                                          // local % 16 = g < 8: feature f of the lane's gate (g) and up (g + 8) rows
                                          const int f = rb * FB + (local / INT4_TILE_ROWS) * 8 + local % INT4_TILE_ROWS;
                                          gemm_each_token([&](int token, float gv, float uv) {
                                              if (f < F) h[(u64)token * F + f] = swiglu_f16(gv, uv);
                                          })(acc, m0, M_, t);
                                      });)
}
