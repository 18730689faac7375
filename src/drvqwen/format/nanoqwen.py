"""The `.nanoqwen` file: one self-contained, memory-mapped model file (docs/file-format.md).

Layout (little-endian; every offset is from the start of the file)::

    [0, 256)             header: magic, version, config, quantization, region offsets, CRCs
    [tok_off, +tok_size) tokenizer.json text (UTF-8), so one file is enough to run
    [data_off, +size)    tensor data, each tensor starting on a DATA_ALIGN (4 KiB) boundary
    [table_off, +size)   tensor table: name, dtype, shape, offset, byte size, CRC32 per tensor

The table sits at the end so the writer can stream tensors one by one (a 7B conversion never
holds the model twice in memory) and write the table and header last. The reader validates
the header (magic, version, header CRC, file size, region bounds, config sanity,
quantization), then the table (CRC, names, dtypes, bounds, alignment, byte sizes, the shapes a
Qwen2 model of this config must have) — all before anyone allocates device memory. Tensor
data is mapped with `np.memmap`, so opening a 4.5 GB file costs nothing until a tensor is read.
Per-tensor CRC32s are checked only on request (`verify_data`): hashing 4.5 GB on every load
would cost seconds.

Header fields (offset: type name):
    0: 8s magic "NANOQWEN"        8: u32 version            12: u32 header_size (256)
    16..44: u32 vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
            num_kv_heads, head_dim, max_position
    48: f64 rope_theta            56: f64 rms_norm_eps       64: u32 flags (bit 0: tied lm_head)
    68: u32 quant_bits (4)        72: u32 quant_group (128)  76: u32 quant_symmetric (1)
    80: u32 layout_id (1)         84: u32 n_tensors
    88: u64 table_offset          96: u64 table_size        104: u64 tokenizer_offset
    112: u64 tokenizer_size      120: u64 data_offset       128: u64 data_size
    136: u64 file_size           144: u32 data_align        148: u32 table_crc32
    152: u32 tokenizer_crc32
    version 2 adds:
    156: u32 text_vocab          the ids below it have text; the lm_head rows from here up to
                                 vocab_size (padding: 151665… for Qwen2.5) are never chosen
    160: u32 n_eog               164..212: u32 eog_ids[12], the first n_eog used: the ids that
                                 end generation (tokenizer.Tokenizer.eog_ids)
    212: u32 rope_scaling (0 none, 1 YaRN)            216: u32 rope_original_max_position
    220: f64 rope_factor          228: f32 rope_beta_fast    232: f32 rope_beta_slow
    236: f64 rope_attention_factor                    244: u32 rope_flags (bit 0: truncate)
    248: u32 zero                 252: u32 header_crc32 of [0, 252)

Version 1 files (without the fields from 156 on, which are zero there) still open: their
end-of-generation set and text vocabulary are derived from the embedded tokenizer by the
same rules the converter applies (`Tokenizer.eog_ids`, `Tokenizer.text_vocab_size`), so a
converted model keeps working after an upgrade. The writer (nanoqwen_writer.py) always writes
version 2.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator

import numpy as np

from ..config import QwenConfig, RopeScaling
from ..errors import ConfigError, DrvqwenError, FormatError
from . import quant

MAGIC = b"NANOQWEN"
VERSION = 2
READ_VERSIONS = (1, 2)
HEADER_SIZE = 256
# 4 KiB: a page for mmap, and comfortably above the 256-byte alignment that 128-bit vector
# loads, TMA (16 B) and cuMemcpy fast paths want.
DATA_ALIGN = 4096

_HEADER = struct.Struct("<8sII" "8I" "dd" "I" "4I" "I" "7Q" "III")
# Version 2, right after _HEADER: text_vocab, n_eog, eog_ids[MAX_EOG], then the RoPE scaling
# (kind, original_max_position, factor, beta_fast, beta_slow, attention_factor, flags, zero).
MAX_EOG = 12
_HEADER_V2 = struct.Struct(f"<II{MAX_EOG}I" "IIdffdII")
_HEADER_CRC_AT = 252
assert _HEADER.size + _HEADER_V2.size == _HEADER_CRC_AT

FLAG_TIED_LM_HEAD = 1
# RoPE scaling kinds and flags (version 2).
ROPE_YARN = 1
ROPE_FLAG_TRUNCATE = 1

# dtype codes of the tensor table
DTYPES: dict[int, np.dtype] = {1: np.dtype("<f2"), 2: np.dtype("<f4"), 3: np.dtype("<u4")}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}

_REC_FIXED = struct.Struct("<H")        # name length, then name bytes
_REC_TAIL = struct.Struct("<BB")        # dtype code, ndim; then ndim u64 dims
_REC_END = struct.Struct("<QQI")        # offset, nbytes, crc32


@dataclass(frozen=True)
class TensorInfo:
    """One tensor table entry: shape and dtype, absolute byte offset and size, CRC32 of the bytes."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int


