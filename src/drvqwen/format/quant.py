"""Symmetric INT4, group 128 along K, and the nibble layout the GPU GEMV unpacks (layout id 1).

Quantization (docs/quantization.md)
---------------------------
A projection weight W has the Hugging Face shape [N, K] = [out_features, in_features] and
computes y = W x. Each row is cut into groups of G = 128 consecutive inputs; each group gets
one FP16 scale s, and

    q = clamp(round(w / s), -8, 7)          w' = q * s

(round half to even, numpy's rule). We use s = max|w_group| / 7: the largest weight maps
exactly to ±7, nothing clips, and every error is at most s/2 = max|w_group| / 14 (plus the
FP16 rounding of s, absorbed because q is computed against the stored s). -8 is never
produced from data but is a legal code.

A clipping search (s = alpha * max / 7, alpha in [0.70, 1.00], per group the least squared
error; `quantize(w, alphas=CLIP_SEARCH)`) lowers the weight error by ~13% (relative L2 0.103–0.128
against 0.120–0.148 on the real Qwen2.5-Coder-0.5B) — and makes the model worse: over ~900
tokens of code the mean KL divergence from the unquantized model's next-token distribution
rose from 0.162 (plain) to 0.219 (search), and top-1 agreement fell from 0.789 to 0.752;
weighting the search by the RMSNorm gains was worse still (KL 0.408). The largest weights of
a group matter more than their share of the squared error, and clipping damages exactly
those. So the plain scale is the default; the search stays for the record and for
experiments. The group-RMS bound below holds for both (alpha = 1 is among the candidates).

Layout id 1 ("FT-interleaved rows")
-----------------------------------
- `qweight`: uint32 [N, K/8], row-major. Word j of row n holds inputs k = 8j … 8j+7 as
  nibbles stored as q + 8 (0..15). Nibble p (bits 4p … 4p+3) holds input 8j + NIBBLE_ORDER[p]
  with NIBBLE_ORDER = [0, 2, 4, 6, 1, 3, 5, 7].
- `scales`: float16 [N, K/128], row-major; group g of row n covers k = 128g … 128g+127.

Why that order: the GEMV turns one 32-bit word into four `half2` (inputs (0,1), (2,3), (4,5),
(6,7)) with no per-element shifts or conversions.

    lo  = lop3(word,      0x000F000F, 0x64006400)  # nibbles 0 and 4 -> inputs 0, 1
    hi  = lop3(word,      0x00F000F0, 0x64006400)  # nibbles 1 and 5 -> inputs 2, 3 (x16)
    lo2 = lop3(word >> 8, 0x000F000F, 0x64006400)  # nibbles 2 and 6 -> inputs 4, 5
    hi2 = lop3(word >> 8, 0x00F000F0, 0x64006400)  # nibbles 3 and 7 -> inputs 6, 7 (x16)

OR-ing a nibble v into the mantissa of 1024.0 (0x6400) gives the half 1024 + v, so
`lo - (1024 + 8)` is q; a nibble sitting 4 bits higher gives 1024 + 16v, hence
`hi * (1/16) - (64 + 8)` in one `fma`. Each half of a half2 takes the 16-bit lane of the word
it sits in, so nibble p and nibble p+4 land in the low and high half of the same half2: that is
why inputs 2i and 2i+1 sit 4 nibbles apart. (FasterTransformer and Marlin use the same trick.)

Every shape in the Qwen2.5 family has K % 128 == 0 (896, 3584, 4864, 18944 …).
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError

GROUP_SIZE = 128
LAYOUT_ID = 1
# Bumped when the quantizer's choice of codes/scales changes (not the layout), so that cached
# conversions (models.conversion_path) are redone.
QUANTIZER_VERSION = 3
# NIBBLE_ORDER[p] = which of the word's 8 inputs sits in nibble p.
NIBBLE_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7], dtype=np.int64)
QMIN, QMAX = -8, 7


# The default: the plain scale s = max / 7 (see the module doc for why no clipping search).
PLAIN = np.array([1.0], dtype=np.float32)
# Candidate clipping ratios of the (measured, rejected) clipping search: 0.70, 0.72, …, 1.00.
CLIP_SEARCH = np.linspace(0.70, 1.00, 16, dtype=np.float32)
# Rows quantized at a time: bounds the float32 temporaries to ~ROW_CHUNK × K × 4 B × a few.
ROW_CHUNK = 1024


def _quantize_rows(g: np.ndarray, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """g: [n, groups, G] float32 → (q int8 [n, groups, G], scales f16 [n, groups])."""
    amax = np.abs(g).max(axis=2)                                    # [n, groups]
    best_err = np.full(amax.shape, np.inf, dtype=np.float32)
    best_s = np.ones(amax.shape, dtype=np.float16)
    for a in alphas:
        s = (amax * np.float32(a) / QMAX).astype(np.float16)        # the stored FP16 scale
        s[s == 0] = np.float16(1.0)                                 # all-zero group: any scale
        s32 = s.astype(np.float32)[:, :, None]
        err = np.square(np.clip(np.rint(g / s32), QMIN, QMAX) * s32 - g).sum(axis=2)
        better = err < best_err
        best_err[better] = err[better]
        best_s[better] = s[better]
    s32 = best_s.astype(np.float32)[:, :, None]
    q = np.clip(np.rint(g / s32), QMIN, QMAX).astype(np.int8)
    return q, best_s


def quantize(w: np.ndarray, group_size: int = GROUP_SIZE,
             alphas: np.ndarray = PLAIN) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a weight matrix to symmetric INT4 codes with one FP16 scale per group.

    Args:
        w: [N, K] float (any float dtype; computed in float32). K % group_size == 0.
        alphas: clipping ratios searched per group (see the module doc); the default `PLAIN`
            is s = max|w_group| / 7, `CLIP_SEARCH` the least-squares clipping search.
    Returns:
        q: [N, K] int8 codes in [-8, 7].
        scales: [N, K / group_size] float16 (1.0 for an all-zero group, so that dequantization
            never divides or produces NaN). q is computed against the stored FP16 scale.
    Raises:
        ValueError: K is not a multiple of group_size or w is not 2-D.
    """
    if w.ndim != 2:
        raise ValueError(f"quantize: expected a 2-D weight, got shape {w.shape}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"quantize: K={k} is not a multiple of the group size {group_size}")
    q = np.empty((n, k), dtype=np.int8)
    scales = np.empty((n, k // group_size), dtype=np.float16)
    for r0 in range(0, n, ROW_CHUNK):
        r1 = min(n, r0 + ROW_CHUNK)
        g = np.asarray(w[r0:r1], dtype=np.float32).reshape(r1 - r0, k // group_size, group_size)
        qc, sc = _quantize_rows(g, np.asarray(alphas, dtype=np.float32))
        q[r0:r1] = qc.reshape(r1 - r0, k)
        scales[r0:r1] = sc
    return q, scales


def dequantize_codes(q: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """w' = q * s per group.  q: [N, K] int8, scales: [N, K/G] f16 → [N, K] `dtype`."""
    n, k = q.shape
    g = k // scales.shape[1]
    out = q.reshape(n, scales.shape[1], g).astype(np.float32) * scales.astype(np.float32)[:, :, None]
    return out.reshape(n, k).astype(dtype, copy=False)


def pack(q: np.ndarray) -> np.ndarray:
    """Pack INT4 codes into layout id 1.  q: [N, K] int8 in [-8, 7] → qweight [N, K/8] uint32."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"pack: K={k} is not a multiple of 8")
    if q.min(initial=0) < QMIN or q.max(initial=0) > QMAX:
        raise ValueError("pack: codes outside [-8, 7]")
    nib = (q.astype(np.int32) + 8).astype(np.uint32).reshape(n, k // 8, 8)  # [N, K/8, 8] inputs
    words = np.zeros((n, k // 8), dtype=np.uint32)
    for p in range(8):
        words |= nib[:, :, NIBBLE_ORDER[p]] << np.uint32(4 * p)
    return words


def unpack(qweight: np.ndarray) -> np.ndarray:
    """Inverse of `pack`: qweight [N, K/8] uint32 → codes [N, K] int8 in [-8, 7].

    This is the numpy statement of layout id 1 that every kernel test dequantizes through.
    """
    n, kw = qweight.shape
    out = np.empty((n, kw, 8), dtype=np.int8)
    for p in range(8):
        out[:, :, NIBBLE_ORDER[p]] = ((qweight >> np.uint32(4 * p)) & np.uint32(0xF)).astype(np.int8) - 8
    return out.reshape(n, kw * 8)


def dequantize(qweight: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Dequantize a packed tensor: qweight [N, K/8] uint32, scales [N, K/G] f16 → [N, K]."""
    if qweight.dtype != np.uint32 or scales.dtype != np.float16:
        raise FormatError(f"dequantize: expected uint32 qweight and float16 scales, "
                          f"got {qweight.dtype} and {scales.dtype}")
    return dequantize_codes(unpack(qweight), scales, dtype)


def quantize_packed(w: np.ndarray, group_size: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """quantize + pack: w [N, K] → (qweight [N, K/8] uint32, scales [N, K/G] f16)."""
    q, s = quantize(w, group_size)
    return pack(q), s


def error_bound(w: np.ndarray, scales: np.ndarray, group_size: int = GROUP_SIZE) -> np.ndarray:
    """Per-element bound on |w - w'| given the stored scales [N, K/G]: s/2 where w lies inside
    the grid's range (round to nearest), and |w| - 7 s where it was clipped. [N, K] float32,
    with a 1e-6 relative slack for float32 arithmetic."""
    s = np.repeat(scales.astype(np.float32), group_size, axis=1)
    b = np.maximum(s / 2, np.abs(np.asarray(w, np.float32)) - QMAX * s)
    return b * (1 + 1e-6) + 1e-12


def group_rms_bound(w: np.ndarray, group_size: int = GROUP_SIZE) -> np.ndarray:
    """Bound on each group's RMS error: s1/2 with s1 = fp16(max|w_group| / 7), the plain
    quantizer's step (the search only keeps scales that do at least as well). [N, K/G] f32."""
    n, k = w.shape
    amax = np.abs(np.asarray(w, np.float32)).reshape(n, k // group_size, group_size).max(axis=2)
    s1 = (amax / QMAX).astype(np.float16).astype(np.float32)
    return s1 / 2 * (1 + 1e-5) + 1e-12


def reconstruction_error(w: np.ndarray, w_hat: np.ndarray) -> dict[str, float]:
    """Error figures printed by `convert`: relative L2 (‖w−w'‖/‖w‖), max abs, and SNR in dB."""
    return reconstruction_error_rows([(w, w_hat)])


def reconstruction_error_rows(blocks) -> dict[str, float]:
    """`reconstruction_error` of one weight given as (w, w_hat) blocks of its rows, taken one at
    a time: the float64 difference of a whole 7B embedding would be 4.4 GB."""
    sum_w2 = sum_d2 = max_abs = 0.0
    for w, w_hat in blocks:
        w = np.asarray(w, dtype=np.float64).ravel()
        d = w - np.asarray(w_hat, dtype=np.float64).ravel()
        sum_w2 += float(np.dot(w, w))
        sum_d2 += float(np.dot(d, d))
        max_abs = max(max_abs, float(np.abs(d).max()) if d.size else 0.0)
    rel = float(np.sqrt(sum_d2)) / (float(np.sqrt(sum_w2)) or 1.0)
    return {"rel_l2": rel, "max_abs": max_abs, "snr_db": float(-20 * np.log10(rel)) if rel > 0 else float("inf")}
