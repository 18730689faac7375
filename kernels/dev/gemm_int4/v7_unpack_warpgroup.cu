// kernels/dev/gemm_int4/v7_unpack_warpgroup.cu — the prefill GEMM, version 7: production's file
// (../../gemm_int4.cu) built with GEMM_UNPACK_WG=1, a fourth warpgroup that unpacks each stage's
// weights into an FP16 A tile in shared memory, so the two consumer warpgroups issue SS wgmma
// only. Not a production kernel: tools/dev_kernels.py checks it against the float64 reference
// and times it beside kernels/gemm_int4.cu.
//
//   gemm_int4_f32, gemm_int4_qkv, gemm_int4_residual, gemm_int4_gate_up_swiglu (and the file's
//   other kernels): production's, on this mainloop; the same arguments, the device layout.
//
// Why: in production the consumer warpgroups unpack their own A fragments, one warpgroup's
// unpack under the other's MMAs ("MMA turns"); where the unpack of a group takes longer than the
// other's MMAs — the 128-token tiles (o_proj of the 7B, half the MMA work a group of the 256-token
// tiles) and the GGUF formats, whose unpack is longer — the tensor pipe waits (Nsight Compute:
// 46 % busy in o_proj, 59 % in the Q5_K gate_up, 72 % in INT4's). Here the unpack runs on warps
// of its own, up to the ring's depth ahead of the MMAs.
// Cost: 32 KB a stage for the A tile (3 stages of 72 KB at 128 tokens, 4 of 56 KB at 64, against
// production's 4 and 4), 512 threads (128 registers a thread at launch: consumers 152, producer
// 88, unpack 120 after setmaxnreg), and the A tile's stores and SS reads through shared memory.
// Built at 128 and 64 tokens a tile only: a 256-token consumer's 128 accumulators do not compile
// in the 128 registers a thread of 512 starts with (ptxas C7602 at the m64n256k16 wgmma). Work split, barriers and why they
// cannot race: ../../gemm_int4.cu, "The unpack warpgroup".
// Requirements: as ../../gemm_int4.cu.
#define GEMM_UNPACK_WG 1
#include "../../gemm_int4.cu"
