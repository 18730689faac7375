// kernels/attention_decode.cu — paged GQA decode attention, split-KV ("flash-decoding").
//
//   attention_decode_hd64 / _hd128   per split s: partial_out o_s (unnormalised), max_logits m_s,
//                                    exp_sums l_s
//   attention_combine                out[h] = Σ_s 2^(m_s − M) o_s / Σ_s 2^(m_s − M) l_s,
//                                    M = max_s m_s (scores in log2 units, hence 2^)
//   attention_decode_tokens_hd64 / _hd128, attention_combine_tokens
//                                    the same for T ≤ 16 tokens of a chunk at once, token j over
//                                    the first state[2] + j keys, bit for bit the single-token
//                                    kernels' (the verify pass; see "T tokens" below)
//
// out[h, :] = softmax(q[h] · K[0:seq_len]ᵀ / √Dh) · V[0:seq_len] for every query head h,
// with query head h reading KV head h / (Hq/Hkv) (GQA, 7:1 for every Qwen2.5-Coder size
// here). seq_len = state[2] comes from device memory, so one graph serves every step.
//
// This is the plain version: no TMA, no warp specialisation (the warp-specialised one is
// attention_decode_tma.cu; the split rule and the per-page arithmetic the two share
// are in attention_decode.cuh). It is built around HBM bandwidth at long contexts and latency
// at short ones: bytes per call at 7B = seq_len × Hkv × Dh × 2 (K and V) × 2 B = 2 KiB per token
// per layer (4 MiB per layer at 2048 tokens), plus the partials (L2-resident): active splits ×
// Hq × Dh × 4 B.
//
// Work split
// ----------
//   grid    = (S, Hkv): S blocks per KV head (the launcher picks S ≈ resident blocks / Hkv:
//             one wave that fills every block slot of the GPU); block = ATTN_WARPS warps.
//   split   = one warp. The NS = S · ATTN_WARPS warps of a KV head divide its pages evenly:
//             pages_per_split = ceil(n_pages / NS), computed in the kernel from seq_len, so the
//             grid is fixed (graph-friendly) while the work adapts to the length. Warps past the
//             last page write a neutral partial (m = −inf, l = 0) and stop; the combine reads
//             only the splits that cover seq_len (the same formula).
//   warp    = all G = Hq/Hkv query heads of its KV head at once (K/V read once for 7 heads),
//             one page (16 tokens) per iteration:
//     QKᵀ   : tensor cores. A = the G query heads (MMA rows 0..7; rows 8..15 zero), B = 8
//             tokens' keys (one n-tile), two n-tiles per page. Lane (g, t) loads 16-byte
//             chunks of key row (token g) at dims 32m + 8t … +8 and the same chunks of query
//             row g, so the MMA k order is permuted identically on both sides (ptx/mma.cuh).
//             Products exact, sums FP32; c[0], c[1] = scores of head g, tokens 2t, 2t+1.
//     softmax: online (running max and sum, FP32, exp2 with log2(e)/√Dh folded into the
//             scale); the 4 lanes of a quad share a head, so the page max is a 2-step butterfly.
//     P·V   : FP32 FMA, lane-per-dim: lane l owns dims DPL·l … DPL·l+DPL-1 (DPL = Dh/32) of all
//             8 head rows (acc[8][DPL]); the probabilities go through a warp-private 544-byte
//             shared buffer (p[16 tokens][8 heads] and the 8 rescale factors) read as broadcasts.
//             P stays FP32 (no FP16 rounding of probabilities).
//             Page lp+1's K/V loads are issued before page lp is multiplied (double buffer),
//             and the split's block-table entries come in one load per 32 pages.
//   combine = attention_combine: grid (Hq, C), block (1024 / C): the active splits of head h,
//             split across 1024/Dh threads per dim and added in a fixed order (bit-reproducible),
//             a C-th of the head's dims per block (the same bits for every C: attention_combine_dims).
//
// Measured on the H200 (graph replay, test_kernel_attention_decode.py), decode + combine:
//   7B, 2048 tokens (4.2 MB of K/V, L2-resident): 9.6 µs (the first version, with a one-thread-
//   per-dim combine walking 128 splits: 20.9 µs); 0.5B, 2048 tokens: 6.7 µs;
//   7B, 32768 tokens (67 MB): 32.8 µs = 2.04 TB/s with S = 66 blocks per KV head, 36.0 µs
//   with S = 33. A warp spends ~1–2 µs per page (latency-bound: one warp per scheduler), so
//   the TMA producer/consumer version (attention_decode_tma.cu) is the way to the HBM roofline.
//
// Never reads past seq_len: block-table entries only for pages < ceil(seq_len/16), and K/V
// loads predicated per token (slots ≥ seq_len in the last page are never touched: zeros are
// used instead and their scores masked to −inf). Tests fill those slots with NaN.
//
// T tokens at once
// ----------------
// The verify pass of speculative decoding runs the last accepted token and k proposed ones
// (T = k + 1 ≤ 16) through the model at positions pos … pos + T − 1; gemv_int4_qkv_rope_tokens
// has written all T positions' K/V into the paged cache before attention runs. Token j is the
// query at position pos + j and must see exactly keys [0, seq_len + j), seq_len = state[2] (the
// single-token step's length for token 0): causal inside the chunk, the later positions' slots
// are in the cache but never read. The *_tokens kernels are the single-token kernels' body with
// a token index: the splits on the single-token grid (S, Hkv), its warps sharing out the
// (token, split) pairs that hold pages (the tokens kernels' schedule, below the kernels), and
// the combine on grid (Hq, T); the same S, block and NS per token as the single-token launch
// (launchers/attention_decode.py); token z reads
// q [T, Hq, Dh] row z, writes its own partials (partial_out [T, NS, Hq, Dh], max_logits /
// exp_sums [T, NS, Hq]) and its output row of out [T, Hq, Dh], with seq_len + z everywhere the
// single-token kernels read state[2].
//   Why it is exact: a split's sums depend on (split, NS, KV head, its length) and the data only
//   (attention_decode_split), and the split rule, the page loop with its per-token masking of
//   the last page (slots ≥ seq_len + z are never loaded: zeros, scores −inf), the partials and
//   the combine's fixed order are the same code with the length seq_len + z — the single-token
//   kernels run with state[2] = seq_len + z, whose token is the constant 0 (the index costs
//   them nothing: their SASS equals that of a build without it, up to label names;
//   decode_persistent.cu's too).
//   Bytes per call: T times the single-token call's (each token reads its own keys: Σ_j (seq_len
//   + j) × 2 KiB per layer at 7B, and its partials); the T tokens' blocks share the L2, where a
//   page read by one token is usually still there for the next. Merging the tokens of a KV head
//   into one warp (one K/V read for all of them, as the GQA heads share one) would change the
//   per-page arithmetic of each token, so it is not done here.
//   Registers (ptxas): the token kernels 128 (hd64) and 226 (hd128) against the single-token
//   kernels' 131 and 230, no spills; the combines 32 (single token) and 48 (tokens).
//
// head_dim is a template parameter, instantiated as attention_decode_hd64 (0.5B) and
// attention_decode_hd128 (7B and the other sizes): the per-lane register arrays (query
// fragments, keys, the acc[8][Dh/32] output accumulator) need compile-time sizes.
//
// Requirements (asserted by the launcher): Hq / Hkv ≤ 8 (true for every Qwen2.5 size: 5–8),
// seq_len ≥ 1, pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"             // u32, u64, WARP_SIZE, QUAD_SIZE, F32_NEG_INF, F32_LOG2E
#include "ldst.cuh"              // ld_nc_noalloc_v4 / _v2 / _u32
#include "warp.cuh"              // warp_max, FULL_WARP_MASK
#include "kv_cache.cuh"          // PAGE_TOKENS, kv_offset
#include "griddep.cuh"           // grid_dependency_wait, grid_launch_dependents
#include "attention_decode.cuh"  // ATTN_MAX_GROUP, attn_pages_per_split, attn_page, …
#include "block_coord.cuh"       // BlockCoord, GridDep

