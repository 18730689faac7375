// kernels/timing.cu — a kernel that holds a stream for a fixed time, for honest per-kernel
// timing of eager launches.
//
//   gpu_sleep   one thread spins on %globaltimer until `ns` nanoseconds have passed
//
// Why: timing each eager launch with a CUDA event pair measures launch latency, not the
// kernel, whenever the GPU is faster than the host's ~5 µs per cuLaunchKernel — the GPU runs
// the first event, then idles until the kernel arrives. Queueing gpu_sleep first lets the
// host enqueue the whole step (kernels and events) while the stream is held; when it is
// released, every kernel runs back to back and each event pair brackets GPU time only.
//
// Work split: one thread. Bytes moved: none. %globaltimer is the GPU's nanosecond wall clock
// (PTX ISA, "Special Registers: %globaltimer"); its resolution is coarse (~1 µs on
// recent GPUs), which is fine for a hold of milliseconds.
#include "types.cuh"

__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// grid (1), block (1).
extern "C" __global__ void gpu_sleep(u64 ns) {
    const u64 start = globaltimer_ns();
    while (globaltimer_ns() - start < ns) {
        __nanosleep(1000);  // back off: no need to hammer the timer
    }
}
