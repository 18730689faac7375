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
// 2 · 2 · 28 heads · 128 · (512²/2) ≈ 3.8 GFLOP per layer; a chunk at position 31 744 does
// ~120 GFLOP per layer, where attention is most of a long prompt's prefill. FlashAttention-2
// structure on mma.sync: one block per (16-query tile, KV head, KV split).
//
// Work split
// ----------
//   grid    = (ceil(rows_max / 16), Hkv, S); block = G warps, G = Hq / Hkv (7 for Qwen2.5-Coder).
//             Query tiles run in reverse (blockIdx.x 0 is the last tile): the tiles that walk
//             the most positions are dispatched first.
//   warp    = one query head of the KV head × the tile's 16 queries (the M of the MMAs); the G
//             warps share every K/V byte staged in shared memory (GQA: read once for 7 heads).
//   kv loop = the positions 0 … kv_len-1 that the tile's last query sees, in n_tiles tiles of 64
//             tokens (4 pages), cut into ns = min(S, n_tiles) contiguous splits of
//             [z·n_tiles/ns, (z+1)·n_tiles/ns) tiles; block z walks split z (blocks z ≥ ns
//             return at once). Tiles are staged with cp.async (ptx/cp_async.cuh) in a ring of
//             APF_STAGES: the one multiplied and the next two in flight. Positions past kv_len
//             are zero-filled, never read: tests fill unused slots and page tails with NaN.
//     S = QKᵀ : m16n8k16 MMAs, Q fragments in registers (loaded once), K fragments by ldmatrix
//               from the [token][dim] tile (ptx/ldmatrix.cuh); FP32 scores, scaled to log2 units.
//     causal  : score of position p for the query at p_r is −inf when p > p_r (select, not
//               multiply: 0 · NaN would still be NaN).
//     softmax : online, FP32 (running max and sum per query row; the 4 lanes of a quad share a
//               row, so row max/sum are 2-step butterflies). A split past a row's position
//               leaves that row's max at −inf; its exponents are then taken against 0, so they
//               are exactly 0 and nothing is added.
//     O += PV : P rounded to FP16 as the A operand (the S accumulator layout is exactly the A
//               fragment layout of the next MMA), V fragments by ldmatrix.trans.
//   out     = O / l, FP16, only rows < n_rows (ns = 1), or after the combine below.
//
// The pipeline and its one barrier per tile: tile i goes to stage i % APF_STAGES in commit group
// i (empty groups past the end keep the count uniform). Step i waits until group i has landed
// (cp.async.wait_group APF_STAGES − 2), then __syncthreads: every thread's copies of tile i are
// visible, and every warp has finished step i − 1; only then is tile i + APF_STAGES − 1 issued,
// into the stage step i − 1 read. No stage is overwritten while a warp may read it, and none is
// read before all of its copies have landed.
//
// KV splits
// ---------
// Why: one block per (query tile, KV head) is 64 blocks for the 0.5B (2 KV heads) on 132 SMs, and
// at a 512-token prompt from position 0 the last tile walks all 8 tiles of positions while the
// first walks one. Split into S blocks, a tile's positions run side by side and the grid fills
// the GPU: the launcher (launchers/attention_prefill.py, kv_splits_for) gives S = resident block
// slots ÷ (2 · query tiles · Hkv), at most APF_MAX_SPLITS.
// Bytes: each split of a split tile stores, per warp, its 2·Dh/8 × 32 lanes O accumulators
// (Dh · 16 FP32: 8 KiB at Dh = 128) and 32 float4 of row maxima and sums; the last split reads
// all ns back (L2: the splits of a tile run at the same time).
//   part_o    float4 [units, S, G, Dh/8, 32]: split z's o[n][0..3] of warp w, lane l at
//             [unit, z, w, n, l] — a warp's store is 512 contiguous bytes per n.
//   part_ml   float4 [units, S, G, 32]: (m row g, m row g+8, l row g, l row g+8), l quad-summed.
//   counters  u32 [units]: how many of the unit's ns splits have stored; 0 between launches.
//   unit = kv_head · gridDim.x + query tile.
// The protocol (ptx/flags.cuh's split_arrive_last, which states the memory-model pattern): every
// thread of the block stores its partial, __syncthreads, then thread 0 adds 1 to counters[unit]
// with one atom.acq_rel.gpu. Its release half publishes, through the barrier, every thread's
// stores; the split whose add returns ns − 1 is the last, and its acquire half synchronizes with
// every earlier add (the counter changes only by these read-modify-writes: one release sequence),
// so every split's stores happen before the last split's loads, which come after a second
// __syncthreads and use ld.cg (L2: never a stale L1 line, never the non-coherent path). The last
// split resets the counter; no other block touches it again in this launch (each of the ns splits
// adds once; blocks z ≥ ns never touch it). The next launch touches the buffers only after its
// griddepcontrol.wait, which returns once this grid has completed: the prefill launches its
// kernels as programmatic dependents, and every kernel between two attention launches waits
// before it finishes, so completion runs in stream order. apf_is_last (shared) is written by
// thread 0 between the two barriers and read by all after the second, once per block.
// The combine, whichever split is last, in split order: M = the max over z of m_z;
// w_z = 2^(m_z − M), 0 where split z saw nothing of the row (m_z = −inf); l = Σ w_z l_z;
// O = Σ w_z O_z; out = O / l. M is finite: split 0 holds position 0, which every row sees. So
// a launch gives the same bits every time. S > 1 differs from S = 1 by more than FP32
// reassociation: each split rounds P to FP16 against its own running max, so the P·V products
// differ too (tests: the float64 reference's tolerance at S = 1 … 4, poisoned partials, counters
// back at 0; never S = 1 against S > 1 bit for bit).
// The loads: per lane, APF_COMBINE_CHUNK float4 of every split in flight together (predicated on
// z < ns), Dh/8/APF_COMBINE_CHUNK round trips (2 at Dh = 64, 4 at Dh = 128).
//
// Shared memory (dynamic): APF_STAGES × (K, V) × 64 tokens × (Dh·2 + 16) B = 102 KiB at Dh = 128
// (54 KiB at Dh = 64). The 16-byte row padding puts the 8 rows of each ldmatrix in 8 different
// bank groups. Registers (ptxas): 173 at Dh = 128 (one block of 7 warps per SM), 128 at Dh = 64
// (two).
//
// Measured on the H200 (tools/bench_attention_prefill.py: graph replay, µs per call; a chunk of
// 512 rows at position START; docs/bench/2026-12-02_h200_attention_prefill_splits.json, with the
// version before the splits from docs/bench/2026-12-02_2ba4bde_h200_attention_prefill.json):
//   | shape, START     | before | S = 1  | S = 2  | S = 4  |
//   | 0.5B, 0          |  18.4  |  16.6  |  12.0  |  13.6  |
//   | 0.5B, 7680       | 249.7  | 220.3  | 114.2  | 116.2  |
//   | 0.5B, 31744      | 972.1  | 857.7  | 433.0  | 434.9  |
//   | 7B, 0            |  29.9  |  27.5  |  30.2  |  32.5  |
//   | 7B, 7680         | 429.3  | 369.7  | 372.1  | 378.1  |
//   | 7B, 31744        | 1643   | 1456   | 1450   | 1444   |
// ("S = 1" is this file without splits: the reversed tiles and the ring of three with one barrier
// per tile. That run's build had __launch_bounds__(256, 1), 187 / 134 registers; this one's
// (256) gives 182 / 125, the same code otherwise.) In the prefill (the synthetic 0.5B, 512 tokens,
// docs/bench/2026-12-02_8925093_h200_prefill_attention_splits.json): the attention's 24 launches
// 473 → 366 µs, TTFT 2.99 → 2.79 ms. The 0.5B's 64 units leave half the GPU idle without splits; the 7B's 128 fill it
// (one block per SM: its registers), so splits only add combines there.
// What lost, same runs: two stages instead of three, 0–3 % slower; the 7B at 144 registers
// (__maxnreg__, two blocks of 7 warps per SM, 88 B of spills in the loop): 10–15 % slower.
// The staging loop: it first took one block-table load, the index arithmetic and one copy per
// 16-byte piece (53 instructions of SASS per copy, ~485 per thread and tile at Dh = 128: ~38 % of a
// warp's ~1 280 per tile). Now each thread keeps one 16-byte column and walks the tile's rows, the
// 4 page offsets loaded once, K and V from one offset: ~237 (52 before the loop, 37 per row for
// both copies). The same bytes land in shared memory, so the outputs keep their bits (compared
// bit for bit over 60 outputs: 4 head shapes × 5 chunks × S = 1, 2, 4). Same tool, both builds
// alternately in one run (docs/bench/2026-12-02_8e6a560_h200_attention_prefill_staging.json):
//   | shape, START, S  | before | now    |
//   | 0.5B, 0, 2       |  11.9  |  11.6  |
//   | 0.5B, 7680, 2    | 115.7  | 106.9  |
//   | 0.5B, 31744, 2   | 439    | 404    |
//   | 7B, 0, 1         |  28.2  |  24.3  |
//   | 7B, 7680, 1      | 388.6  | 310.7  |
//   | 7B, 31744, 1     | 1501   | 1214   |
// (that machine ran the old build 2–4 % slower than the runs of the table above.) The 7B's chunk
// at 31 744 now runs at ~193 TFLOP/s, one block of 7 warps per SM, Nsight Compute (before the
// splits, docs/bench/2026-12-02_2ba4bde_h200_attention_prefill_ncu.json) showing warps mostly
// waiting on fixed-latency dependencies. Next: K/V by TMA (no issue loop at all), then
// FlashAttention-3's structure (wgmma, warp-specialised).
//
// Requirements (asserted by the launcher): Hq / Hkv ≤ 8; Dh ∈ {64, 128}; pointers 16-byte
// aligned; block_table valid for every page < ceil((start + n_rows) / 16); with S > 1, the
// scratch of AttentionSplitScratch for ceil(rows_max / 16) · S tile splits.
#include <cuda_fp16.h>