#define ATTN_WARPS 4   // warps (= splits) per block
// Warps of the block that runs the splits: their p/alpha buffers in shared memory. ATTN_WARPS
// for a launch of this kernel; the persistent decode step, whose blocks run 8 splits at once,
// defines it as 8 before including this file.
#ifndef ATTN_SMEM_WARPS
#define ATTN_SMEM_WARPS ATTN_WARPS
#endif
#ifndef ATTN_PREFETCH
#define ATTN_PREFETCH 1  // page lp+1's loads issued before page lp is multiplied (see the page loop)
#endif

// One page of K and V as one lane holds them, raw FP16 (converted when used, so that a
// prefetched page costs 16 + 16 registers at Dh = 128, not 16 + 64).
template <int HEAD_DIM>
struct AttnPage {
    static constexpr int KCH = HEAD_DIM / 32;  // 16-byte key chunks per lane per token
    static constexpr int VW = HEAD_DIM / 64;   // 32-bit words of V per lane per token
    uint4 k[2][KCH];                           // keys of tokens g and 8 + g, dims 32m + 8t … +8
    u32 v[PAGE_TOKENS][VW];                    // V of every token, dims (Dh/32)·lane … +Dh/32
};

// Issues the loads of logical page `lp` (physical `page`): tokens ≥ valid are zeros, never read.
template <int HEAD_DIM>
__device__ __forceinline__ void attn_load_page(AttnPage<HEAD_DIM>& pg, const __half* k_page,
                                               const __half* v_page, int valid, int lane) {
    constexpr int KCH = AttnPage<HEAD_DIM>::KCH, VW = AttnPage<HEAD_DIM>::VW;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        const int tok = nt * 8 + g;
#pragma unroll
        for (int m = 0; m < KCH; ++m)
            pg.k[nt][m] = tok < valid ? ld_nc_noalloc_v4(k_page + tok * HEAD_DIM + 32 * m + 8 * t)
                                      : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int tok = 0; tok < PAGE_TOKENS; ++tok) {
        const __half* src = v_page + tok * HEAD_DIM + 2 * VW * lane;
        if constexpr (VW == 2) {
            const uint2 raw = tok < valid ? ld_nc_noalloc_v2(src) : make_uint2(0u, 0u);
            pg.v[tok][0] = raw.x;
            pg.v[tok][1] = raw.y;
        } else {
            pg.v[tok][0] = tok < valid ? ld_nc_noalloc_u32(src) : 0u;
        }
    }
}

