// kernels/attention_decode_tma.cu — warp-specialised paged GQA decode attention: a TMA producer
// warp feeds consumer warps through mbarriers (docs/kernels.md#the-warp-specialised-tma-version). Split-KV ("flash-decoding").
//
//   attention_decode_tma_hd64 / _hd128   per split: partial_out, max_logits, exp_sums
//   (combined by attention_combine of attention_decode.cu, whose partial layout this writes)
//
// out[h, :] = softmax(q[h] · K[0:seq_len]ᵀ / √Dh) · V[0:seq_len] for every query head h, with
// query head h reading KV head h / (Hq/Hkv) (GQA, 7:1 for every Qwen2.5-Coder size).
// seq_len = state[2] comes from device memory, so one graph serves every step. The plain
// attention_decode.cu computes the same thing — the split rule and the per-page arithmetic are
// the same code, attention_decode.cuh — and stays the reference kernel and the fallback; this
// file adds the producer warp, the stage ring and its mbarriers.
//
// The limit it is built around: HBM bandwidth at long contexts. Bytes per call = seq_len ×
// Hkv × Dh × 2 (K and V) × 2 B = 2 KiB per token per layer at 7B (64 MiB at 32768 tokens), plus
// the fp32 partials (L2-resident). To read at the HBM rate an SM needs ~ bandwidth / SMs ×
// latency ≈ 4.3 TB/s / 132 × ~1 µs ≈ 32 KiB in flight; the plain kernel's warps each hold one
// page in registers and wait for it (latency-bound, ~2 TB/s at 32k). Here each block keeps up to
// CONSUMERS × STAGES pages (96 KiB at Dh = 128) in flight through TMA, and no register holds
// bytes that are still on their way.
//
// Work split
// ----------
//   grid    = (S, Hkv): S blocks per KV head (launchers/attention_decode_tma.py blocks_per_kv_head: every resident
//             block slot of the GPU); block = 1 producer warp + ATMA_CONSUMERS consumer warps.
//   split   = one consumer warp, exactly as in the plain kernel: the NS = S · ATMA_CONSUMERS
//             splits of a KV head divide its pages evenly, pages_per_split = ceil(n_pages / NS)
//             from seq_len in the kernel (fixed grid, graph-friendly). Split s = blockIdx.x ·
//             CONSUMERS + c covers logical pages [s · pps, min((s+1) · pps, n_pages)); warps with
//             none write a neutral partial (m = −inf, l = 0). attention_combine reads the splits
//             that cover seq_len by the same formula.
//   stages  = a ring of ATMA_STAGES per consumer warp in dynamic shared memory (AtmaShape); stage j of warp c
//             holds one page of one KV head: K [16][Dh] then V [16][Dh] fp16 (2 × 4 KiB at Dh 128).
//             Page i of warp c goes to stage j = i % STAGES in round r = i / STAGES.
//   producer (warp ATMA_CONSUMERS): walks the block's pages in the order (i, c) — page i of
//             every consumer warp in turn — with 32 block-table entries per warp-wide load (the
//             next 32 loaded while these are issued). For page i of warp c: wait until stage j is
//             free (round r > 0: empty[c][j] phase r−1 complete, parity (r−1) & 1), then lane 0
//             arms full[c][j] with the stage's bytes (arrive.expect_tx, 2 · 16 · Dh · 2 B) and
//             issues two TMA box copies (K, V: rows ((layer_page0 + page) · Hkv + kv_head) · 16 of
//             the [rows, Dh] pool views) completing on full[c][j].
//   consumer c (warps 0 … CONSUMERS−1): for page i: wait full[c][j] phase r (parity r & 1);
//             QKᵀ on tensor cores, online softmax in FP32, P·V in FP32 FMA — the plain kernel's
//             per-page arithmetic (attn_page, attention_decode.cuh), reading K/V from the stage
//             instead of registers — then every lane arrives on empty[c][j] after its last read
//             of the stage.
//
// Barriers and phases (each initialised once by thread 0, then fence + the kernel's only
// __syncthreads(), before the role branch):
//   full[c][j]   count 1 (the producer's arrive.expect_tx) + 2 box transactions. Phase r
//                completes when page r · STAGES + j of warp c is in shared memory.
//   empty[c][j]  count 32 (every lane of consumer warp c). Phase r completes when warp c is done
//                reading round r of stage j.
//   Why parities suffice: the producer arms full[c][j] for round r only after empty[c][j] phase
//   r−1, i.e. after warp c finished round r−1, so full is never more than one phase ahead of its
//   waiter; and warp c cannot finish round r before round r was issued, so empty is never more
//   than one phase ahead of the producer's wait. A 1-bit parity therefore names the phase.
//   No thread barrier is used inside a role branch; consumers sync only their own warp.
//
// Measured on the H200 (tools/bench_attention.py, graph replay, 7B, grids for a 32k cache,
// copy bandwidth 4273 GB/s): 32768 tokens (67 MB, from HBM) 22.7 µs for this kernel alone
// (2.96 TB/s; plain 23.8 µs), 32.1 µs with the combine (plain 33.5 µs); 8192 tokens 7.2 µs alone,
// 16.7 µs with the combine. The combine's ~9.5 µs over 256 active splits is now the larger lever.
//
// Tried and not kept: the combine as this kernel's own tail, with no attention_combine launch
// (commits 3cfb3e5 and 6c9e276: a merge function in attention_decode.cuh, a fused twin of each
// kernel of this file, a flag of the decode plan choosing it). The blocks whose splits hold
// pages count themselves on a per-KV-head counter (ptx/flags.cuh's split_arrive_last, the
// prefill attention's protocol) and the last merges the KV head's query heads, with the
// combine's virtual rows and order, so bit for bit attention_combine's output (its GPU test, and
// the same tokens in every run below). One block of 160 threads per KV head does the merge
// that attention_combine spread over Hq blocks of 1024 then, and that costs more than the launch
// it saves. Alone (graph of 20 calls, 7B, grids for a 32k cache): 18.6 µs at 512 tokens
// against 8.6 µs with the combine launch and 4.5 µs for the split kernel alone; 53.7 against
// 14.3 µs at 4096; 102.9 against 22.8 µs at 16384 — the merge grows by ~0.3 µs per active
// split, far more than its L2 bytes (3.5 KiB per split) or its instructions account for, and
// unrolling its split loop twice (two steps of loads in flight) changed nothing; no profile
// was taken. In the captured 7B step, graph ITL at 512 tokens 2.998 / 3.010 ms with the dependents
// triggered at the kernel's start, 2.572 / 2.572 ms with them launched at its exit, against
// 2.170 / 2.182 ms with the combine launch; at 16384 tokens 4.98–5.50 ms against 2.67–2.68;
// the 0.5B at 512 tokens 0.824 / 0.847 against 0.642 / 0.657 ms
// (docs/bench/2026-12-04_6c9e276_h200_{syn7b,syn05b}_fused_combine_2.json,
// …_attention_fused_combine_alone_{7b,05b}.json). A merge without a kernel boundary would have
// to be spread over many blocks, which the last-arriver pattern cannot do without blocks
// waiting on each other.
//
// Masking: TMA copies the whole 16-row box, so slots ≥ seq_len of the last page arrive with
// whatever the cache holds there (NaN in the tests). Their K and V are replaced by zeros with a
// select (never multiplied: 0 · NaN = NaN) and their scores set to −inf; the block table is read
// only for pages < ceil(seq_len / 16).
//
// head_dim is a template parameter (instantiated for 64 and 128): the register arrays need it.
// Requirements (asserted by the launcher): Hq / Hkv ≤ 8, seq_len ≥ 1, the tensor maps built by
// kv_cache.tensor_map (2-D [rows, Dh] fp16, box [16, Dh], no swizzle), dynamic shared memory
// = launchers/attention_decode_tma.py smem_bytes(Dh).
#include <cuda_fp16.h>

