// kernels/attention_decode.cuh — one split of the split-KV decode attention, shared by the plain
// kernel (attention_decode.cu: each warp loads its pages into registers) and the warp-specialised
// one (attention_decode_tma.cu: a producer warp copies them into shared memory by TMA). Both
// divide the pages by the same rule and do the same arithmetic per page, so they write the same
// partials, which attention_combine (attention_decode.cu) merges.
//
//   attn_pages_per_split   the split rule: pages per split from seq_len (the combine uses it too)
//   AttnLane               where a lane stands: its split, its KV head's query heads, its MMA role
//   attn_query_fragments   the G query heads of the KV head as the MMA's A rows 0..7
//   attn_page              one page of 16 tokens: QKᵀ on tensor cores, online softmax, P·V
//   attn_publish           the split's partial (attn_neutral_partial: for a split with no page)
//
// The lane roles, the MMA k order, the p/alpha shared buffers and the masking are described in
// attention_decode.cu's header ("Work split"). The partial of split s for query head h, named
// as in vLLM's paged attention:
//   partial_out [NS, Hq, Dh] fp32   Σ_tok exp2(s_tok − m) · v_tok, unnormalised
//   max_logits  [NS, Hq] fp32       m = max_tok s_tok, the scores scaled to log2 units
//   exp_sums    [NS, Hq] fp32       Σ_tok exp2(s_tok − m)
// A split with no page writes m = −inf and a sum of 0: it contributes nothing (attention_combine
// reads only the splits that hold pages anyway, by the same split rule).
#pragma once
#include <cuda_fp16.h>

#include "types.cuh"     // u32, u64, WARP_SIZE, QUAD_SIZE, F32_NEG_INF, F32_LOG2E
#include "mma.cuh"       // mma_m16n8k16_f32_f16
#include "warp.cuh"      // quad_max, quad_sum
#include "kv_cache.cuh"  // PAGE_TOKENS

#define ATTN_MAX_GROUP 8   // query heads per KV head handled by one warp (MMA rows 0..7)

// Pages per split (pps) for a given length — the split rule. Split s covers logical pages
// [s · pps, min((s+1) · pps, n_pages)); both decode kernels and the combine use this rule, so
// the combine knows which splits hold data (launchers/attention_decode.py pages_per_split
// mirrors it for the tests).
//   pps = max(ceil(n_pages / n_splits), min(ATTN_SHORT_MAX_PAGES, ceil(n_pages / ATTN_SHORT_SPLITS)))
// The first term spreads a long context over every split (the HBM stream needs them all). The
// second stops a mid-length context from spreading one page a split over all NS splits: a
// split's page loop costs little per page, but the combine's cost grows with the active splits
// (each thread's chain of partial loads), so up to ATTN_SHORT_MAX_PAGES pages a split are taken
// to keep the active splits near ATTN_SHORT_SPLITS (one page a split up to 2048 tokens, two at
// 4096, four at 8192, the natural eight at 32 000 with NS = 264). Measured against one page a
// split (ATTN_SHORT_MAX_PAGES=1), synthetic 7B, graph ITL, tools/bench_decode_ablation.py in
// turns: 4096 tokens 2.392 / 2.400 / 2.389 / 2.385 ms against 2.435 / 2.433 / 2.445 / 2.449,
// 8192 tokens 2.505 / 2.484 / 2.496 / 2.499 against 2.504 / 2.498 / 2.510 / 2.514
// (docs/bench/2026-12-04_ebbdc96_h200_syn7b_split_rule_{new,old}_{1,2}.json).
#ifndef ATTN_SHORT_SPLITS
#define ATTN_SHORT_SPLITS 128
#endif
#ifndef ATTN_SHORT_MAX_PAGES
#define ATTN_SHORT_MAX_PAGES 4
#endif
__device__ __forceinline__ int attn_pages_per_split(int n_pages, int n_splits) {
    const int spread = (n_pages + n_splits - 1) / n_splits;
    const int short_pps = min(ATTN_SHORT_MAX_PAGES, (n_pages + ATTN_SHORT_SPLITS - 1) / ATTN_SHORT_SPLITS);
    return max(1, max(spread, short_pps));
}

