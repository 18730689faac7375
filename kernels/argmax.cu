// kernels/argmax.cu — deterministic greedy argmax over the logits, in two passes, no atomics.
//
//   argmax_partial   per block: best (value, index) of a contiguous chunk of logits
//   argmax_final     next_token[0] = index of the best of the partial pairs
//   argmax_final_tokens  the same for T tokens' rows of pairs [T, P] (the verify pass), block j
//                    token j: argmax_final's body on row j, so each token's choice is its own
//
// Order (ptx/warp.cuh argmax_better): the larger logit wins; on equal logits the LOWER index
// wins; a NaN never beats a number. That is a strict total order on (value, index), so the
// winner is the same whatever the reduction tree: bit-reproducible, and equal to numpy's
// np.argmax on NaN-free input (first occurrence of the maximum).
//
// In the decode step pass 1 is fused into the lm_head GEMV (gemv_f16.cu writes one pair per
// 32 rows), and argmax_final runs on those 4752 pairs (38 KB: ~2 µs of one block's latency).
// argmax_partial is the stand-alone pass 1 for logits from anywhere else (prefill's last row,
// tests).
//
// T tokens (the verify pass of speculative decoding): argmax_final_tokens, grid (T), block j runs
// argmax_final's body (argmax_final_row) on token j's row of pairs [T, P] — the lm_head's for T
// tokens — and writes next_token[j]; argmax_final is token 0 of the same body (its SASS equals
// that of a build without the token index). The order is a strict total order, so each token's
// choice is exactly the single-token kernel's on the same pairs. Bytes: T times argmax_final's.
//
// Work split: argmax_partial — grid (P), block (ARGMAX_THREADS); block b scans
// logits[b·chunk, min((b+1)·chunk, V)) with a strided loop (float reads, coalesced).
// argmax_final — grid (1), block (ARGMAX_THREADS); thread i scans pairs i, i+1024, …, then
// a warp butterfly and a serial pass over the 32 warp winners.
//
// Bytes per call at 7B: argmax_partial reads the V = 152064 fp32 logits once (608 KB, L2-resident
// right after the lm_head or prefill wrote them) and writes 8 B per block; argmax_final reads
// 8 B per pair (38 KB for the lm_head's 4752) and writes 4 B. The limit: latency — one block's
// dependent chain load → butterfly → shared-memory pass (~2–4 µs), not bandwidth.
#include "types.cuh"  // WARP_SIZE, u64
#include "warp.cuh"   // argmax_better, warp_argmax
#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents

#define ARGMAX_THREADS 1024
#define ARGMAX_NONE    0x7fffffff  // index of "no candidate yet": loses every tie

// Block-wide argmax of one candidate per thread; the result is valid in thread 0.
// Contains a __syncthreads(): call from every thread.
__device__ __forceinline__ void block_argmax(float& v, int& i) {
    __shared__ float warp_val[ARGMAX_THREADS / WARP_SIZE];
    __shared__ int warp_idx[ARGMAX_THREADS / WARP_SIZE];
    warp_argmax(v, i);
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (lane == 0) { warp_val[warp] = v; warp_idx[warp] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int n_warps = blockDim.x / WARP_SIZE;
        for (int w = 1; w < n_warps; ++w)
            if (argmax_better(warp_val[w], warp_idx[w], v, i)) { v = warp_val[w]; i = warp_idx[w]; }
    }
}

// grid (P), block (≤ ARGMAX_THREADS, a multiple of 32).
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_partial(float* __restrict__ part_val,      // [P] fp32, out
               int* __restrict__ part_idx,        // [P] int32, out
               const float* __restrict__ logits,  // [V] fp32
               int V, int chunk) {                // chunk = ceil(V / P)
    grid_launch_dependents();
    grid_dependency_wait();
    const int begin = blockIdx.x * chunk, end = min(begin + chunk, V);
    float best_v = F32_NEG_INF;
    int best_i = ARGMAX_NONE;
    for (int k = begin + threadIdx.x; k < end; k += blockDim.x) {
        const float v = logits[k];
        if (argmax_better(v, k, best_v, best_i)) { best_v = v; best_i = k; }
    }
    block_argmax(best_v, best_i);
    if (threadIdx.x == 0) { part_val[blockIdx.x] = best_v; part_idx[blockIdx.x] = best_i; }
}

// Token `token`'s next_token[token] from its row of P pairs, part_val / part_idx [T, P]; token 0
// is the single-token argmax_final. Contains a __syncthreads(): call from every thread.
__device__ __forceinline__ void argmax_final_row(int* __restrict__ next_token, const float* __restrict__ part_val,
                                                 const int* __restrict__ part_idx, int P, int token) {
    grid_launch_dependents();
    grid_dependency_wait();
    float best_v = F32_NEG_INF;
    int best_i = ARGMAX_NONE;
    for (int k = threadIdx.x; k < P; k += blockDim.x) {
        const float v = part_val[(u64)token * P + k];
        const int i = part_idx[(u64)token * P + k];
        if (argmax_better(v, i, best_v, best_i)) { best_v = v; best_i = i; }
    }
    block_argmax(best_v, best_i);
    if (threadIdx.x == 0) next_token[token] = best_i == ARGMAX_NONE ? 0 : best_i;
}

// grid (1), block (ARGMAX_THREADS).
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_final(int* __restrict__ next_token,           // [1] int32, out
             const float* __restrict__ part_val,     // [P] fp32
             const int* __restrict__ part_idx,       // [P] int32
             int P) {
    argmax_final_row(next_token, part_val, part_idx, P, 0);
}

// grid (T), block (ARGMAX_THREADS): block j is argmax_final over token j's row of pairs.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_final_tokens(int* __restrict__ next_token,        // [T] int32, out
                    const float* __restrict__ part_val,  // [T, P] fp32
                    const int* __restrict__ part_idx,    // [T, P] int32
                    int P) {
    argmax_final_row(next_token, part_val, part_idx, P, blockIdx.x);
}