#include "types.cuh"             // u32, u64, WARP_SIZE, QUAD_SIZE, F32_NEG_INF, F32_LOG2E
#include "warp.cuh"              // FULL_WARP_MASK
#include "kv_cache.cuh"          // PAGE_TOKENS
#include "griddep.cuh"           // grid_dependency_wait, grid_launch_dependents
#include "mbarrier.cuh"          // mbarrier_init, mbarrier_arrive(_expect_tx), mbarrier_wait_parity, fence_mbarrier_init
#include "tma.cuh"               // CUtensorMap, tma_load_2d, tma_prefetch_map
#include "attention_decode.cuh"  // ATTN_MAX_GROUP, attn_pages_per_split, attn_page, …

#define ATMA_CONSUMERS 4                        // consumer warps (= splits) per block
#define ATMA_STAGES    3                        // ring stages per consumer warp
#define ATMA_THREADS   ((ATMA_CONSUMERS + 1) * WARP_SIZE)  // + the producer warp

// The block's shared memory, all of it dynamic (so the launcher's byte count is the whole
// footprint: the > 48 KiB opt-in and the occupancy estimate see every byte):
//   [0, P_OFFSET)            stages [CONSUMERS][STAGES] × {K [16][Dh], V [16][Dh]} fp16
//   [P_OFFSET, ALPHA_OFFSET) p      [CONSUMERS][16 tokens][8 heads] fp32 (warp-private)
//   [ALPHA_OFFSET, BAR_OFFSET) alpha [CONSUMERS][8 heads] fp32 (warp-private)
//   [BAR_OFFSET, SMEM_BYTES) full [CONSUMERS][STAGES], empty [CONSUMERS][STAGES] mbarriers (u64)
template <int HEAD_DIM>
struct AtmaShape {
    static constexpr int TILE_HALVES = PAGE_TOKENS * HEAD_DIM;  // one page of one head
    static constexpr u32 TILE_BYTES = TILE_HALVES * 2;           // one TMA box
    static constexpr u32 STAGE_BYTES = 2 * TILE_BYTES;           // K box + V box
    static constexpr u32 P_OFFSET = ATMA_CONSUMERS * ATMA_STAGES * STAGE_BYTES;
    static constexpr u32 ALPHA_OFFSET = P_OFFSET + ATMA_CONSUMERS * PAGE_TOKENS * ATTN_MAX_GROUP * 4;
    static constexpr u32 BAR_OFFSET = ALPHA_OFFSET + ATMA_CONSUMERS * ATTN_MAX_GROUP * 4;
    static constexpr u32 SMEM_BYTES = BAR_OFFSET + 2 * ATMA_CONSUMERS * ATMA_STAGES * 8;
    static_assert(TILE_BYTES % 128 == 0 && P_OFFSET % 16 == 0 && BAR_OFFSET % 8 == 0, "smem alignment");
};

