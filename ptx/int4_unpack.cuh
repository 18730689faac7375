// ptx/int4_unpack.cuh — INT4 (layout id 1) → FP16 without per-element shifts or conversions.
//
//   lop3_and_or      : lop3.b32 d, a, b, c, 0xEA  computes (a & b) | c  (PTX ISA, "Logic and Shift Instructions: lop3")
//   unpack_int4x8    : one 32-bit word of 8 nibbles → 4 half2 of exact integers in [-8, 7]
//                      (PTX ISA, "Half Precision Floating-Point
//                      Instructions: sub", "…: fma")
//
// The layout (src/drvqwen/format/quant.py, "Layout id 1"): word j of a row holds inputs
// k = 8j … 8j+7; nibble p (bits 4p … 4p+3) holds input 8j + NIBBLE_ORDER[p] as q + 8, with
// NIBBLE_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]. So the two 16-bit halves of the word carry the
// pairs (nibble p, nibble p+4) = inputs (2i, 2i+1) in the same bit position of each half.
//
// The FP16 magic number: 0x6400 is 1024.0, whose 10 mantissa bits weigh exactly 1 each. OR-ing
// a nibble v into bits 0–3 gives the half 1024 + v; into bits 4–7 gives 1024 + 16v. Both are
// exact, so one lop3 per pair of inputs does the "shift and convert" for two values at once:
//
//   lo  = (w      & 0x000F000F) | 0x64006400  → (1024 + v0, 1024 + v1)   inputs 0, 1
//   hi  = (w      & 0x00F000F0) | 0x64006400  → (1024 + 16 v2, 1024 + 16 v3)   inputs 2, 3
//   lo' = (w >> 8 & 0x000F000F) | 0x64006400  → inputs 4, 5
//   hi' = (w >> 8 & 0x00F000F0) | 0x64006400  → inputs 6, 7
//
// and then q = lo - (1024 + 8) (one sub.f16x2) or q = hi * (1/16) - (64 + 8) (one fma.f16x2).
// Every step is exact in FP16 (all values are integers below 2048), so the unpacked weights
// are the exact codes q ∈ [-8, 7]; the group scale is applied later, in FP32.
// Cost: 1 shift + 4 lop3 + 4 f16x2 ops for 8 weights.
#pragma once
#include "types.cuh"

// (a & b) | c. immLut: with a = 0xF0, b = 0xCC, c = 0xAA, (0xF0 & 0xCC) | 0xAA = 0xEA.
__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

#define INT4_MASK_LO    0x000F000Fu  // nibble 0 of each 16-bit half
#define INT4_MASK_HI    0x00F000F0u  // nibble 1 of each 16-bit half
#define FP16X2_1024     0x64006400u  // (1024.0, 1024.0)
#define FP16X2_1032     0x64086408u  // (1024 + 8, 1024 + 8): magic + the stored +8 offset
#define FP16X2_1_16     0x2C002C00u  // (1/16, 1/16)
#define FP16X2_NEG_72   0xD480D480u  // (-(64 + 8), -(64 + 8)): 1024/16 + the +8 offset

// One word of layout id 1 → four half2 (as raw u32 registers, ready to be MMA operands):
//   out[0] = (k+0, k+1), out[1] = (k+2, k+3), out[2] = (k+4, k+5), out[3] = (k+6, k+7),
// low half first, each the exact code q = nibble - 8.
// The first step alone: the four lop3 halves (1024 + v0, 1024 + v1), (1024 + 16 v2, …), … in
// unpack_int4x8's output order, before their f16x2 fixups.
__device__ __forceinline__ void unpack_int4x8_halves(u32 w, u32 (&h)[4]) {
    const u32 w8 = w >> 8;
    h[0] = lop3_and_or(w,  INT4_MASK_LO, FP16X2_1024);
    h[1] = lop3_and_or(w,  INT4_MASK_HI, FP16X2_1024);
    h[2] = lop3_and_or(w8, INT4_MASK_LO, FP16X2_1024);
    h[3] = lop3_and_or(w8, INT4_MASK_HI, FP16X2_1024);
}

__device__ __forceinline__ void unpack_int4x8(u32 w, u32 (&out)[4]) {
    u32 h[4];
    unpack_int4x8_halves(w, h);
    asm("sub.f16x2 %0, %1, %2;" : "=r"(out[0]) : "r"(h[0]), "r"(FP16X2_1032));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out[1]) : "r"(h[1]), "r"(FP16X2_1_16), "r"(FP16X2_NEG_72));
    asm("sub.f16x2 %0, %1, %2;" : "=r"(out[2]) : "r"(h[2]), "r"(FP16X2_1032));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out[3]) : "r"(h[3]), "r"(FP16X2_1_16), "r"(FP16X2_NEG_72));
}
