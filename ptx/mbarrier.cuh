// ptx/mbarrier.cuh — shared-memory transaction barriers (sm_90), the handshake between a TMA
// producer warp and its consumer warps.
//
//   mbarrier_init              : mbarrier.init.shared::cta.b64 [bar], count
//                                (PTX ISA, "Parallel Synchronization and Communication
//                                Instructions: mbarrier.init")
//   fence_mbarrier_init        : fence.mbarrier_init.release.cluster + fence.proxy.async.shared::cta
//                                ("…: membar / fence")
//   mbarrier_arrive            : mbarrier.arrive.shared::cta.b64 _, [bar]           ("…: mbarrier.arrive")
//   mbarrier_arrive_expect_tx  : mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], bytes
//                                ("…: mbarrier.expect_tx" and "…: mbarrier.arrive")
//   mbarrier_wait_parity       : loop over mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity
//                                ("…: mbarrier.test_wait / mbarrier.try_wait")
//
// What an mbarrier is: a 64-bit object in shared memory holding a pending-arrival count, a
// pending-transaction byte count and a phase bit. A phase completes when both counts reach zero;
// the hardware then flips the phase bit and re-arms the arrival count to the init value. Threads
// wait for "the phase with parity P has completed" (try_wait.parity), so a barrier reused round
// after round needs no re-initialisation: round r of a ring stage waits on parity r & 1.
//
// Why not __syncthreads(): in a warp-specialised kernel the producer and the consumers run
// different code. A block-wide barrier reached by only some warps is undefined behaviour (the
// classic bug: consumers read a stage before its copy landed). An mbarrier lets exactly the
// parties of one hand-off meet — the producer's copy and one consumer warp — and it counts the
// bytes of an asynchronous copy (transaction count), which no thread barrier can: the TMA unit
// itself decrements it as the data lands (complete_tx), so "phase complete" means "bytes in
// shared memory", not "copy issued".
//
// Memory semantics: arrive has .release and try_wait has .acquire semantics at CTA scope by
// default (PTX ISA memory consistency model), so shared-memory reads a consumer makes before its
// arrive happen-before the producer's next copy into that stage, and the bytes a completed
// phase covers are visible to the waiting threads.
#pragma once
#include "types.cuh"

// The shared-state-space address of an mbarrier (32-bit), as the .shared::cta forms take it.
__device__ __forceinline__ u32 mbarrier_smem_addr(const u64* bar) {
    return static_cast<u32>(__cvta_generic_to_shared(bar));
}

// Initialise `bar` for `count` arrivals per phase (phase 0, no pending transactions). One
// thread does it, before any other thread touches the barrier.
__device__ __forceinline__ void mbarrier_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n"
                 :: "r"(mbarrier_smem_addr(bar)), "r"(count) : "memory");
}

// Make the initialised barriers visible before anyone uses them: fence.mbarrier_init orders the
// init before later (released) operations of this thread, and fence.proxy.async makes the
// generic-proxy writes to shared memory (the init) visible to the async proxy — the TMA unit
// that will complete transactions on these barriers. A __syncthreads() must follow (outside any
// warp-role branch) before other warps arrive or wait.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One arrival (release semantics): "I am done with what this phase guarded". The state token
// is discarded (sink `_`): waits use the phase parity instead.
__device__ __forceinline__ void mbarrier_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n"
                 :: "r"(mbarrier_smem_addr(bar)) : "memory");
}

// One arrival that also raises the phase's expected transaction count by `tx_bytes`: the phase
// cannot complete until copies carrying mbarrier::complete_tx::bytes have delivered that many
// bytes. Issued by the producer before (or together with) the copies of a stage.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u64* bar, u32 tx_bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(mbarrier_smem_addr(bar)), "r"(tx_bytes) : "memory");
}

// Non-blocking probe: true once the phase with parity `parity` has completed (acquire).
// try_wait (unlike test_wait) may suspend the thread for a hardware-chosen time before
// returning false, so the spin below does not hammer the barrier.
__device__ __forceinline__ bool mbarrier_try_wait_parity(u64* bar, u32 parity) {
    u32 done;
    asm volatile("{\n"
                 "  .reg .pred p;\n"
                 "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "  selp.u32 %0, 1, 0, p;\n"
                 "}\n"
                 : "=r"(done) : "r"(mbarrier_smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}

// Block until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait_parity(u64* bar, u32 parity) {
    while (!mbarrier_try_wait_parity(bar, parity)) {
    }
}
