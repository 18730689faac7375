// ptx/ldmatrix.cuh — warp-collective loads of 8×8 FP16 tiles from shared memory into MMA fragments.
//
//   ldmatrix_x4        : ldmatrix.sync.aligned.m8n8.x4.shared.b16
//   ldmatrix_x4_trans  : ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16
//                        (PTX ISA, "Warp-level matrix load instruction: ldmatrix")
//
// Four 8×8 matrices of 16-bit elements per instruction. Lane i supplies the shared address of
// row i % 8 of matrix i / 8 (each row 16 contiguous bytes, 16-byte aligned); lane (g, t) =
// (lane / 4, lane % 4) receives, in register r[m], of matrix m:
//   without .trans : row g, columns 2t, 2t+1           (the A/B fragment of an MMA when the
//                                                      8×8 tile is stored k-contiguous)
//   with .trans    : rows 2t, 2t+1 of column g         (the same fragment from a tile stored
//                                                      the other way round)
// The attention_prefill kernel uses the plain form for K (stored [token][dim], and QKᵀ wants
// B[k = dim][n = token] = K[token][dim]: dims contiguous) and the .trans form for V (P·V wants
// B[k = token][n = dim], pairs of *tokens* for one dim, but V is stored [token][dim]).
//
// Rows are read as 16-byte units: eight rows at a stride that is an odd multiple of 16 bytes
// modulo 128 hit eight different bank groups, so padded tiles (row stride Dh·2 + 16) are
// conflict-free.
#pragma once
#include "types.cuh"

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* row_addr) {
    const u32 a = static_cast<u32>(__cvta_generic_to_shared(row_addr));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* row_addr) {
    const u32 a = static_cast<u32>(__cvta_generic_to_shared(row_addr));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
