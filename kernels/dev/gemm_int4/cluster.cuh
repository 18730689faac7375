// kernels/dev/gemm_int4/cluster.cuh — thread-block clusters (sm_90): a CTA's rank, cluster-wide
// barriers, arrivals on another CTA's mbarrier through distributed shared memory, and TMA copies
// multicast to several CTAs.
//
//   cluster_ctarank          : mov.u32 r, %cluster_ctarank          (PTX ISA, "Special Registers")
//   cluster_sync             : barrier.cluster.arrive.release + barrier.cluster.wait.acquire
//                              ("Parallel Synchronization and Communication Instructions: barrier.cluster")
//   cluster_map_shared       : mapa.shared::cluster.u32 d, a, rank  ("Data Movement and Conversion
//                              Instructions: mapa")
//   mbarrier_arrive_cluster  : mbarrier.arrive.release.cluster.shared::cluster.b64 _, [addr]
//                              ("…: mbarrier.arrive")
//   tma_load_2d_multicast    : cp.async.bulk.tensor.2d.…multicast::cluster: one read of a box,
//                              written to the same shared-memory offset of every CTA in a mask
//                              ("…: cp.async.bulk.tensor")
//
// Why clusters: CTAs of one cluster run at the same time on SMs of one GPC and can write each
// other's shared memory. A TMA copy with .multicast::cluster lands the same box in several CTAs'
// shared memory from one read of L2 — two CTAs that multiply the same activations by different
// weight rows then pull those activations through L2 once instead of twice (v2_wgmma_cluster2.cu).
// The price is the hand-off: a stage may be refilled only when the consumers of every CTA that
// receives it are done, so consumers arrive on the mbarriers of all the cluster's CTAs.
//
// These were ptx/cluster.cuh and part of ptx/tma.cuh at commit 96e0ea5; v2_wgmma_cluster2.cu
// is their only user, so they live beside it.
#pragma once
#include "types.cuh"
#include "tma.cuh"  // CUtensorMap

__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

// Every thread of every CTA of the cluster arrives, then waits for all the others: with release /
// acquire semantics, what one CTA wrote to shared memory (an mbarrier.init) before it arrived
// is visible to the others after the wait. Also a barrier for the CTA's own threads.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The shared::cluster address of the object at `local` (a generic pointer into this CTA's shared
// memory) in the shared memory of CTA `rank`: the same offset, another SM.
__device__ __forceinline__ u32 cluster_map_shared(const void* local, u32 rank) {
    const u32 a = static_cast<u32>(__cvta_generic_to_shared(local));
    u32 d;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(rank));
    return d;
}

// One arrival (release at cluster scope) on the mbarrier at shared::cluster address `bar`,
// which may belong to another CTA of the cluster.
__device__ __forceinline__ void mbarrier_arrive_cluster(u32 bar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

// As tma_load_2d (ptx/tma.cuh), but the box lands in every CTA of the cluster whose bit is set
// in `cta_mask`, at dst's offset, and completes the bytes on the mbarrier at bar's offset in
// each of them.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, int c0, int c1, u64* bar,
                                                      unsigned short cta_mask) {
    const u32 dst_smem = static_cast<u32>(__cvta_generic_to_shared(dst));
    const u32 bar_smem = static_cast<u32>(__cvta_generic_to_shared(bar));
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;\n"
        :: "r"(dst_smem), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar_smem), "h"(cta_mask)
        : "memory");
}
