// kernels/attention_decode_cluster.cu — paged GQA decode attention for short contexts in ONE
// launch: the split-KV kernel's splits, merged on chip by a thread block cluster instead of by
// attention_combine's second launch.
//
//   attention_decode_cluster_hd64 / _hd128   out [Hq, Dh] fp16 over positions < state[2]
//
// Why: at short contexts the decode attention is two latency chains, not bytes. At 512 tokens the
// 7B's K/V is 1 MiB a layer (0.25 µs at HBM rate), but the split kernel and the combine take
// ~8.6 µs together (graph replay; attention_decode_tma.cu's header), ~4 µs of it the combine's
// launch: its blocks wait for the whole split grid to drain, then read the partials back from
// L2. A combine inside the split kernel by its last block lost (attention_decode_tma.cu's
// header): one block merging every split of a KV head is a long serial chain. Here the merge is
// spread over the C blocks of the KV head's cluster, each merging a slice of the outputs, and the
// partials never leave the chip: distributed shared memory (ptx/cluster.cuh).
//
// The limit it is built around: latency at short contexts. Bytes per call = seq_len × Hkv × Dh
// × 2 (K, V) × 2 B, as every decode attention (2 KiB per token per layer at 7B); no partials in
// global memory. Only C · Hkv blocks run (32 at 7B), so at long contexts the HBM stream lacks
// SMs: this is the short-context kernel, the split-KV kernels (attention_decode_tma.cu) the
// long-context ones.
//
// Measured on the H200 (tools/bench_attention.py, graph of 20 calls, grids for a 32 768-token
// cache; docs/bench/2026-12-05_979f3b7_h200_attention_{7b,05b}.json), µs at 512 / 8192 / 32768
// tokens, this one launch against the TMA kernel's two (split + combine) and the plain kernel's:
//   | model | cluster of 8         | cluster of 16        | TMA + combine        | plain + combine      |
//   | 7B    | 6.38 / 21.28 / 72.79 | 6.60 / 14.05 / 41.17 | 7.06 / 14.46 / 27.33 | 6.71 / 14.00 / 28.29 |
//   | 0.5B  | 4.64 / 13.20 / 42.94 | 5.06 / 9.51 / 24.99  | 6.18 / 10.62 / 12.88 | 5.07 / 8.35 / 12.68  |
// So it wins at short contexts only, 0.3–0.7 µs a 7B layer and 0.4–1.5 µs a 0.5B layer at 512
// tokens, alone; inside the step PDL already overlaps the two launches with their neighbours.
// In the step (`python -m drvqwen.bench --mode graph --new-tokens 128 --short-attention-below
// 1024`, synthetic 0.5B, 128 tokens after a 512-token prompt, in turns with the default step on
// one machine): graph ITL 0.606 / 0.593 ms against the default's 0.617–0.623
// (docs/bench/2026-12-05_7e77f51_h200_syn05b_attention_short_cluster_3.json, …_4.json, and the
// default's …_attention_tma_1.json to …_4.json). The step's default since, up to one page a split
// at Dh = 128 (1024 positions) and two at Dh = 64 (2048), and built with ACL_CLUSTER=16 up to twice
// those lengths (src/drvqwen/decode.py has the second band's runs): on an H100, in turns, the 7B after 512
// tokens 2.1505 against 2.1928 ms, after 1024 2.198 / 2.201 against 2.159 / 2.157; the 0.5B after
// 512 0.599 against 0.640, after 2048 0.674 / 0.679 against 0.696 / 0.695, after 3072 0.713 /
// 0.714 against 0.707 / 0.701 (docs/bench/2026-12-06_f89a602_h100_syn{7b,05b}_*_short_attention_*.json;
// src/drvqwen/decode.py: default_short_attention).
//
// Work split
// ----------
//   grid    = (C, Hkv), C = ACL_CLUSTER blocks per KV head = one cluster (__cluster_dims__);
//             block = ACL_WARPS warps.
//   split   = one warp, exactly as in attention_decode.cu (attention_decode_split_body: the same
//             split rule, page loop and arithmetic): the NS = C · ACL_WARPS warps of a KV head
//             are its splits, split s = rank · ACL_WARPS + warp. A split with no page does nothing.
//   publish = each warp leaves its running state in shared memory: part_m, part_l [W][G] (the
//             max score, log2 units, and the exp-sum of each query head of its KV head) and
//             part_o [W][G][Dh] (the unnormalised output).
//   merge 1 = block: thread i of the block's G·Dh outputs (strided) merges the block's active
//             warps in warp order — M the largest of their m, o = Σ 2^(m − M) o, l = Σ 2^(m − M) l
//             — into blk_m, blk_l [G], blk_o [G][Dh] (attention_combine's formula).
//   merge 2 = cluster: block `rank` takes the outputs i ∈ [rank · P, (rank + 1) · P), P =
//             ceil(G·Dh / C); thread i reads blk_m, blk_l, blk_o of every active block r = 0 …
//             of the cluster (remote loads, all issued before the sums), merges them in order r,
//             writes out = o / l in fp16.
// Every output is computed by one thread in a fixed order: bit-reproducible, as the two-launch
// kernels are (their bits differ from these: a two-level merge rounds differently).
//
// Barriers, and why nothing races:
//   1. part_* [w] are written by warp w's lanes only (each (w, h, d) by one lane), after its page
//      loop; the block's __syncthreads orders them before merge 1 reads them. The split body's
//      p/alpha buffers (attention_decode.cu, sized ATTN_SMEM_WARPS = ACL_WARPS) are per warp.
//   2. blk_* are written by merge 1 (each (h, d) by one thread, blk_m / blk_l [h] by the thread of
//      d = 0) and read by merge 2 of every block of the cluster: cluster_sync between them (release
//      / acquire at cluster scope). Nothing writes shared memory after it.
//   3. A final cluster barrier after merge 2 (cluster_sync_exit: its arrive relaxed, it publishes
//      nothing): no block exits, releasing its shared memory, while another may still read its
//      blk_*; a thread's remote loads have returned before its arrive (their values were used).
// Every thread reaches all three barriers (no early return; the splits with no page and the
// threads with no output skip work, not barriers).
//
// ACL_CLUSTER=16 (the decode step's second band, where 64 splits would hold two pages each): 128
// splits a KV head on 16 SMs, half the pages a warp at mid contexts; 16 is past the portable
// cluster size, which the module loader opts in to (cuda/module.py: allow_its_cluster_size).
// ACL_POISON_SMEM=1 (tests only) fills part_* and blk_* with NaN before the splits run: a read of
// shared memory nothing wrote then shows in the output (the sanitizers check global memory only).
//
// Requirements (asserted by the launcher): Hq / Hkv ≤ 8, Dh ∈ {64, 128}, seq_len ≥ 1, pointers
// 16-byte aligned. And a GPC with C = 8 SMs free for a cluster (the portable cluster size; at
// Dh = 128 a block takes an SM: 230 registers × 256 threads).
#include <cuda_fp16.h>

