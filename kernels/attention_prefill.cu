// kernels/attention_prefill.cu — causal GQA attention of a prompt chunk over the paged KV cache.
//
//   attention_prefill_hd64 / _hd128
//     out[r, h, :] = softmax(q[r, h] · K[0 : p_r + 1]ᵀ / √Dh) · V[0 : p_r + 1]
//   for the chunk's rows r < n_rows at positions p_r = start + r, query head h reading KV
//   head h / (Hq/Hkv). K/V of every position ≤ p_r is already in the cache: rope_kv_rows wrote
//   this chunk's, earlier chunks (or decode steps) the rest. (start, n_rows) = prefill_state[0..1]
//   come from device memory, like every prefill kernel (the launch list is reused per grid size).
//
// The limit: latency and tensor-core issue, not bytes. At the 7B shape a 512-token prompt reads
// 512 × 4 KV heads × 128 × 2 B × 2 = 1 MiB of K/V per layer (L2-resident), and does
// 2 · 2 · 28 heads · 128 · (512²/2) ≈ 3.8 GFLOP per layer: a few percent of the GEMMs'.
// FlashAttention-2 structure, simple-correct first: one block per (16-query tile, KV head).
//
// Work split
// ----------
//   grid    = (ceil(rows_max / 16), Hkv); block = G warps, G = Hq / Hkv (7 for Qwen2.5-Coder).
//   warp    = one query head of the KV head × the tile's 16 queries (the M of the MMAs); the G
//             warps share every K/V byte staged in shared memory (GQA: read once for 7 heads).
//   kv loop = the positions 0 … kv_len-1 that the tile's last query sees, 64 tokens (4 pages)
//             per step, double-buffered with cp.async (ptx/cp_async.cuh). Positions past kv_len
//             are zero-filled, never read: tests fill unused slots and page tails with NaN.
//     S = QKᵀ : m16n8k16 MMAs, Q fragments in registers (loaded once), K fragments by ldmatrix
//               from the [token][dim] tile (ptx/ldmatrix.cuh); FP32 scores, scaled to log2 units.
//     causal  : score of position p for the query at p_r is −inf when p > p_r (select, not
//               multiply: 0 · NaN would still be NaN).
//     softmax : online, FP32 (running max and sum per query row; the 4 lanes of a quad share a
//               row, so row max/sum are 2-step butterflies).
//     O += PV : P rounded to FP16 as the A operand (the S accumulator layout is exactly the A
//               fragment layout of the next MMA), V fragments by ldmatrix.trans.
//   out     = O / l, FP16, only rows < n_rows.
//
// Shared memory (dynamic): 2 stages × (K, V) × 64 tokens × (Dh·2 + 16) B = 68 KiB at Dh = 128
// (36 KiB at Dh = 64). The 16-byte row padding puts the 8 rows of each ldmatrix in 8 different
// bank groups.
//
// Measured on the H200 at commit 4b56ce2 (7B, a 512-token prompt, per-kernel timing of the prefill
// by that commit's tools/bench_e2e.py, since folded into `drvqwen bench`): 33.5 µs per layer,
// 0.94 ms of the prefill's 37.7 ms of kernels — 2.5 %, far from mattering before the GEMMs.
//
// Requirements (asserted by the launcher): Hq / Hkv ≤ 8; Dh ∈ {64, 128}; pointers 16-byte
// aligned; block_table valid for every page < ceil((start + n_rows) / 16).
#include <cuda_fp16.h>

#include "types.cuh"     // u32, u64, WARP_SIZE, QUAD_SIZE, F32_NEG_INF, F32_LOG2E
#include "mma.cuh"       // mma_m16n8k16_f32_f16
#include "ldmatrix.cuh"  // ldmatrix_x4, ldmatrix_x4_trans
#include "cp_async.cuh"  // cp_async_16, cp_async_commit, cp_async_wait
#include "warp.cuh"      // quad_max, quad_sum
#include "kv_cache.cuh"  // PAGE_TOKENS, kv_offset
#include "griddep.cuh"   // grid_dependency_wait, grid_launch_dependents

#define APF_QTILE     16    // queries per block (M of the MMA)
#define APF_KV_TILE   64    // positions per pipeline step (4 pages)
#define APF_MAX_GROUP 8     // warps per block = query heads per KV head
#define APF_STAGES    2

template <int HEAD_DIM>
struct ApfShape {
    static constexpr int ROW_BYTES = HEAD_DIM * 2 + 16;          // padded token row
    static constexpr int TILE_BYTES = APF_KV_TILE * ROW_BYTES;    // K (or V) of one step
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;            // K then V
    static constexpr int SMEM_BYTES = APF_STAGES * STAGE_BYTES;   // kernels.py mirrors it
    static constexpr int CHUNKS = HEAD_DIM / 8;                   // 16-byte chunks per row
    static constexpr int KSTEPS = HEAD_DIM / 16;                  // MMA k-steps over dims
};

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
}