#include "types.cuh"     // u32, u64, WARP_SIZE, QUAD_SIZE, F32_NEG_INF, F32_LOG2E
#include "mma.cuh"       // mma_m16n8k16_f32_f16
#include "ldmatrix.cuh"  // ldmatrix_x4, ldmatrix_x4_trans
#include "cp_async.cuh"  // cp_async_16, cp_async_commit, cp_async_wait
#include "warp.cuh"      // quad_max, quad_sum
#include "kv_cache.cuh"  // PAGE_TOKENS, kv_offset
#include "griddep.cuh"   // grid_dependency_wait, grid_launch_dependents
#include "flags.cuh"     // split_arrive_last

#define APF_QTILE      16   // queries per block (M of the MMA)
#define APF_KV_TILE    64   // positions per pipeline step (4 pages)
#define APF_MAX_GROUP  8    // warps per block = query heads per KV head
#ifndef APF_STAGES
#define APF_STAGES     3    // K/V tiles in shared memory: the one multiplied and two in flight
#endif
#define APF_MAX_SPLITS 4    // KV splits of one query tile at most (gridDim.z)
#define APF_COMBINE_CHUNK 4  // float4 of each split's partial loaded together in the combine

template <int HEAD_DIM>
struct ApfShape {
    static constexpr int ROW_BYTES = HEAD_DIM * 2 + 16;          // padded token row
    static constexpr int TILE_BYTES = APF_KV_TILE * ROW_BYTES;    // K (or V) of one step
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;            // K then V
    static constexpr int SMEM_BYTES = APF_STAGES * STAGE_BYTES;   // kernels.py mirrors it
    static constexpr int CHUNKS = HEAD_DIM / 8;                   // 16-byte chunks per row
    static constexpr int KSTEPS = HEAD_DIM / 16;                  // MMA k-steps over dims
    static constexpr int ONS = HEAD_DIM / 8;                      // O accumulators (n8 tiles) per warp
};

