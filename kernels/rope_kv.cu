// kernels/rope_kv.cu — QKV bias, RoPE, and the write of a prefill chunk's K/V into the paged cache.
//
//   rope_kv_rows     for each chunk row r < n_rows at position p = start + r:
//                    q_out[r] = rope(qkv[r, q] + bq, p);  K/V cache[page(p), :, slot(p), :] = rope(k), v
//   rope_table_rows  rope_cs[r, i] = (cos, sin) of pair i's angle at p = start + r, once per chunk
//                    for the QKV GEMM's epilogue (gemm_int4_qkv_rope), which every layer runs
//
// RoPE is the rotate-half (NeoX) form of HF Qwen2, computed by rope.cuh (FP32, the accurate
// sincosf, docs/numerics.md#rope-angles-as-hf-computes-them). The GEMM left q/k/v in FP32
// (gemm_int4_qkv), so bias + rotation are FP32 and each output is rounded to FP16 once. A
// decode step does the same inside its QKV GEMV's epilogue (gemv_int4.cu, same arithmetic).
//
// (start, n_rows) come from prefill_state in device memory; the grid is sized for the chunk's
// row capacity and rows ≥ n_rows return at once, so one launch serves every chunk of that
// size. Pages for every written position are in the block table before the launch (the host
// reserves them for the whole prompt). Only the chunk's positions are written.
//
// Work split: grid (rows_max), block ROPE_THREADS: block r is the row, and its threads take
// the row's (head, i) pairs in turn — head [0, Hq) query heads, [Hq, Hq+Hkv) key heads,
// [Hq+Hkv, Hq+2·Hkv) value heads (36 at 7B), i the rotation pair (i, i + Dh/2), consecutive
// threads consecutive i (coalesced). head_dim is a runtime argument: nothing is sized by it in
// registers. A first version ran one block of Dh/2 threads per (head, row), 9216 blocks of 32
// threads for the 0.5B's 512 rows: 10 µs a layer on the H200, spent scheduling blocks.
// Bytes per call at 7B, 512 rows: 512 × (4608 × 4 read + 4608 × 2 bias (L1/L2) + 4608 × 2
// written) ≈ 14 MB: a few µs of bandwidth, latency-bound below ~100 rows.
#include <cuda_fp16.h>

#include "types.cuh"     // u64
#include "kv_cache.cuh"  // PAGE_TOKENS, kv_offset
#include "rope.cuh"      // rope_rotate
#include "griddep.cuh"   // grid_dependency_wait, grid_launch_dependents

#define ROPE_THREADS 256  // threads per row (launchers/rope_kv.py mirrors it)

// One token at position `pos`, one head, rotation pair i (of the row's (head, i) items).
// src_row: the token's fp32 q | k | v row; q_dst: where this token's rotated query goes.
// Heads are numbered [0, Hq) query, [Hq, Hq+Hkv) key, then value heads.
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
    float o1, o2;
    rope_rotate(x1, x2, pos, inv_freq[i], o1, o2);
    __half* dst = is_q ? q_dst + (u64)head * Dh
                       : k_cache + kv_offset(block_table[pos / PAGE_TOKENS], head,
                                             pos % PAGE_TOKENS, Hkv, Dh);
    dst[i] = __float2half_rn(o1);
    dst[i + half_dim] = __float2half_rn(o2);
}

// grid (rows_max), block (ROPE_THREADS).
extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
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
    grid_launch_dependents();
    grid_dependency_wait();  // qkv and prefill_state are earlier kernels' outputs (programmatic launch)
    const int row = blockIdx.x;
    if (row >= prefill_state[1]) return;
    const int width = (Hq + 2 * Hkv) * Dh, half_dim = Dh / 2;
    const int pos = prefill_state[0] + row;
    for (int w = threadIdx.x; w < (Hq + 2 * Hkv) * half_dim; w += ROPE_THREADS)
        rope_kv_token(q_out + (u64)row * Hq * Dh, k_cache, v_cache, qkv + (u64)row * width, q_bias,
                      k_bias, v_bias, inv_freq, block_table, pos, w / half_dim, w % half_dim, Hq, Hkv, Dh);
}

// The chunk's RoPE angles, once for every layer and head: the QKV GEMM's epilogue
// (gemm_int4_qkv_rope) rotates with these instead of calling sincosf per element. Its tiles run
// on one block per SM and few SMs (the 0.5B's QKV at 512 tokens is 36 tiles), so ~30 accurate
// sincosf per lane, each a branch (the Payne–Hanek path) the compiler cannot schedule across,
// made the fused GEMM slower than the GEMM and rope_kv_rows apart (H200, 0.5B: 621 µs against
// 335 + 168 over 24 layers; docs/bench/2026-12-02_b80f3a3_h200_syn05b_rope_epilogue.json and
// 2026-12-02_8e6a560_h200_syn05b.json). The values are those rope_rotate computes
// (rope_cos_sin), so the epilogue's outputs equal rope_kv_rows' bit for bit.
// Work split: one thread per (row, pair), rows ≥ n_rows return; no shared memory, no barrier.
// Bytes: 8 per pair written (512 rows × 64 pairs: 256 KB at Dh = 128). The limit: latency (one
// dependent sincosf a thread; ~4 µs a chunk on an H100 at 512 rows,
// docs/bench/2026-12-02_81f037f_h100_syn05b_rope_epilogue.json).
// grid (ceil(rows_max · Dh/2 / ROPE_THREADS)), block (ROPE_THREADS).
extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope_table_rows(float2* __restrict__ rope_cs,         // [rows, Dh/2] fp32 (cos, sin), out
                const float* __restrict__ inv_freq,   // [Dh/2] fp32
                const int* __restrict__ prefill_state, // [2] int32: start position, n_rows
                int Dh) {
    grid_launch_dependents();
    grid_dependency_wait();  // prefill_state is the chunk's begin kernel's output (programmatic launch)
    const int half_dim = Dh / 2;
    const int idx = blockIdx.x * ROPE_THREADS + threadIdx.x;
    const int row = idx / half_dim, i = idx % half_dim;
    if (row >= __ldcg(prefill_state + 1)) return;
    rope_cs[idx] = rope_cos_sin(__ldcg(prefill_state) + row, inv_freq[i]);
}