template <int HEAD_DIM>
__device__ __forceinline__ void attention_prefill_impl(
    __half* __restrict__ out, const __half* __restrict__ q, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_table,
    const int* __restrict__ prefill_state, int Hq, int Hkv) {
    using S = ApfShape<HEAD_DIM>;
    extern __shared__ __align__(128) unsigned char apf_smem[];  // [stage][K|V][64][ROW_BYTES]

    const int start = __ldg(prefill_state), n_rows = __ldg(prefill_state + 1);
    const int q0 = blockIdx.x * APF_QTILE;
    if (q0 >= n_rows) return;  // whole block, before any barrier
    const int kv_head = blockIdx.y;
    const int group = Hq / Hkv;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int head = kv_head * group + warp;
    // Positions this tile reads: up to its last query's position.
    const int kv_len = start + min(n_rows, q0 + APF_QTILE);
    const int n_tiles = (kv_len + APF_KV_TILE - 1) / APF_KV_TILE;

    // Q fragments (A operand; k = dims 16j … 16j+15) of rows q0+g and q0+g+8, zero past n_rows.
    const int r0 = q0 + g, r1 = q0 + g + 8;
    const int qp0 = start + r0, qp1 = start + r1;  // the rows' positions
    const __half* q_r0 = q + ((u64)r0 * Hq + head) * HEAD_DIM + 2 * t;
    const __half* q_r1 = q + ((u64)r1 * Hq + head) * HEAD_DIM + 2 * t;
    u32 qa[S::KSTEPS][4];
#pragma unroll
    for (int j = 0; j < S::KSTEPS; ++j) {
        qa[j][0] = r0 < n_rows ? *reinterpret_cast<const u32*>(q_r0 + 16 * j) : 0u;
        qa[j][1] = r1 < n_rows ? *reinterpret_cast<const u32*>(q_r1 + 16 * j) : 0u;
        qa[j][2] = r0 < n_rows ? *reinterpret_cast<const u32*>(q_r0 + 16 * j + 8) : 0u;
        qa[j][3] = r1 < n_rows ? *reinterpret_cast<const u32*>(q_r1 + 16 * j + 8) : 0u;
    }

    // Stage the K/V of positions [64·tile, 64·tile + 64) into `stage`; past kv_len: zeros.
    auto issue = [&](int tile, int stage) {
        unsigned char* dst0 = apf_smem + stage * S::STAGE_BYTES;
        for (int c = threadIdx.x; c < 2 * APF_KV_TILE * S::CHUNKS; c += blockDim.x) {
            const int which = c / (APF_KV_TILE * S::CHUNKS);  // 0: K, 1: V
            const int rem = c % (APF_KV_TILE * S::CHUNKS);
            const int tok = rem / S::CHUNKS, ch = rem % S::CHUNKS;
            const int pos = tile * APF_KV_TILE + tok;
            const bool valid = pos < kv_len;
            const __half* cache = which ? v_cache : k_cache;
            const __half* src = valid ? cache + kv_offset(__ldg(block_table + pos / PAGE_TOKENS), kv_head,
                                                          pos % PAGE_TOKENS, Hkv, HEAD_DIM) + 8 * ch
                                      : cache;
            cp_async_16(dst0 + which * S::TILE_BYTES + tok * S::ROW_BYTES + 16 * ch, src, valid);
        }
    };

    const float scale_log2 = rsqrtf((float)HEAD_DIM) * F32_LOG2E;
    float o[2 * S::KSTEPS][4];  // O[row g | g+8][dims 8n + 2t, +1]
#pragma unroll
    for (int n = 0; n < 2 * S::KSTEPS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
    float m_run[2] = {F32_NEG_INF, F32_NEG_INF};  // per row (g, g+8), log2 units, quad-uniform
    float l_run[2] = {0.f, 0.f};                  // per row, this lane's share (quad-summed at the end)

    // ldmatrix lane roles: lane supplies row (lane % 8) of matrix (lane / 8).
    const int lm_row = lane % 8, lm_mat = lane / 8;

    issue(0, 0);
    cp_async_commit();
    for (int tile = 0; tile < n_tiles; ++tile) {
        if (tile + 1 < n_tiles) issue(tile + 1, (tile + 1) % APF_STAGES);
        cp_async_commit();
        cp_async_wait<1>();  // this tile's copies (not necessarily the next one's) have landed
        __syncthreads();
        const unsigned char* ks = apf_smem + (tile % APF_STAGES) * S::STAGE_BYTES;
        const unsigned char* vs = ks + S::TILE_BYTES;

        // S = Q Kᵀ: s[n] = scores of tokens 8n … 8n+7 of the tile (c layout: rows g, g+8).
        float s[APF_KV_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < APF_KV_TILE / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll
        for (int nb = 0; nb < APF_KV_TILE / 16; ++nb)
#pragma unroll
            for (int j = 0; j < S::KSTEPS; ++j) {
                // matrices: (tokens +0..7 | +8..15) × (dims 16j … +7 | 16j+8 … +15)
                u32 kb[4];
                const int tok = nb * 16 + (lm_mat / 2) * 8 + lm_row, dim = 16 * j + (lm_mat % 2) * 8;
                ldmatrix_x4(kb, ks + tok * S::ROW_BYTES + 2 * dim);
                mma_m16n8k16_f32_f16(s[2 * nb], qa[j], kb[0], kb[1]);
                mma_m16n8k16_f32_f16(s[2 * nb + 1], qa[j], kb[2], kb[3]);
            }

        // Causal mask and scale; e = 0, 1: row g; e = 2, 3: row g+8.
        float row_max[2] = {F32_NEG_INF, F32_NEG_INF};
#pragma unroll
        for (int n = 0; n < APF_KV_TILE / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int pos = tile * APF_KV_TILE + 8 * n + 2 * t + (e & 1);
                const int qp = e < 2 ? qp0 : qp1;
                s[n][e] = pos <= qp ? s[n][e] * scale_log2 : F32_NEG_INF;
                row_max[e / 2] = fmaxf(row_max[e / 2], s[n][e]);
            }

        // Online softmax update. Tile 0 holds position 0 ≤ every query's position, so m_new
        // is finite from the first tile on; the guard keeps −inf − −inf out regardless.
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m_new = fmaxf(m_run[h], quad_max(row_max[h]));
            alpha[h] = m_run[h] == F32_NEG_INF ? 0.f : exp2f(m_run[h] - m_new);
            m_run[h] = m_new;
        }
        float p_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < APF_KV_TILE / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[n][e] - m_run[e / 2]);  // exactly 0 where masked
                s[n][e] = p;
                p_sum[e / 2] += p;
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + p_sum[h];
#pragma unroll
        for (int n = 0; n < 2 * S::KSTEPS; ++n) {
            o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
            o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
        }

        // O += P V, k = the tile's tokens in steps of 16.
#pragma unroll
        for (int kk = 0; kk < APF_KV_TILE / 16; ++kk) {
            const u32 pa[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]),           // row g,   tokens 2t, 2t+1
                               pack_half2(s[2 * kk][2], s[2 * kk][3]),           // row g+8
                               pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),   // row g,   tokens 2t+8, 2t+9
                               pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};  // row g+8