// Where a lane of a split's warp stands: the split, the query heads of its KV head
// (head0 … head0 + group − 1, of Hq), and its role in the MMA fragments, g = lane / 4 (head row;
// key token) and t = lane % 4 (ptx/mma.cuh).
struct AttnLane {
    int split, Hq, head0, group;
    int warp, lane, g, t;  // warp: the split's warp in the block (its p/alpha buffers)
};

// Query fragments of head row g (zero for the padding rows g ≥ group): 16-byte chunks at dims
// 32m + 8t … +8, the same chunks a lane takes of a key row, so that the MMA k order is permuted
// identically on both sides (ptx/mma.cuh).
template <int HEAD_DIM>
__device__ __forceinline__ void attn_query_fragments(uint4 (&qf)[HEAD_DIM / 32],
                                                     const __half* __restrict__ q,  // [Hq, Dh] fp16
                                                     const AttnLane& at) {
#pragma unroll
    for (int m = 0; m < HEAD_DIM / 32; ++m)
        // An ordinary load: q is the previous kernel's output, read after griddepcontrol.wait
        // (ptx/griddep.cuh: the inline-asm loads could be hoisted above it).
        qf[m] = at.g < at.group ? *reinterpret_cast<const uint4*>(q + (u64)(at.head0 + at.g) * HEAD_DIM + 32 * m + 8 * at.t)
                                : make_uint4(0u, 0u, 0u, 0u);
}

// The partial of a split that covers no page: contributes nothing to the combine.
__device__ __forceinline__ void attn_neutral_partial(float* __restrict__ max_logits,  // [NS, Hq] fp32, out
                                                     float* __restrict__ exp_sums,    // [NS, Hq] fp32, out
                                                     const AttnLane& at) {
    if (at.t == 0 && at.g < at.group) {
        max_logits[(u64)at.split * at.Hq + at.head0 + at.g] = F32_NEG_INF;
        exp_sums[(u64)at.split * at.Hq + at.head0 + at.g] = 0.f;
    }
}

// The running state of a split lives in the kernel, declared before its page loop:
//   float m_run = F32_NEG_INF;                      running max of head g (log2 units), same in the quad
//   float l_run = 0.f;                              running sum of head g over this lane's tokens
//   float acc[ATTN_MAX_GROUP][HEAD_DIM / 32] = {};  unnormalised output of the 8 head rows for this
//                                                   lane's DPL = Dh/32 dims, DPL·lane … DPL·lane+DPL-1
// attn_page advances it by one page; attn_publish writes it as the split's partial.