// The KV-split scratch of a launch (null where gridDim.z = 1: never touched then).
struct ApfSplit {
    float4* part_o;   // [units, S, G, Dh/8, 32] float4: a warp's O accumulators, lane-major
    float4* part_ml;  // [units, S, G, 32] float4: (m row g, m row g+8, l row g, l row g+8)
    u32* counters;    // [units] u32: splits of the unit that have stored; 0 between launches
};

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
}

template <int HEAD_DIM>
__device__ __forceinline__ void attention_prefill_impl(
    __half* __restrict__ out, const __half* __restrict__ q, const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache, const int* __restrict__ block_table,
    const int* __restrict__ prefill_state, int Hq, int Hkv, const ApfSplit& sp) {
    using S = ApfShape<HEAD_DIM>;
    extern __shared__ __align__(128) unsigned char apf_smem[];  // [stage][K|V][64][ROW_BYTES]
    __shared__ int apf_is_last;

    // ld.global.cg, not __ldg: ptxas hoists a non-coherent load above griddepcontrol.wait (it
    // assumes the bytes fixed for the kernel's life), which is sound only while prefill_state's
    // writer is never this kernel's programmatic predecessor.
    const int start = __ldcg(prefill_state), n_rows = __ldcg(prefill_state + 1);
    // Query tiles in reverse: the longest (last) tiles are dispatched first.
    const int q_tile = gridDim.x - 1 - blockIdx.x;
    const int q0 = q_tile * APF_QTILE;
    if (q0 >= n_rows) return;  // whole block, before any barrier
    const int kv_head = blockIdx.y;
    const int group = Hq / Hkv;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int head = kv_head * group + warp;
    // Positions this tile reads: up to its last query's position, in n_tiles tiles of 64, cut
    // into ns contiguous splits (never an empty one); this block takes split blockIdx.z.
    const int kv_len = start + min(n_rows, q0 + APF_QTILE);
    const int n_tiles = (kv_len + APF_KV_TILE - 1) / APF_KV_TILE;
    const int ns = min((int)gridDim.z, n_tiles);
    const int split = blockIdx.z;
    if (split >= ns) return;   // whole block, before any barrier
    const int t_begin = split * n_tiles / ns, t_end = (split + 1) * n_tiles / ns;
    const int n_steps = t_end - t_begin;

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
    // Thread t copies the 16-byte column t % CHUNKS of rows t / CHUNKS, + blockDim / CHUNKS, …
    // (blockDim is a multiple of 32, so of CHUNKS: every thread has a column), K and V from one
    // offset; the tile's 4 page ids are loaded once, together (pages past kv_len: never read).
    auto issue = [&](int tile, int stage) {
        unsigned char* dst = apf_smem + stage * S::STAGE_BYTES + 16 * (threadIdx.x % S::CHUNKS);
        const int pos0 = tile * APF_KV_TILE, ch8 = 8 * (threadIdx.x % S::CHUNKS);
        u64 base[APF_KV_TILE / PAGE_TOKENS];  // element offset of each page's slot 0, column ch8
#pragma unroll
        for (int p = 0; p < APF_KV_TILE / PAGE_TOKENS; ++p) {
            const int page = pos0 + p * PAGE_TOKENS < kv_len ? __ldg(block_table + pos0 / PAGE_TOKENS + p) : 0;
            base[p] = kv_offset(page, kv_head, 0, Hkv, HEAD_DIM) + ch8;
        }
        const int step_rows = blockDim.x / S::CHUNKS;
        for (int tok = threadIdx.x / S::CHUNKS; tok < APF_KV_TILE; tok += step_rows) {
            const bool valid = pos0 + tok < kv_len;
            const int pq = tok / PAGE_TOKENS;  // the tile's page of this token
            const u64 off = (pq == 0 ? base[0] : pq == 1 ? base[1] : pq == 2 ? base[2] : base[3])
                            + (u64)(tok % PAGE_TOKENS) * HEAD_DIM;
            cp_async_16(dst + tok * S::ROW_BYTES, valid ? k_cache + off : k_cache, valid);
            cp_async_16(dst + S::TILE_BYTES + tok * S::ROW_BYTES, valid ? v_cache + off : v_cache, valid);
        }
    };
    static_assert(APF_KV_TILE / PAGE_TOKENS == 4, "the page select above takes 4 pages a tile");

    const float scale_log2 = rsqrtf((float)HEAD_DIM) * F32_LOG2E;
    float o[S::ONS][4];  // O[row g | g+8][dims 8n + 2t, +1]
#pragma unroll
    for (int n = 0; n < S::ONS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
    float m_run[2] = {F32_NEG_INF, F32_NEG_INF};  // per row (g, g+8), log2 units, quad-uniform
    float l_run[2] = {0.f, 0.f};                  // per row, this lane's share (quad-summed at the end)

    // ldmatrix lane roles: lane supplies row (lane % 8) of matrix (lane / 8).
    const int lm_row = lane % 8, lm_mat = lane / 8;

    // The pipeline: tiles t_begin + i, i < n_steps, into stage i % APF_STAGES; one commit group
    // per tile (empty groups past the end keep the count uniform). Step i waits for group i
    // (wait_group APF_STAGES - 2: the later ones may still fly), then one barrier: every thread's
    // copies of tile i have landed, and every warp has finished step i - 1, so the refill after
    // the barrier may overwrite the stage step i - 1 read ((i + APF_STAGES - 1) % APF_STAGES).
#pragma unroll
    for (int i = 0; i < APF_STAGES - 1; ++i) {
        if (i < n_steps) issue(t_begin + i, i);
        cp_async_commit();
    }
    for (int step = 0; step < n_steps; ++step) {
        const int tile = t_begin + step;
        cp_async_wait<APF_STAGES - 2>();
        __syncthreads();
        if (step + APF_STAGES - 1 < n_steps)
            issue(tile + APF_STAGES - 1, (step + APF_STAGES - 1) % APF_STAGES);
        cp_async_commit();
        const unsigned char* ks = apf_smem + (step % APF_STAGES) * S::STAGE_BYTES;
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

        // Online softmax update. A row may see no position of a tile (a split past the row's
        // position, in the query tile's last KV tiles): its max stays −inf, so exponents are
        // taken against 0 instead (exp2(−inf) = 0: nothing added) and alpha is 0 only while
        // nothing was added yet — never −inf − −inf.
        float alpha[2], m_use[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m_new = fmaxf(m_run[h], quad_max(row_max[h]));
            alpha[h] = m_run[h] == F32_NEG_INF ? 0.f : exp2f(m_run[h] - m_new);
            m_run[h] = m_new;
            m_use[h] = m_new == F32_NEG_INF ? 0.f : m_new;
        }
        float p_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < APF_KV_TILE / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[n][e] - m_use[e / 2]);  // exactly 0 where masked
                s[n][e] = p;
                p_sum[e / 2] += p;
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + p_sum[h];
#pragma unroll
        for (int n = 0; n < S::ONS; ++n) {
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
    }

    // The quad sums are shuffles of the whole warp: taken before the per-row branches below,
    // which diverge in the chunk's last tile.
    float l_tot[2] = {quad_sum(l_run[0]), quad_sum(l_run[1])};

    if (ns > 1) {
        // Store this split's partial, count it, and let the unit's last split combine them
        // (the protocol and why it cannot race: the header, "KV splits").
        const int unit = kv_head * gridDim.x + q_tile;
        const u64 slot0 = (u64)unit * gridDim.z * group + warp;  // + z · group: split z's slot of this warp
        const u64 zstride = (u64)group;
        float4* po = sp.part_o + slot0 * S::ONS * WARP_SIZE + lane;
        float4* pml = sp.part_ml + slot0 * WARP_SIZE + lane;
#pragma unroll
        for (int n = 0; n < S::ONS; ++n)
            __stcg(po + ((u64)split * zstride * S::ONS + n) * WARP_SIZE,
                   make_float4(o[n][0], o[n][1], o[n][2], o[n][3]));
        __stcg(pml + (u64)split * zstride * WARP_SIZE, make_float4(m_run[0], m_run[1], l_tot[0], l_tot[1]));
        __syncthreads();  // every thread's stores before thread 0's release
        if (threadIdx.x == 0) {
            apf_is_last = split_arrive_last(sp.counters + unit, ns);
        }
        __syncthreads();  // thread 0's acquire before every thread's loads below
        if (!apf_is_last) return;

        // Combine, in split order whichever split is last (its own partial read back too):
        // M = the max over z of m_z; w_z = 2^(m_z − M) (0 where a split saw nothing of the row);
        // l = Σ w_z l_z; O = Σ w_z O_z. M is finite: split 0 holds position 0, which every row sees.
        float4 ml[APF_MAX_SPLITS];
#pragma unroll
        for (int z = 0; z < APF_MAX_SPLITS; ++z)
            if (z < ns) ml[z] = __ldcg(pml + (u64)z * zstride * WARP_SIZE);
        float mx[2] = {F32_NEG_INF, F32_NEG_INF};
#pragma unroll
        for (int z = 0; z < APF_MAX_SPLITS; ++z)
            if (z < ns) { mx[0] = fmaxf(mx[0], ml[z].x); mx[1] = fmaxf(mx[1], ml[z].y); }
        float w[APF_MAX_SPLITS][2];
        l_tot[0] = l_tot[1] = 0.f;
#pragma unroll
        for (int z = 0; z < APF_MAX_SPLITS; ++z)
            if (z < ns) {
                w[z][0] = ml[z].x == F32_NEG_INF ? 0.f : exp2f(ml[z].x - mx[0]);
                w[z][1] = ml[z].y == F32_NEG_INF ? 0.f : exp2f(ml[z].y - mx[1]);
                l_tot[0] += w[z][0] * ml[z].z;
                l_tot[1] += w[z][1] * ml[z].w;
            }
#pragma unroll
        for (int n0 = 0; n0 < S::ONS; n0 += APF_COMBINE_CHUNK) {
            float4 p[APF_MAX_SPLITS][APF_COMBINE_CHUNK];
#pragma unroll
            for (int z = 0; z < APF_MAX_SPLITS; ++z)
#pragma unroll
                for (int e = 0; e < APF_COMBINE_CHUNK; ++e)
                    if (z < ns) p[z][e] = __ldcg(po + ((u64)z * zstride * S::ONS + n0 + e) * WARP_SIZE);
#pragma unroll
            for (int e = 0; e < APF_COMBINE_CHUNK; ++e) {
                float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                for (int z = 0; z < APF_MAX_SPLITS; ++z)
                    if (z < ns) {
                        sum.x += w[z][0] * p[z][e].x; sum.y += w[z][0] * p[z][e].y;
                        sum.z += w[z][1] * p[z][e].z; sum.w += w[z][1] * p[z][e].w;
                    }
                o[n0 + e][0] = sum.x; o[n0 + e][1] = sum.y; o[n0 + e][2] = sum.z; o[n0 + e][3] = sum.w;
            }
        }
    }

    // out = O / l for the valid rows.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = h == 0 ? r0 : r1;
        if (r >= n_rows) continue;
        const float inv_l = 1.f / l_tot[h];
        __half* dst = out + ((u64)r * Hq + head) * HEAD_DIM + 2 * t;
#pragma unroll
        for (int n = 0; n < S::ONS; ++n)
            *reinterpret_cast<u32*>(dst + 8 * n) = pack_half2(o[n][2 * h] * inv_l, o[n][2 * h + 1] * inv_l);
    }
}

