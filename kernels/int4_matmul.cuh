// kernels/int4_matmul.cuh — what the decode GEMV (gemv_int4.cu) and the prefill GEMM
// (gemm_int4.cu) share about INT4 weights (layout id 1, format/quant.py, stored tile-major on the
// GPU: below): 16-row weight tiles as the A operand of m16n8k16 MMAs, matrices stacked along N
// (q, k, v), and the SwiGLU epilogue of the fused gate/up projection.
//
//   INT4_GROUP, INT4_TILE_ROWS    the quantisation group along K and the rows of a weight tile
//   int4_tile_item                the tile-major device layout: where a (tile, group) item starts
//   int4_pair_tile / int4_head_dim_slot   the tile of a RoPE pair (head, dim) of q, k or v, and
//                                 the tile and slot of a head's dim
//   div_reciprocal / div_by       division by the head dim as one multiply-high
//   int4_plain_row / int4_pair_row    a row's words of group 0, plain or by its RoPE pair
//   int4_tiles / int4_segment / int4_pick   tiles of a matrix; which stacked matrix a tile is in
//   int4_a_fragments              one word of rows g and g+8 → the A fragments of two MMAs
//   gemv_tile_rows / gemv_store_rows   the rows behind MMA rows g and g+8 of a tile (RoPE-paired
//                                 or plain), for the GEMVs of every weight format (gemv_fmt.cu too)
//   swiglu_f16                    the gate/up epilogue: silu(gate) · up
//   swiglu_f16_approx             the same with __expf and __fdividef (the prefill GEMMs)
//
// Lane (g, t) = (lane / 4, lane % 4) holds words 4t … 4t+3 of a group (inputs 32t … 32t+31) of
// tile rows g and g+8, one 16-byte load each; word i (inputs 32t + 8i … +7) feeds two MMAs, whose
// k positions {2t, 2t+1 | 2t+8, 2t+9} take inputs +0..+3 and +4..+7 (ptx/mma.cuh: the k order
// inside an MMA is free as long as the B operand, x, uses the same one).
#pragma once
#include <cuda_fp16.h>

#include "types.cuh"        // u32, u64
#include "int4_unpack.cuh"  // unpack_int4x8

#define INT4_GROUP     128  // inputs per FP16 scale along K (quant.py GROUP_SIZE)
#define INT4_TILE_ROWS 16   // weight rows per tile = M of the m16n8k16 MMA

// Tiles of INT4_TILE_ROWS rows that cover n rows (the last one may be partial).
__device__ __forceinline__ int int4_tiles(int n) { return (n + INT4_TILE_ROWS - 1) / INT4_TILE_ROWS; }

// The device layout of INT4 weights (format/int4_tiles.py builds it on the host, kernels/
// weight_layout.cu on the GPU when a model is loaded): qweight uint32 [ceil(N/16), K/128, 16, 16]
// — for each 16-row tile and 128-input group one item of 16 rows × 16 words, 1 KiB contiguous,
// where layout id 1 as stored in the file ([N, K/8], row-major) gives 16 pieces of 64 B, K/2
// bytes apart. A warp of the decode GEMV loads one item per group with two 16-byte loads a
// lane, so each of its loads is 512 contiguous bytes, not 8 pieces of 64 B in 8 DRAM rows: the
// synthetic 7B's decode step takes 2.197 ms against 2.320 row-major (H100, graph ITL, medians
// of five rounds in turns; docs/bench/2026-12-05_033f04b_h100_syn7b_item_rows_*.json and
// …_194fb36_h100_syn7b_vs_item_rows_*.json). The rows of a tile are in the order of the MMA rows
// (gemv_tile_rows): plain (pair_dim 0: slot m is row 16·tile + m) for o_proj, gate, up and down,
// RoPE-paired (pair_dim = Dh: slots g and g + 8 are dims 8j + g and 8j + g + Dh/2 of a head) for
// q, k and v, so that an item's slots are the GEMV's MMA rows as loaded. Rows past N (a last
// partial tile, plain order only) are zeros. The scales stay row-major [N, K/128].
#define INT4_ITEM_WORDS (INT4_TILE_ROWS * INT4_GROUP / 8)  // 256 words = 1 KiB per (tile, group)

