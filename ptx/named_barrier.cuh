// ptx/named_barrier.cuh — named CTA barriers (PTX ISA, "bar, barrier"): bar.sync and bar.arrive.
//
//   named_barrier_sync<ID, N>   : bar.sync ID, N   — wait until N threads have arrived at barrier
//                                 ID (this thread among them), then go on
//   named_barrier_arrive<ID, N> : bar.arrive ID, N — count this thread's arrival, do not wait
//
// Why: __syncthreads is barrier 0 for the whole block. Two warpgroups that hand a turn to each
// other (the one that may issue its MMAs next) need a barrier of their own where one side
// waits and the other only signals: 128 threads sync, the other 128 arrive, N = 256. A barrier
// completes when N arrivals (sync or arrive) are counted, and resets for its next use; every
// kernel that uses one balances its syncs and arrivals, so none is left half-counted at exit.
// IDs 1 … 15 are free for such protocols (0 is __syncthreads); N is a multiple of 32.
#pragma once

template <int ID, int N>
__device__ __forceinline__ void named_barrier_sync() {
    static_assert(ID >= 1 && ID <= 15 && N % 32 == 0, "barrier 1..15, a whole number of warps");
    asm volatile("bar.sync %0, %1;\n" :: "n"(ID), "n"(N) : "memory");
}

template <int ID, int N>
__device__ __forceinline__ void named_barrier_arrive() {
    static_assert(ID >= 1 && ID <= 15 && N % 32 == 0, "barrier 1..15, a whole number of warps");
    asm volatile("bar.arrive %0, %1;\n" :: "n"(ID), "n"(N) : "memory");
}
