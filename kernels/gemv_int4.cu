// kernels/gemv_int4.cu — decode GEMVs over INT4 (layout id 1) weights: y = W x, batch 1.
//
//   gemv_int4_f16            y fp16[N]             = W x
//   gemv_int4_qkv            qkv fp32[Nq+2·Nkv]    = [Wq x; Wk x; Wv x]    (one launch, 3 matrices)
//   gemv_int4_residual       residual fp32[N]     += W x                   (o_proj, down_proj)
//   gemv_int4_gate_up_swiglu h fp16[F]             = silu(Wg x) ⊙ (Wu x)   (gate_proj + up_proj)
//
// The limit: HBM bandwidth. Each weight byte is read exactly once per token and used for one
// multiply-add pair (2 weights per byte), so the whole decode step is a stream of 3.4 GB of
// INT4 through the SMs; nothing else matters as long as the SMs keep enough bytes in flight
// and spend few instructions per byte. Bytes per call at the 7B shape (weights + scales):
//   qkv      (3584+512+512) × 3584 / 2           =  8.26 MB + 0.26 MB scales
//   o_proj    3584 × 3584 / 2                    =  6.42 MB + 0.20 MB
//   gate_up   2 × 18944 × 3584 / 2               = 67.90 MB + 2.12 MB
//   down      3584 × 18944 / 2                   = 33.95 MB + 1.06 MB
//   per layer 116.5 MB + 3.6 MB; × 28 layers = 3.37 GB (DESIGN.md §11).
//
// Work split
// ----------
//   tile    = 16 output rows (the M of one m16n8k16 MMA) of one matrix; gemv_int4_qkv stacks
//             the tiles of q, k and v (ceil(Nq/16) + 2·ceil(Nkv/16)), gate/up pairs the same
//             16 rows of both matrices.
//   grid.x  = G blocks, each owning a contiguous, balanced range of tiles
//             [b·T/G, (b+1)·T/G) — G = T for one tile per block, or fewer ("persistent"): the
//             launcher picks G and W so that the tiles spread evenly over the SMs in one wave
//             (kernels.py, gemv_launch_shape). A block stages x once for all its tiles, and its
//             warps stream their weights without a pause between tiles.
//   block   = W warps (W = blockDim.x / 32, 1 ≤ W ≤ 8). The K groups of 128 inputs are split
//             into W contiguous ranges, one per warp ("split-K inside the block").
//   warp    = for each tile of the block, 16 rows (× 2 matrices for gate/up) × its K range: a
//             flat sequence of (tile, group) items, loaded in batches of 4 (2 for gate/up)
//             with the next batch in flight while the current one is multiplied. Per group of
//             128 inputs, lane (g, t) = (lane/4, lane%4) loads ONE 16-byte word quad of row g
//             and one of row g+8 (words 4t … 4t+3 of the group = inputs 32t … 32t+31),
//             unpacks them to FP16 (int4_a_fragments, int4_matmul.cuh) and feeds 8 MMAs:
//
//                 group gi of row r:  | t=0: words 0-3 | t=1: 4-7 | t=2: 8-11 | t=3: 12-15 |
//                 lanes 4g..4g+3 → rows row0+g (and row0+g+8), 64 contiguous bytes per row
//
//             MMA j of the group (j = 0..7, word i = j/2) takes from lane (g, t) the inputs
//             k = 128·gi + 32t + 8i + 4(j%2) + {0,1 | 2,3} as its k positions {2t,2t+1 | 2t+8,2t+9}
//             (ptx/mma.cuh: the order of k inside an MMA is free). The B operand is x at the
//             same positions: 8 consecutive bytes of x per MMA, identical for every column n of
//             B, so all 8 columns of the result are the same dot product and lane (g, t)
//             finds row g's partial in c[0] and row g+8's in c[2].
//             Products are exact and accumulate in FP32 (why MMA: ptx/mma.cuh); the per-group
//             FP32 partial is multiplied by the row's FP16 scale once per group.
//   reduce  = when a warp finishes a tile, its 16 (32) row sums go to shared memory; after
//             the block's one __syncthreads the block's threads add the W partials of each
//             output row in warp order. Every output row is written by exactly one thread: no
//             atomics, bit-reproducible.
//
// x is staged once per block in dynamic shared memory (K·2 bytes: 7 KB at K = 3584, 37 KB at
// K = 18944; the launcher raises the 48 KB opt-in limit when a model needs more), in a
// permuted order that makes the MMA B-fragment reads conflict-free broadcasts. Keeping x in
// registers instead would cost 16 registers per group in flight; the weights need them more.
// Weights use the streaming load (L1::no_allocate, L2 evict-first, 256 B prefetch,
// ptx/ldst.cuh).
//
// Shared memory (dynamic): x, K·2 bytes, then the warp partials,
// ceil(T/G) · MT · W · 16 · 4 bytes (MT = 2 for gate/up, else 1).
//
// Measured on the H200 (7B shapes, graph replay of 20 calls, test_kernel_gemv_int4.py; q/k/v,
// o and down fit in the 60 MB L2 across replays, gate/up does not; copy bandwidth 4.3 TB/s):
//   | launch shape                               | gate_up  | down     | qkv     | o_proj  |
//   | one tile per block (first version)         | 29.7 µs  | 16.9 µs  | 7.2 µs  | 4.6 µs  |
//   | persistent, kernels.gemv_launch_shape      | 24.5 µs  | 16.9 µs  | 6.1 µs  | 4.6 µs  |
// gate_up at 24.5 µs is 2.86 TB/s; qkv and o are launch/latency bound (~1.5–2 µs of bytes in
// ~5 µs). A tile-major weight layout is measured in kernels/dev/gemv_int4_tile_major.cu.
//
// Requirements (asserted by the launcher): K % 128 == 0; 1 ≤ W ≤ K/128 (every warp has at
// least one group); N ≥ 1 (any N: rows past N are loaded from the last row, never stored);
// pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"        // u32, u64, WARP_SIZE, QUAD_SIZE
#include "ldst.cuh"         // ld_stream_v4, ld_nc_v4, l2_evict_first_policy
#include "mma.cuh"          // mma_m16n8k16_f32_f16
#include "int4_matmul.cuh"  // INT4_GROUP, INT4_TILE_ROWS, int4_a_fragments, int4_segment, swiglu_f16, …

