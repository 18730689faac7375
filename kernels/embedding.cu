// kernels/embedding.cu — token embedding lookup into the FP32 residual stream.
//
//   embedding        residual[:] = fp32(embed[state[1], :])          (decode: token from device state)
//   embedding_rows   residual[r, :] = fp32(embed[ids[r], :])         (prefill: T tokens)
//
// The decode token id is read from device memory (state[1], written by the previous step's
// argmax → advance_state), never passed as a launch argument, so one captured CUDA graph
// serves every step (docs/graphs.md#one-graph-serves-every-step).
//
// Work split: thread i converts 16-byte chunk i of the row (8 FP16 → 8 FP32, two float4
// stores); grid.x = ceil(D / 8 / EMBEDDING_THREADS) (2 blocks at 7B, 1 at 0.5B), grid.y = rows.
// Bytes per call at 7B (decode): 3584 × (2 read + 4 written) = 21.5 KB: pure latency.
//
// A token id outside [0, V) is a bug upstream; rather than read out of bounds, the row is
// filled with NaN so the failure shows in the logits.
//
// Requirements: D % 8 == 0; pointers 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"    // u32, u64
#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents
#include "block_coord.cuh"  // BlockCoord, GridDep

#define EMBEDDING_THREADS 256

__device__ __forceinline__ void embedding_row(float* __restrict__ out_row,
                                              const __half* __restrict__ embed,
                                              int token, int V, int D, int bx) {
    if (threadIdx.x >= EMBEDDING_THREADS) return;
    const int chunk = bx * EMBEDDING_THREADS + threadIdx.x;
    if (chunk >= D / 8) return;
    float4* dst = reinterpret_cast<float4*>(out_row) + 2 * chunk;
    if (token < 0 || token >= V) {
        const float nan = F32_NAN;
        dst[0] = make_float4(nan, nan, nan, nan);
        dst[1] = dst[0];
        return;
    }
    const uint4 raw = reinterpret_cast<const uint4*>(embed + (u64)token * D)[chunk];
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
    const float2 c = __half22float2(*reinterpret_cast<const __half2*>(&raw.z));
    const float2 d = __half22float2(*reinterpret_cast<const __half2*>(&raw.w));
    dst[0] = make_float4(a.x, a.y, b.x, b.y);
    dst[1] = make_float4(c.x, c.y, d.x, d.y);
}

struct EmbeddingArgs {
    float* residual;      // [D] fp32, out
    const __half* embed;  // [V, D] fp16
    const int* state;     // [3] int32: pos, token, seq_len (reads [1])
    int V, D;
};

// Block bc.bx of the launch: 8 · EMBEDDING_THREADS elements of the row. No block-wide barrier.
template <typename Dep>
__device__ __forceinline__ void embedding_item(const EmbeddingArgs& a, const BlockCoord& bc, Dep dep) {
    dep.launch_dependents();
    dep.wait();  // state[1] is the previous step's token; residual was read by it
    embedding_row(a.residual, a.embed, a.state[1], a.V, a.D, bc.bx);
}

// grid (ceil(D/8/256)), block (256).
#ifndef DEVICE_FUNCTIONS_ONLY  // a file that includes this one for its device functions defines it
extern "C" __global__ void __launch_bounds__(EMBEDDING_THREADS)
embedding(float* __restrict__ residual, const __half* __restrict__ embed, const int* __restrict__ state,
          int V, int D) {  // EmbeddingArgs says what each is
    embedding_item(EmbeddingArgs{residual, embed, state, V, D}, BlockCoord::of_launch(), GridDep{});
}
#endif  // DEVICE_FUNCTIONS_ONLY

// grid (ceil(D/8/256), T), block (256).
#ifndef DEVICE_FUNCTIONS_ONLY
extern "C" __global__ void __launch_bounds__(EMBEDDING_THREADS)
embedding_rows(float* __restrict__ residual,      // [T, D] fp32, out
               const __half* __restrict__ embed,  // [V, D] fp16
               const int* __restrict__ ids,       // [T] int32 token ids
               int V, int D) {
    embedding_row(residual + (u64)blockIdx.y * D, embed, ids[blockIdx.y], V, D, blockIdx.x);
}
#endif  // DEVICE_FUNCTIONS_ONLY
