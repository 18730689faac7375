// ptx/ex2.cuh — the hardware's base-2 exponential, by name.
//
//   ex2_approx_ftz(x) : ex2.approx.ftz.f32 (PTX ISA, "Floating Point Instructions: ex2")
//
// What it does: 2^x on the SFU (MUFU.EX2), maximum relative error ~2^-22 over the normal range;
// 2^-inf = +0; results below the smallest normal float flush to +0 (.ftz).
//
// Why: exp2f() without --use_fast_math (drvqwen compiles without it: RoPE needs the exact sin
// and cos) compiles to a range check, a scale into the normal range and back around the same
// MUFU.EX2 — a compare and two multiplies an element, in the softmax loops that run once per
// score. A softmax weight below 2^-126 is zero to the FP16 P it becomes (FP16's smallest
// subnormal is 2^-24) and to the FP32 sums it joins, so the flush changes nothing there.
#pragma once

__device__ __forceinline__ float ex2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
