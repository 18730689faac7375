// ptx/ldst.cuh — global loads with explicit cache behaviour.
//
//   l2_evict_first_policy  : createpolicy.fractional.L2::evict_first.b64 (PTX ISA, "Data Movement
//                            and Conversion Instructions: createpolicy")
//   l2_evict_normal_policy : createpolicy.fractional.L2::evict_normal.b64
//   ld_stream_v4           : ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32
//                            (PTX ISA, "Data Movement and
//                            Conversion Instructions: ld.global.nc"; the .L2::cache_hint
//                            and .L2::256B qualifiers: "… : ld")
//   ld_nc_v4 / _v2 / _u32  : ld.global.nc.v4.u32 … — read-only data, cached in L1
//
// Weights are read exactly once per decode step (3.4 GB of INT4 + 1.1 GB of lm_head at the
// 7B shape, against a 60 MB L2), so caching them can only hurt:
//   - L1::no_allocate: don't evict the activation vector x (read by every warp of the block,
//     and by every block on the SM) from L1 to make room for bytes that are never re-read;
//   - L2 evict_first policy: when a weight line must leave L2, it goes before the KV cache
//     and activations that the next kernels will read again;
//   - L2::256B prefetch size: a warp's 16-byte loads walk each weight row front to back, so
//     asking L2 to fetch 256 B around each miss turns the row into full DRAM bursts.
// `.nc` (the non-coherent read-only path) is legal because no kernel writes the weights, and
// for activations because they were written by an earlier kernel launch, never by this one.
//
// The asm statements are not `volatile` and have no memory clobber: they are pure functions
// of their address, which lets the compiler hoist them early and batch them — exactly what a
// bandwidth-bound loop wants.
#pragma once
#include "types.cuh"

// An L2 cache policy that marks every line it touches evict-first. Created once per thread
// (a register), passed to every streaming load.
__device__ __forceinline__ u64 l2_evict_first_policy() {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// The same with the default (evict-normal) priority, for weights that other blocks read again
// soon: the prefill GEMMs' tiles of one weight row block run at once for every token block.
__device__ __forceinline__ u64 l2_evict_normal_policy() {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// Compile-time switches of the streaming load, for measurement (tools/bench_gemv.py
// --int4-defines, drvqwen bench --persistent-define): LD_STREAM_PREFETCH the L2 prefetch size
// (256 B, 128 B, or 0: none), LD_STREAM_EVICT_FIRST 0 drops the cache hint (the policy argument
// is then unused: evict-normal lines). The defaults are the qualifiers above.
#ifndef LD_STREAM_PREFETCH
#define LD_STREAM_PREFETCH 0
#endif
#ifndef LD_STREAM_EVICT_FIRST
#define LD_STREAM_EVICT_FIRST 1
#endif
#if LD_STREAM_PREFETCH == 256
#define LD_STREAM_SIZE ".L2::256B"
#elif LD_STREAM_PREFETCH == 128
#define LD_STREAM_SIZE ".L2::128B"
#elif LD_STREAM_PREFETCH == 0
#define LD_STREAM_SIZE ""
#else
#error "LD_STREAM_PREFETCH: 256, 128 or 0"
#endif

// 16 bytes of streaming (read-once) data: weights.
__device__ __forceinline__ uint4 ld_stream_v4(const void* ptr, u64 policy) {
    uint4 v;
#if LD_STREAM_EVICT_FIRST
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint" LD_STREAM_SIZE ".v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(ptr), "l"(policy));
#else
    (void)policy;
    asm("ld.global.nc.L1::no_allocate" LD_STREAM_SIZE ".v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(ptr));
#endif
    return v;
}

// 16 / 8 / 4 bytes of read-only data that is re-read (activations, KV pages within a block):
// the default caching, L1 included.
__device__ __forceinline__ uint4 ld_nc_v4(const void* ptr) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

__device__ __forceinline__ uint2 ld_nc_v2(const void* ptr) {
    uint2 v;
    asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
    return v;
}

__device__ __forceinline__ u32 ld_nc_u32(const void* ptr) {
    u32 v;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(ptr));
    return v;
}

// 16 bytes read once, not worth keeping in L1, but that other kernels read again soon (KV
// cache pages: read by this step's attention, again by the next step's): L1::no_allocate only.
__device__ __forceinline__ uint4 ld_nc_noalloc_v4(const void* ptr) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

__device__ __forceinline__ uint2 ld_nc_noalloc_v2(const void* ptr) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
    return v;
}

__device__ __forceinline__ u32 ld_nc_noalloc_u32(const void* ptr) {
    u32 v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(ptr));
    return v;
}
