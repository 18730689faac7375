// kernels/dev/gemv_int4/v3_flat_split.cu — the decode GEMV, version 3: the block's (tile, group)
// items shared among its warps as one flat sequence (GEMV_FLAT_SPLIT=1, ../../gemv_int4.cu)
// instead of each warp taking the same range of K groups in every tile. Not a production kernel:
// tools/dev_kernels.py checks it against the float64 reference and times it beside
// kernels/gemv_int4.cu.
//
//   gemv_int4_qkv_rope_flat, gemv_int4_residual_flat, gemv_int4_gate_up_swiglu_flat: the
//   production kernels of the same names without _flat, on the flat split.
//
// Why: at the 7B's K = 3584 a row has 28 groups, and 8 warps split them 4, 3, 4, 3, …: per tile
// half the warps have one item more, and the block's reduction waits for them — gate_up's 5
// tiles a block are 20 items for four warps and 15 for the other four, so for a quarter of the
// loop half the warps are idle and half the loads are not in flight. Flat, each warp has 17 or
// 18 of the 140; qkv_rope's 2 tiles a block, 8 against 7. A block of one tile (the 7B's o_proj and
// down_proj, 224 blocks of one) splits its groups as production does: same ranges, same bits,
// no gain. W = 7 warps, which
// splits 28 groups evenly, measured slower than W = 8 (docs/kernels.md, "Launch shape"): the
// loss was the warps, not the balance.
// Cost: a warp whose range begins or ends inside a tile publishes that tile's sums too (one
// more partial store at most a warp and tile end), and writes zeros into the slots of the tiles
// it does not reach; ptxas: 122–128 registers, no spills, main loops 0–9 % longer than production's
// instruction count (the range counter and its end test; tools/sass_loops.py). The sums are added in another grouping than
// production's, so the bits differ within the tests' bounds.
// Measured (tools/dev_kernels.py gemv_int4 --versions v3, H200, 7B shapes, µs; production in the
// same run; docs/bench/2026-12-05_e6b8a90_h200_dev_gemv_int4_v3.json):
//   | version    | qkv_rope | o_proj | gate_up | down  |
//   | production |   8.34   |  4.50  |  22.61  | 14.15 |
//   | this one   |   8.67   |  4.83  |  23.33  | 15.03 |
// Slower everywhere, o_proj and down too, where the ranges are production's: the cost is the
// range counter and the loop's longer body, and the balance at gate_up and qkv_rope does not
// win it back.
// Only the single-token kernels: the T-token ones spill at this setting (ptxas: 8–28 bytes). They
// repeat production's three wrappers under their own names on purpose (the runner's versions are
// kernels of their own names, compiled from this file); the engine is production's.
// Requirements: as ../../gemv_int4.cu.
#define GEMV_FLAT_SPLIT 1
#define DEVICE_FUNCTIONS_ONLY  // production's kernels are not built here; its items are
#include "../../gemv_int4.cu"

extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_qkv_rope_flat(__half* __restrict__ q_out, __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                        const float* __restrict__ residual, const __half* __restrict__ norm_w,
                        const u32* __restrict__ q_qweight, const __half* __restrict__ q_scales,
                        const u32* __restrict__ k_qweight, const __half* __restrict__ k_scales,
                        const u32* __restrict__ v_qweight, const __half* __restrict__ v_scales,
                        const __half* __restrict__ q_bias, const __half* __restrict__ k_bias,
                        const __half* __restrict__ v_bias, const float* __restrict__ inv_freq,
                        const int* __restrict__ state, const int* __restrict__ block_table,
                        int Hq, int Hkv, int Dh, int K, float eps) {  // GemvInt4QkvRopeArgs says what each is
    gemv_int4_qkv_rope_item(GemvInt4QkvRopeArgs{q_out, k_cache, v_cache, residual, norm_w, q_qweight, q_scales,
                                                k_qweight, k_scales, v_qweight, v_scales, q_bias, k_bias, v_bias,
                                                inv_freq, state, block_table, Hq, Hkv, Dh, K, eps},
                            BlockCoord::of_launch(), GridDep{});
}

extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_residual_flat(float* __restrict__ residual, const __half* __restrict__ x, const u32* __restrict__ qweight,
                        const __half* __restrict__ scales, int N, int K) {  // GemvInt4ResidualArgs says what each is
    gemv_int4_residual_item(GemvInt4ResidualArgs{residual, x, qweight, scales, N, K}, BlockCoord::of_launch(),
                            GridDep{});
}

extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_gate_up_swiglu_flat(__half* __restrict__ h, const float* __restrict__ residual,
                              const __half* __restrict__ norm_w, const u32* __restrict__ gate_qweight,
                              const __half* __restrict__ gate_scales, const u32* __restrict__ up_qweight,
                              const __half* __restrict__ up_scales, int F, int K, float eps) {  // …Args says what each is
    gemv_int4_gate_up_swiglu_item(GemvInt4GateUpSwigluArgs{h, residual, norm_w, gate_qweight, gate_scales, up_qweight,
                                                           up_scales, F, K, eps},
                                  BlockCoord::of_launch(), GridDep{});
}