// Split `split` of `n_splits` of KV head `kv_head` for token `token` of a chunk, run by warp
// `warp` of its block (its p/alpha buffers). What a split adds up depends on (split, n_splits,
// kv_head, seq_len) only: a launch's warp and a persistent step's warp that take the same split
// compute the same bits. Token j is the query at position state[0] + j: it reads its own row of
// q [T, Hq, Dh] over seq_len = state[2] + j keys — the single-token step's at that position
// (T tokens at once, header). token = 0 is the single-token kernel (the offsets fold away).
// At the end, a split with no page calls neutral(at), any other publish(m_run, l_run, acc, at)
// with its running state (attention_decode.cuh): attention_decode_split below writes them as
// the split's partial in global memory, attention_decode_cluster.cu keeps them on chip. No
// block-wide barrier (a warp past the last page returns early); the caller has waited for q and
// the K/V slots.
template <int HEAD_DIM, typename Neutral, typename Publish>
__device__ __forceinline__ void attention_decode_split_body(
    const __half* __restrict__ q, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_table,
    const int* __restrict__ state, int Hq, int Hkv, int split, int n_splits, int kv_head, int warp,
    int token, Neutral neutral, Publish publish) {
    q += (u64)token * Hq * HEAD_DIM;  // token j's row of q
    __shared__ __align__(16) float p_smem[ATTN_SMEM_WARPS][PAGE_TOKENS][ATTN_MAX_GROUP];
    __shared__ __align__(16) float alpha_smem[ATTN_SMEM_WARPS][ATTN_MAX_GROUP];

    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int group = Hq / Hkv;
    const int head0 = kv_head * group;  // first query head of this KV head
    const AttnLane at = {split, Hq, head0, group, warp, lane, g, t};

    // Query fragments: issued before the state read, whose latency they share.
    uint4 qf[HEAD_DIM / 32];
    attn_query_fragments<HEAD_DIM>(qf, q, at);

    const int seq_len = state[2] + token;
    const int n_pages = (seq_len + PAGE_TOKENS - 1) / PAGE_TOKENS;
    const int pps = attn_pages_per_split(n_pages, n_splits);
    const int page_begin = split * pps, page_end = min(page_begin + pps, n_pages);

    if (page_begin >= page_end) {
        neutral(at);
        return;
    }

    // The split's block-table entries, 32 at a time: lane i holds entry page_begin + 32c + i
    // (one load for up to 32 pages instead of one dependent load per page).
    int bt_lane = page_begin + lane < page_end ? block_table[page_begin + lane] : 0;
    auto physical = [&](int lp) {  // warp-uniform lp; reloads the entries every 32 pages
        const int rel = lp - page_begin;
        if (rel > 0 && rel % WARP_SIZE == 0)
            bt_lane = lp + lane < page_end ? block_table[lp + lane] : 0;
        return __shfl_sync(FULL_WARP_MASK, bt_lane, rel % WARP_SIZE);
    };
    auto page_ptrs = [&](int page, const __half*& kp, const __half*& vp) {
        kp = k_cache + kv_offset(page, kv_head, 0, Hkv, HEAD_DIM);
        vp = v_cache + kv_offset(page, kv_head, 0, Hkv, HEAD_DIM);
    };

    // The split's running state (attention_decode.cuh).
    const float scale_log2 = rsqrtf((float)HEAD_DIM) * F32_LOG2E;
    float m_run = F32_NEG_INF;
    float l_run = 0.f;
    float acc[ATTN_MAX_GROUP][HEAD_DIM / 32] = {};

    // Double buffer: page lp+1's loads are in flight while page lp is multiplied. Without
    // ATTN_PREFETCH (the persistent decode step at Dh = 128, where the second page's 64
    // registers would spill) a page is loaded when the one before is done: the same values.
    auto load = [&](AttnPage<HEAD_DIM>& pg, int lp) {
        const __half *kp, *vp;
        page_ptrs(physical(lp), kp, vp);
        attn_load_page<HEAD_DIM>(pg, kp, vp, min(PAGE_TOKENS, seq_len - lp * PAGE_TOKENS), lane);
    };
    AttnPage<HEAD_DIM> cur;
    load(cur, page_begin);
    for (int lp = page_begin; lp < page_end; ++lp) {
#if ATTN_PREFETCH
        AttnPage<HEAD_DIM> next;
        if (lp + 1 < page_end) load(next, lp + 1);
#endif
        const int valid = min(PAGE_TOKENS, seq_len - lp * PAGE_TOKENS);  // ≥ 1
        // K and V from the registers (attn_load_page zeroed the masked tokens).
        attn_page<HEAD_DIM>(m_run, l_run, acc, scale_log2, qf, valid, p_smem, alpha_smem, at,
                            [&](int nt, int m) { return cur.k[nt][m]; },
                            [&](int tok, int w) {
                                return __half22float2(*reinterpret_cast<const __half2*>(&cur.v[tok][w]));
                            });
        __syncwarp();  // p_smem / alpha_smem are rewritten by the next page
#if ATTN_PREFETCH
        cur = next;
#else
        if (lp + 1 < page_end) load(cur, lp + 1);
#endif
    }
    publish(m_run, l_run, acc, at);
}

