// kernels/dev/gemm_int4/v8_unpack_warps.cu — the prefill GEMM, version 8: production's file
// (../../gemm_int4.cu) built with GEMM_UNPACK_WG=2: the three warps of the producer warpgroup that
// production leaves idle unpack each stage's weights into an FP16 A tile in shared memory (warp
// tiles u, u + 3, u + 6 for warp u), and the two consumer warpgroups issue SS wgmma only. As
// v7_unpack_warpgroup.cu, in production's 384-thread block, so the 256-token build fits.
// Not a production kernel: tools/dev_kernels.py checks it against the float64 reference and times
// it beside kernels/gemm_int4.cu.
//
//   gemm_int4_f32, gemm_int4_qkv, gemm_int4_qkv_rope, gemm_int4_residual, gemm_int4_gate_up_swiglu:
//   production's, on this mainloop; the same arguments, the device layout.
//
// Cost against v7: three unpack warps instead of four (up to three warp tiles a warp a group);
// registers after setmaxnreg: consumers 184 / 160, the producer warpgroup 136 / 184 (256 /
// other tiles; 168 a thread at launch as production). Stages: 2 of 104 KB at 256 tokens, 3 of 72
// KB at 128, 4 of 56 KB at 64. Barriers and why they cannot race: ../../gemm_int4.cu, "The unpack
// warpgroup" (the unpack lanes: 96 here).
// Requirements: as ../../gemm_int4.cu.
#define GEMM_UNPACK_WG 2
#include "../../gemm_int4.cu"
