// ptx/warp.cuh — warp shuffles and the butterfly reductions built on them.
//
//   shfl_xor_f32 / shfl_xor_i32 : shfl.sync.bfly.b32 (PTX ISA, "Data Movement and Conversion Instructions: shfl.sync")
//   warp_sum / warp_max          : 5-step butterfly over all 32 lanes
//   quad_sum / quad_max          : 2-step butterfly over the 4 lanes of an MMA row group
//
// Why a butterfly (xor) and not a tree to lane 0: after log2(n) steps every lane holds the
// result, so no broadcast is needed, and the order of the additions is fixed by the lane
// pattern alone. That makes every reduction in drvqwen bit-reproducible run to run: no
// atomics, no order that depends on timing.
#pragma once
#include "types.cuh"

// Full-warp member mask: every shuffle here is executed by all 32 lanes (the kernels never
// call them inside lane-divergent branches).
#define FULL_WARP_MASK 0xffffffffu

// shfl.sync.bfly.b32 d, a, laneMask, clamp, membermask: read register `a` of lane
// (lane ^ laneMask). clamp = 0x1f: the whole warp is one segment.
__device__ __forceinline__ float shfl_xor_f32(float v, int lane_mask) {
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, %3;"
                 : "=f"(r) : "f"(v), "r"(lane_mask), "r"(FULL_WARP_MASK));
    return r;
}

__device__ __forceinline__ int shfl_xor_i32(int v, int lane_mask) {
    int r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, %3;"
                 : "=r"(r) : "r"(v), "r"(lane_mask), "r"(FULL_WARP_MASK));
    return r;
}

// Sum over all 32 lanes; every lane gets the same bits.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) v += shfl_xor_f32(v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) v = fmaxf(v, shfl_xor_f32(v, m));
    return v;
}

// Sum / max over the 4 lanes 4g .. 4g+3 that share row g of an MMA accumulator.
__device__ __forceinline__ float quad_sum(float v) {
    v += shfl_xor_f32(v, 1);
    v += shfl_xor_f32(v, 2);
    return v;
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, shfl_xor_f32(v, 1));
    v = fmaxf(v, shfl_xor_f32(v, 2));
    return v;
}

// Greedy-argmax order: a larger value wins; among equal values the lower index wins; any
// number beats a NaN, and between two NaNs the lower index wins. That is a strict total order
// on (value, index), which a butterfly needs so that every lane ends with the same answer
// whatever the order in which candidates meet. Returns true when (v, i) should replace
// (best_v, best_i).
__device__ __forceinline__ bool argmax_better(float v, int i, float best_v, int best_i) {
    const bool v_nan = v != v, best_nan = best_v != best_v;
    if (v_nan != best_nan) return best_nan;
    if (v_nan) return i < best_i;
    return v > best_v || (v == best_v && i < best_i);
}

// Warp argmax by butterfly: every lane ends with the same (value, index).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
        float ov = shfl_xor_f32(v, m);
        int oi = shfl_xor_i32(i, m);
        if (argmax_better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}