#define GEMV_MAX_WARPS        8                 // K-split warps per block (256 threads)
#define GEMV_WORDS_PER_GROUP  (INT4_GROUP / 8)  // 32-bit words of INT4 per row per group
#define GEMV_CHUNKS_PER_GROUP (INT4_GROUP / 8)  // 16-byte chunks of FP16 x per group
// Groups per load batch: 4 for one matrix, 2 for gate/up (two matrices): 4 KB of weights per
// warp per batch. The next batch is loaded while the current one is multiplied, so a warp
// keeps 4–8 KB in flight; with ≥ 14 warps per SM that covers HBM latency (~15 KB per SM).
#define GEMV_GROUP_UNROLL(MT) ((MT) == 1 ? 4 : 2)

// x in shared memory, 16-byte chunks permuted so that the 4 chunks the lanes t = 0..3 read
// together sit in 4 consecutive 16-byte slots (conflict-free; the 8 lanes g share them as a
// broadcast): chunk (group gi, lane t, word i) — inputs 128·gi + 32t + 8i … +8 — lives at
// slot 16·gi + 4i + t.
__device__ __forceinline__ int gemv_x_slot(int chunk) {
    const int gi = chunk / GEMV_CHUNKS_PER_GROUP, c = chunk % GEMV_CHUNKS_PER_GROUP;
    return gi * GEMV_CHUNKS_PER_GROUP + (c % 4) * 4 + c / 4;
}

// Copies x (K fp16, from global) into the block's shared x_smem in the permuted order.
// Every thread takes part; the caller syncs.
__device__ __forceinline__ void gemv_stage_x(uint4* x_smem, const __half* __restrict__ x, int K) {
    for (int chunk = threadIdx.x; chunk < K / 8; chunk += blockDim.x)
        x_smem[gemv_x_slot(chunk)] = ld_nc_v4(x + 8 * chunk);
}

// One batch of UNROLL (tile, group) items as one lane holds them.
template <int MT, int UNROLL>
struct GemvBatch {
    uint4 w[UNROLL][MT][2];  // words 4t … 4t+3 of the group, row g / row g+8, per matrix
    float s[UNROLL][MT][2];  // the rows' scales for the group
};