template <int HEAD_DIM>
__device__ __forceinline__ void attention_decode_tma_impl(
    float* __restrict__ partial_out, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    const __half* __restrict__ q, const CUtensorMap* k_map, const CUtensorMap* v_map,
    const int* __restrict__ block_table, const int* __restrict__ state, int Hq, int Hkv,
    int layer_page0) {
    using Shape = AtmaShape<HEAD_DIM>;
    constexpr int VW = HEAD_DIM / 64;   // 32-bit words of V per lane per token
    grid_launch_dependents();
    grid_dependency_wait();  // q, the K/V slot of this position and state come from earlier kernels

    // AtmaShape's layout; the stages first, where the TMA's 128-byte alignment holds.
    extern __shared__ __align__(128) unsigned char atma_smem[];
    auto p_smem = reinterpret_cast<float (*)[PAGE_TOKENS][ATTN_MAX_GROUP]>(atma_smem + Shape::P_OFFSET);
    auto alpha_smem = reinterpret_cast<float (*)[ATTN_MAX_GROUP]>(atma_smem + Shape::ALPHA_OFFSET);
    auto full_bar = reinterpret_cast<u64 (*)[ATMA_STAGES]>(atma_smem + Shape::BAR_OFFSET);
    auto empty_bar = full_bar + ATMA_CONSUMERS;

    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int kv_head = blockIdx.y;
    const int n_splits = gridDim.x * ATMA_CONSUMERS;
    const int seq_len = state[2];
    const int n_pages = (seq_len + PAGE_TOKENS - 1) / PAGE_TOKENS;
    const int pps = attn_pages_per_split(n_pages, n_splits);
    const int block_page0 = blockIdx.x * ATMA_CONSUMERS * pps;  // first page of the block's warp 0

    if (threadIdx.x == 0) {
        for (int c = 0; c < ATMA_CONSUMERS; ++c)
            for (int j = 0; j < ATMA_STAGES; ++j) {
                mbarrier_init(&full_bar[c][j], 1);
                mbarrier_init(&empty_bar[c][j], WARP_SIZE);
            }
        fence_mbarrier_init();
    }
    __syncthreads();  // the only block-wide barrier: before the warp-role branch

    auto k_stage = [&](int c, int j) {
        return reinterpret_cast<__half*>(atma_smem + (c * ATMA_STAGES + j) * Shape::STAGE_BYTES);
    };

    if (warp == ATMA_CONSUMERS) {
        // ---------------- producer warp: block table → TMA copies into the rings ----------------
        // Item k = i · CONSUMERS + c is page i of consumer warp c (logical page block_page0 +
        // c · pps + i); items past a split's end (or past n_pages) read -1 and are skipped.
        const int n_items = ATMA_CONSUMERS * pps;
        auto entry = [&](int k) {
            const int lp = block_page0 + (k % ATMA_CONSUMERS) * pps + k / ATMA_CONSUMERS;
            return k < n_items && lp < n_pages ? block_table[lp] : -1;
        };
        if (lane == 0) {
            tma_prefetch_map(k_map);
            tma_prefetch_map(v_map);
        }
        int bt_cur = entry(lane);
        for (int k0 = 0; k0 < n_items; k0 += WARP_SIZE) {
            const int bt_next = entry(k0 + WARP_SIZE + lane);  // in flight while these are issued
            const int n = min(WARP_SIZE, n_items - k0);
            for (int l = 0; l < n; ++l) {                      // warp-uniform loop
                const int page = __shfl_sync(FULL_WARP_MASK, bt_cur, l);
                if (page < 0) continue;                        // warp-uniform
                const int c = (k0 + l) % ATMA_CONSUMERS, i = (k0 + l) / ATMA_CONSUMERS;
                const int j = i % ATMA_STAGES, r = i / ATMA_STAGES;
                if (r > 0) mbarrier_wait_parity(&empty_bar[c][j], (r - 1) & 1);
                if (lane == 0) {
                    __half* k_dst = k_stage(c, j);
                    const int row = ((layer_page0 + page) * Hkv + kv_head) * PAGE_TOKENS;
                    mbarrier_arrive_expect_tx(&full_bar[c][j], Shape::STAGE_BYTES);
                    tma_load_2d(k_dst, k_map, 0, row, &full_bar[c][j]);
                    tma_load_2d(k_dst + Shape::TILE_HALVES, v_map, 0, row, &full_bar[c][j]);
                }
                __syncwarp();
            }
            bt_cur = bt_next;
        }
        return;
    }

    // ---------------- consumer warp c = split blockIdx.x · CONSUMERS + c ----------------
    // The plain kernel's split, reading its pages from the ring instead of registers.
    const int c = warp;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int group = Hq / Hkv;
    const int split = blockIdx.x * ATMA_CONSUMERS + c;
    const int head0 = kv_head * group;
    const int page_begin = split * pps, page_end = min(page_begin + pps, n_pages);
    const AttnLane at = {split, Hq, head0, group, c, lane, g, t};

    if (page_begin >= page_end) {
        attn_neutral_partial(max_logits, exp_sums, at);
        return;
    }

    uint4 qf[HEAD_DIM / 32];
    attn_query_fragments<HEAD_DIM>(qf, q, at);

    // The split's running state (attention_decode.cuh).
    const float scale_log2 = rsqrtf((float)HEAD_DIM) * F32_LOG2E;
    float m_run = F32_NEG_INF;
    float l_run = 0.f;
    float acc[ATTN_MAX_GROUP][HEAD_DIM / 32] = {};

    for (int lp = page_begin; lp < page_end; ++lp) {
        const int i = lp - page_begin, j = i % ATMA_STAGES, r = i / ATMA_STAGES;
        const int valid = min(PAGE_TOKENS, seq_len - lp * PAGE_TOKENS);  // ≥ 1
        const __half* ks = k_stage(c, j);
        const __half* vs = ks + Shape::TILE_HALVES;
        mbarrier_wait_parity(&full_bar[c][j], r & 1);  // page i's K and V are in the stage

        // K and V from the stage. The box holds all 16 slots: the masked ones are replaced by
        // zeros with a select (multiplying them by 0 would keep a NaN).
        attn_page<HEAD_DIM>(m_run, l_run, acc, scale_log2, qf, valid, p_smem, alpha_smem, at,
                            [=](int nt, int m) {
                                const int tok = nt * 8 + g;
                                const uint4* src =
                                    reinterpret_cast<const uint4*>(ks + tok * HEAD_DIM + 32 * m + 8 * t);
                                return tok < valid ? *src : make_uint4(0u, 0u, 0u, 0u);
                            },
                            [=](int tok, int w) {
                                const __half* src = vs + tok * HEAD_DIM + 2 * VW * lane;
                                u32 raw;
                                if constexpr (VW == 2) {
                                    const uint2 w2 = *reinterpret_cast<const uint2*>(src);
                                    raw = w == 0 ? w2.x : w2.y;
                                } else {
                                    raw = *reinterpret_cast<const u32*>(src);
                                }
                                const u32 bits = tok < valid ? raw : 0u;
                                return __half22float2(*reinterpret_cast<const __half2*>(&bits));
                            });
        mbarrier_arrive(&empty_bar[c][j]);  // this lane's reads of stage j are done (release)
        __syncwarp();                       // p_smem / alpha_smem are rewritten by the next page
    }
    attn_publish<HEAD_DIM>(m_run, l_run, acc, partial_out, max_logits, exp_sums, at);
}