// The split above as a partial in global memory: token j writes its own partials [T, NS, …],
// a split with no page the neutral one. The partials' pointers are offset where they are
// written, so that no 64-bit pointer is held in registers across the page loop.
template <int HEAD_DIM>
__device__ __forceinline__ void attention_decode_split(
    float* __restrict__ partial_out, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    const __half* __restrict__ q, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_table,
    const int* __restrict__ state, int Hq, int Hkv, int split, int n_splits, int kv_head, int warp,
    int token) {
    const u64 split_row0 = (u64)token * n_splits;
    attention_decode_split_body<HEAD_DIM>(
        q, k_cache, v_cache, block_table, state, Hq, Hkv, split, n_splits, kv_head, warp, token,
        [&](const AttnLane& at) { attn_neutral_partial(max_logits + split_row0 * Hq, exp_sums + split_row0 * Hq, at); },
        [&](float m_run, float l_run, const float (&acc)[ATTN_MAX_GROUP][HEAD_DIM / 32], const AttnLane& at) {
            attn_publish<HEAD_DIM>(m_run, l_run, acc, partial_out + split_row0 * Hq * HEAD_DIM,
                                   max_logits + split_row0 * Hq, exp_sums + split_row0 * Hq, at);
        });
}

// The plain kernel's arguments (the persistent decode step packs them with this layout).
struct AttentionDecodeArgs {
    float* partial_out;       // [NS, Hq, Dh] fp32, out: unnormalised o
    float* max_logits;        // [NS, Hq] fp32, out: max score (log2 units)
    float* exp_sums;          // [NS, Hq] fp32, out: Σ exp2(s − m)
    const __half* q;          // [Hq, Dh] fp16, rotated query
    const __half* k_cache;    // [P, Hkv, 16, Dh] fp16, this layer
    const __half* v_cache;    // [P, Hkv, 16, Dh] fp16, this layer
    const int* block_table;   // [max_pages] int32
    const int* state;         // [3] int32 (reads seq_len = state[2])
    int Hq, Hkv;
};

template <int HEAD_DIM>
__device__ __forceinline__ void attention_decode_args_split(const AttentionDecodeArgs& a, int split, int n_splits,
                                                            int kv_head, int warp) {
    attention_decode_split<HEAD_DIM>(a.partial_out, a.max_logits, a.exp_sums, a.q, a.k_cache, a.v_cache,
                                     a.block_table, a.state, a.Hq, a.Hkv, split, n_splits, kv_head, warp, 0);
}

// grid (S, Hkv), block (ATTN_WARPS · 32). Splits NS = S · ATTN_WARPS; warp w of block (x, y)
// takes split x · ATTN_WARPS + w of KV head y (token 0: state[2] keys, the [Hq, …] / [NS, …]
// buffers). The *_tokens kernels below run the same split body per (token, split) pair; the
// single-token kernels' token is the constant 0, so their code is that of a build without tokens.
#ifndef DEVICE_FUNCTIONS_ONLY  // a file that includes this one for its device functions defines it
#define ATTENTION_DECODE_KERNEL(NAME, HEAD_DIM, TOKEN)                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP_SIZE) NAME(                   \
        float* __restrict__ partial_out, float* __restrict__ max_logits,                       \
        float* __restrict__ exp_sums, const __half* __restrict__ q,                            \
        const __half* __restrict__ k_cache, const __half* __restrict__ v_cache,                \
        const int* __restrict__ block_table, const int* __restrict__ state,                    \
        int Hq, int Hkv) { /* AttentionDecodeArgs says what each is */                          \
        const int warp = threadIdx.x / WARP_SIZE;                                                \
        grid_launch_dependents();                                                                \
        grid_dependency_wait(); /* q, the K/V slot of this position and state: earlier kernels */ \
        attention_decode_split<HEAD_DIM>(partial_out, max_logits, exp_sums, q, k_cache, v_cache,   \
                                         block_table, state, Hq, Hkv,                           \
                                         blockIdx.x * ATTN_WARPS + warp, gridDim.x * ATTN_WARPS, \
                                         blockIdx.y, warp, TOKEN);                              \
    }

