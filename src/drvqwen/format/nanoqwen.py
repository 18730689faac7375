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

The header's fields, offset by offset, are in docs/file-format.md (and in _HEADER / _HEADER_V2
below). Version 2 added text_vocab, the end-of-generation ids and the RoPE scaling (bytes
156 … 251); version 3 added a weight format id to every table record (weight_formats.py): each
matrix weight is stored in its own format, INT4 g128 by default. Version 4 has version 3's
records, with the K-quants in their two-level form (formats 10–12, uint8/int8 scale tensors)
and the high-bit plane of 5- and 6-bit codes in the layout of weight_formats.py.

Version 1 and 2 files still open: their projections are INT4 g128 and everything else FP16
(the default formats); a version-1 file's end-of-generation set and text vocabulary are
derived from the embedded tokenizer by the rules the converter applies (`Tokenizer.eog_ids`,
`Tokenizer.text_vocab_size`). A version-3 file opens when its weights are all in formats whose
layout version 4 kept (V3_FORMATS); the others need converting again. The writer
(nanoqwen_writer.py) always writes version 4.
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
from . import weight_formats as wf
from .tensor_set import EMBED, LM_HEAD, default_formats, expected_tensors, weight_shapes

MAGIC = b"NANOQWEN"
VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
# The formats of a version-3 file that mean the same in version 4 (no qhigh plane, flat scales).
V3_FORMATS = (1, 2, 3, 9)
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
DTYPES: dict[int, np.dtype] = {1: np.dtype("<f2"), 2: np.dtype("<f4"), 3: np.dtype("<u4"),
                               4: np.dtype("u1"), 5: np.dtype("i1")}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}

_REC_FIXED = struct.Struct("<H")        # name length, then name bytes
_REC_TAIL = struct.Struct("<BB")        # dtype code, ndim; then ndim u64 dims (versions 1, 2)
_REC_TAIL_V3 = struct.Struct("<BBB")    # dtype code, weight format id, ndim (versions 3, 4)
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
    format_id: int = 0      # weight_formats: 0 for a dense tensor, else the weight's format


# ---------------------------------------------------------------------------------------------
# Shared by the reader and the writer (nanoqwen_writer.py)
# ---------------------------------------------------------------------------------------------
def formats_of(path: Path, cfg: QwenConfig, infos: dict[str, TensorInfo]) -> dict[str, int]:
    """Weight prefix → format id, read from the table records, checked for consistency: every
    part of a quantized weight carries the same known format id, dense tensors carry 0 (a
    projection may be dense FP16 too: a GGUF's F16 matrix kept as it is).

    Raises:
        FormatError: names the file and tensor.
    """
    shapes = weight_shapes(cfg)
    out: dict[str, int] = {}
    for name, i in infos.items():
        prefix = wf.weight_prefix(name)
        if prefix is None:
            if i.format_id != wf.PLAIN:
                raise FormatError(f"{path}: tensor {name}: weight format id {i.format_id} on a dense tensor")
            continue
        if i.format_id == wf.PLAIN:
            raise FormatError(f"{path}: tensor {name}: part of a quantized weight with format id 0")
        wf.get_format(i.format_id, f"{path}: tensor {name}")
        if prefix not in shapes:
            raise FormatError(f"{path}: unexpected tensor {name}")
        if out.setdefault(prefix, i.format_id) != i.format_id:
            raise FormatError(f"{path}: tensor {name}: format id {i.format_id}, but the other parts of "
                              f"{prefix} have {out[prefix]}")
    for prefix in shapes:
        if prefix not in out and f"{prefix}.weight" in infos:
            out[prefix] = wf.PLAIN
        elif prefix not in out and prefix not in (EMBED, LM_HEAD):
            out[prefix] = wf.INT4_G128.id        # absent: reported as missing by the set check
    return out


def check_tensor_set(path: Path, cfg: QwenConfig, infos: dict[str, TensorInfo]) -> dict[str, int]:
    """The table holds exactly the tensors of a Qwen2 model of `cfg` in the formats its records
    name, each with the dtype and shape those require (dense tensors FP16, or FP32 in a
    file of version 3 or later). Returns the formats (formats_of).

    Raises:
        FormatError: names the file and the first tensor that is missing, unexpected or wrong.
    """
    formats = formats_of(path, cfg, infos)
    try:
        want = expected_tensors(cfg, formats)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
    for name, (dt, shape) in want.items():
        if name not in infos:
            raise FormatError(f"{path}: tensor {name} missing")
        i = infos[name]
        ok_dt = i.dtype == dt or (i.format_id == wf.PLAIN and dt == wf.F16 and i.dtype == wf.F32)
        if not ok_dt or i.shape != shape:
            raise FormatError(f"{path}: tensor {name}: {i.dtype}{list(i.shape)}, expected {dt}{list(shape)}")
    extra = sorted(set(infos) - set(want))
    if extra:
        raise FormatError(f"{path}: unexpected tensor {extra[0]}")
    return formats


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
            if h.version >= 3:
                code, fid, ndim = _REC_TAIL_V3.unpack_from(raw, pos); pos += _REC_TAIL_V3.size
            else:
                code, ndim = _REC_TAIL.unpack_from(raw, pos); pos += _REC_TAIL.size
                fid = wf.INT4_G128.id if wf.weight_prefix(name) else wf.PLAIN
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
            if h.version == 3 and fid not in (wf.PLAIN,) + V3_FORMATS:
                raise FormatError(f"{path}: tensor {name}: format id {fid} of a version-3 file, whose "
                                  f"layout this drvqwen changed: convert the model again")
            infos[name] = TensorInfo(name, dt, tuple(shape), off, nbytes, crc, fid)
    except (struct.error, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: tensor table malformed ({e})") from None
    if pos != len(raw):
        raise FormatError(f"{path}: tensor table has {len(raw) - pos} trailing bytes")
    check_tensor_set(path, h.config, infos)
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

    def data_region(self) -> np.ndarray:
        """The data region, every tensor's bytes with their alignment padding, as a read-only
        uint8 view of the mapping (no copy): bytes [data_offset, data_offset + data_size)."""
        h = self.header
        return self._mm[h.data_offset:h.data_offset + h.data_size]

    @cached_property
    def formats(self) -> dict[str, int]:
        """Weight prefix (`lm_head`, `model.layers.3.mlp.up_proj` …) → format id
        (weight_formats.FORMATS; 0 = dense). Validated when the file was opened."""
        return formats_of(self.path, self.config, self.tensors)

    @property
    def has_default_formats(self) -> bool:
        """Every projection INT4 g128, embedding and lm_head FP16, every dense tensor FP16: the
        formats the GPU kernels run (a version-1/2 file always has them)."""
        return (self.formats == default_formats(self.config)
                and all(i.dtype != wf.F32 for i in self.tensors.values()))

    def weight(self, prefix: str, dtype=np.float32) -> np.ndarray:
        """The weight `prefix` [N, K] as `dtype`, dequantized from its stored format (a dense
        one converted). Raises KeyError for an unknown prefix."""
        fid = self.formats[prefix]
        if fid == wf.PLAIN:
            return np.asarray(self.tensor(f"{prefix}.weight")).astype(dtype)
        return wf.dequantize_weight(wf.FORMATS[fid], self.tensor, prefix, dtype)

    def weight_nbytes(self, prefix: str) -> int:
        """Bytes the weight `prefix` occupies in the file (all of its parts)."""
        return sum(i.nbytes for n, i in self.tensors.items()
                   if n == f"{prefix}.weight" or wf.weight_prefix(n) == prefix)

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