#pragma unroll
            for (int d = 0; d < S::KSTEPS; ++d) {
                // matrices: (tokens +0..7 | +8..15) × (dims 16d … +7 | 16d+8 … +15), transposed
                u32 vb[4];
                const int tok = kk * 16 + (lm_mat % 2) * 8 + lm_row, dim = 16 * d + (lm_mat / 2) * 8;
                ldmatrix_x4_trans(vb, vs + tok * S::ROW_BYTES + 2 * dim);
                mma_m16n8k16_f32_f16(o[2 * d], pa, vb[0], vb[1]);
                mma_m16n8k16_f32_f16(o[2 * d + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }

    // out = O / l for the valid rows. The quad sums are shuffles of the whole warp: taken
    // before the per-row branch, which diverges in the chunk's last tile.
    const float l_tot[2] = {quad_sum(l_run[0]), quad_sum(l_run[1])};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = h == 0 ? r0 : r1;
        if (r >= n_rows) continue;
        const float inv_l = 1.f / l_tot[h];
        __half* dst = out + ((u64)r * Hq + head) * HEAD_DIM + 2 * t;
#pragma unroll
        for (int n = 0; n < 2 * S::KSTEPS; ++n)
            *reinterpret_cast<u32*>(dst + 8 * n) = pack_half2(o[n][2 * h] * inv_l, o[n][2 * h + 1] * inv_l);
    }
}

// grid (ceil(rows_max / 16), Hkv), block (32 · Hq/Hkv), dynamic smem ApfShape<Dh>::SMEM_BYTES.
#define ATTENTION_PREFILL_KERNEL(NAME, HEAD_DIM)                                                   \
    extern "C" __global__ void __launch_bounds__(APF_MAX_GROUP * WARP_SIZE) NAME(                  \
        __half* __restrict__ out,               /* [rows, Hq, Dh] fp16, out                    */ \
        const __half* __restrict__ q,           /* [rows, Hq, Dh] fp16, rotated queries       */ \
        const __half* __restrict__ k_cache,     /* [P, Hkv, 16, Dh] fp16, this layer          */ \
        const __half* __restrict__ v_cache,     /* [P, Hkv, 16, Dh] fp16, this layer          */ \
        const int* __restrict__ block_table,    /* [max_pages] int32: logical → physical page */ \
        const int* __restrict__ prefill_state,  /* [2] int32: start position, n_rows          */ \
        int Hq, int Hkv) {                                                                     \
        grid_launch_dependents();                                                              \
        grid_dependency_wait(); /* q, this chunk's K/V and prefill_state: earlier kernels */   \
        attention_prefill_impl<HEAD_DIM>(out, q, k_cache, v_cache, block_table, prefill_state,     \
                                         Hq, Hkv);                                              \
    }

ATTENTION_PREFILL_KERNEL(attention_prefill_hd64, 64)
ATTENTION_PREFILL_KERNEL(attention_prefill_hd128, 128)