// The first word of item (tile, gi) of a tile-major matrix of K inputs.
__device__ __forceinline__ const u32* int4_tile_item(const u32* qweight, int tile, int gi, int K) {
    return qweight + ((u64)tile * (K / INT4_GROUP) + gi) * INT4_ITEM_WORDS;
}

// Division by a divisor fixed through a kernel (the head dim), where a loop divides every
// iteration: n / d = umulhi(n, r) with r = ⌈2³²/d⌉ = div_reciprocal(d), d ≥ 2 — one multiply-high
// where a division by a runtime value compiles to some 20 instructions. Exact for 0 ≤ n < 2³²/d:
// with n = qd + s (s < d) and e = r·d − 2³² (0 ≤ e < d), n·r/2³² = q + (s + n·e/2³²)/d, and
// n·e < n·d < 2³² keeps s + n·e/2³² below d, so the floor is q.
__device__ __forceinline__ u32 div_reciprocal(int d) { return 0xFFFFFFFFu / (u32)d + 1u; }
__device__ __forceinline__ int div_by(int n, u32 reciprocal) { return (int)__umulhi((u32)n, reciprocal); }

// The tile that holds RoPE pair (h, i) of a RoPE-paired matrix (dims i and i + Dh/2 of head h,
// i < Dh/2): h·Dh/16 + i/8, the pair's rows in its slots i % 8 and i % 8 + 8.
__device__ __forceinline__ int int4_pair_tile(int h, int i, int Dh) { return h * (Dh / INT4_TILE_ROWS) + i / 8; }

// The tile and slot (MMA row, 0..15) of dim d (< Dh) of head h in a RoPE-paired matrix: dim
// i < Dh/2 of the pair (h, i) in slot i % 8, dim i + Dh/2 in slot i % 8 + 8.
__device__ __forceinline__ void int4_head_dim_slot(int h, int d, int Dh, int& tile, int& slot) {
    const int half = Dh / 2, upper = d >= half, i = upper ? d - half : d;
    tile = int4_pair_tile(h, i, Dh);
    slot = i % 8 + (upper ? 8 : 0);
}

// The words of group 0 of row `row` of a plain-order matrix of `tiles` tiles, clamped into its
// last tile: slot row % 16 of tile row / 16. Rows r and r + 8 of a warp tile (r % 16 < 8) share
// one item, 8 slots (128 words) apart: one item address per warp tile. The GEMM's producer takes
// its 8 warp tiles' rows again every group, so this is a shift, a min and one multiply-add.
__device__ __forceinline__ const u32* int4_plain_row(const u32* qweight, int row, int tiles, int K) {
    return int4_tile_item(qweight, min(row / INT4_TILE_ROWS, tiles - 1), 0, K) + (row % INT4_TILE_ROWS) * (INT4_GROUP / 8);
}

// The words of group 0 of the first row of RoPE pair (h, i), dim i of head h: slot i % 8 of its
// tile; the second row, dim i + Dh/2, is slot i % 8 + 8 of the same item, 128 words on. From the
// pair, not the row, there is no division by the head dim: four a row (a row's head and dim,
// then its pair's) made the prefill QKV GEMM's producer loop 1292 SASS instructions a group
// instead of 172 (tools/sass_loops.py gemm_int4 --copies;
// docs/bench/2026-12-06_{dbffe69,d82f791}_cpu_sass_gemm_int4_bm128.json).
__device__ __forceinline__ const u32* int4_pair_row(const u32* qweight, int h, int i, int Dh, int K) {
    return int4_tile_item(qweight, int4_pair_tile(h, i, Dh), 0, K) + (i % 8) * (INT4_GROUP / 8);
}

// Which of NSEG stacked matrices holds tile `tile`, matrix s starting at tile first_tile[s]:
// by comparisons, not a search through a runtime-indexed array (that would live in local memory).
template <int NSEG>
__device__ __forceinline__ int int4_segment(const int (&first_tile)[NSEG + 1], int tile) {
    int seg = 0;
#pragma unroll
    for (int s = 1; s < NSEG; ++s) seg += tile >= first_tile[s];
    return seg;
}

