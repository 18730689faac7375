// smoke.cu — trivial kernels that test the GPU layer itself, not the model.
//
// They exercise each path from Python to the GPU once: fp32 scalars and pointers in the
// parameter array (smoke_axpb), the CUDA headers found by NVRTC (smoke_add_f16 includes
// cuda_fp16.h), and a 128-byte struct passed by value as a __grid_constant__ parameter, the
// way TMA descriptors are passed (smoke_echo_tensormap). tests/test_cuda_layer.py runs them.
//
// Work split: one thread per element, 1-D grid of ceil(n / blockDim.x) blocks.
// Bytes moved: 8 B (smoke_axpb) / 6 B (smoke_add_f16) per element; nothing here is performance-relevant.

#include <cuda_fp16.h>  // __half, __hadd

// y[i] = a * x[i] + b for i < n.  y, x: [n] fp32 (they may alias: in-place updates are used
// by the graph-replay test).
extern "C" __global__ void smoke_axpb(float* y, const float* x, float a, float b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}

// z[i] = x[i] + y[i] for i < n.  z, x, y: [n] fp16.
extern "C" __global__ void smoke_add_f16(__half* z, const __half* x, const __half* y, unsigned int n) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) z[i] = __hadd(x[i], y[i]);
}

// The shape of a CUtensorMap: 128 opaque bytes, 64-byte aligned (cuda.h). Declared here
// rather than taken from ptx/ so this file depends on nothing but the CUDA headers.
struct alignas(64) SmokeTensorMap {
    unsigned long long opaque[16];
};

// out[i] = tm.opaque[i], i < 16: copies the by-value parameter back so the test can compare
// it with the bytes Python packed. One block of 16 threads.  out: [16] u64.
extern "C" __global__ void smoke_echo_tensormap(unsigned long long* out, const __grid_constant__ SmokeTensorMap tm) {
    if (threadIdx.x < 16) out[threadIdx.x] = tm.opaque[threadIdx.x];
}
