// kernels/rope_kv.cu — QKV bias, RoPE, and the write of this step's K/V into the paged cache.
//
//   rope_kv   q      = rope(qkv[q] + bq, pos)        → q_out fp16 [Hq, Dh]
//             k      = rope(qkv[k] + bk, pos)        → k_cache[page(pos), :, slot(pos), :]
//             v      =      qkv[v] + bv              → v_cache[page(pos), :, slot(pos), :]
//   rope_kv_rows  the same for the rows of a prefill chunk (positions start … start+n-1; below)
//
// RoPE is the rotate-half (NeoX) form of HF Qwen2: for i < Dh/2, with x1 = x[i],
// x2 = x[i + Dh/2] and angle = float32(pos) · inv_freq[i]:
//     out[i] = x1·cos − x2·sin,   out[i + Dh/2] = x2·cos + x1·sin.
// inv_freq is a float32 [Dh/2] table built on the host exactly as HF does
// (1 / theta^(arange(0, Dh, 2) / Dh) in float32), and cos/sin are the accurate libdevice
// sincosf (≤ 2 ulp): no __sinf, no fast-math (DESIGN.md §9) — at pos ~ 3e4 the fast
// versions are off by ~1e-3 absolute, which shows in attention scores. The GEMV left q/k/v in
// FP32 (gemv_int4_qkv), so bias + rotation are FP32 and each output is rounded to FP16 once.
//
// pos comes from device memory (state[0]) and the page from the device block table, so a CUDA
// graph can replay this launch every step. Only the token at pos is written; nothing else in
// the cache is touched.
//
// Work split: one block per head — blocks [0, Hq) are query heads, [Hq, Hq+Hkv) key heads,
// [Hq+Hkv, Hq+2·Hkv) value heads (36 blocks at 7B) — and Dh/2 threads per block, thread i
// owning the rotation pair (i, i + Dh/2). head_dim is a runtime argument here: nothing is
// sized by it in registers.
// Bytes per call at 7B: (3584 + 1024) × 4 read + 4608 × 2 bias + 4608 × 2 written ≈ 37 KB:
// pure latency (~2 µs), a candidate for fusion into the QKV GEMV epilogue later.
#include <cuda_fp16.h>

#include "types.cuh"     // u64
#include "kv_cache.cuh"  // PAGE_TOKENS, kv_offset

// One token at position `pos`, one head, thread i: the work of both kernels below.
// src_row: the token's fp32 q | k | v row; q_dst: where this token's rotated query goes.
// Heads are numbered as the grid's x: [0, Hq) query, [Hq, Hq+Hkv) key, then value heads.
__device__ __forceinline__ void
rope_kv_token(__half* __restrict__ q_dst, __half* __restrict__ k_cache, __half* __restrict__ v_cache,
              const float* __restrict__ src_row, const __half* __restrict__ q_bias,
              const __half* __restrict__ k_bias, const __half* __restrict__ v_bias,
              const float* __restrict__ inv_freq, const int* __restrict__ block_table,
              int pos, int head, int i, int Hq, int Hkv, int Dh) {
    const int half_dim = Dh / 2;
    if (head >= Hq + Hkv) {  // value head: bias only
        head -= Hq + Hkv;
        const float* src = src_row + (u64)(Hq + Hkv) * Dh + (u64)head * Dh;
        const __half* b = v_bias + (u64)head * Dh;
        __half* dst = v_cache + kv_offset(block_table[pos / PAGE_TOKENS], head,
                                          pos % PAGE_TOKENS, Hkv, Dh);
        dst[i] = __float2half_rn(src[i] + __half2float(b[i]));
        dst[i + half_dim] = __float2half_rn(src[i + half_dim] + __half2float(b[i + half_dim]));
        return;
    }
    const bool is_q = head < Hq;
    if (!is_q) head -= Hq;
    const float* src = src_row + (is_q ? 0 : (u64)Hq * Dh) + (u64)head * Dh;
    const __half* b = (is_q ? q_bias : k_bias) + (u64)head * Dh;
    const float x1 = src[i] + __half2float(b[i]);
    const float x2 = src[i + half_dim] + __half2float(b[i + half_dim]);
    const float angle = (float)pos * inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    __half* dst = is_q ? q_dst + (u64)head * Dh
                       : k_cache + kv_offset(block_table[pos / PAGE_TOKENS], head,
                                             pos % PAGE_TOKENS, Hkv, Dh);
    dst[i] = __float2half_rn(x1 * c - x2 * s);
    dst[i + half_dim] = __float2half_rn(x2 * c + x1 * s);
}