// Up to 3 matrices stacked along N (q, k, v); MT matrices per segment read together (gate, up).
template <int MT, int NSEG>
struct GemvProblem {
    const u32* qweight[NSEG][MT];     // [n, K/8] uint32 each
    const __half* scales[NSEG][MT];   // [n, K/128] fp16 each
    int n[NSEG];                      // rows of each segment
    int first_tile[NSEG + 1];         // tile index where each segment starts (prefix sums)
};

template <int MT, int NSEG>
__device__ __forceinline__ const u32* gemv_qweight(const GemvProblem<MT, NSEG>& p, int seg, int m) {
    if constexpr (NSEG == 1) return p.qweight[0][m];
    else return int4_pick(seg, p.qweight[0][m], p.qweight[1][m], p.qweight[NSEG - 1][m]);
}

template <int MT, int NSEG>
__device__ __forceinline__ const __half* gemv_scales(const GemvProblem<MT, NSEG>& p, int seg, int m) {
    if constexpr (NSEG == 1) return p.scales[0][m];
    else return int4_pick(seg, p.scales[0][m], p.scales[1][m], p.scales[NSEG - 1][m]);
}

template <int MT, int NSEG>
__device__ __forceinline__ int gemv_first_tile(const GemvProblem<MT, NSEG>& p, int seg) {
    if constexpr (NSEG == 1) return 0;
    else return int4_pick(seg, p.first_tile[0], p.first_tile[1], p.first_tile[NSEG - 1]);
}

template <int MT, int NSEG>
__device__ __forceinline__ int gemv_rows(const GemvProblem<MT, NSEG>& p, int seg) {
    if constexpr (NSEG == 1) return p.n[0];
    else return int4_pick(seg, p.n[0], p.n[1], p.n[NSEG - 1]);
}

// The weight layout, as gemv_int4_block reads it: the address of lane t's words 4t … 4t+3 of
// group gi in row r (0..15) of tile `tile` of a matrix, which is matrix row `row` (tile·16 + r,
// clamped to the matrix's last row). Layout id 1 (format/quant.py): qweight [n, K/8] uint32,
// row after row, so the 16 rows of a (tile, group) are 16 pieces of 64 bytes, K/2 bytes apart.
struct GemvRowMajor {
    __device__ static __forceinline__ const u32* quad(const u32* qweight, int tile, int r, u64 row,
                                                      int gi, int K, int t) {
        return qweight + 4 * t + gi * GEMV_WORDS_PER_GROUP + row * (K / 8);
    }
};