// grid (S, Hkv), block (ATMA_THREADS), dynamic smem AtmaShape<Dh>::SMEM_BYTES (96 KiB + 2.3 KiB
// at Dh = 128, 48 KiB + 2.3 KiB at Dh = 64).
// Splits NS = S · ATMA_CONSUMERS.
#define ATTENTION_DECODE_TMA_KERNEL(NAME, HEAD_DIM)                                              \
    extern "C" __global__ void __launch_bounds__(ATMA_THREADS) NAME(                             \
        float* __restrict__ partial_out,      /* [NS, Hq, Dh] fp32, out: unnormalised o     */ \
        float* __restrict__ max_logits,       /* [NS, Hq] fp32, out: max score (log2 units) */ \
        float* __restrict__ exp_sums,         /* [NS, Hq] fp32, out: Σ exp2(s − m)          */ \
        const __half* __restrict__ q,         /* [Hq, Dh] fp16, rotated query               */ \
        const __grid_constant__ CUtensorMap k_map, /* K pool as [rows, Dh] fp16, box [16, Dh] */ \
        const __grid_constant__ CUtensorMap v_map, /* V pool, likewise                      */ \
        const int* __restrict__ block_table,  /* [max_pages] int32                          */ \
        const int* __restrict__ state,        /* [3] int32 (reads seq_len = state[2])       */ \
        int Hq, int Hkv,                                                                     \
        int layer_page0) {                    /* layer · pages per layer: the layer's page 0 */ \
        attention_decode_tma_impl<HEAD_DIM>(partial_out, max_logits, exp_sums, q, &k_map, &v_map,  \
                                            block_table, state, Hq, Hkv, layer_page0);          \
    }

ATTENTION_DECODE_TMA_KERNEL(attention_decode_tma_hd64, 64)
ATTENTION_DECODE_TMA_KERNEL(attention_decode_tma_hd128, 128)