// One page of 16 tokens, of which tokens ≥ valid (≥ 1) are masked. The kernel supplies its K and V:
//   key(nt, m)     uint4: key chunk m (dims 32m + 8t … +8) of token nt·8 + g; zeros if masked
//   value(tok, w)  float2: V of token tok at dims DPL·lane + 2w and +1, in FP32; zeros if masked
// scale_log2 = log2(e)/√Dh. The probabilities (p[token][head]) and the heads' rescale factors go
// through the warp's own rows p_smem[warp] and alpha_smem[warp], read back as broadcasts: the
// caller syncs the warp before the next page rewrites them.
template <int HEAD_DIM, typename Key, typename Value>
__device__ __forceinline__ void attn_page(float& m_run, float& l_run,
                                          float (&acc)[ATTN_MAX_GROUP][HEAD_DIM / 32], float scale_log2,
                                          const uint4 (&qf)[HEAD_DIM / 32], int valid,
                                          float (*p_smem)[PAGE_TOKENS][ATTN_MAX_GROUP],  // [W][16][8] fp32, smem
                                          float (*alpha_smem)[ATTN_MAX_GROUP],           // [W][8] fp32, smem
                                          const AttnLane& at, Key key, Value value) {
    constexpr int KCH = HEAD_DIM / 32, VW = HEAD_DIM / 64, DPL = HEAD_DIM / 32;
    const int warp = at.warp, g = at.g, t = at.t;

    // Scores: s[nt][j] = head g, token nt·8 + 2t + j, scaled to log2 units, masked.
    float s[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int m = 0; m < KCH; ++m) {
            const uint4 k = key(nt, m);
            const u32 a_lo[4] = {qf[m].x, 0u, qf[m].y, 0u};
            const u32 a_hi[4] = {qf[m].z, 0u, qf[m].w, 0u};
            mma_m16n8k16_f32_f16(c, a_lo, k.x, k.y);
            mma_m16n8k16_f32_f16(c, a_hi, k.z, k.w);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
            s[nt][j] = nt * 8 + 2 * t + j < valid ? c[j] * scale_log2 : F32_NEG_INF;
    }

    // Online softmax update for head g (token 0 of the page is valid, so m_new is finite).
    const float page_max = quad_max(fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1])));
    const float m_new = fmaxf(m_run, page_max);
    const float alpha = exp2f(m_run - m_new);  // 0 on the first page (m_run = −inf)
    float p_sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const float p = exp2f(s[nt][j] - m_new);  // exactly 0 for masked tokens
            p_smem[warp][nt * 8 + 2 * t + j][g] = p;
            p_sum += p;
        }
    l_run = l_run * alpha + p_sum;
    m_run = m_new;
    if (t == 0) alpha_smem[warp][g] = alpha;
    __syncwarp();

    // acc[h][:] = acc[h][:] · alpha[h] + Σ_tok p[tok][h] · v[tok][:]
    const float4 al0 = *reinterpret_cast<const float4*>(&alpha_smem[warp][0]);
    const float4 al1 = *reinterpret_cast<const float4*>(&alpha_smem[warp][4]);
    const float al[ATTN_MAX_GROUP] = {al0.x, al0.y, al0.z, al0.w, al1.x, al1.y, al1.z, al1.w};
#pragma unroll
    for (int h = 0; h < ATTN_MAX_GROUP; ++h)
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] *= al[h];
#pragma unroll
    for (int tok = 0; tok < PAGE_TOKENS; ++tok) {
        const float4 p0 = *reinterpret_cast<const float4*>(&p_smem[warp][tok][0]);
        const float4 p1 = *reinterpret_cast<const float4*>(&p_smem[warp][tok][4]);
        const float p[ATTN_MAX_GROUP] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
        float v[DPL];
#pragma unroll
        for (int w = 0; w < VW; ++w) {
            const float2 f = value(tok, w);
            v[2 * w] = f.x;
            v[2 * w + 1] = f.y;
        }
#pragma unroll
        for (int h = 0; h < ATTN_MAX_GROUP; ++h)
#pragma unroll
            for (int j = 0; j < DPL; ++j) acc[h][j] = fmaf(p[h], v[j], acc[h][j]);
    }
}

// The split's partial for the group's query heads head0 … head0 + group − 1.
template <int HEAD_DIM>
__device__ __forceinline__ void attn_publish(float m_run, float l_run,
                                             const float (&acc)[ATTN_MAX_GROUP][HEAD_DIM / 32],
                                             float* __restrict__ partial_out,  // [NS, Hq, Dh] fp32, out
                                             float* __restrict__ max_logits,   // [NS, Hq] fp32, out
                                             float* __restrict__ exp_sums,     // [NS, Hq] fp32, out
                                             const AttnLane& at) {
    constexpr int DPL = HEAD_DIM / 32;
    const float l_total = quad_sum(l_run);
    if (at.t == 0 && at.g < at.group) {
        max_logits[(u64)at.split * at.Hq + at.head0 + at.g] = m_run;
        exp_sums[(u64)at.split * at.Hq + at.head0 + at.g] = l_total;
    }
#pragma unroll
    for (int h = 0; h < ATTN_MAX_GROUP; ++h) {
        if (h >= at.group) break;
        float* dst = partial_out + ((u64)at.split * at.Hq + at.head0 + h) * HEAD_DIM + DPL * at.lane;
        if constexpr (DPL == 4) {
            *reinterpret_cast<float4*>(dst) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        } else {
            *reinterpret_cast<float2*>(dst) = make_float2(acc[h][0], acc[h][1]);
        }
    }
}
