"""Per-tensor weight formats of a `.nanoqwen` file (version 4), and the numpy statement of each
that the reference and every kernel test use.

A quantized weight W [N, K] (HF [out_features, in_features]) is cut along K into groups of g
inputs. Input k of row n has an unsigned b-bit code c, its group a scale s and, in the formats
with an offset, an offset o:

    symmetric:    w = (c - z) · s          z = 2^(b-1)      (c - z is the signed code)
    with offset:  w =  c · s + o           z = 0

computed in float32 in exactly that order: the product rounded to float32, then the sum. That
is the order `gguf`'s dequantizers use, so a GGUF block carried in the format of its type
dequantizes to the same float32 bits (docs/quantization.md, "Per-tensor formats").

The flat formats store s (and o) per group. The K-quants keep the GGUF's two levels: a
super-block of 256 inputs has fp16 scales (d, and dmin with a min) and each group (sub-block)
a small integer scale (and min) in the GGUF's own bytes; s and o are formed in float32 as gguf
forms them, an fp16 value times an integer, exact:

    q4_k, q5_k:  s_j = d · sc_j,   o_j = −(dmin · m_j)     sc_j, m_j = get_scale_min(j, scales)
    q6_k:        s_j = d · sc_j                            sc_j int8, z = 32

| id | name       | b | g   | scale per group      | offset per group      | bytes/256 w | source |
|----|------------|---|-----|----------------------|-----------------------|-------------|--------|
|  1 | int4_g128  | 4 | 128 | fp16                 | –                     | 132         | F32/F16/BF16 (HF) |
|  2 | q4_g32     | 4 | 32  | fp16                 | –                     | 144         | Q4_0 |
|  3 | q4_g32_min | 4 | 32  | fp16                 | fp16                  | 160         | Q4_1 |
|  5 | q5_g32     | 5 | 32  | fp16                 | –                     | 176         | Q5_0 |
|  6 | q5_g32_min | 5 | 32  | fp16                 | fp16                  | 192         | Q5_1 |
|  9 | q8_g32     | 8 | 32  | fp16                 | –                     | 272         | Q8_0; other types re-quantized |
| 10 | q4_k       | 4 | 32  | d · sc (6-bit)       | −dmin · m (6-bit)     | 144         | Q4_K |
| 11 | q5_k       | 5 | 32  | d · sc (6-bit)       | −dmin · m (6-bit)     | 176         | Q5_K |
| 12 | q6_k       | 6 | 16  | d · sc (int8)        | –                     | 210         | Q6_K |

Every format of a GGUF type takes exactly the GGUF's bytes per weight.

Tensors of a quantized weight with prefix P (`model.layers.3.mlp.down_proj`, `lm_head`,
`model.embed_tokens`):

    P.qweight      uint32 [N, K/8]   b ≤ 6: the low 4 bits of every code, layout id 1's nibble
                                     order (format/quant.py), so the GPU's lop3 unpack applies
                   uint32 [N, K/4]   b = 8: byte i of word j is the code of input 4j + i
    P.qhigh        uint32 [N, K/32 · (b−4)]   b = 5, 6: the high bits (the plane below)
    P.scales       fp16 [N, K/g]              flat formats
                   uint8 [N, K/256, 12]       q4_k, q5_k: the GGUF block's 12 scale bytes as they
                                              are (eight 6-bit (sc, m), see get_scale_min)
                   int8 [N, K/16]             q6_k: the GGUF's sc
    P.offsets      fp16 [N, K/g]              q4_g32_min, q5_g32_min
    P.superscales  fp16 [N, K/256, 2]         q4_k, q5_k: (d, dmin)
                   fp16 [N, K/256]            q6_k: d

The high-bit plane puts a code's high bits at the bit positions of its nibble in qweight, so
the GPU ORs them in with one lop3 after the nibble unpack, no per-element shifts. With
HB = b − 4 and ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (nibble p of qweight word j holds input
8j + ORDER[p]): input 32c + 8i + ORDER[p] (i = 0..3, p = 0..7) of chunk c has its HB high bits
at bits [4p + HB·(i mod (4/HB)), +HB) of qhigh word HB·c + (i div (4/HB)) of its row, low bit
first:

    b = 5:  word c,             bit 4p + i
    b = 6:  word 2c + i div 2,  bits 4p + 2(i mod 2), 4p + 2(i mod 2) + 1

Format id 1 is exactly the INT4 g128 layout of version-2 files (its c - 8 is quant.py's code).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError
from . import quant

F16, F32, U32 = np.dtype("<f2"), np.dtype("<f4"), np.dtype("<u4")
U8, I8 = np.dtype("u1"), np.dtype("i1")
PLAIN = 0          # format id of a dense tensor (fp16/fp32, its dtype in the table)
SUPERBLOCK = 256   # inputs per K-quant super-block (ggml's QK_K)


@dataclass(frozen=True)
class WeightFormat:
    """One grouped integer format (see the module doc).

    scale_dtype: the stored scales' dtype (fp16 per group; a K-quant's integer scales).
    offset_dtype: the stored offsets' dtype (fp16), None where there are none stored.
    superblock: 256 for a K-quant (its fp16 `superscales` per 256 inputs), else 0.
    has_min: a K-quant with a min (q4_k, q5_k): offset −dmin·m per group.
    """

    id: int
    name: str
    bits: int
    group: int
    scale_dtype: np.dtype
    offset_dtype: np.dtype | None
    sources: tuple[str, ...]
    superblock: int = 0
    has_min: bool = False

    @property
    def has_offset(self) -> bool:
        """Whether w = c·s + o (else w = (c − z)·s)."""
        return self.offset_dtype is not None or self.has_min

    @property
    def zero(self) -> int:
        """z of w = (c - z)·s: 2^(b-1) when symmetric, 0 with an offset."""
        return 0 if self.has_offset else 1 << (self.bits - 1)

    @property
    def k_multiple(self) -> int:
        """K must be a multiple of this: whole groups, whole 32-input chunks, whole super-blocks."""
        return math.lcm(self.group, 32, self.superblock or 1)

    @property
    def bits_per_weight(self) -> float:
        """Bits stored (and read by a GEMV) per weight: codes, scales, offsets, super-scales."""
        k = math.lcm(self.k_multiple, 256)
        return parts_nbytes(self, 1, k) * 8 / k

    def tensors(self, prefix: str, n: int, k: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The table entries of a weight [n, k] in this format: name → (dtype, shape)."""
        out = {f"{prefix}.qweight": (U32, (n, k // 4 if self.bits == 8 else k // 8))}
        if self.bits in (5, 6):
            out[f"{prefix}.qhigh"] = (U32, (n, k // 32 * (self.bits - 4)))
        if self.superblock and self.has_min:
            out[f"{prefix}.scales"] = (self.scale_dtype, (n, k // self.superblock, 12))
        else:
            out[f"{prefix}.scales"] = (self.scale_dtype, (n, k // self.group))
        if self.offset_dtype is not None:
            out[f"{prefix}.offsets"] = (self.offset_dtype, (n, k // self.group))
        if self.superblock:
            shape = (n, k // self.superblock, 2) if self.has_min else (n, k // self.superblock)
            out[f"{prefix}.superscales"] = (F16, shape)
        return out

    def fits(self, k: int) -> bool:
        """Whether a weight with K = k inputs can be stored (whole groups, words and super-blocks)."""
        return k > 0 and k % self.k_multiple == 0


FORMATS: dict[int, WeightFormat] = {f.id: f for f in (
    WeightFormat(1, "int4_g128", 4, 128, F16, None, ("F32", "F16", "BF16")),
    WeightFormat(2, "q4_g32", 4, 32, F16, None, ("Q4_0",)),
    WeightFormat(3, "q4_g32_min", 4, 32, F16, F16, ("Q4_1",)),
    WeightFormat(5, "q5_g32", 5, 32, F16, None, ("Q5_0",)),
    WeightFormat(6, "q5_g32_min", 5, 32, F16, F16, ("Q5_1",)),
    WeightFormat(9, "q8_g32", 8, 32, F16, None, ("Q8_0",)),
    WeightFormat(10, "q4_k", 4, 32, U8, None, ("Q4_K",), SUPERBLOCK, True),
    WeightFormat(11, "q5_k", 5, 32, U8, None, ("Q5_K",), SUPERBLOCK, True),
    WeightFormat(12, "q6_k", 6, 16, I8, None, ("Q6_K",), SUPERBLOCK, False),
)}
INT4_G128 = FORMATS[1]
Q8_G32 = FORMATS[9]
# GGUF type name → the format that holds its blocks exactly.
EXACT_FOR_GGUF: dict[str, WeightFormat] = {s: f for f in FORMATS.values() if f.id != 1 for s in f.sources}
# Suffixes of the tensors a quantized weight is stored as.
PART_SUFFIXES = (".qweight", ".qhigh", ".scales", ".offsets", ".superscales")


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
def _high_shifts(hb: int) -> np.ndarray:
    """Bit position of the high bits of input 8i + e of a chunk, as [HB words, 4/HB, 8]
    (i = word·(4/HB) + r): 4·p(e) + HB·r, p(e) the nibble of input e in layout id 1."""
    nib = np.argsort(quant.NIBBLE_ORDER).astype(np.uint32)          # input e → its nibble p
    r = np.arange(4 // hb, dtype=np.uint32)
    return np.broadcast_to(4 * nib[None, :] + hb * r[:, None], (hb, 4 // hb, 8))


def pack_codes(fmt: WeightFormat, codes: np.ndarray) -> dict[str, np.ndarray]:
    """codes uint8 [N, K] in [0, 2^b) → {"qweight": …, "qhigh": …} (qhigh for b = 5, 6; the
    layouts in the module doc). Raises ValueError for a code of more than b bits."""
    n, k = codes.shape
    c = codes.astype(np.uint32)
    if int(c.max(initial=0)) >= 1 << fmt.bits:
        raise ValueError(f"pack_codes: codes exceed {fmt.bits} bits")
    if fmt.bits == 8:
        w = c.reshape(n, k // 4, 4) << (np.arange(4, dtype=np.uint32) * 8)
        return {"qweight": np.bitwise_or.reduce(w, axis=2)}
    out = {"qweight": quant.pack((c & 0xF).astype(np.int8) - 8)}
    if fmt.bits > 4:
        hb = fmt.bits - 4
        hi = (c >> 4).reshape(n, k // 32, hb, 4 // hb, 8) << _high_shifts(hb)
        out["qhigh"] = np.bitwise_or.reduce(hi.reshape(n, k // 32, hb, 32 // hb), axis=3).reshape(n, -1)
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
        words = np.asarray(qhigh).reshape(n, -1, hb, 1, 1)
        hi = (words >> _high_shifts(hb)) & np.uint32((1 << hb) - 1)
        c |= (hi.reshape(n, -1) << 4).astype(np.uint8)
    return c


# ---------------------------------------------------------------------------------------------
# The K-quants' packed 6-bit scales and mins
# ---------------------------------------------------------------------------------------------
def get_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_k/q5_k scale bytes [..., 12] → (sc, m) uint8 [..., 8], as gguf-py's
    Q4_K.get_scale_min reads them: bytes 0–3 hold sc 0–3 (low 6 bits) and the top 2 bits of
    sc 4–7, bytes 4–7 the same for m, bytes 8–11 the low 4 bits of sc 4–7 (low nibble) and of
    m 4–7 (high nibble)."""
    s = np.asarray(scales, np.uint8)
    d, m, m_d = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of `get_scale_min`: sc, m [..., 8] in [0, 64) → the 12 bytes [..., 12] uint8."""
    sc, m = np.asarray(sc, np.uint8), np.asarray(m, np.uint8)
    lo = np.concatenate([(sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
                         (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
                         (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)
    return lo.astype(np.uint8)


def group_scales(fmt: WeightFormat, scales: np.ndarray, offsets: np.ndarray | None = None,
                 superscales: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The float32 scale and offset of every group [N, K/g] (offset None when symmetric) from
    the stored parts; a K-quant's formed as gguf-py forms them (module doc)."""
    if not fmt.superblock:
        return (np.asarray(scales).astype(np.float32),
                None if offsets is None else np.asarray(offsets).astype(np.float32))
    ss = np.asarray(superscales).astype(np.float32)
    n = ss.shape[0]
    if fmt.has_min:
        sc, m = get_scale_min(scales)                                # [N, K/256, 8]
        s = ss[:, :, 0:1] * sc.astype(np.float32)
        return s.reshape(n, -1), (-(ss[:, :, 1:2] * m.astype(np.float32))).reshape(n, -1)
    per = fmt.superblock // fmt.group
    s = ss[:, :, None] * np.asarray(scales).reshape(n, -1, per).astype(np.float32)
    return s.reshape(n, -1), None


def dequantize_parts(fmt: WeightFormat, codes: np.ndarray, scales: np.ndarray,
                     offsets: np.ndarray | None = None) -> np.ndarray:
    """w = (c - z)·s (symmetric) or c·s + o (offset), float32 [N, K], in gguf's order of
    float32 operations (so exact formats reproduce `gguf.quants.dequantize` bit for bit).
    scales, offsets: per group [N, K/g] (group_scales for a K-quant)."""
    n, k = codes.shape
    groups = k // fmt.group
    s = np.asarray(scales).astype(np.float32)[:, :, None]
    if not fmt.has_offset:
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
    s, o = group_scales(fmt, get(f"{prefix}.scales"),
                        get(f"{prefix}.offsets") if fmt.offset_dtype is not None else None,
                        get(f"{prefix}.superscales") if fmt.superblock else None)
    return dequantize_parts(fmt, codes, s, o).astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# Quantizing a float weight (sources without blocks of their own)
# ---------------------------------------------------------------------------------------------
def quantize_dense(fmt: WeightFormat, w: np.ndarray) -> dict[str, np.ndarray]:
    """Quantize float w [N, K] into symmetric `fmt` (int4_g128 or q8_g32): s = fp16(max|w|/qmax),
    c = clip(rint(w / s), -qmax-1, qmax) + z, as quant.py's rule. Returns the stored parts
    {"qweight", ["qhigh"], "scales"}.

    Raises:
        ValueError: fmt has an offset or integer scales (only sources' own blocks use those).
    """
    if fmt.id == INT4_G128.id:
        qw, s = quant.quantize_packed(w)
        return {"qweight": qw, "scales": s}
    if fmt.has_offset or fmt.scale_dtype != F16:
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


# ---------------------------------------------------------------------------------------------
# Random weights, for synthetic models and the kernel tests
# ---------------------------------------------------------------------------------------------
# Typical |w| of a projection of a real model (0.02 – 0.05): every format's random values aim
# at it, so kernels see the magnitudes (and the cancellation in c·s + o) they meet in a model.
RANDOM_AMPLITUDE = 0.05


def random_weight(fmt: WeightFormat, n: int, k: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random stored parts of a weight [n, k] in `fmt`, keyed by suffix without the dot
    ("qweight", "qhigh", "scales", "offsets", "superscales": those the format has), in the
    dtypes and shapes of `fmt.tensors`.

    Codes are uniform over [0, 2^b). Flat scales: fp16 U(0.5, 1.5)·0.05 / 2^(b−1), positive;
    offsets −2^(b−1)·s·U(0.8, 1.2) (centring the codes). K-quants: 6-bit sc and m uniform
    over [0, 64) packed as gguf packs them, d ~ U(0.5, 1.5)·0.03 / (32·2^(b−1)) and dmin ~
    U(0.5, 1.5)·0.001; q6_k sc uniform int8 in [−64, 63], d ~ U(0.5, 1.5)·0.03 / (32·32).
    Dequantized, |w| is about 0.02 – 0.05, as in a real model.

    Raises:
        ValueError: k does not fit the format (`fmt.fits`).
    """
    if not fmt.fits(k):
        raise ValueError(f"random_weight: K={k} is not a multiple of {fmt.k_multiple} ({fmt.name})")
    half = 1 << (fmt.bits - 1)
    shapes = {name.rsplit(".", 1)[1]: shape for name, (_, shape) in fmt.tensors("w", n, k).items()}
    # Every bit of the code planes belongs to exactly one code (pack_codes fills them whole), so
    # uniform random words are uniform codes — without drawing and packing n·k bytes first (a 7B
    # synthetic model is 7 G codes).
    parts = {p: rng.integers(0, 1 << 32, shapes[p], dtype=np.uint32) for p in ("qweight", "qhigh") if p in shapes}

    def u(shape, lo=0.5, hi=1.5):
        return rng.uniform(lo, hi, shape)

    if not fmt.superblock:
        s = (u(shapes["scales"]) * RANDOM_AMPLITUDE / half).astype(np.float16)
        parts["scales"] = s
        if fmt.offset_dtype is not None:
            parts["offsets"] = (-half * s.astype(np.float32) * u(s.shape, 0.8, 1.2)).astype(np.float16)
        return parts
    nsb = k // fmt.superblock
    # d·sc·c averages ~d·32·2^(b−1) (sc, c uniform): ~0.03, which dmin·m (~0.001·32) centres.
    d = u((n, nsb)) * 0.03 / (32 * half)
    if fmt.has_min:
        sc, m = (rng.integers(0, 64, (n, nsb, 8), dtype=np.uint8) for _ in range(2))
        parts["scales"] = pack_scale_min(sc, m)
        parts["superscales"] = np.stack([d, u((n, nsb)) * 0.001], axis=-1).astype(np.float16)
    else:
        parts["scales"] = rng.integers(-64, 64, shapes["scales"], dtype=np.int8)
        parts["superscales"] = d.astype(np.float16)
    return parts
