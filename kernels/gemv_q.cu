// kernels/gemv_q.cu — decode GEMV over the grouped integer weight formats of version-3
// `.nanoqwen` files (format/weight_formats.py): y = W x, batch 1, one kernel per format.
//
//   gemv_q_<format>   y fp16[N] = W x          (out_f16 given, residual null)
//                     residual fp32[N] += W x  (residual given, out_f16 null)
//
// for <format> in int4_g128, q4_g32, q4_g32_min, q4_g32_kmin, q5_g32, q5_g32_min, q5_g32_kmin,
// q6_g16_k, q8_g32: bits b, group g, FP16 or FP32 scale, optional offset per group,
//
//     symmetric:    w = (c − 2^(b−1)) · s          with offset:  w = c · s + o
//
// so per group y += s · Σ (c − z) x  (+ o · Σ x). Codes (integers ≤ 255 in magnitude) and FP16
// x multiply exactly in FP32; the sums are FP32.
//
// The limit: HBM bandwidth, b/8 + (scale + offset bytes)/g bytes per weight (4.125 – 8.5 bits,
// docs/quantization.md#gguf-sources-per-tensor-formats). This is the first, plain version of
// these GEMVs — correct for every format at every shape the formats allow, and the reference
// point for tools/bench_gemv.py's per-format figures — not yet the MMA engine of gemv_int4.cu.
//
// Work split: block = GQ_WARPS warps, one output row per warp (grid.x = ceil(N / GQ_WARPS)).
// Lane l walks the row's 32-input chunks l, l+32, …: per chunk it reads 16 B of low nibbles
// (qweight, layout id 1's nibble order: input e of a word sits in nibble (e%2)·4 + e/2), the
// chunk's high bits (qhigh: 4 B for 5-bit codes, 8 B for 6-bit) or 32 B of bytes (8-bit), the
// group's scale (and offset), and 64 B of x through L1 (every warp of the SM shares x). Weights
// use the streaming load (L1::no_allocate, L2 evict-first). The row's sum is a warp butterfly
// (fixed order): no atomics, bit-reproducible.
//
// Requirements (checked by launchers/gemv_q.py): K % 32 == 0 and K % g == 0; pointers 16-byte
// aligned (every tensor of a `.nanoqwen` is 4 KiB aligned; qweight rows are K/2 bytes).
#include <cuda_fp16.h>

#include "types.cuh"  // u32, u64, WARP_SIZE
#include "ldst.cuh"   // ld_stream_v4, l2_evict_first_policy
#include "warp.cuh"   // warp_sum

#define GQ_WARPS 8    // rows per block (one per warp)
#define GQ_CHUNK 32   // inputs per lane step

// Input e (0..7) of a layout-id-1 word: its low 4 bits.
__device__ __forceinline__ u32 gq_nibble(u32 word, int e) { return (word >> (4 * ((e & 1) * 4 + (e >> 1)))) & 0xFu; }