// grid (Hq + 2·Hkv), block (Dh/2).
extern "C" __global__ void
rope_kv(__half* __restrict__ q_out,          // [Hq, Dh] fp16, out (rotated query)
        __half* __restrict__ k_cache,        // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
        __half* __restrict__ v_cache,        // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
        const float* __restrict__ qkv,       // [Hq·Dh + 2·Hkv·Dh] fp32: q | k | v (no bias yet)
        const __half* __restrict__ q_bias,   // [Hq·Dh] fp16
        const __half* __restrict__ k_bias,   // [Hkv·Dh] fp16
        const __half* __restrict__ v_bias,   // [Hkv·Dh] fp16
        const float* __restrict__ inv_freq,  // [Dh/2] fp32
        const int* __restrict__ state,       // [3] int32: pos, token, seq_len (reads [0])
        const int* __restrict__ block_table, // [max_pages] int32: logical → physical page
        int Hq, int Hkv, int Dh) {
    const int i = threadIdx.x;
    if (i >= Dh / 2) return;
    rope_kv_token(q_out, k_cache, v_cache, qkv, q_bias, k_bias, v_bias, inv_freq, block_table,
                  state[0], blockIdx.x, i, Hq, Hkv, Dh);
}

// ---- Prefill: the same for the n_rows tokens of a prompt chunk ---------------------------------
//
//   rope_kv_rows   for each chunk row r < n_rows at position p = start + r:
//                  q_out[r] = rope(qkv[r, q] + bq, p);  K/V cache[page(p), :, slot(p), :] = rope(k), v
//
// The arithmetic is rope_kv's, row by row (FP32 bias + rotation with the accurate sincosf,
// one FP16 rounding). (start, n_rows) come from prefill_state in device memory; the grid is
// sized for the chunk's row capacity and rows ≥ n_rows return at once, so one launch serves
// every chunk of that size. Pages for every written position are in the block table before the
// launch (the host reserves them for the whole prompt).
//
// Work split: grid (Hq + 2·Hkv, rows_max) — blockIdx.x is the head as in rope_kv, blockIdx.y the
// row; block (Dh/2), thread i owning the rotation pair (i, i + Dh/2).
// Bytes per call at 7B, 512 rows: 512 × (4608 × 4 read + 4608 × 2 bias (L1/L2) + 4608 × 2
// written) ≈ 14 MB: a few µs of bandwidth, latency-bound below ~100 rows.

// grid (Hq + 2·Hkv, rows_max), block (Dh/2).
extern "C" __global__ void
rope_kv_rows(__half* __restrict__ q_out,            // [rows, Hq, Dh] fp16, out (rotated queries)
             __half* __restrict__ k_cache,          // [P, Hkv, 16, Dh] fp16, this layer; slots start … start+n_rows-1 written
             __half* __restrict__ v_cache,          // [P, Hkv, 16, Dh] fp16, this layer; likewise
             const float* __restrict__ qkv,         // [rows, Hq·Dh + 2·Hkv·Dh] fp32: q | k | v (no bias yet)
             const __half* __restrict__ q_bias,     // [Hq·Dh] fp16
             const __half* __restrict__ k_bias,     // [Hkv·Dh] fp16
             const __half* __restrict__ v_bias,     // [Hkv·Dh] fp16
             const float* __restrict__ inv_freq,    // [Dh/2] fp32
             const int* __restrict__ prefill_state, // [2] int32: start position, n_rows
             const int* __restrict__ block_table,   // [max_pages] int32: logical → physical page
             int Hq, int Hkv, int Dh) {
    const int i = threadIdx.x;
    const int row = blockIdx.y;
    if (i >= Dh / 2 || row >= prefill_state[1]) return;
    const int width = (Hq + 2 * Hkv) * Dh;
    rope_kv_token(q_out + (u64)row * Hq * Dh, k_cache, v_cache, qkv + (u64)row * width, q_bias,
                  k_bias, v_bias, inv_freq, block_table, prefill_state[0] + row, blockIdx.x, i,
                  Hq, Hkv, Dh);
}
