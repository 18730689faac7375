// ptx/ldst.cuh — global loads with explicit cache behaviour.
//
//   l2_evict_first_policy  : createpolicy.fractional.L2::evict_first.b64 (PTX ISA, "Data Movement
//                            and Conversion Instructions: createpolicy")
//   l2_evict_normal_policy : createpolicy.fractional.L2::evict_normal.b64
//   ld_stream_v4           : ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32
//                            (PTX ISA, "Data Movement and
//                            Conversion Instructions: ld.global.nc"; the .L2::cache_hint
//                            and .L2::256B qualifiers: "… : ld")
//   ld_nc_v4 / _v2 / _u32  : ld.global.nc.v4.u32 … — read-only data, cached in L1
//
// Weights are read exactly once per decode step (3.4 GB of INT4 + 1.1 GB of lm_head at the
// 7B shape, against a 50–60 MB L2), so caching them can only hurt:
//   - L1::no_allocate: don't evict the activation vector x (read by every warp of the block,
//     and by every block on the SM) from L1 to make room for bytes that are never re-read;
//   - L2 evict_first policy: when a weight line must leave L2, it goes before the KV cache
//     and activations that the next kernels will read again;
//   - no L2 prefetch size (.L2::256B, .L2::128B): each load brings in its own sectors only.
//     With .L2::256B the 256 bytes around a miss come in as evict-first lines, but a GEMV warp
//     reads 64 B of a row per group over a K range of 3 or 4 groups (gate_up, qkv) that need
//     not fill one 256-byte block: the rest is another warp's, or this warp's next batch. Once
//     L2 is full — always, inside a decode step; never in a GEMV timed after a cache flush —
//     those lines are evicted before they are read, and read again. Measured on an H100 (Nsight
//     Compute, docs/bench/2026-12-05_7ac45fc_h100_persistent_dram_probes.json): with it the
//     persistent 7B step reads 4.14 GB from DRAM for 3.37 GB of weights, gate_up 0.64 GB of
//     the excess, and the per-launch step's gate_up without flushes 114.6 MB a launch for
//     70.0, down_proj 47.1 for 35.0; without it the persistent step reads 3.366 GB
//     (…_ea6f914_h100_persistent_ld_stream_ncu.json). Graph ITL of the synthetic 7B (drvqwen
//     bench --preset 7b --mode graph --new-tokens 64, in turns on one machine): per launch
//     2.410 / 2.357 ms without against 2.623 / 2.629 with (…_963214d_h100_syn7b_ld_stream_no_prefetch_{1,2}.json,
//     …_ea6f914_h100_syn7b_ld_stream_base_{1,2}.json), the persistent step 2.644 against
//     2.819; keeping .L2::256B and dropping the evict-first hint instead changes nothing (2.615
//     / 2.615 ms, 4.14 GB; …_evict_normal_{1,2}.json, the copy's default edited). Timed alone
//     with its weights rotated past L2 (tools/bench_gemv.py --pdl,
//     …_ea6f914_h100_gemv_int4_ld_stream.json) a GEMV hardly shows it: gate_up 29.09 µs
//     against 30.64, the others within ±1 %. The 128-byte size, fastest for gate_up alone there
//     (28.64 µs), loses in the step too: 2.454 / 2.451 ms against 2.364 / 2.354 without, the
//     persistent step 2.707 / 2.672 against 2.642 / 2.621 (in turns, one H100;
//     …_194fb36_h100_l2pf_{pl,ps}_{ld128,base}_*.json).
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
// (256 B, 128 B, or 0: none, the default), LD_STREAM_EVICT_FIRST 0 drops the cache hint (the
// policy argument is then unused: evict-normal lines). The defaults are the qualifiers above.
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