// Runtime selection among the (≤ 3) stacked matrices by comparisons, for the same reason.
template <typename T>
__device__ __forceinline__ T int4_pick(int seg, T a0, T a1, T a2) {
    return seg == 0 ? a0 : seg == 1 ? a1 : a2;
}

// Word i of a lane's quad. i is a compile-time constant in every caller (unrolled loops), so
// this is a register choice, not a runtime index.
__device__ __forceinline__ u32 int4_word(const uint4& q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// Word i of the lane's quads of rows g (row_g) and g+8 (row_g8), unpacked to exact FP16 codes
// (ptx/int4_unpack.cuh), as the A fragments of the two MMAs over inputs 32t + 8i … +7:
// a_lo = inputs +0..+3, a_hi = inputs +4..+7. FIXUP = false hands over the lop3 halves before
// their fixups (unpack_int4x8_halves: not the codes; gemv_int4.cu's GEMV_PROBE_NO_FIXUP timing).
template <bool FIXUP = true>
__device__ __forceinline__ void int4_a_fragments(const uint4& row_g, const uint4& row_g8, int i,
                                                 u32 (&a_lo)[4], u32 (&a_hi)[4]) {
    u32 h0[4], h1[4];  // row g / row g+8: (k0,k1) (k2,k3) (k4,k5) (k6,k7)
    if constexpr (FIXUP) {
        unpack_int4x8(int4_word(row_g, i), h0);
        unpack_int4x8(int4_word(row_g8, i), h1);
    } else {
        unpack_int4x8_halves(int4_word(row_g, i), h0);
        unpack_int4x8_halves(int4_word(row_g8, i), h1);
    }
    a_lo[0] = h0[0]; a_lo[1] = h1[0]; a_lo[2] = h0[1]; a_lo[3] = h1[1];
    a_hi[0] = h0[2]; a_hi[1] = h1[2]; a_hi[2] = h0[3]; a_hi[3] = h1[3];
}

// The rows behind MMA rows g (lo) and g + 8 (hi) of tile `tile_in_seg` of a segment.
__device__ __forceinline__ void gemv_tile_rows(int tile_in_seg, int g, int rope_dim, int& lo, int& hi) {
    if (rope_dim > 0) {
        const int tiles_per_head = rope_dim / INT4_TILE_ROWS;
        const int head = tile_in_seg / tiles_per_head, j = tile_in_seg % tiles_per_head;
        lo = head * rope_dim + j * 8 + g;
        hi = lo + rope_dim / 2;
    } else {
        lo = tile_in_seg * INT4_TILE_ROWS + g;
        hi = lo + 8;
    }
}

// Plain row order: store `f(row, value)` for MMA rows g and g + 8 of a tile, rows < n only.
template <typename F>
__device__ __forceinline__ void gemv_store_rows(int tile_in_seg, int g, int n, const float (&v)[2], F f) {
    const int lo = tile_in_seg * INT4_TILE_ROWS + g;
    if (lo < n) f(lo, v[0]);
    if (lo + 8 < n) f(lo + 8, v[1]);
}

// silu(gate) · up, rounded once to FP16. silu(g) = g / (1 + e^-g) in FP32 with the accurate
// expf: F values per token cost nothing next to the 2·F·K weights they come from.
__device__ __forceinline__ __half swiglu_f16(float gate, float up) {
    const float silu = gate / (1.f + expf(-gate));
    return __float2half_rn(silu * up);
}

// silu(gate) · up for the prefill GEMMs' epilogues, with the approximate exponential and
// division (__expf: ex2.approx of gate·log2 e; __fdividef: rcp.approx and a multiply): a few
// FP32 ulp, far under the FP16 rounding of the result. The accurate forms above cost ~25
// instructions an element, a range check and a call to the slow division path among them
// (FCHK, CALL), and a 256-token tile's 64 elements a lane run after its MMAs, with the tensor
// cores idle. Below gate ≈ −87 both forms give −0 (silu's true value is under FP16's smallest
// subnormal there; the divisor ≥ 2¹²⁶ makes __fdividef's 0); a large positive gate gives gate
// (e^−gate → 0, the divisor 1); NaN for NaN.
__device__ __forceinline__ __half swiglu_f16_approx(float gate, float up) {
    const float silu = __fdividef(gate, 1.f + __expf(-gate));
    return __float2half_rn(silu * up);
}