# ---------------------------------------------------------------------------------------------
# Tensor names (Hugging Face names; INT4 projections split into .qweight and .scales)
# ---------------------------------------------------------------------------------------------
ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


def proj_prefix(layer: int, proj: str) -> str:
    """HF module path of a projection, e.g. `model.layers.3.mlp.down_proj`."""
    block = "self_attn" if proj in ATTN_PROJ else "mlp"
    return f"model.layers.{layer}.{block}.{proj}"


def expected_tensors(cfg: QwenConfig) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every tensor a Qwen2 model of `cfg` stores, with dtype and shape.

    INT4 projections [N, K] are stored as `<prefix>.qweight` uint32 [N, K/8] and
    `<prefix>.scales` float16 [N, K/128] (format/quant.py, layout id 1).
    """
    f16, u32 = np.dtype("<f2"), np.dtype("<u4")
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    g = quant.GROUP_SIZE
    out: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
        "model.embed_tokens.weight": (f16, (V, D)),
        "model.norm.weight": (f16, (D,)),
        "lm_head.weight": (f16, (V, D)),
    }
    shapes = {"q_proj": (cfg.q_dim, D), "k_proj": (cfg.kv_dim, D), "v_proj": (cfg.kv_dim, D),
              "o_proj": (D, cfg.q_dim), "gate_proj": (F, D), "up_proj": (F, D),
              "down_proj": (D, F)}
    for i in range(cfg.num_layers):
        out[f"model.layers.{i}.input_layernorm.weight"] = (f16, (D,))
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = (f16, (D,))
        for proj, (n, k) in shapes.items():
            p = proj_prefix(i, proj)
            out[f"{p}.qweight"] = (u32, (n, k // 8))
            out[f"{p}.scales"] = (f16, (n, k // g))
            if proj in ("q_proj", "k_proj", "v_proj"):
                out[f"{p}.bias"] = (f16, (n,))
    return out


# ---------------------------------------------------------------------------------------------
# Shared by the reader and the writer (nanoqwen_writer.py)
# ---------------------------------------------------------------------------------------------
def _align(x: int, a: int = DATA_ALIGN) -> int:
    return (x + a - 1) // a * a


def _check_vocab_fields(path: Path, cfg: QwenConfig, text_vocab: int, eog_ids: tuple[int, ...]) -> None:
    if not 1 <= text_vocab <= cfg.vocab_size:
        raise FormatError(f"{path}: header field text_vocab: {text_vocab}, must be in [1, {cfg.vocab_size}]")
    if len(eog_ids) > MAX_EOG:
        raise FormatError(f"{path}: header field n_eog: {len(eog_ids)} end-of-generation ids, at most {MAX_EOG}")
    bad = [i for i in eog_ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise FormatError(f"{path}: header field eog_ids: id {bad[0]} outside the vocabulary of {cfg.vocab_size}")


def vocab_facts(tokenizer_json: str, vocab_size: int, extra_eog: Iterable[int] = ()) -> tuple[int, tuple[int, ...]]:
    """(text_vocab, eog_ids) of a tokenizer for a model of `vocab_size` rows: the ids below
    text_vocab have text (`Tokenizer.text_vocab_size`, at most vocab_size) and eog_ids is the
    end-of-generation set (`Tokenizer.eog_ids(extra_eog)`), ids past the model's rows dropped.

    Raises:
        DrvqwenError: the tokenizer.json text is invalid.
    """
    from ..tokenizer import Tokenizer

    tok = Tokenizer.from_json(tokenizer_json)
    text_vocab = max(1, min(tok.text_vocab_size, vocab_size))
    return text_vocab, tuple(sorted(i for i in tok.eog_ids(extra_eog) if 0 <= i < vocab_size))


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    version: int
    config: QwenConfig
    quant_bits: int
    quant_group: int
    layout_id: int
    n_tensors: int
    table_offset: int
    table_size: int
    tokenizer_offset: int
    tokenizer_size: int
    data_offset: int
    data_size: int
    file_size: int
    data_align: int
    table_crc32: int
    tokenizer_crc32: int
    # Version 2 (None in a version-1 file: NanoqwenFile derives them from the tokenizer).
    text_vocab: int | None = None
    eog_ids: tuple[int, ...] | None = None


def _parse_header(path: Path, raw: bytes, actual_size: int) -> Header:
    def bad(field: str, msg: str) -> FormatError:
        return FormatError(f"{path}: header field {field}: {msg}")

    if len(raw) < len(MAGIC) or raw[:8] != MAGIC:
        raise FormatError(f"{path}: not a .nanoqwen file (magic {raw[:8]!r}, expected {MAGIC!r})")
    if actual_size < HEADER_SIZE:
        raise FormatError(f"{path}: truncated: {actual_size} bytes, the header alone is {HEADER_SIZE}")
    (magic, version, header_size, vocab, hidden, inter, layers, heads, kv_heads, head_dim,
     max_pos, theta, eps, flags, bits, group, symmetric, layout, n_tensors,
     table_off, table_size, tok_off, tok_size, data_off, data_size, file_size,
     data_align, table_crc, tok_crc) = _HEADER.unpack_from(raw)
    if version not in READ_VERSIONS:
        newer = " (written by a newer drvqwen: upgrade drvqwen, or convert the model again)" \
            if version > VERSION else ""
        raise bad("version", f"{version}, this drvqwen reads versions "
                             f"{', '.join(map(str, READ_VERSIONS))}{newer}")
    if header_size != HEADER_SIZE:
        raise bad("header_size", f"{header_size}, expected {HEADER_SIZE}")
    (stored_crc,) = struct.unpack_from("<I", raw, _HEADER_CRC_AT)
    if zlib.crc32(raw[:_HEADER_CRC_AT]) != stored_crc:
        raise bad("header_crc32", "checksum mismatch (the header is corrupt)")
    if file_size != actual_size:
        what = "truncated" if actual_size < file_size else "has trailing bytes"
        raise bad("file_size", f"{file_size}, but the file is {actual_size} bytes ({what})")
    if (bits, group, symmetric) != (4, quant.GROUP_SIZE, 1):
        raise bad("quant", f"bits={bits} group={group} symmetric={symmetric}; drvqwen reads INT4 "
                           f"symmetric group-{quant.GROUP_SIZE}")
    if layout != quant.LAYOUT_ID:
        raise bad("layout_id", f"{layout}, this drvqwen knows layout {quant.LAYOUT_ID}")
    if data_align == 0 or data_align & (data_align - 1):
        raise bad("data_align", f"{data_align} is not a power of two")
    for name, off, size in (("tokenizer", tok_off, tok_size), ("table", table_off, table_size),
                            ("data", data_off, data_size)):
        if off < HEADER_SIZE or off + size > file_size:
            raise bad(f"{name}_offset", f"region [{off}, {off + size}) outside the file "
                                        f"[{HEADER_SIZE}, {file_size})")
    regions = sorted([(tok_off, tok_off + tok_size, "tokenizer"), (table_off, table_off + table_size, "table"),
                      (data_off, data_off + data_size, "data")])
    for (a0, a1, an), (b0, b1, bn) in zip(regions, regions[1:]):
        if b0 < a1:
            raise bad(f"{bn}_offset", f"region overlaps the {an} region")
    ext = _HEADER_V2.unpack_from(raw, _HEADER.size) if version >= 2 else None
    scaling = None
    try:
        if ext is not None:
            kind, orig, factor, beta_fast, beta_slow, attn, rflags = ext[2 + MAX_EOG:2 + MAX_EOG + 7]
            if kind == ROPE_YARN:
                scaling = RopeScaling(factor=factor, original_max_position=orig, beta_fast=beta_fast,
                                      beta_slow=beta_slow, attention_factor=attn,
                                      truncate=bool(rflags & ROPE_FLAG_TRUNCATE))
            elif kind != 0:
                raise bad("rope_scaling", f"kind {kind} unknown to this drvqwen")
        cfg = QwenConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, max_position=max_pos, rope_theta=theta,
                         rms_norm_eps=eps, tie_word_embeddings=bool(flags & FLAG_TIED_LM_HEAD),
                         rope_scaling=scaling)
    except ConfigError as e:
        raise FormatError(f"{path}: {e}") from None
    text_vocab = eog_ids = None
    if ext is not None:
        text_vocab, n_eog = ext[0], ext[1]
        if n_eog > MAX_EOG:
            raise bad("n_eog", f"{n_eog}, at most {MAX_EOG}")
        eog_ids = tuple(ext[2:2 + n_eog])
        _check_vocab_fields(path, cfg, text_vocab, eog_ids)
    return Header(version, cfg, bits, group, layout, n_tensors, table_off, table_size, tok_off,
                  tok_size, data_off, data_size, file_size, data_align, table_crc, tok_crc,
                  text_vocab, eog_ids)


def _parse_table(path: Path, h: Header, raw: bytes) -> dict[str, TensorInfo]:
    if zlib.crc32(raw) != h.table_crc32:
        raise FormatError(f"{path}: tensor table checksum mismatch (the table is corrupt)")
    infos: dict[str, TensorInfo] = {}
    pos = 0
    try:
        for index in range(h.n_tensors):
            (nlen,) = _REC_FIXED.unpack_from(raw, pos); pos += _REC_FIXED.size
            name = raw[pos:pos + nlen].decode("utf-8"); pos += nlen
            # A name is shown in every message below: one that is not printable (a damaged
            # length field reads into the next record) would break the one-line error.
            if not name or not name.isprintable():
                raise FormatError(f"{path}: tensor table record {index}: name {name[:48]!r} (length "
                                  f"field {nlen}) is not a tensor name")
            code, ndim = _REC_TAIL.unpack_from(raw, pos); pos += _REC_TAIL.size
            shape = struct.unpack_from(f"<{ndim}Q", raw, pos); pos += 8 * ndim
            off, nbytes, crc = _REC_END.unpack_from(raw, pos); pos += _REC_END.size
            if code not in DTYPES:
                raise FormatError(f"{path}: tensor {name}: unknown dtype code {code}")
            dt = DTYPES[code]
            if nbytes != math.prod(shape) * dt.itemsize:      # exact: no int64 wrap-around
                raise FormatError(f"{path}: tensor {name}: nbytes={nbytes} disagrees with shape {shape} {dt}")
            if off % h.data_align:
                raise FormatError(f"{path}: tensor {name}: offset {off} not aligned to {h.data_align}")
            if off < h.data_offset or off + nbytes > h.data_offset + h.data_size:
                raise FormatError(f"{path}: tensor {name}: bytes [{off}, {off + nbytes}) outside the data region")
            if name in infos:
                raise FormatError(f"{path}: tensor {name} listed twice")
            infos[name] = TensorInfo(name, dt, tuple(shape), off, nbytes, crc)
    except (struct.error, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: tensor table malformed ({e})") from None
    if pos != len(raw):
        raise FormatError(f"{path}: tensor table has {len(raw) - pos} trailing bytes")
    want = expected_tensors(h.config)
    for name, (dt, shape) in want.items():
        if name not in infos:
            raise FormatError(f"{path}: tensor {name} missing")
        i = infos[name]
        if i.dtype != dt or i.shape != shape:
            raise FormatError(f"{path}: tensor {name}: {i.dtype}{list(i.shape)}, expected {dt}{list(shape)}")
    extra = sorted(set(infos) - set(want))
    if extra:
        raise FormatError(f"{path}: unexpected tensor {extra[0]}")
    return infos


class NanoqwenFile:
    """A validated, memory-mapped `.nanoqwen` file.

    Opening reads only the header, the table and the tokenizer text; tensors are `np.memmap`
    views, read-only, paged in on first touch. Every check happens here, before any caller can
    allocate device memory.

    Raises:
        FormatError: missing file, wrong magic/version, truncated, checksum mismatch, bad table,
            or a config/tensor set that is not a Qwen2 model; the message names file and field.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                raw = f.read(HEADER_SIZE)
                self.header = _parse_header(self.path, raw, size)
                h = self.header
                f.seek(h.table_offset)
                table = f.read(h.table_size)
                self.tensors = _parse_table(self.path, h, table)
                f.seek(h.tokenizer_offset)
                tok = f.read(h.tokenizer_size)
        except FileNotFoundError:
            raise FormatError(f"{self.path}: file not found") from None
        except IsADirectoryError:
            raise FormatError(f"{self.path}: is a directory, not a .nanoqwen file") from None
        except PermissionError:
            raise FormatError(f"{self.path}: permission denied") from None
        if zlib.crc32(tok) != h.tokenizer_crc32:
            raise FormatError(f"{self.path}: embedded tokenizer checksum mismatch")
        try:
            self.tokenizer_json = tok.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.path}: embedded tokenizer is not UTF-8") from None
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")

    @property
    def config(self) -> QwenConfig:
        return self.header.config

    @cached_property
    def _derived_vocab_facts(self) -> tuple[int, tuple[int, ...]]:
        # Version-1 files: the rules the converter now applies, from the embedded tokenizer.
        try:
            return vocab_facts(self.tokenizer_json, self.config.vocab_size)
        except DrvqwenError as e:
            raise FormatError(f"{self.path}: {e}") from None

    @property
    def text_vocab(self) -> int:
        """Ids below this have text; the backends never choose the rows from here up to
        vocab_size (their logits are −inf). 151665 for Qwen2.5's 151936/152064-row lm_head."""
        if self.header.text_vocab is not None:
            return self.header.text_vocab
        return self._derived_vocab_facts[0]

    @property
    def eog_ids(self) -> frozenset[int]:
        """The ids that end generation (`drvqwen run` stops at the first one it generates)."""
        if self.header.eog_ids is not None:
            return frozenset(self.header.eog_ids)
        return frozenset(self._derived_vocab_facts[1])

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of tensor `name` (no copy). Raises KeyError for an unknown name."""
        i = self.tensors[name]
        return self._mm[i.offset:i.offset + i.nbytes].view(i.dtype).reshape(i.shape)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(sorted(self.tensors.values(), key=lambda i: i.offset))

    def verify_data(self, progress=None) -> None:
        """Check every tensor's CRC32 (reads the whole file). Raises FormatError on a mismatch."""
        for info in self:
            if zlib.crc32(memoryview(self.tensor(info.name)).cast("B")) != info.crc32:
                raise FormatError(f"{self.path}: tensor {info.name}: data checksum mismatch")
            if progress is not None:
                progress(info)

    def close(self) -> None:
        # Drop our reference; the mapping is unmapped once no tensor view is alive (numpy
        # refuses to close a mapping that views still point into).
        self._mm = None

    def __enter__(self) -> "NanoqwenFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_model(path: str | Path) -> NanoqwenFile:
    """Open and validate a `.nanoqwen` file (see NanoqwenFile)."""
    return NanoqwenFile(path)