#include "types.cuh"    // u32, u64, WARP_SIZE, F32_NEG_INF
#include "warp.cuh"     // quad_sum
#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents
#include "cluster.cuh"  // cluster_ctarank, cluster_sync(_exit), cluster_map_shared, ld_shared_cluster_f32

#ifndef ACL_CLUSTER
#define ACL_CLUSTER 8            // blocks per KV head: one cluster (16: a non-portable size, below)
#endif
static_assert(ACL_CLUSTER >= 1 && ACL_CLUSTER <= 16, "a cluster of at most 16 blocks (sm_90)");
#ifndef ACL_POISON_SMEM
#define ACL_POISON_SMEM 0        // tests: NaN in the merge buffers first (the header)
#endif
#define ACL_WARPS   8            // warps (= splits) per block
#define ATTN_SMEM_WARPS ACL_WARPS  // the split body's p/alpha buffers, one per warp
#define DEVICE_FUNCTIONS_ONLY    // attention_decode.cu's own kernels are not built into this module
#include "attention_decode.cu"   // attention_decode_split_body, attn_pages_per_split, ATTN_MAX_GROUP

// One block: the splits of rank `rank` of KV head `kv_head`, then its share of the merge.
// Contains __syncthreads() and cluster barriers: call from every thread of every block.
template <int HEAD_DIM>
__device__ __forceinline__ void attention_decode_cluster_block(__half* __restrict__ out,
                                                               const __half* __restrict__ q,
                                                               const __half* __restrict__ k_cache,
                                                               const __half* __restrict__ v_cache,
                                                               const int* __restrict__ block_table,
                                                               const int* __restrict__ state, int Hq, int Hkv,
                                                               int rank, int kv_head) {
    constexpr int DPL = HEAD_DIM / 32;  // dims a lane holds of each head row (attention_decode.cuh)
    __shared__ __align__(16) float part_o[ACL_WARPS][ATTN_MAX_GROUP][HEAD_DIM];  // per warp, unnormalised
    __shared__ float part_m[ACL_WARPS][ATTN_MAX_GROUP];                         // per warp, log2 units
    __shared__ float part_l[ACL_WARPS][ATTN_MAX_GROUP];                         // per warp
    __shared__ float blk_o[ATTN_MAX_GROUP][HEAD_DIM];                           // the block's merge
    __shared__ float blk_m[ATTN_MAX_GROUP];
    __shared__ float blk_l[ATTN_MAX_GROUP];

    const int warp = threadIdx.x / WARP_SIZE;
    const int n_splits = ACL_CLUSTER * ACL_WARPS;
    const int group = Hq / Hkv, head0 = kv_head * group;
    if constexpr (ACL_POISON_SMEM) {
        const float nan = __int_as_float(0x7fc00000);
        float* po = &part_o[0][0][0];
        float* bo = &blk_o[0][0];
        for (int i = threadIdx.x; i < ACL_WARPS * ATTN_MAX_GROUP * HEAD_DIM; i += blockDim.x) po[i] = nan;
        for (int i = threadIdx.x; i < ATTN_MAX_GROUP * HEAD_DIM; i += blockDim.x) bo[i] = nan;
        for (int i = threadIdx.x; i < ACL_WARPS * ATTN_MAX_GROUP; i += blockDim.x) (&part_m[0][0])[i] = (&part_l[0][0])[i] = nan;
        if (threadIdx.x < ATTN_MAX_GROUP) blk_m[threadIdx.x] = blk_l[threadIdx.x] = nan;
        __syncthreads();
    }

    attention_decode_split_body<HEAD_DIM>(
        q, k_cache, v_cache, block_table, state, Hq, Hkv, rank * ACL_WARPS + warp, n_splits, kv_head, warp, 0,
        [](const AttnLane&) {},  // a split with no page: the merges read only the active ones
        [&](float m_run, float l_run, const float (&acc)[ATTN_MAX_GROUP][DPL], const AttnLane& at) {
            const float l_total = quad_sum(l_run);  // the head's sum over the quad's tokens
            if (at.t == 0) {
                part_m[warp][at.g] = m_run;
                part_l[warp][at.g] = l_total;
            }
#pragma unroll
            for (int h = 0; h < ATTN_MAX_GROUP; ++h) {
                if (h >= group) break;
                float* dst = &part_o[warp][h][DPL * at.lane];
                if constexpr (DPL == 4) {
                    *reinterpret_cast<float4*>(dst) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
                } else {
                    *reinterpret_cast<float2*>(dst) = make_float2(acc[h][0], acc[h][1]);
                }
            }
        });

    // The active splits (the split rule's count), this block's and the cluster's blocks holding any.
    const int n_pages = (state[2] + PAGE_TOKENS - 1) / PAGE_TOKENS;
    const int pps = attn_pages_per_split(n_pages, n_splits);
    const int n_active = (n_pages + pps - 1) / pps;
    const int local = max(0, min(ACL_WARPS, n_active - rank * ACL_WARPS));
    const int n_blocks = (n_active + ACL_WARPS - 1) / ACL_WARPS;  // ≤ ACL_CLUSTER
    const int n_out = group * HEAD_DIM;
    __syncthreads();  // (1) part_* written

    // Merge 1: the block's active warps, in warp order.
    if (local > 0) {
        for (int i = threadIdx.x; i < n_out; i += blockDim.x) {
            const int h = i / HEAD_DIM, d = i % HEAD_DIM;
            float m_max = F32_NEG_INF;
            for (int w = 0; w < local; ++w) m_max = fmaxf(m_max, part_m[w][h]);
            float o = 0.f, l = 0.f;
            for (int w = 0; w < local; ++w) {
                const float e = exp2f(part_m[w][h] - m_max);
                o = fmaf(e, part_o[w][h][d], o);
                l = fmaf(e, part_l[w][h], l);
            }
            blk_o[h][d] = o;
            if (d == 0) {
                blk_m[h] = m_max;
                blk_l[h] = l;
            }
        }
    }
    cluster_sync();  // (2) every block's blk_* written, visible across the cluster

    // Merge 2: this block's slice of the outputs over the cluster's active blocks, in rank order.
    const int per = (n_out + ACL_CLUSTER - 1) / ACL_CLUSTER;
    const int i_end = min(n_out, (rank + 1) * per);
    for (int i = rank * per + threadIdx.x; i < i_end; i += blockDim.x) {
        const int h = i / HEAD_DIM, d = i % HEAD_DIM;
        float m_r[ACL_CLUSTER], l_r[ACL_CLUSTER], o_r[ACL_CLUSTER];
#pragma unroll
        for (int r = 0; r < ACL_CLUSTER; ++r) {  // every load issued before the first sum
            if (r < n_blocks) {
                m_r[r] = ld_shared_cluster_f32(cluster_map_shared(&blk_m[h], r));
                l_r[r] = ld_shared_cluster_f32(cluster_map_shared(&blk_l[h], r));
                o_r[r] = ld_shared_cluster_f32(cluster_map_shared(&blk_o[h][d], r));
            }
        }
        float m_max = F32_NEG_INF;
#pragma unroll
        for (int r = 0; r < ACL_CLUSTER; ++r)
            if (r < n_blocks) m_max = fmaxf(m_max, m_r[r]);
        float o = 0.f, l = 0.f;
#pragma unroll
        for (int r = 0; r < ACL_CLUSTER; ++r) {
            if (r < n_blocks) {
                const float e = exp2f(m_r[r] - m_max);
                o = fmaf(e, o_r[r], o);
                l = fmaf(e, l_r[r], l);
            }
        }
        out[(u64)(head0 + h) * HEAD_DIM + d] = __float2half_rn(o / l);
    }
    cluster_sync_exit();  // (3) no block leaves while another may still read its blk_*
}

