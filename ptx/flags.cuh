// ptx/flags.cuh — completion counters in global memory, shared by the blocks of one grid: how the
// persistent decode step (kernels/decode_persistent.cu) orders work between blocks without a
// kernel boundary.
//
//   ld_relaxed_gpu_u32   ld.relaxed.gpu.global.u32        (the same: a strong load, no ordering)
//   ld_acquire_gpu_u32   ld.acquire.gpu.global.u32        (PTX ISA, "Data Movement and Conversion
//                                                           Instructions: ld", memory consistency
//                                                           model: acquire patterns)
//   red_release_gpu_add  red.release.gpu.global.add.u32   ("…: red")
//   atom_acq_rel_gpu_add_u32  atom.acq_rel.gpu.global.add.u32  ("…: atom"): the release and the
//                        acquire in one read-modify-write, for a counter whose last adder goes on
//                        to read what every earlier adder published (the prefill attention's KV splits)
//   split_arrive_last    that add, and the last adder's reset of the counter: the step every
//                        split computation's parts share
//   global_timer_ns      mov.u64 %globaltimer              ("Special Registers: %globaltimer")
//   sm_id                mov.u32 %smid                     ("Special Registers: %smid"): which
//                        SM a block runs on, for the persistent step's trace
//   nanosleep            nanosleep.u32                     ("Miscellaneous Instructions: nanosleep")
//
// The pattern: a producer block finishes its writes, __syncthreads() (its threads' writes are
// ordered before thread 0's next operation at block scope), then thread 0 adds 1 to the counter
// with release semantics at gpu scope. A consumer's thread 0 polls with relaxed loads until the
// counter reaches the number of producers, then reads it once more with an acquire load, then
// __syncthreads(). The counter only grows by release adds, so the value the acquire reads is at
// the end of a chain of them and it synchronizes with every one (a release sequence continues
// through later read-modify-writes). Release and acquire are cumulative in the PTX memory model
// (causality order runs through the barriers), so every producer write happens before every read
// the consumer block makes after its barrier.
// What the hardware does for them (sm_90 SASS, read with cuobjdump): the release is MEMBAR.ALL.GPU
// then REDG.E.ADD.STRONG.GPU; the acquire is LDG.E.STRONG.GPU then CCTL.IVALL, which drops the
// SM's L1, so an ordinary load after it cannot hit a stale line of another SM's data. A separate
// gpu-scope fence (`fence` with acquire-release order) on either side only repeats the MEMBAR (measured: 0.1 ms of a 0.5B step
// over 145 hand-offs). Loads that bypass the model — ld.global.nc / __ldg on data written in the
// same grid — are never used for such data (decode_persistent.cu says how).
#pragma once

#include "types.cuh"  // u32, u64

// A poll that orders nothing: no L1 invalidation per poll (see the acquire's SASS above), which
// matters where another block of the SM is working while this one waits. The ordering comes
// from the one acquire load after the poll has seen the target.
__device__ __forceinline__ u32 ld_relaxed_gpu_u32(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u32 ld_acquire_gpu_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_release_gpu_add(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}


// Returns the counter's value before the add. Release: the block's writes ordered before it (by
// a barrier) are published with it; acquire: what the earlier adders published is visible after
// it (their adds and this one form one release sequence).
__device__ __forceinline__ u32 atom_acq_rel_gpu_add_u32(u32* p, u32 v) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// The last-arriver count of a computation cut into `splits` parts that run on different blocks
// (the prefill attention's KV splits, kernels/attention_prefill.cu): one thread of each
// part calls it once, after a barrier that orders every thread's partial stores before it.
// Returns true in the part whose add comes last — its acquire half has synchronized with every
// earlier add (one release sequence), so every part's stores happen before its reads after the
// next barrier — and that part sets the counter back to 0 for the next launch (no other part
// touches it again in this one).
__device__ __forceinline__ bool split_arrive_last(u32* counter, int splits) {
    const bool last = (int)atom_acq_rel_gpu_add_u32(counter, 1u) == splits - 1;
    if (last) *counter = 0;
    return last;
}

__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The SM this thread runs on (0 … SMs − 1; a block stays on one SM). For traces only: PTX allows
// the value to change during a thread's life in general, so nothing is computed from it.
__device__ __forceinline__ u32 sm_id() {
    u32 id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

// Suspends the warp for about `ns` nanoseconds (at most 1 ms): a spinning thread leaves its
// scheduler's issue slots to the warps that do the work.
__device__ __forceinline__ void nanosleep(u32 ns) {
    asm volatile("nanosleep.u32 %0;" :: "r"(ns));
}