// grid (ceil(rows_max / 16), Hkv, S), block (32 · Hq/Hkv), dynamic smem ApfShape<Dh>::SMEM_BYTES.
#define ATTENTION_PREFILL_KERNEL(NAME, HEAD_DIM)                                                   \
    extern "C" __global__ void __launch_bounds__(APF_MAX_GROUP * WARP_SIZE) NAME(  \
        __half* __restrict__ out,               /* [rows, Hq, Dh] fp16, out                    */ \
        const __half* __restrict__ q,           /* [rows, Hq, Dh] fp16, rotated queries       */ \
        const __half* __restrict__ k_cache,     /* [P, Hkv, 16, Dh] fp16, this layer          */ \
        const __half* __restrict__ v_cache,     /* [P, Hkv, 16, Dh] fp16, this layer          */ \
        const int* __restrict__ block_table,    /* [max_pages] int32: logical → physical page */ \
        const int* __restrict__ prefill_state,  /* [2] int32: start position, n_rows          */ \
        int Hq, int Hkv,                                                                       \
        float4* part_o,                         /* [units, S, G, Dh/8, 32] float4 (S > 1)     */ \
        float4* part_ml,                        /* [units, S, G, 32] float4 (S > 1)           */ \
        u32* counters) {                        /* [units] u32, zero between launches (S > 1) */ \
        grid_launch_dependents();                                                              \
        grid_dependency_wait(); /* q, this chunk's K/V and prefill_state: earlier kernels */   \
        attention_prefill_impl<HEAD_DIM>(out, q, k_cache, v_cache, block_table, prefill_state,     \
                                         Hq, Hkv, ApfSplit{part_o, part_ml, counters});         \
    }

ATTENTION_PREFILL_KERNEL(attention_prefill_hd64, 64)
ATTENTION_PREFILL_KERNEL(attention_prefill_hd128, 128)