// The whole GEMV of one block: its tiles × all K, for MT matrices per tile, ending with the
// per-row sums of the block's warps in shared memory. Then calls
// epilogue(seg, row, sums[MT]) once per output row (row < n of its segment), from one thread.
// Layout: where a (tile, group)'s words lie (GemvRowMajor for every kernel here).
// Contains __syncthreads(): call from every thread of the block.
template <int MT, int NSEG, typename Layout = GemvRowMajor, typename Epilogue>
__device__ __forceinline__ void gemv_int4_block(const GemvProblem<MT, NSEG>& p,
                                                const __half* __restrict__ x, int K,
                                                Epilogue epilogue) {
    constexpr int UNROLL = GEMV_GROUP_UNROLL(MT);
    extern __shared__ uint4 x_smem[];  // [K/8] chunks of x (gemv_x_slot order), then partials
    float* partial = reinterpret_cast<float*>(x_smem + K / 8);  // [T_b][MT][W][16] fp32

    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    const int n_groups = K / INT4_GROUP;
    // This warp's contiguous, balanced share of the groups (non-empty: W ≤ K/128).
    const int gb = warp * n_groups / n_warps, ge = (warp + 1) * n_groups / n_warps;
    // This block's contiguous, balanced share of the tiles.
    const int n_tiles = p.first_tile[NSEG];
    const int tile_b = blockIdx.x * n_tiles / gridDim.x, tile_e = (blockIdx.x + 1) * n_tiles / gridDim.x;
    const u64 policy = l2_evict_first_policy();

    // Loads the next UNROLL items (tile, group) that exist, advancing (ld_tile, ld_gi).
    int ld_tile = tile_b, ld_gi = gb;
    auto load = [&](GemvBatch<MT, UNROLL>& b) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (ld_tile >= tile_e || gb >= ge) break;  // warp-uniform
            const int seg = int4_segment<NSEG>(p.first_tile, ld_tile);
            const int n = gemv_rows(p, seg);
            const int tile = ld_tile - gemv_first_tile(p, seg);  // within its matrix
            const int row0 = tile * INT4_TILE_ROWS;
            // Rows past n (last tile of a matrix) load the last row and are never stored.
            const u64 r0 = min(row0 + g, n - 1), r1 = min(row0 + g + 8, n - 1);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const __half* sc = gemv_scales(p, seg, m) + ld_gi;
                const u32* qw = gemv_qweight(p, seg, m);
                b.w[u][m][0] = ld_stream_v4(Layout::quad(qw, tile, g, r0, ld_gi, K, t), policy);
                b.w[u][m][1] = ld_stream_v4(Layout::quad(qw, tile, g + 8, r1, ld_gi, K, t), policy);
                b.s[u][m][0] = __half2float(__ldg(sc + r0 * n_groups));
                b.s[u][m][1] = __half2float(__ldg(sc + r1 * n_groups));
            }
            if (++ld_gi == ge) { ld_gi = gb; ++ld_tile; }
        }
    };

    // The first batch goes out before x is staged: its latency overlaps the staging.
    GemvBatch<MT, UNROLL> cur, next;
    load(cur);
    gemv_stage_x(x_smem, x, K);
    __syncthreads();

    float acc[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
    int c_tile = tile_b, c_gi = gb;
    while (c_tile < tile_e && gb < ge) {
        load(next);  // in flight while `cur` is multiplied
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (c_tile >= tile_e) break;  // warp-uniform: every lane takes the same branch
            const uint4* x_group = x_smem + c_gi * GEMV_CHUNKS_PER_GROUP + t;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    u32 a_lo[4], a_hi[4];  // rows g, g+8 × inputs 8i + 0..3 | 8i + 4..7
                    int4_a_fragments(cur.w[u][m][0], cur.w[u][m][1], i, a_lo, a_hi);
                    const uint4 xi = x_group[4 * i];  // x[128·gi + 32t + 8i … +8]
                    mma_m16n8k16_f32_f16(c, a_lo, xi.x, xi.y);
                    mma_m16n8k16_f32_f16(c, a_hi, xi.z, xi.w);
                }
                acc[m][0] = fmaf(cur.s[u][m][0], c[0], acc[m][0]);
                acc[m][1] = fmaf(cur.s[u][m][1], c[2], acc[m][1]);
            }
            if (++c_gi == ge) {  // the tile's last group: publish its row sums, start the next
                if (t == 0) {
                    float* dst = partial + (c_tile - tile_b) * MT * n_warps * INT4_TILE_ROWS;
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        dst[(m * n_warps + warp) * INT4_TILE_ROWS + g] = acc[m][0];
                        dst[(m * n_warps + warp) * INT4_TILE_ROWS + g + 8] = acc[m][1];
                    }
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
                c_gi = gb;
                ++c_tile;
            }
        }
        cur = next;
    }
    __syncthreads();

    // One thread per output row of the block: the W partials in warp order, then the epilogue.
    for (int o = threadIdx.x; o < (tile_e - tile_b) * INT4_TILE_ROWS; o += blockDim.x) {
        const int tl = o / INT4_TILE_ROWS, r = o % INT4_TILE_ROWS;
        const int tile = tile_b + tl;
        const int seg = int4_segment<NSEG>(p.first_tile, tile);
        const int row = (tile - gemv_first_tile(p, seg)) * INT4_TILE_ROWS + r;
        if (row >= gemv_rows(p, seg)) continue;
        float sums[MT];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const float* src = partial + ((tl * MT + m) * n_warps) * INT4_TILE_ROWS + r;
            float s = 0.f;
            for (int w = 0; w < n_warps; ++w) s += src[w * INT4_TILE_ROWS];
            sums[m] = s;
        }
        epilogue(seg, row, sums);
    }
}