ATTENTION_DECODE_KERNEL(attention_decode_hd64, 64, 0)
ATTENTION_DECODE_KERNEL(attention_decode_hd128, 128, 0)
#endif  // DEVICE_FUNCTIONS_ONLY

// The T-token kernels' schedule: grid (S, Hkv) as the single-token launch, the same NS = S ·
// ATTN_WARPS splits per token. The work of a KV head is the list of (token z, split s) pairs
// whose split holds pages of z (s < the active splits of z, the combine's count), token-major;
// warp w of the head takes items w, w + NS, w + 2·NS, … Each item is attention_decode_split
// for (z, s): the very sums the single-token kernel writes for split s at z's length, so the
// schedule changes nothing in the arithmetic. Pairs past z's active splits are not run at all:
// no partial of theirs is ever read (the combine runs over the active ones only).
// Why not a grid (S, Hkv, T), one single-token grid per token: at short contexts most splits
// have no page (512 keys are 32 pages over the 7B's 264 splits per KV head), and T grids of
// mostly idle blocks ran T waves of them — 13.4 µs a layer at T = 8 against 7.6 for one token
// (docs/bench/2026-12-02_f6448f9_h200_syn7b_verify.json, kernels_us). Here the 32·T active
// pairs spread over the 264 warps of one wave. At long contexts every split is active for every
// token and each warp runs T items in turn, as T grids would have.
template <int HEAD_DIM>
__device__ __forceinline__ void attention_decode_tokens_items(const AttentionDecodeArgs& a, int n_tokens, int w,
                                                              int n_splits, int kv_head, int warp) {
    const int len0 = a.state[2];
    int z = 0, first = 0;  // token z's items are [first, first + active(z))
    auto active = [&](int tok) {
        const int n_pages = (len0 + tok + PAGE_TOKENS - 1) / PAGE_TOKENS;
        const int pps = attn_pages_per_split(n_pages, n_splits);
        return (n_pages + pps - 1) / pps;
    };
    int n_z = active(0);
    for (int item = w;; item += n_splits) {
        while (z < n_tokens && item >= first + n_z) {  // warp-uniform: item, z and n_z are
            first += n_z;
            if (++z < n_tokens) n_z = active(z);
        }
        if (z >= n_tokens) return;
        attention_decode_split<HEAD_DIM>(a.partial_out, a.max_logits, a.exp_sums, a.q, a.k_cache, a.v_cache,
                                         a.block_table, a.state, a.Hq, a.Hkv, item - first, n_splits, kv_head, warp,
                                         z);
        __syncwarp();  // the next item rewrites this warp's p/alpha buffers
    }
}

// grid (S, Hkv), block (ATTN_WARPS · 32); q [T, Hq, Dh], partial_out [T, NS, Hq, Dh],
// max_logits / exp_sums [T, NS, Hq], T = n_tokens (the schedule above).
#ifndef DEVICE_FUNCTIONS_ONLY
#define ATTENTION_DECODE_TOKENS_KERNEL(NAME, HEAD_DIM)                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP_SIZE) NAME(                   \
        float* __restrict__ partial_out, float* __restrict__ max_logits,                       \
        float* __restrict__ exp_sums, const __half* __restrict__ q,                            \
        const __half* __restrict__ k_cache, const __half* __restrict__ v_cache,                \
        const int* __restrict__ block_table, const int* __restrict__ state,                    \
        int Hq, int Hkv, int n_tokens) { /* AttentionDecodeArgs says what each is */            \
        const int warp = threadIdx.x / WARP_SIZE;                                                \
        grid_launch_dependents();                                                                \
        grid_dependency_wait(); /* q, the chunk's K/V slots and state: earlier kernels */         \
        attention_decode_tokens_items<HEAD_DIM>(                                                 \
            AttentionDecodeArgs{partial_out, max_logits, exp_sums, q, k_cache, v_cache, block_table, state, Hq, Hkv}, \
            n_tokens, blockIdx.x * ATTN_WARPS + warp, gridDim.x * ATTN_WARPS, blockIdx.y, warp);   \
    }

ATTENTION_DECODE_TOKENS_KERNEL(attention_decode_tokens_hd64, 64)
ATTENTION_DECODE_TOKENS_KERNEL(attention_decode_tokens_hd128, 128)
#endif  // DEVICE_FUNCTIONS_ONLY

