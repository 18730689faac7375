// ptx/cluster.cuh — thread block clusters (sm_90): the blocks of one cluster run at once on one
// GPC, may read each other's shared memory and meet at one barrier. How the short-context decode
// attention (kernels/attention_decode_cluster.cu) merges its splits without a second launch.
//
//   cluster_ctarank          mov.u32 %cluster_ctarank            (PTX ISA, "Special Registers:
//                                                                  %cluster_ctarank")
//   cluster_sync             barrier.cluster.arrive.release.aligned +
//                            barrier.cluster.wait.acquire.aligned ("Parallel Synchronization and
//                                                                  Communication Instructions:
//                                                                  barrier.cluster")
//   cluster_sync_exit        barrier.cluster.arrive.relaxed.aligned + barrier.cluster.wait.aligned
//   cluster_map_shared       mapa.shared::cluster.u32             ("Data Movement and Conversion
//                                                                  Instructions: mapa")
//   ld_shared_cluster_f32    ld.shared::cluster.f32               ("…: ld", state space
//                                                                  .shared::cluster)
//
// What they give: a kernel declared with __cluster_dims__(C, 1, 1) is launched in groups of C
// consecutive blocks along x that the hardware co-schedules; each block's shared memory is
// visible to the others through the .shared::cluster window ("distributed shared memory"):
// mapa turns an address of this block's shared memory into the address of the same variable in
// block `rank` of the cluster, and ld.shared::cluster reads it over the SM-to-SM network. No
// global memory, no kernel boundary: a merge of C blocks' partial results costs a barrier and a
// few hundred cycles of remote loads.
//
// Memory semantics of the barrier: every thread of every block of the cluster arrives (with
// release semantics at cluster scope) and then waits (acquire): once a thread's wait returns,
// every write any thread of the cluster made before its arrive — to its own shared memory
// included — is visible to it, so the barrier both orders a block's writes before the other
// blocks' remote reads and serves as the block's own barrier. `.aligned`: every thread of a warp
// executes the same barrier instruction (never call it under a divergent branch).
// Lifetime: a block's shared memory may be read by the others only while it is running, so a
// kernel whose blocks read remotely ends with one more barrier after the last remote read:
// cluster_sync_exit, whose arrive is relaxed — it publishes nothing, it only holds every block
// until the others' reads are done (each thread's remote loads have returned by then: their
// values were used before its arrive). The release arrive compiles to MEMBAR.ALL.GPU (sm_90
// SASS), which would make each block wait for its own global stores first.
#pragma once
#include "types.cuh"  // u32

// The block's rank in its cluster, 0 … C − 1 (blockIdx.x % C for clusters along x).
__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// Every thread of the cluster: the writes before it are visible to every thread after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Every thread of the cluster, last: no block exits while another may still read its shared
// memory (see "Lifetime").
__device__ __forceinline__ void cluster_sync_exit() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\t"
                 "barrier.cluster.wait.aligned;" ::: "memory");
}

// The .shared::cluster address of `p` (a variable in this block's shared memory) in block `rank`:
// a pure address computation.
__device__ __forceinline__ u32 cluster_map_shared(const void* p, u32 rank) {
    u32 remote;
    asm("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote) : "r"(static_cast<u32>(__cvta_generic_to_shared(p))), "r"(rank));
    return remote;
}

// A float of another block's shared memory (an address from cluster_map_shared). Volatile with a
// memory clobber: it must stay after the cluster_sync that publishes what it reads.
__device__ __forceinline__ float ld_shared_cluster_f32(u32 addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