__device__ __forceinline__ u32 gq_word(const uint4& q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

template <typename S>
__device__ __forceinline__ float gq_load_scale(const S* p);
template <>
__device__ __forceinline__ float gq_load_scale<__half>(const __half* p) { return __half2float(__ldg(p)); }
template <>
__device__ __forceinline__ float gq_load_scale<float>(const float* p) { return __ldg(p); }

// One row's dot product. BITS ∈ {4, 5, 6, 8}; GROUP ∈ {16, 32, 128}; S the scale (and offset)
// type; OFFSET: the format has an offset (z = 0), else z = 2^(BITS-1).
template <int BITS, int GROUP, typename S, bool OFFSET>
__device__ __forceinline__ float gq_row_dot(const u32* __restrict__ qweight,  // [N, K/8] or [N, K/4] (8-bit)
                                            const u32* __restrict__ qhigh,    // [N, K/32] (5-bit), [N, K/16] (6-bit)
                                            const S* __restrict__ scales,     // [N, K/GROUP]
                                            const S* __restrict__ offsets,    // [N, K/GROUP] or null
                                            const __half* __restrict__ x,     // [K]
                                            u64 row, int K, int lane, u64 policy) {
    constexpr float Z = OFFSET ? 0.f : float(1 << (BITS - 1));
    constexpr int SUBS = GROUP < GQ_CHUNK ? GQ_CHUNK / GROUP : 1;  // groups per chunk
    constexpr int PER_SUB = GQ_CHUNK / SUBS;
    const int n_chunks = K / GQ_CHUNK, n_groups = K / GROUP;
    float acc = 0.f;
    for (int c = lane; c < n_chunks; c += WARP_SIZE) {
        uint4 lo, b8hi;
        u32 hi0 = 0, hi1 = 0;
        if constexpr (BITS == 8) {
            const uint4* q = reinterpret_cast<const uint4*>(qweight + row * (K / 4)) + 2 * c;
            lo = ld_stream_v4(q, policy);
            b8hi = ld_stream_v4(q + 1, policy);
        } else {
            lo = ld_stream_v4(reinterpret_cast<const uint4*>(qweight + row * (K / 8)) + c, policy);
            if constexpr (BITS == 5) hi0 = __ldg(qhigh + row * (K / 32) + c);
            if constexpr (BITS == 6) {
                const uint2 h = __ldg(reinterpret_cast<const uint2*>(qhigh + row * (K / 16)) + c);
                hi0 = h.x; hi1 = h.y;
            }
        }
        const uint4* xc = reinterpret_cast<const uint4*>(x) + 4 * c;
#pragma unroll
        for (int sub = 0; sub < SUBS; ++sub) {
            float dot = 0.f, xsum = 0.f;
#pragma unroll
            for (int e = sub * PER_SUB; e < (sub + 1) * PER_SUB; ++e) {
                u32 code;
                if constexpr (BITS == 8) {
                    code = (gq_word(e < 16 ? lo : b8hi, (e % 16) / 4) >> (8 * (e % 4))) & 0xFFu;
                } else {
                    code = gq_nibble(gq_word(lo, e / 8), e % 8);
                    if constexpr (BITS == 5) code |= ((hi0 >> e) & 1u) << 4;
                    if constexpr (BITS == 6) code |= (((e < 16 ? hi0 : hi1) >> (2 * (e % 16))) & 3u) << 4;
                }
                const uint4 xv = xc[e / 8];
                const u32 xw = gq_word(xv, (e % 8) / 2);
                const float xf = __half2float(__ushort_as_half((unsigned short)((e & 1) ? xw >> 16 : xw & 0xFFFFu)));
                dot = fmaf(float(code) - Z, xf, dot);
                if constexpr (OFFSET) xsum += xf;
            }
            // A chunk lies inside one group (GROUP ≥ 32) or holds SUBS whole ones (GROUP = 16):
            // the scale multiplies each chunk's partial, s · Σ_group = Σ_chunks s · partial.
            const u64 at = row * n_groups + (c * GQ_CHUNK + sub * PER_SUB) / GROUP;
            float part = dot * gq_load_scale<S>(scales + at);
            if constexpr (OFFSET) part = fmaf(xsum, gq_load_scale<S>(offsets + at), part);
            acc += part;
        }
    }
    return warp_sum(acc);
}

template <int BITS, int GROUP, typename S, bool OFFSET>
__device__ __forceinline__ void gemv_q(__half* __restrict__ out_f16, float* __restrict__ residual,
                                       const u32* __restrict__ qweight, const u32* __restrict__ qhigh,
                                       const S* __restrict__ scales, const S* __restrict__ offsets,
                                       const __half* __restrict__ x, int N, int K) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int row = blockIdx.x * GQ_WARPS + warp;
    if (row >= N) return;  // warp-uniform; no block-wide synchronisation below
    const float sum = gq_row_dot<BITS, GROUP, S, OFFSET>(qweight, qhigh, scales, offsets, x, (u64)row, K, lane,
                                                         l2_evict_first_policy());
    if (lane == 0) {
        if (residual != nullptr) residual[row] += sum;
        else out_f16[row] = __float2half_rn(sum);
    }
}

// grid (ceil(N / GQ_WARPS)), block (GQ_WARPS · 32). Each entry: out_f16 [N] fp16 or null,
// residual [N] fp32 or null (exactly one given), qweight, qhigh (null for 4- and 8-bit codes),
// scales and offsets (null when symmetric) as the format stores them, x [K] fp16.
#define GEMV_Q_ENTRY(NAME, BITS, GROUP, S, OFFSET)                                                        \
    extern "C" __global__ void __launch_bounds__(GQ_WARPS * WARP_SIZE)                                   \
    gemv_q_##NAME(__half* out_f16, float* residual, const u32* qweight, const u32* qhigh, const S* scales, \
                  const S* offsets, const __half* x, int N, int K) {                                     \
        gemv_q<BITS, GROUP, S, OFFSET>(out_f16, residual, qweight, qhigh, scales, offsets, x, N, K);     \
    }

GEMV_Q_ENTRY(int4_g128, 4, 128, __half, false)
GEMV_Q_ENTRY(q4_g32, 4, 32, __half, false)
GEMV_Q_ENTRY(q4_g32_min, 4, 32, __half, true)
GEMV_Q_ENTRY(q4_g32_kmin, 4, 32, float, true)
GEMV_Q_ENTRY(q5_g32, 5, 32, __half, false)
GEMV_Q_ENTRY(q5_g32_min, 5, 32, __half, true)
GEMV_Q_ENTRY(q5_g32_kmin, 5, 32, float, true)
GEMV_Q_ENTRY(q6_g16_k, 6, 16, float, false)
GEMV_Q_ENTRY(q8_g32, 8, 32, __half, false)
