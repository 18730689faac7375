// ptx/types.cuh — fixed-width integer names and FP32 constants for kernels compiled by NVRTC.
//
// NVRTC cannot include <cstdint> (no C++ standard library), so the kernels use these names.
// Sizes are the CUDA data model's (LP64 on every supported host): int 32 bits, long long 64.
#pragma once

typedef unsigned int       u32;
typedef int                i32;
typedef unsigned long long u64;
typedef long long          i64;

static_assert(sizeof(u32) == 4 && sizeof(u64) == 8, "drvqwen kernels assume LP64 CUDA types");

// Width of one warp. A named constant, not 32 scattered through the kernels.
#define WARP_SIZE 32
// Threads that share one m16n8k16 MMA row group ("quad": lanes 4g .. 4g+3).
#define QUAD_SIZE 4

// IEEE constants (NVRTC has no <math.h>, hence no INFINITY/NAN macros).
#define F32_NEG_INF (__int_as_float(0xff800000))
#define F32_NAN     (__int_as_float(0x7fffffff))
// log2(e) in FP32. The softmax kernels fold it into the score scale once, so that e^x becomes
// exp2f of a log2-unit score: the hardware's native exponential, no multiply per element.
#define F32_LOG2E   1.4426950408889634f
