"""The q4_k/q5_k scales' device layout: each super-block's 16 bytes as four lane words.

A q4_k or q5_k weight stores per 256-input super-block the GGUF block's 12 bytes of packed 6-bit
(sc, m) (`scales` uint8 [N, K/256, 12], weight_formats.get_scale_min) and the FP16 pair (d, dmin)
(`superscales` fp16 [N, K/256, 2]). The GPU holds the same 16 bytes rearranged into four
uint32 lane words, together, in one plane (`scales` uint32 [N, K/256, 4], no `superscales`):

    word t (t < 4) = sc_t | m_t << 6 | sc_{t+4} << 12 | m_{t+4} << 18 | D_t << 24

sc_j, m_j: sub-block j's 6-bit values; D_0 … D_3: the bytes of (d, dmin), little-endian (d's in
D_0, D_1). The decode GEMVs' lane t of a quad multiplies sub-block t or t + 4 of a super-block,
so its (sc, m) are a shift and two masks of the one word it loads, and (d, dmin) the quad's four
top bytes; the prefill GEMMs' consumers read a row's four words with one 16-byte load
(kernels/weight_formats.cuh says what each saves). The file keeps the GGUF's packing (the CPU
reference reads it); the GPU rearranges it when a model is loaded (gpu_weights.py,
kernels/weight_layout.cu: kquant_scales_to_lanes), and the kernel tests upload `to_lane_words`
of it (launchers/gemv_fmt.device_parts).
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from .weight_formats import get_scale_min, pack_scale_min

SUPER_BYTES = 12   # packed (sc, m) bytes a super-block
LANES = 4          # lane words a super-block


def _check(scales: np.ndarray, superscales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc = np.ascontiguousarray(scales).view(np.uint8)
    ss = np.ascontiguousarray(superscales)
    if sc.shape[-1] != SUPER_BYTES or ss.view(np.uint16).shape != sc.shape[:-1] + (2,):
        raise FormatError(f"K-quant lane words: scales {tuple(np.shape(scales))} and superscales "
                          f"{tuple(np.shape(superscales))} are not [..., {SUPER_BYTES}] and [..., 2] of the same super-blocks")
    return sc, ss.view(np.uint16)


def to_lane_words(scales: np.ndarray, superscales: np.ndarray) -> np.ndarray:
    """(scales uint8 [..., 12], superscales fp16 [..., 2]) of a q4_k/q5_k weight in the file's
    layout → its lane words, uint32 [..., 4] (word t of each super-block as above).

    Raises:
        FormatError: the shapes do not describe the same super-blocks.
    """
    sc_bytes, dd = _check(scales, superscales)
    sc, m = (x.astype(np.uint32) for x in get_scale_min(sc_bytes))               # [..., 8] each
    d_bytes = dd.view(np.uint8).astype(np.uint32)                                # [..., 4]: D_0 … D_3
    words = sc[..., :4] | m[..., :4] << 6 | sc[..., 4:] << 12 | m[..., 4:] << 18 | d_bytes << 24
    return np.ascontiguousarray(words.astype(np.uint32))                         # [..., 4]


def from_lane_words(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `to_lane_words`: lane words uint32 [..., 4] back to the file's (scales uint8
    [..., 12], superscales fp16 [..., 2]).

    Raises:
        FormatError: `words` is not uint32 [..., 4].
    """
    words = np.asarray(words)
    if words.dtype != np.uint32 or words.ndim < 1 or words.shape[-1] != LANES:
        raise FormatError(f"K-quant lane words: {words.dtype} {tuple(words.shape)} is not uint32 [..., {LANES}]")
    lo, hi = words & 0xFFF, (words >> 12) & 0xFFF
    sc = np.concatenate([lo & 63, hi & 63], axis=-1)
    m = np.concatenate([lo >> 6, hi >> 6], axis=-1)
    d_bytes = np.ascontiguousarray((words >> 24).astype(np.uint8))                     # [..., 4]
    return pack_scale_min(sc, m).reshape(words.shape[:-1] + (SUPER_BYTES,)), \
        d_bytes.view(np.float16).reshape(words.shape[:-1] + (2,))
