// kernels/rope.cuh — the rotate-half (NeoX) RoPE of one pair of dims, the one definition shared
// by rope_kv.cu (prefill rows), the prefill QKV GEMM's epilogue (gemm_int4.cu) and the decode QKV
// GEMVs' epilogues (gemv_int4.cu, gemv_fmt.cu).
//
// For pair i < Dh/2 of a head, x1 = x[i], x2 = x[i + Dh/2], angle = float32(pos) · inv_freq[i]:
//     out[i] = x1·cos − x2·sin,   out[i + Dh/2] = x2·cos + x1·sin
// as Hugging Face's Qwen2 computes it. inv_freq is the float32 [Dh/2] table built on the host
// exactly as HF does (1 / theta^(arange(0, Dh, 2) / Dh) in float32), and cos/sin are the
// accurate libdevice sincosf (≤ 2 ulp): no __sinf, no fast-math
// (docs/numerics.md#rope-angles-as-hf-computes-them) — at pos ~ 3e4 the fast versions are off
// by ~1e-3 absolute, which shows in attention scores.
#pragma once

// cos and sin of pair i's angle at position pos: the accurate libdevice sincosf.
__device__ __forceinline__ float2 rope_cos_sin(int pos, float inv_freq_i) {
    const float angle = (float)pos * inv_freq_i;
    float s, c;
    sincosf(angle, &s, &c);
    return make_float2(c, s);
}

// The rotation of (x1, x2) by an angle of cosine c and sine s.
__device__ __forceinline__ void rope_apply(float x1, float x2, float c, float s, float& out1, float& out2) {
    // The contraction spelled out (x1·c rounded inside an FMA, x2·s rounded alone): the form
    // ptxas picks for `x1 * c - x2 * s` anyway, fixed here so that every kernel including this
    // file (the rope_kv rows, the decode QKV GEMVs, the prefill QKV GEMM's epilogue) rounds the
    // same way and their outputs can be compared bit for bit.
    out1 = __fmaf_rn(x1, c, -__fmul_rn(x2, s));
    out2 = __fmaf_rn(x2, c, __fmul_rn(x1, s));
}

__device__ __forceinline__ void rope_rotate(float x1, float x2, int pos, float inv_freq_i,
                                            float& out1, float& out2) {
    const float2 cs = rope_cos_sin(pos, inv_freq_i);
    rope_apply(x1, x2, cs.x, cs.y, out1, out2);
}
