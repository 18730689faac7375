// ptx/setmaxnreg.cuh — moving registers between the warpgroups of a block (sm_90a).
//
//   setmaxnreg_inc<N> : setmaxnreg.inc.sync.aligned.u32 N   (this warpgroup may use up to N a thread)
//   setmaxnreg_dec<N> : setmaxnreg.dec.sync.aligned.u32 N   (this warpgroup gives all above N back)
//   (PTX ISA, "Miscellaneous Instructions: setmaxnreg")
//
// Why: a block's warps start with the same register count (the kernel's, at most 65536 / the
// block's threads: 168 for 384 threads). A producer warpgroup that only issues copies needs few;
// MMA warpgroups with 128 FP32 accumulators a thread (wgmma m64n256) need more than 168. The
// producer gives its registers back to the SM's pool (dec) and the consumers take them (inc),
// which blocks until the pool has them. Every warp of a warpgroup executes the same instruction
// (.sync.aligned); N is a multiple of 8 in 24 … 256, and the block's total after the moves must
// fit the register file (the consumers' N times their threads plus the producer's N times its
// threads ≤ 65536).
#pragma once

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: a multiple of 8 in 24..256");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}

template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: a multiple of 8 in 24..256");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}

// Values read again after a setmaxnreg role split (volatile: not merged with the reads before
// it). A value live across setmaxnreg from before the split has to sit where both roles'
// register budgets reach it, which ptxas did by spilling it to local memory (one load per tile
// in the consumers of the prefill GEMM).
//   block_index()        %ctaid.x
//   thread_index()       %tid.x
//   live_rows(state)     ld.global.cg of state[1] (the L2's value: written by an earlier kernel)
__device__ __forceinline__ int block_index() {
    int b;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(b));
    return b;
}
__device__ __forceinline__ int thread_index() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}
__device__ __forceinline__ int live_rows(const int* prefill_state) {
    int m;
    asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(m) : "l"(prefill_state + 1) : "memory");
    return m;
}
