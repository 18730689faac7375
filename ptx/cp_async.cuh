// ptx/cp_async.cuh — asynchronous global → shared copies (sm_80+), the prefill kernels' staging.
//
//   cp_async_16        : cp.async.cg.shared.global [dst], [src], 16, src_bytes
//                        (PTX ISA, "Data Movement and Conversion Instructions: cp.async")
//   cp_async_commit    : cp.async.commit_group   ("…: cp.async.commit_group")
//   cp_async_wait<N>   : cp.async.wait_group N   ("…: cp.async.wait_group")
//   cp_async_mbarrier_arrive_noinc : cp.async.mbarrier.arrive.noinc.shared::cta.b64 [bar]
//                        ("…: cp.async.mbarrier.arrive")
//
// Why cp.async and not load-then-store: the copy goes from L2 straight into shared memory
// without passing through registers, and the issuing thread does not wait for it. A kernel
// keeps several K-steps ("stages") in flight this way: it issues the copies of step k+S-1,
// commits them as one group, and waits only until step k's group has landed
// (wait_group S-2). The tensor-core loop then runs on shared memory while the next steps'
// bytes are still on their way — the classic multi-stage pipeline (Ampere GEMMs, FlashAttention-2).
//
// .cg caches in L2 only (not L1): the staged tiles are read once from global per block; L1
// would only hold bytes that are already in shared memory. The 16-byte size is the only one
// .cg allows.
//
// src_bytes < 16 zero-fills the rest of the 16 bytes; src_bytes = 0 reads nothing at all and
// writes 16 zero bytes. The prefill kernels use that for rows past the end of the data (a
// prompt's last partial tile, KV slots past the sequence): shared memory gets zeros, never the
// NaN that tests put in unused cache slots, and no out-of-range address is dereferenced.
#pragma once
#include "types.cuh"

// Copy 16 bytes from global `src` to shared `dst` asynchronously; `valid` false writes zeros
// and reads nothing (src must still be a well-formed pointer; callers pass a base pointer).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    const u32 dst_smem = static_cast<u32>(__cvta_generic_to_shared(dst));
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst_smem), "l"(src), "r"(src_bytes) : "memory");
}

// Close the copies issued so far by this thread into one group.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight. Only this
// thread's copies: a __syncthreads() must follow before other threads read the data.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// cp.async.mbarrier.arrive.noinc.shared::cta.b64 [bar] ("…: cp.async.mbarrier.arrive"): when
// every cp.async this thread issued before it has landed, arrive on `bar` once. Lets a cp.async
// producer feed an mbarrier ring as TMA does.
//
// Why .noinc: without it the instruction raises the barrier's pending arrival count by one "prior
// to" its asynchronous arrival, which lowers it again — by the ISA's own words "a zero-net change
// for the pending count ... during the current phase". Whether the copies then hold the phase
// back depends on when the hardware applies the raise, which the ISA does not pin down, and
// compute-sanitizer's synccheck counts each such arrival against the init count (it reported a
// "barrier overflow" on a barrier initialised for 1 with 32 lanes arriving this way). With .noinc
// the asynchronous arrival is an ordinary arrival: the init count includes one per thread that
// issues it, and a phase cannot complete before every such thread's copies have landed — a
// count the ISA defines and the sanitizers check.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n"
                 :: "r"(static_cast<u32>(__cvta_generic_to_shared(bar))) : "memory");
}
