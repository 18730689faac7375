"""GGUF quantized blocks → codes and the stored scale parts of the drvqwen format that holds them.

Each reader below follows the block layout of the `gguf` package's dequantizer for that type
(gguf-py `gguf/quants.py`, itself ggml's `ggml-quants.c`), but stops before the multiplication:
it returns the integer codes c [N, K] and the block's scale fields as the format stores them —
fp16 scale (and offset) per group for the flat formats; for the K-quants the fp16 d (and dmin)
and the integer sub-block scale bytes, copied as they are — so that
`weight_formats.dequantize_weight` then computes the very same float32 products.

Byte layouts (little-endian; one row of K inputs is K / block_size blocks back to back):

    Q4_0  (32, 18 B):  d f16 | qs[16]: low nibbles inputs 0–15, high nibbles 16–31; w = d(q − 8)
    Q4_1  (32, 20 B):  d f16 | m f16 | qs[16];                                     w = d q + m
    Q5_0  (32, 22 B):  d f16 | qh u32 (bit i: bit 4 of input i) | qs[16];          w = d(q − 16)
    Q5_1  (32, 24 B):  d f16 | m f16 | qh u32 | qs[16];                            w = d q + m
    Q8_0  (32, 34 B):  d f16 | x int8[32];                                         w = d x
    Q4_K (256, 144 B): d f16 | dmin f16 | 12 B of eight 6-bit (sc, m) | qs[128]: bytes 32i … 32i+31
                       hold sub-blocks 2i (low nibbles) and 2i+1 (high);  w = d·sc_j q − dmin·m_j
    Q5_K (256, 176 B): as Q4_K with qh[32] before qs: bit j of qh byte i is bit 4 of input i of
                       sub-block j
    Q6_K (256, 210 B): ql[128] | qh[64] | sc int8[16] | d f16;   w = d·sc_j (q − 32), 16 per j
"""

from __future__ import annotations

import numpy as np

from .weight_formats import EXACT_FOR_GGUF, WeightFormat

_SHIFT_LO_HI = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)


def _f16_bits(b: np.ndarray) -> np.ndarray:
    """Bytes [n, 2j] → fp16 [n, j], bit for bit."""
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """Bytes [n, c·span] → nibbles [n, 2c·span]: low nibbles of each span first, then high."""
    n = qs.shape[0]
    return ((qs.reshape(n, -1, 1, span) >> _SHIFT_LO_HI) & 0x0F).reshape(n, -1)


def _bits(words: np.ndarray, count: int) -> np.ndarray:
    """u32 [n] → its low `count` bits, [n, count] uint8 (bit i at column i)."""
    return ((words.reshape(-1, 1) >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def read_q4_0(b):
    return _nibbles(b[:, 2:], 16), {"scales": _f16_bits(b[:, 0:2])}


def read_q4_1(b):
    return _nibbles(b[:, 4:], 16), {"scales": _f16_bits(b[:, 0:2]), "offsets": _f16_bits(b[:, 2:4])}


def read_q5_0(b):
    qh = np.ascontiguousarray(b[:, 2:6]).view(np.uint32)
    return _nibbles(b[:, 6:], 16) | (_bits(qh, 32) << 4), {"scales": _f16_bits(b[:, 0:2])}


def read_q5_1(b):
    qh = np.ascontiguousarray(b[:, 4:8]).view(np.uint32)
    return (_nibbles(b[:, 8:], 16) | (_bits(qh, 32) << 4),
            {"scales": _f16_bits(b[:, 0:2]), "offsets": _f16_bits(b[:, 2:4])})


def read_q8_0(b):
    codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, {"scales": _f16_bits(b[:, 0:2])}


def _k_parts(b):
    """Q4_K/Q5_K: (d, dmin) and the 12 scale bytes, as they are."""
    return {"scales": np.ascontiguousarray(b[:, 4:16]), "superscales": _f16_bits(b[:, 0:4])}


def read_q4_k(b):
    return _nibbles(b[:, 16:], 32), _k_parts(b)


def read_q5_k(b):
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    return _nibbles(b[:, 48:], 32) | ((qh & 1).reshape(n, -1) << 4), _k_parts(b)


def read_q6_k(b):
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64)                                             # [n, 256]
    qh = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = ql | ((qh & 3).reshape(n, -1) << 4)
    return codes, {"scales": np.ascontiguousarray(b[:, 192:208]).view(np.int8),
                   "superscales": _f16_bits(b[:, 208:210])}


READERS = {"Q4_0": read_q4_0, "Q4_1": read_q4_1, "Q5_0": read_q5_0, "Q5_1": read_q5_1,
           "Q8_0": read_q8_0, "Q4_K": read_q4_k, "Q5_K": read_q5_k, "Q6_K": read_q6_k}


def exact_format(type_name: str) -> WeightFormat | None:
    """The drvqwen format that holds GGUF type `type_name` exactly, or None."""
    return EXACT_FOR_GGUF.get(type_name) if type_name in READERS else None


def read_blocks(type_name: str, data: np.ndarray, n: int, k: int) -> tuple[WeightFormat, dict[str, np.ndarray]]:
    """A GGUF tensor's raw bytes → (format, parts) with parts {"codes" uint8 [n, k]} and the
    format's stored scale parts ("scales", "offsets", "superscales": those it has) in the
    dtypes and shapes of `format.tensors` (weight_formats.py).

    Args:
        type_name: the GGML type's name (`Q5_0` …), one of READERS.
        data: the tensor's bytes, uint8, n·k / block_size · type_size of them.
    Raises:
        KeyError: type_name has no exact format (see exact_format).
        ValueError: the byte count does not match [n, k].
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    fmt = EXACT_FOR_GGUF[type_name]
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = np.ascontiguousarray(np.asarray(data).view(np.uint8)).reshape(-1)
    if k % bs or raw.size != n * k // bs * ts:
        raise ValueError(f"{type_name}: {raw.size} bytes do not hold a [{n}, {k}] tensor")
    codes, stored = READERS[type_name](raw.reshape(-1, ts))
    # Blocks run along each row, so the block-major fields are already in row-major order.
    parts = {"codes": codes.reshape(n, k).astype(np.uint8)}
    for name, (dt, shape) in fmt.tensors("w", n, k).items():
        part = name.rsplit(".", 1)[1]
        if part in stored:
            parts[part] = stored[part].reshape(shape).astype(dt, copy=False)
    return fmt, parts
