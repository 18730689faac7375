// kernels/dev/gemv_int4/v1_tile_major.cu — the decode GEMV, version 1: the production engine
// over a tile-major INT4 weight layout. Not a production kernel: tools/dev_kernels.py checks it
// against the float64 reference and times it beside kernels/gemv_int4.cu on the same weights
// (the runner stores them tile-major for this version).
//
//   gemv_int4_residual_tile_major        residual fp32[N] += W x              (o_proj, down_proj)
//   gemv_int4_gate_up_swiglu_tile_major  h fp16[F] = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual)
//
// What changes from the production kernels: only where a lane's words lie. Tile-major is
// qweight [N/16, K/128, 16 rows, 16 words] uint32 (N % 16 == 0): the 16 rows of one (tile,
// group) — the item one warp loads with two 16-byte loads per lane — are 1 KiB of contiguous
// memory, where layout id 1 ([N, K/8], format/quant.py) gives 16 pieces of 64 bytes, K/2 bytes
// apart. This file includes ../../gemv_int4.cu and runs its gemv_int4_block with another Layout
// (the one hook the engine has). Same work split, same bytes (the weights once, plus the scales
// and x or the residual); the limit is the same, HBM bandwidth.
// Why: fewer, longer DRAM bursts per warp might bring the GEMVs closer to the copy bandwidth.
// If it wins, it becomes a new layout id in format/quant.py (a new id, never a silent change of
// id 1).
//
// Measured (kernels/gemv_int4.cu's header, H200, 7B shapes, graph replay of 20 calls, with the
// register engine before the fusions and PDL, when both gate/up kernels still took x, not the
// residual; down's weights stayed in L2 across the replays, gate_up's did not):
//   | weights                                    | gate_up  | down     |
//   | layout id 1, persistent launch shape       | 24.5 µs  | 16.9 µs  |
//   | tile-major (this version)                  | 22.5 µs  | 15.3 µs  |
// gate_up at 22.5 µs was 3.12 TB/s (2.86 TB/s in layout id 1). With the fusions, PDL and W = 8
// the question is open again; the runner times both the way tools/bench_gemv.py does (PDL,
// weights rotated past L2).
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemv_int4 --versions v1
//
// Requirements: as ../../gemv_int4.cu, and N % 16 == 0.
#include "../../gemv_int4.cu"

// Tile-major: the (tile, group) item is 16 rows × 16 words, row r at word 16·r of it.
struct GemvTileMajor {
    __device__ static __forceinline__ const u32* quad(const u32* qweight, int tile, int r, u64 row,
                                                      int gi, int K, int t) {
        const u64 item = (u64)tile * (K / INT4_GROUP) + gi;  // (tile, group) items before this one
        return qweight + 4 * t + item * (INT4_TILE_ROWS * GEMV_WORDS_PER_GROUP) + r * GEMV_WORDS_PER_GROUP;
    }
};

// As gemv_int4_residual: same arguments, grid, block and smem.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_residual_tile_major(float* __restrict__ residual,      // [N] fp32, in/out
                              const __half* __restrict__ x,      // [K] fp16
                              const u32* __restrict__ qweight,   // [N/16, K/128, 16, 16] uint32
                              const __half* __restrict__ scales, // [N, K/128] fp16
                              int N, int K) {
    const GemvProblem<1, 1> p = {{{qweight}}, {{scales}}, {N}, {0, int4_tiles(N)}, {0}};
    gemv_int4_block<1, 1, GemvTileMajor>(p, K, BlockCoord::of_launch(), GridDep{}, GemvStageX{x}, [&](int, int tile, int g, const float (&s)[1][2]) {
        gemv_store_rows(tile, g, N, s[0], [&](int row, float v) { residual[row] += v; });
    });
}

// As gemv_int4_gate_up_swiglu: same arguments, grid, block and smem.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_gate_up_swiglu_tile_major(__half* __restrict__ h,                // [F] fp16, out
                                    const float* __restrict__ residual,    // [K] fp32, the residual stream
                                    const __half* __restrict__ norm_w,     // [K] fp16, post_attention_layernorm gain
                                    const u32* __restrict__ gate_qweight,  // [F/16, K/128, 16, 16] uint32
                                    const __half* __restrict__ gate_scales,// [F, K/128] fp16
                                    const u32* __restrict__ up_qweight,    // [F/16, K/128, 16, 16] uint32
                                    const __half* __restrict__ up_scales,  // [F, K/128] fp16
                                    int F, int K, float eps) {
    const GemvProblem<2, 1> p = {{{gate_qweight, up_qweight}}, {{gate_scales, up_scales}},
                                 {F}, {0, int4_tiles(F)}, {0}};
    gemv_int4_block<2, 1, GemvTileMajor>(p, K, BlockCoord::of_launch(), GridDep{}, GemvStageRmsNorm{residual, norm_w, eps},
                                         [&](int, int tile, int g, const float (&s)[2][2]) {
        const int lo = tile * INT4_TILE_ROWS + g;
        if (lo < F) h[lo] = swiglu_f16(s[0][0], s[1][0]);
        if (lo + 8 < F) h[lo + 8] = swiglu_f16(s[0][1], s[1][1]);
    });
}