// grid (ACL_CLUSTER, Hkv), block (ACL_WARPS · 32), one cluster per KV head; no dynamic shared
// memory. Launched as the plain decode kernels are (griddepcontrol.wait first: a no-op without
// programmatic launch).
#define ATTENTION_DECODE_CLUSTER_KERNEL(NAME, HEAD_DIM)                                                   \
    extern "C" __global__ void __launch_bounds__(ACL_WARPS * WARP_SIZE, 1)                                \
        __cluster_dims__(ACL_CLUSTER, 1, 1) NAME(                                                         \
            __half* __restrict__ out,                /* [Hq, Dh] fp16, out */                             \
            const __half* __restrict__ q,            /* [Hq, Dh] fp16, rotated query */                   \
            const __half* __restrict__ k_cache,      /* [P, Hkv, 16, Dh] fp16, this layer */              \
            const __half* __restrict__ v_cache,      /* [P, Hkv, 16, Dh] fp16, this layer */              \
            const int* __restrict__ block_table,     /* [max_pages] int32 */                              \
            const int* __restrict__ state,           /* [3] int32 (reads seq_len = state[2]) */           \
            int Hq, int Hkv) {                                                                            \
        grid_launch_dependents();                                                                         \
        grid_dependency_wait(); /* q, the K/V slot of this position and state: earlier kernels */         \
        attention_decode_cluster_block<HEAD_DIM>(out, q, k_cache, v_cache, block_table, state, Hq, Hkv,   \
                                                 (int)cluster_ctarank(), blockIdx.y);                     \
    }

ATTENTION_DECODE_CLUSTER_KERNEL(attention_decode_cluster_hd64, 64)
ATTENTION_DECODE_CLUSTER_KERNEL(attention_decode_cluster_hd128, 128)