// Merge the active splits of head h. Virtual thread (d, j) = (v % Dh, v / Dh), v < ATTN_COMBINE_THREADS,
// adds the splits s ≡ j (mod J), J = ATTN_COMBINE_THREADS / Dh, for dim d; then the J partial
// sums are added in order j = 0 … J-1. Every form has one thread per virtual thread: the tokens
// launch a block of all of them a head, attention_combine (and the persistent decode step's items)
// a block of the virtual threads of a C-th of the head's dims: the same sums in the same order.
// With ≤ 264 splits that is ≤ 33 independent loads per virtual thread, issued in groups (8, then
// 4, 2, 1 at 1024 threads a block; 16 first at 256), instead of one thread walking every split
// (20 µs at 128 splits).
// Bytes per call: n_active × Hq × (Dh + 2) × 4 B of partials (≤ 264 × 28 × 130 × 4 = 3.8 MB at
// 7B, L2-resident: the decode kernel wrote them just before) + Hq × Dh × 2 B written. The limit:
// L2 latency of each thread's chain of split loads (~9.5 µs over 256 splits, measured in
// attention_decode_tma.cu's header), not HBM.
#define ATTN_COMBINE_THREADS 1024
struct AttentionCombineArgs {
    __half* out;               // [Hq, Dh] fp16, out (= [Hq·Dh] o_proj input)
    const float* partial_out;  // [NS, Hq, Dh] fp32
    const float* max_logits;   // [NS, Hq] fp32
    const float* exp_sums;     // [NS, Hq] fp32
    const int* state;          // [3] int32 (reads seq_len = state[2])
    int n_splits, Hq, Dh;      // n_splits = NS of the decode launch
};

// The max_logits and exp_sums of head h's n_active splits (rows split0 + s of the partials) into
// shared memory m_s / l_s, and their maximum — the same value in every warp (a butterfly over a
// lane-strided scan: no second barrier). Contains __syncthreads(): call from every thread.
__device__ __forceinline__ float combine_head_logits(const AttentionCombineArgs& a, int h, u64 split0, int n_active,
                                                     float* m_s, float* l_s) {
    const int Hq = a.Hq;
    for (int s = threadIdx.x; s < n_active; s += blockDim.x) {
        m_s[s] = a.max_logits[(split0 + s) * Hq + h];
        l_s[s] = a.exp_sums[(split0 + s) * Hq + h];
    }
    __syncthreads();
    const int lane = threadIdx.x % WARP_SIZE;
    float m_max = F32_NEG_INF;
    for (int s = lane; s < n_active; s += WARP_SIZE) m_max = fmaxf(m_max, m_s[s]);
    return warp_max(m_max);
}

// G splits s, s + n_j, …, s + (G−1)·n_j of one (d, j) of the combine added to its sums in that
// order, their G partial loads issued first (po: the thread's column of split 0, split_stride
// floats between splits; m_s / l_s: the head's max_logits / exp_sums in smem); s moves past them.
template <int G>
__device__ __forceinline__ void combine_add_splits(const float* po, u64 split_stride, const float* m_s,
                                                   const float* l_s, float m_max, int n_j, int& s,
                                                   float& o_sum, float& l_sum) {
    float x[G];
#pragma unroll
    for (int g = 0; g < G; ++g) x[g] = po[(u64)(s + g * n_j) * split_stride];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float w = exp2f(m_s[s + g * n_j] - m_max);
        o_sum = fmaf(w, x[g], o_sum);
        l_sum = fmaf(w, l_s[s + g * n_j], l_sum);
    }
    s += G * n_j;
}

