"""Per-tensor weight formats of a `.nanoqwen` file (version 3): one family of grouped integer
formats, and the numpy statement of each that the reference and every kernel test use.

A quantized weight W [N, K] (HF [out_features, in_features]) is cut along K into groups of g
inputs. Input k of row n has an unsigned b-bit code c, its group a scale s and, in the formats
with an offset, an offset o:

    symmetric:    w = (c - z) · s          z = 2^(b-1)      (c - z is the signed code)
    with offset:  w =  c · s + o           z = 0

computed in float32 in exactly that order: the product rounded to float32, then the sum. That
is the order `gguf`'s dequantizers use, so a GGUF block carried in the format of its type
dequantizes to the same float32 bits (docs/quantization.md, "Per-tensor formats").

| id | name          | b | g   | scale | offset | source types                        |
|----|---------------|---|-----|-------|--------|-------------------------------------|
|  1 | int4_g128     | 4 | 128 | fp16  | –      | F32/F16/BF16 (HF checkpoints)       |
|  2 | q4_g32        | 4 | 32  | fp16  | –      | Q4_0                                |
|  3 | q4_g32_min    | 4 | 32  | fp16  | fp16   | Q4_1                                |
|  4 | q4_g32_kmin   | 4 | 32  | fp32  | fp32   | Q4_K  (s = d·sc, o = −dmin·m)       |
|  5 | q5_g32        | 5 | 32  | fp16  | –      | Q5_0                                |
|  6 | q5_g32_min    | 5 | 32  | fp16  | fp16   | Q5_1                                |
|  7 | q5_g32_kmin   | 5 | 32  | fp32  | fp32   | Q5_K  (s = d·sc, o = −dmin·m)       |
|  8 | q6_g16_k      | 6 | 16  | fp32  | –      | Q6_K  (s = d·sc)                    |
|  9 | q8_g32        | 8 | 32  | fp16  | –      | Q8_0; other GGUF types re-quantized |

The K-quant scales are products of an fp16 super-block scale and a 6- or 8-bit integer: at most
11 + 8 significant bits, so float32 holds them exactly where fp16 could not.

Tensors of a quantized weight with prefix P (`model.layers.3.mlp.down_proj`, `lm_head`,
`model.embed_tokens`):

    P.qweight  uint32 [N, K/8]   b ≤ 6: the low 4 bits of every code, layout id 1's nibble order
                                 (format/quant.py), so the GPU's lop3 unpack applies as it is
               uint32 [N, K/4]   b = 8: byte i of word j is the code of input 4j + i
    P.qhigh    uint32 [N, K/32]  b = 5: bit i of word j is bit 4 of input 32j + i
               uint32 [N, K/16]  b = 6: bits 2i, 2i+1 of word j are bits 4, 5 of input 16j + i
    P.scales   fp16|fp32 [N, K/g]
    P.offsets  fp16|fp32 [N, K/g]   formats with an offset only

Format id 1 is exactly the INT4 g128 layout of version-2 files (its c - 8 is quant.py's code).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FormatError
from . import quant

F16, F32, U32 = np.dtype("<f2"), np.dtype("<f4"), np.dtype("<u4")
PLAIN = 0          # format id of a dense tensor (fp16/fp32, its dtype in the table)


@dataclass(frozen=True)
class WeightFormat:
    """One grouped integer format (see the module doc)."""

    id: int
    name: str
    bits: int
    group: int
    scale_dtype: np.dtype
    offset_dtype: np.dtype | None
    sources: tuple[str, ...]

    @property
    def zero(self) -> int:
        """z of w = (c - z)·s: 2^(b-1) when symmetric, 0 with an offset."""
        return 0 if self.offset_dtype is not None else 1 << (self.bits - 1)

    @property
    def bits_per_weight(self) -> float:
        """Bits read per weight: the code plus the group's scale and offset."""
        per_group = 8 * self.scale_dtype.itemsize + (8 * self.offset_dtype.itemsize if self.offset_dtype else 0)
        return self.bits + per_group / self.group

    def tensors(self, prefix: str, n: int, k: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The table entries of a weight [n, k] in this format: name → (dtype, shape)."""
        out = {f"{prefix}.qweight": (U32, (n, k // 4 if self.bits == 8 else k // 8))}
        if self.bits == 5:
            out[f"{prefix}.qhigh"] = (U32, (n, k // 32))
        elif self.bits == 6:
            out[f"{prefix}.qhigh"] = (U32, (n, k // 16))
        out[f"{prefix}.scales"] = (self.scale_dtype, (n, k // self.group))
        if self.offset_dtype is not None:
            out[f"{prefix}.offsets"] = (self.offset_dtype, (n, k // self.group))
        return out

    def fits(self, k: int) -> bool:
        """Whether a weight with K = k inputs can be stored (whole groups and whole words)."""
        return k > 0 and k % self.group == 0 and k % 32 == 0


FORMATS: dict[int, WeightFormat] = {f.id: f for f in (
    WeightFormat(1, "int4_g128", 4, 128, F16, None, ("F32", "F16", "BF16")),
    WeightFormat(2, "q4_g32", 4, 32, F16, None, ("Q4_0",)),
    WeightFormat(3, "q4_g32_min", 4, 32, F16, F16, ("Q4_1",)),
    WeightFormat(4, "q4_g32_kmin", 4, 32, F32, F32, ("Q4_K",)),
    WeightFormat(5, "q5_g32", 5, 32, F16, None, ("Q5_0",)),
    WeightFormat(6, "q5_g32_min", 5, 32, F16, F16, ("Q5_1",)),
    WeightFormat(7, "q5_g32_kmin", 5, 32, F32, F32, ("Q5_K",)),
    WeightFormat(8, "q6_g16_k", 6, 16, F32, None, ("Q6_K",)),
    WeightFormat(9, "q8_g32", 8, 32, F16, None, ("Q8_0",)),
)}
INT4_G128 = FORMATS[1]
Q8_G32 = FORMATS[9]
# GGUF type name → the format that holds its blocks exactly.
EXACT_FOR_GGUF: dict[str, WeightFormat] = {s: f for f in FORMATS.values() if f.id != 1 for s in f.sources}
# Suffixes of the tensors a quantized weight is stored as.
PART_SUFFIXES = (".qweight", ".qhigh", ".scales", ".offsets")


def weight_prefix(name: str) -> str | None:
    """`model.layers.3.mlp.up_proj.scales` → `model.layers.3.mlp.up_proj`; None for a name that
    is not part of a quantized weight."""
    for s in PART_SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return None


def get_format(fid: int, where: str) -> WeightFormat:
    """The format of id `fid`. Raises FormatError naming `where` for an unknown id."""
    f = FORMATS.get(fid)
    if f is None:
        raise FormatError(f"{where}: weight format id {fid} unknown to this drvqwen "
                          f"(it knows {', '.join(str(i) for i in FORMATS)})")
    return f


# ---------------------------------------------------------------------------------------------
# Packing: codes [N, K] uint8 ↔ the qweight / qhigh planes
# ---------------------------------------------------------------------------------------------
def pack_codes(fmt: WeightFormat, codes: np.ndarray) -> dict[str, np.ndarray]:
    """codes uint8 [N, K] in [0, 2^b) → {"qweight": …, "qhigh": …} (qhigh for b = 5, 6)."""
    n, k = codes.shape
    c = codes.astype(np.uint32)
    if int(c.max(initial=0)) >= 1 << fmt.bits:
        raise ValueError(f"pack_codes: codes exceed {fmt.bits} bits")
    if fmt.bits == 8:
        w = c.reshape(n, k // 4, 4) << (np.arange(4, dtype=np.uint32) * 8)
        return {"qweight": np.bitwise_or.reduce(w, axis=2)}
    out = {"qweight": quant.pack((c & 0xF).astype(np.int8) - 8)}
    if fmt.bits > 4:
        hb = fmt.bits - 4                                    # 1 or 2 high bits per input
        per = 32 // hb                                       # inputs per high word
        hi = (c >> 4).reshape(n, k // per, per) << (np.arange(per, dtype=np.uint32) * hb)
        out["qhigh"] = np.bitwise_or.reduce(hi, axis=2)
    return out


def unpack_codes(fmt: WeightFormat, qweight: np.ndarray, qhigh: np.ndarray | None = None) -> np.ndarray:
    """Inverse of `pack_codes`: the planes → codes uint8 [N, K]."""
    n = qweight.shape[0]
    if fmt.bits == 8:
        b = (qweight[:, :, None] >> (np.arange(4, dtype=np.uint32) * 8)) & 0xFF
        return b.reshape(n, -1).astype(np.uint8)
    c = (quant.unpack(np.asarray(qweight)).astype(np.int16) + 8).astype(np.uint8)
    if fmt.bits > 4:
        hb = fmt.bits - 4
        per = 32 // hb
        hi = (np.asarray(qhigh)[:, :, None] >> (np.arange(per, dtype=np.uint32) * hb)) & ((1 << hb) - 1)
        c |= (hi.reshape(n, -1) << 4).astype(np.uint8)
    return c


def dequantize_parts(fmt: WeightFormat, codes: np.ndarray, scales: np.ndarray,
                     offsets: np.ndarray | None = None) -> np.ndarray:
    """w = (c - z)·s (symmetric) or c·s + o (offset), float32 [N, K], in gguf's order of
    float32 operations (so exact formats reproduce `gguf.quants.dequantize` bit for bit)."""
    n, k = codes.shape
    groups = k // fmt.group
    s = np.asarray(scales).astype(np.float32)[:, :, None]
    if fmt.offset_dtype is None:
        q = (codes.astype(np.int16) - fmt.zero).astype(np.float32).reshape(n, groups, fmt.group)
        return (q * s).reshape(n, k)
    q = codes.astype(np.float32).reshape(n, groups, fmt.group)
    o = np.asarray(offsets).astype(np.float32)[:, :, None]
    return (q * s + o).reshape(n, k)


def dequantize_weight(fmt: WeightFormat, get, prefix: str, dtype=np.float32) -> np.ndarray:
    """Dequantize the weight `prefix` stored in `fmt`; get(name) returns a stored tensor.
    Returns [N, K] `dtype`."""
    qhigh = get(f"{prefix}.qhigh") if fmt.bits in (5, 6) else None
    codes = unpack_codes(fmt, np.asarray(get(f"{prefix}.qweight")), qhigh)
    offsets = get(f"{prefix}.offsets") if fmt.offset_dtype is not None else None
    return dequantize_parts(fmt, codes, get(f"{prefix}.scales"), offsets).astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# Quantizing a float weight (sources without blocks of their own)
# ---------------------------------------------------------------------------------------------
def quantize_dense(fmt: WeightFormat, w: np.ndarray) -> dict[str, np.ndarray]:
    """Quantize float w [N, K] into symmetric `fmt` (int4_g128 or q8_g32): s = fp16(max|w|/qmax),
    c = clip(rint(w / s), -qmax-1, qmax) + z, as quant.py's rule. Returns the stored parts
    {"qweight", ["qhigh"], "scales"}.

    Raises:
        ValueError: fmt has an offset or fp32 scales (only sources' own blocks use those).
    """
    if fmt.id == INT4_G128.id:
        qw, s = quant.quantize_packed(w)
        return {"qweight": qw, "scales": s}
    if fmt.offset_dtype is not None or fmt.scale_dtype != F16:
        raise ValueError(f"quantize_dense: {fmt.name} holds a source's blocks, it is not a quantizer target")
    n, k = w.shape
    qmax = (1 << (fmt.bits - 1)) - 1
    g = np.asarray(w, np.float32).reshape(n, k // fmt.group, fmt.group)
    s = (np.abs(g).max(axis=2) / qmax).astype(np.float16)
    s[s == 0] = np.float16(1.0)
    q = np.clip(np.rint(g / s.astype(np.float32)[:, :, None]), -qmax - 1, qmax).astype(np.int16)
    parts = pack_codes(fmt, (q + fmt.zero).astype(np.uint8).reshape(n, k))
    parts["scales"] = s
    return parts


def parts_nbytes(fmt: WeightFormat, n: int, k: int) -> int:
    """Bytes of a weight [n, k] stored in fmt (the bytes a GEMV over it reads)."""
    return sum(int(np.prod(shape)) * dt.itemsize for dt, shape in fmt.tensors("w", n, k).values())