// y = W x, FP16 out (rounded once from the FP32 sum).
// grid (G ≤ ceil(N/16)), block (32·W), dynamic smem (see the header).
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_f16(__half* __restrict__ y,             // [N] fp16, out
              const __half* __restrict__ x,       // [K] fp16
              const u32* __restrict__ qweight,    // [N, K/8] uint32, layout id 1
              const __half* __restrict__ scales,  // [N, K/128] fp16
              int N, int K) {
    const GemvProblem<1, 1> p = {{{qweight}}, {{scales}}, {N}, {0, int4_tiles(N)}};
    gemv_int4_block(p, x, K, [&](int, int row, const float (&sum)[1]) {
        y[row] = __float2half_rn(sum[0]);
    });
}

// [q; k; v] = [Wq; Wk; Wv] x in one launch, FP32 out (bias, RoPE and the FP16 rounding
// happen once, in rope_kv.cu): one launch instead of three, and the k/v tiles (32 each at 7B)
// share the wave with q's 224 instead of running in two under-filled waves of their own.
// grid (G ≤ ceil(Nq/16) + 2·ceil(Nkv/16)), block (32·W), dynamic smem (see the header).
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_qkv(float* __restrict__ qkv,             // [Nq + 2·Nkv] fp32, out: q | k | v
              const __half* __restrict__ x,        // [K] fp16 (normed hidden state)
              const u32* __restrict__ q_qweight,   // [Nq, K/8] uint32
              const __half* __restrict__ q_scales, // [Nq, K/128] fp16
              const u32* __restrict__ k_qweight,   // [Nkv, K/8] uint32
              const __half* __restrict__ k_scales, // [Nkv, K/128] fp16
              const u32* __restrict__ v_qweight,   // [Nkv, K/8] uint32
              const __half* __restrict__ v_scales, // [Nkv, K/128] fp16
              int Nq, int Nkv, int K) {
    const int tq = int4_tiles(Nq), tkv = int4_tiles(Nkv);
    const GemvProblem<1, 3> p = {{{q_qweight}, {k_qweight}, {v_qweight}},
                                 {{q_scales}, {k_scales}, {v_scales}},
                                 {Nq, Nkv, Nkv},
                                 {0, tq, tq + tkv, tq + 2 * tkv}};
    gemv_int4_block(p, x, K, [&](int seg, int row, const float (&sum)[1]) {
        qkv[(seg == 0 ? 0 : seg == 1 ? Nq : Nq + Nkv) + row] = sum[0];
    });
}

// residual += W x in FP32 (the residual stream is FP32: DESIGN.md §9). Each row is read and
// written by one thread of one block, so the read-modify-write needs no atomics.
// grid (G ≤ ceil(N/16)), block (32·W), dynamic smem (see the header).
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_residual(float* __restrict__ residual,      // [N] fp32, in/out
                   const __half* __restrict__ x,      // [K] fp16
                   const u32* __restrict__ qweight,   // [N, K/8] uint32
                   const __half* __restrict__ scales, // [N, K/128] fp16
                   int N, int K) {
    const GemvProblem<1, 1> p = {{{qweight}}, {{scales}}, {N}, {0, int4_tiles(N)}};
    gemv_int4_block(p, x, K, [&](int, int row, const float (&sum)[1]) {
        residual[row] += sum[0];
    });
}

// h = silu(Wg x) ⊙ (Wu x): each tile is the same 16 rows of gate_proj and up_proj, so the
// SwiGLU (swiglu_f16, in FP32) needs no extra launch and no FP16 round trip of g and u.
// grid (G ≤ ceil(F/16)), block (32·W), dynamic smem (see the header).
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_gate_up_swiglu(__half* __restrict__ h,                // [F] fp16, out
                         const __half* __restrict__ x,          // [K] fp16 (normed hidden)
                         const u32* __restrict__ gate_qweight,  // [F, K/8] uint32
                         const __half* __restrict__ gate_scales,// [F, K/128] fp16
                         const u32* __restrict__ up_qweight,    // [F, K/8] uint32
                         const __half* __restrict__ up_scales,  // [F, K/128] fp16
                         int F, int K) {
    const GemvProblem<2, 1> p = {{{gate_qweight, up_qweight}}, {{gate_scales, up_scales}},
                                 {F}, {0, int4_tiles(F)}};
    gemv_int4_block(p, x, K, [&](int, int row, const float (&sum)[2]) {
        h[row] = swiglu_f16(sum[0], sum[1]);
    });
}
