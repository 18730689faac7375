// ptx/named_barrier.cuh — the CTA's named barriers 1…15 with a thread count (PTX ISA, "Parallel
// Synchronization and Communication Instructions: bar, barrier").
//
//   named_barrier_sync<COUNT>(id)     bar.sync id, COUNT     wait until COUNT threads have
//                                                            arrived (this one included)
//   named_barrier_arrive<COUNT>(id)   bar.arrive id, COUNT   count this thread in, do not wait
//
// __syncthreads is barrier 0 over the whole block; a warp-specialized kernel needs barriers over
// some of its warps only (its producer runs ahead and never meets them), and an ordered handoff
// between two groups of warps: one side syncs, the other arrives, COUNT being both sides'
// threads together. COUNT is a multiple of 32 and every warp takes part whole; id (1 … 15: 0 is
// __syncthreads') is warp-uniform, a register where the caller picks the barrier at run time.
// The "memory" clobber keeps the compiler from moving memory accesses across either.
#pragma once

template <int COUNT>
__device__ __forceinline__ void named_barrier_sync(int id) {
    static_assert(COUNT % 32 == 0, "whole warps");
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(COUNT) : "memory");
}

template <int COUNT>
__device__ __forceinline__ void named_barrier_arrive(int id) {
    static_assert(COUNT % 32 == 0, "whole warps");
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(COUNT) : "memory");
}