// Head h of token `token` of a chunk, by a block of ATTN_COMBINE_THREADS threads (the tokens
// launch, attention_combine_tokens). Token j merges its own partials [T, NS, …] into its row of
// out [T, Hq, Dh] over seq_len = state[2] + j (the split rule of the decode kernel's token j).
// Dynamic smem: 2 · NS floats. Contains __syncthreads(): call from every thread.
template <typename Dep>
__device__ __forceinline__ void attention_combine_token_item(const AttentionCombineArgs& a, int h, int token,
                                                             Dep dep) {
    extern __shared__ float combine_smem[];              // max_logits[NS], exp_sums[NS] of head h
    __shared__ float o_sum_smem[ATTN_COMBINE_THREADS];
    __shared__ float l_sum_smem[ATTN_COMBINE_THREADS / 32];
    const int n_splits = a.n_splits, Hq = a.Hq, Dh = a.Dh;
    float* m_s = combine_smem;
    float* l_s = combine_smem + n_splits;
    dep.launch_dependents();
    // seq_len: before the wait where the state stays fixed (block_coord.cuh), else after it.
    const int seq_len_fixed = Dep::state_fixed ? a.state[2] + token : 0;
    dep.wait();  // the partials are the split kernel's output
    const int n_pages = ((Dep::state_fixed ? seq_len_fixed : a.state[2] + token) + PAGE_TOKENS - 1) / PAGE_TOKENS;
    const int pps = attn_pages_per_split(n_pages, n_splits);
    const int n_active = (n_pages + pps - 1) / pps;
    // Token `token`'s rows: split s of its partials is row token · NS + s, its output row token · Hq + h
    // (the arguments' fields read where they are used, as without tokens).
    const u64 split0 = (u64)token * n_splits;

    const float m_max = combine_head_logits(a, h, split0, n_active, m_s, l_s);

    // Thread (d, j) = (threadIdx.x % Dh, threadIdx.x / Dh) adds splits j, j + J, … in that order
    // (J = n_j), 8 at a time, then a remainder of 4, 2, 1 — each group's loads written before its
    // sums (the loop guarded per step compiled to one load per step, one L2 round trip each), so
    // a thread with n steps waits a few round trips instead of n and reads no split twice. At
    // 1024 threads a block ptxas keeps few registers a thread (attention_combine_tokens: 48), and
    // a group of 8 may issue as two round trips; attention_combine_dims' blocks of 256 take
    // groups of 16 with every load first. At 512 tokens every thread has 2 (Dh = 64) or 4
    // (Dh = 128) steps: one round trip.
    const int n_j = ATTN_COMBINE_THREADS / Dh;
    float o_sum = 0.f, l_sum = 0.f;
    {
        const int j = threadIdx.x / Dh, d = threadIdx.x % Dh;
        const float* po = a.partial_out + (split0 * Hq + h) * Dh + d;  // + s · Hq · Dh: split s
        const u64 split_stride = (u64)Hq * Dh;
        const int steps = n_active > j ? (n_active - j + n_j - 1) / n_j : 0;
        int s = j;
        for (int n = steps >> 3; n > 0; --n) combine_add_splits<8>(po, split_stride, m_s, l_s, m_max, n_j, s, o_sum, l_sum);
        if (steps & 4) combine_add_splits<4>(po, split_stride, m_s, l_s, m_max, n_j, s, o_sum, l_sum);
        if (steps & 2) combine_add_splits<2>(po, split_stride, m_s, l_s, m_max, n_j, s, o_sum, l_sum);
        if (steps & 1) combine_add_splits<1>(po, split_stride, m_s, l_s, m_max, n_j, s, o_sum, l_sum);
    }
    {   // (d, j) again rather than carried from above: carried, ptxas gave the kernel another
        // allocation (32 registers instead of 48; cuobjdump)
        const int v = threadIdx.x, d = v % Dh, j = v / Dh;
        o_sum_smem[v] = o_sum;
        if (d == 0 && j < n_j) l_sum_smem[j] = l_sum;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < Dh; d += blockDim.x) {  // threads j = 0
        float o = 0.f, l = 0.f;
        for (int jj = 0; jj < n_j; ++jj) {
            o += o_sum_smem[jj * Dh + d];
            l += l_sum_smem[jj];
        }
        a.out[((u64)token * Hq + h) * Dh + d] = __float2half_rn(o / l);
    }
}

