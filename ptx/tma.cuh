// ptx/tma.cuh — the Tensor Memory Accelerator (sm_90): tensor-map copies global → shared.
//
//   CUtensorMap          : the 128-byte, 64-byte-aligned descriptor (cuda.h's CUtensorMap;
//                          NVRTC cannot include <cuda.h>, so its shape is declared here)
//   tma_prefetch_map     : prefetch.tensormap [map]
//                          (PTX ISA, "Data Movement and Conversion Instructions: prefetch, prefetchu")
//   tma_load_2d          : cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes
//                          [dst], [map, {c0, c1}], [bar]
//                          ("Data Movement and Conversion Instructions: cp.async.bulk.tensor")
//   bulk_copy_g2s        : cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes
//                          .L2::cache_hint [dst], [src], size, [bar], policy
//                          ("Data Movement and Conversion Instructions: cp.async.bulk")
//   bulk_prefetch_l2     : cp.async.bulk.prefetch.L2.global [src], size
//                          ("Data Movement and Conversion Instructions: cp.async.bulk.prefetch")
//
// Why TMA: one thread describes a whole box (here a 16 × Dh page of one KV head, 2–4 KiB) and
// the copy engine moves it into shared memory while the thread goes on; no registers hold the
// bytes in flight and no address arithmetic runs per element. A single producer warp can then
// keep several stages of several consumer warps in flight — the bytes in flight that HBM
// latency × bandwidth demands — which a warp loading into its own registers cannot.
//
// Completion: the copy carries .mbarrier::complete_tx::bytes, so when its bytes have landed the
// TMA unit decrements the named mbarrier's transaction count by the bytes delivered (a full
// box always, even where the data is NaN: masking is the consumer's job). The producer announces
// the count first with mbarrier_arrive_expect_tx (ptx/mbarrier.cuh).
//
// The descriptor is a kernel parameter (`const __grid_constant__ CUtensorMap`): encoded once
// in Python (cuTensorMapEncodeTiled, src/drvqwen/cuda/tensormap.py) and passed by value, so it
// lives in the constant/param space; its generic address is what the instructions take.
// .shared::cluster with a CTA-local address is the form sm_90 provides for a non-cluster
// launch (a CTA is a cluster of one).
#pragma once
#include "types.cuh"

// cuda.h: typedef struct CUtensorMap_st { alignas(64) cuuint64_t opaque[16]; } CUtensorMap;
struct __align__(64) CUtensorMap {
    u64 opaque[16];
};
static_assert(sizeof(CUtensorMap) == 128, "CUtensorMap is 128 bytes (CU_TENSOR_MAP_NUM_QWORDS = 16)");

// Bring the descriptor into the TMA unit's cache before the first copy uses it (it would be
// fetched on first use otherwise, adding a dependent memory round trip to the first stage).
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<u64>(map)) : "memory");
}

// Copy the box at element coordinates (c0 = innermost, c1 = row) of `map` into shared memory
// at `dst` (128-byte aligned), completing `box bytes` transactions on `bar`. Issued by one
// thread; asynchronous.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1, u64* bar) {
    const u32 dst_smem = static_cast<u32>(__cvta_generic_to_shared(dst));
    const u32 bar_smem = static_cast<u32>(__cvta_generic_to_shared(bar));
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n"
        :: "r"(dst_smem), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar_smem)
        : "memory");
}


// Copy `bytes` contiguous bytes (a multiple of 16; src and dst 16-byte aligned) from global `src`
// to shared `dst`, completing `bytes` transactions on `bar`, with an L2 cache policy
// (l2_evict_first_policy for read-once data). The 1-D form of the TMA copy: no tensor map, for
// data already contiguous in memory. Issued by one thread; asynchronous.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
    const u32 dst_smem = static_cast<u32>(__cvta_generic_to_shared(dst));
    const u32 bar_smem = static_cast<u32>(__cvta_generic_to_shared(bar));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1], %2, [%3], %4;\n"
        :: "r"(dst_smem), "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(bar_smem), "l"(policy)
        : "memory");
}

// Ask L2 for `bytes` contiguous bytes at global `src` (16-byte aligned, a multiple of 16): the
// SM's TMA unit has them read from HBM into L2 and delivers nothing to the SM — no destination, no
// barrier, no completion to wait for, so the issuing thread goes on at once and may even exit.
// It is a hint: it changes no value, and a later load of those bytes hits L2 if they are still
// there. Why this and not `prefetch.global.L2` (one 128-byte line per instruction): one
// instruction asks for a whole run of kilobytes. The address operand is a uniform register in
// the machine code, so a warp whose lanes issue different addresses would be serialised lane by
// lane: issue it from one lane.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(reinterpret_cast<u64>(src)), "r"(bytes)
                 : "memory");
}
