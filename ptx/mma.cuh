// ptx/mma.cuh — the warp-level tensor-core MMA used by the GEMV and attention kernels.
//
//   mma_m16n8k16_f32_f16 : mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
//                          (PTX ISA, "Warp Level Matrix Multiply-Accumulate
//                          Instructions": "Matrix Fragments for mma.m16n8k16 with floating
//                          point type")
//
// D[16x8] = A[16x16] · B[16x8] + C, FP16 inputs, FP32 accumulate. Products of two FP16
// numbers are exact in FP32 and the sum is kept in FP32, which is why the GEMVs use it even
// at batch 1 (7/8 of the tensor work is thrown away; at ~1000 dense FP16 TFLOP/s the tensor
// cores are nowhere near the limit, HBM is): half2 FMA chains round every product and partial
// sum to FP16 and cost ~1e-3 relative error over a 3584-long dot product.
//
// Fragment layout (lane = 4·g + t, g = groupID 0..7, t = threadID_in_group 0..3):
//   a[0] = A[g   ][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]
//   a[2] = A[g   ][2t+8, 2t+9] a[3] = A[g+8][2t+8, 2t+9]   (each a half2, low half = lower k)
//   b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   c[0], c[1] = C[g][2t], C[g][2t+1]      c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
//
// The k index is only summed over, so any permutation of the 16 k positions gives the same
// result as long as A and B use the same one. The kernels exploit that: lane (g, t) always
// supplies the k positions {2t, 2t+1, 2t+8, 2t+9}, and each kernel maps them to whichever
// 4 physical inputs that lane already has in registers from one 16-byte load.
#pragma once
#include "types.cuh"

__device__ __forceinline__ void mma_m16n8k16_f32_f16(float (&c)[4], const u32 (&a)[4],
                                                     u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