// The single-token combine as a launch of its own: block (h, c) of grid (Hq, C) merges dims
// [c · Dh/C, (c + 1) · Dh/C) of head h, its blockDim.x = (Dh/C) · J threads being exactly the
// virtual threads (d, j) of those dims (J = ATTN_COMBINE_THREADS / Dh, as above). Each (d, j)
// adds the same splits in the same order as in attention_combine_token_item, and the J partial
// sums of a dim are added in the same order, so the output has the same bits for every C (and
// as the tokens kernel's combine). The persistent decode step runs a planned block (h, c) as an
// item (Dep: its counters; its blocks are 256 threads, so C = 4 there). Why C > 1: at long
// contexts the combine is its threads' chains of L2 round trips (~9.5 µs over 256 splits, the
// header above);
// with a quarter of the dims a block, a thread can have 16 of its loads in flight instead of 8
// (a block of 256 threads, not 1024: the registers allow it), and the heads' work spreads over
// C × Hq SMs instead of Hq. Measured (tools/bench_attention.py, the combine alone on the TMA
// kernel's partials, graph of 20 calls; docs/bench/2026-12-05_979f3b7_h200_attention_{7b,05b}.json),
// µs at 512 / 8192 / 32768 tokens, the bits equal for every C:
//   |      | C = 1 (1024 threads) | C = 4              | C = 8              | C = 32             |
//   | 7B   | 3.50 / 4.69 / 6.02   | 2.51 / 3.39 / 4.13 | 2.60 / 3.76 / 4.80 | 3.06 / 5.84 / 8.44 |
//   | 0.5B | 3.38 / 4.05 / 6.12   | 2.42 / 2.84 / 4.01 | 2.45 / 2.95 / 4.51 | 2.68 / 4.25 / 9.05 |
// Beyond 4 every block still scans all of the head's split maxima and sums (combine_head_logits),
// C scans a head in all: the likely reason more blocks lose, not measured apart.
// Contains __syncthreads(): call from every thread.
template <typename Dep>
__device__ __forceinline__ void attention_combine_dims(const AttentionCombineArgs& a, int h, int c, int C, Dep dep) {
    extern __shared__ float combine_smem[];              // max_logits[NS], exp_sums[NS] of head h
    __shared__ float o_sum_smem[ATTN_COMBINE_THREADS];   // [J][Dh/C] of this block's dims
    __shared__ float l_sum_smem[ATTN_COMBINE_THREADS / 32];
    const int n_splits = a.n_splits, Hq = a.Hq, Dh = a.Dh;
    float* m_s = combine_smem;
    float* l_s = combine_smem + n_splits;
    dep.launch_dependents();
    // seq_len: before the wait where the state stays fixed (block_coord.cuh), else after it.
    const int seq_len_fixed = Dep::state_fixed ? a.state[2] : 0;
    dep.wait();  // the partials are the split kernel's output; the state an earlier kernel's
    const int n_pages = ((Dep::state_fixed ? seq_len_fixed : a.state[2]) + PAGE_TOKENS - 1) / PAGE_TOKENS;
    const int pps = attn_pages_per_split(n_pages, n_splits);
    const int n_active = (n_pages + pps - 1) / pps;
    const float m_max = combine_head_logits(a, h, 0, n_active, m_s, l_s);

    const int dims = Dh / C, n_j = ATTN_COMBINE_THREADS / Dh;    // blockDim.x = dims · n_j (the launcher)
    const int dl = threadIdx.x % dims, j = threadIdx.x / dims, d = c * dims + dl;
    const float* po = a.partial_out + (u64)h * Dh + d;           // + s · Hq · Dh: split s
    const u64 split_stride = (u64)Hq * Dh;
    const int steps = n_active > j ? (n_active - j + n_j - 1) / n_j : 0;
    float o_sum = 0.f, l_sum = 0.f;
    int s = j;
    for (int n = steps >> 4; n > 0; --n) combine_add_splits<16>(po, split_stride, m_s, l_s, m_max, n_j, s, o_sum, l_sum);
    if (steps & 8) combine_add_splits<8>(po, split_stride, m_s, l_s, m_max, n_j, s, o_sum, l_sum);
    if (steps & 4) combine_add_splits<4>(po, split_stride, m_s, l_s, m_max, n_j, s, o_sum, l_sum);
    if (steps & 2) combine_add_splits<2>(po, split_stride, m_s, l_s, m_max, n_j, s, o_sum, l_sum);
    if (steps & 1) combine_add_splits<1>(po, split_stride, m_s, l_s, m_max, n_j, s, o_sum, l_sum);
    o_sum_smem[j * dims + dl] = o_sum;
    if (dl == 0) l_sum_smem[j] = l_sum;  // the same for every dim of j: its weights and l_s
    __syncthreads();
    for (int e = threadIdx.x; e < dims; e += blockDim.x) {  // virtual threads j = 0
        float o = 0.f, l = 0.f;
        for (int jj = 0; jj < n_j; ++jj) {
            o += o_sum_smem[jj * dims + e];
            l += l_sum_smem[jj];
        }
        a.out[(u64)h * Dh + c * dims + e] = __float2half_rn(o / l);
    }
}

// grid (Hq, C), block (ATTN_COMBINE_THREADS / C), dynamic smem: 2 · NS floats (max_logits,
// exp_sums of each split for head h); ATTN_COMBINE_MIN_SPLIT ≤ C ≤ ATTN_COMBINE_MAX_SPLIT divides Dh
// (launchers/attention_decode.py, COMBINE_SPLIT): the blocks of at most 256 threads let ptxas
// give a thread the registers for 16 loads in flight (at 1024 threads it kept 32 registers); a
// block of at least one whole warp, because combine_head_logits scans the splits a warp's lanes
// apart and reduces with a full-warp shuffle.
#define ATTN_COMBINE_MIN_SPLIT 4
#define ATTN_COMBINE_MAX_SPLIT (ATTN_COMBINE_THREADS / WARP_SIZE)
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(ATTN_COMBINE_THREADS / ATTN_COMBINE_MIN_SPLIT, 1)
attention_combine(__half* __restrict__ out, const float* __restrict__ partial_out,
                  const float* __restrict__ max_logits, const float* __restrict__ exp_sums,
                  const int* __restrict__ state, int n_splits, int Hq, int Dh) {  // AttentionCombineArgs says what each is
    attention_combine_dims(AttentionCombineArgs{out, partial_out, max_logits, exp_sums, state, n_splits, Hq, Dh},
                           blockIdx.x, blockIdx.y, gridDim.y, GridDep{});
}

// grid (Hq, T), block ATTN_COMBINE_THREADS, smem as attention_combine: head x of token y. out [T, Hq, Dh],
// partial_out [T, NS, Hq, Dh], max_logits / exp_sums [T, NS, Hq]; the same parameters as the
// single-token combine (T = gridDim.y), whose body it runs per token.
extern "C" __global__ void __launch_bounds__(ATTN_COMBINE_THREADS)
attention_combine_tokens(__half* __restrict__ out, const float* __restrict__ partial_out,
                         const float* __restrict__ max_logits, const float* __restrict__ exp_sums,
                         const int* __restrict__ state, int n_splits, int Hq, int Dh) {
    attention_combine_token_item(AttentionCombineArgs{out, partial_out, max_logits, exp_sums, state, n_splits, Hq, Dh},
                                 blockIdx.x, blockIdx.y, GridDep{});
}
#endif  // DEVICE_FUNCTIONS_ONLY
