"""Writing a `.nanoqwen` file (the layout and the reader: nanoqwen.py).

`NanoqwenWriter` streams tensors one by one into a temporary file beside the destination, then
writes the tokenizer, the tensor table and the header last and renames the file into place:
a conversion never holds the model twice in memory and never leaves a half-written file.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..config import QwenConfig
from ..errors import FormatError
from ..paths import io_error
from . import quant
from . import weight_formats as wf
from .nanoqwen import (_HEADER, _HEADER_V2, _REC_END, _REC_FIXED, _REC_TAIL, _REC_TAIL_V3, DATA_ALIGN, DTYPE_CODES,
                       FLAG_TIED_LM_HEAD, HEADER_SIZE, MAGIC, MAX_EOG, ROPE_FLAG_TRUNCATE, ROPE_YARN, VERSION,
                       TensorInfo, _align, _check_vocab_fields, check_tensor_set, vocab_facts)
from .tensor_set import expected_tensors


class NanoqwenWriter:
    """Stream tensors into a `.nanoqwen` file, atomically.

    Usage::

        with NanoqwenWriter(path, cfg, tokenizer_json) as w:
            w.add("model.embed_tokens.weight", emb_f16)
            ...
        # on clean exit: table + header written, fsync, renamed into place.
        # on an exception: the temporary file is deleted and `path` is untouched.

    `close()` checks that exactly the tensors of `expected_tensors(cfg, formats)` were added,
    the formats being those the parts of each quantized weight were added with
    (`add(..., format_id=…)`; weight_formats.py).

    Args:
        path: the file to write.
        cfg: the model's configuration.
        tokenizer_json: tokenizer.json text to embed.
        eog_ids: the ids that end generation; default: `Tokenizer.eog_ids()` of the tokenizer.
        text_vocab: ids below it have text; default: the tokenizer's `text_vocab_size`
            (at most cfg.vocab_size). Synthetic models pass cfg.vocab_size: speed runs choose
            among all rows, as a real model of that shape would.
    Raises:
        FormatError: more than MAX_EOG end-of-generation ids, or one outside the vocabulary.
    """

    def __init__(self, path: str | Path, cfg: QwenConfig, tokenizer_json: str, *,
                 eog_ids: Iterable[int] | None = None, text_vocab: int | None = None):
        self.path = Path(path)
        self.cfg = cfg
        if eog_ids is None or text_vocab is None:
            d_text, d_eog = vocab_facts(tokenizer_json, cfg.vocab_size)
            eog_ids = d_eog if eog_ids is None else eog_ids
            text_vocab = d_text if text_vocab is None else text_vocab
        self.eog_ids = tuple(sorted(set(int(i) for i in eog_ids)))
        self.text_vocab = int(text_vocab)
        _check_vocab_fields(self.path, cfg, self.text_vocab, self.eog_ids)
        # The pid in the name lets a later run remove it if this process is killed (paths.py).
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._done = False
        try:
            self._f = open(self.tmp, "wb")
        except OSError as e:
            self._done = True
            raise io_error(self.path, e, "write the model file") from None
        self._infos: list[TensorInfo] = []
        tok = tokenizer_json.encode("utf-8")
        self._tok_off, self._tok_size, self._tok_crc = HEADER_SIZE, len(tok), zlib.crc32(tok)
        try:
            self._f.write(b"\0" * HEADER_SIZE)
            self._f.write(tok)
            self._data_off = _align(self._f.tell())
            self._f.seek(self._data_off)
        except OSError as e:
            self.abort()
            raise io_error(self.path, e, "write the model file") from None

    def __enter__(self) -> "NanoqwenWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, name: str, array: np.ndarray, format_id: int | None = None) -> TensorInfo:
        """Append one tensor (float16, float32, uint32, uint8 or int8; any shape). format_id: the weight
        format of a quantized weight's part (weight_formats.FORMATS), 0 for a dense tensor;
        None: INT4 g128 for a part's name (`.qweight`, `.scales` …), else 0.
        Returns its table entry."""
        if format_id is None:
            format_id = wf.INT4_G128.id if wf.weight_prefix(name) else wf.PLAIN
        a = np.ascontiguousarray(array)
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if np.dtype(dt) not in DTYPE_CODES:
            raise FormatError(f"{self.path}: tensor {name}: dtype {a.dtype} not storable")
        a = a.astype(dt, copy=False)
        buf = memoryview(a).cast("B")
        try:
            off = _align(self._f.tell())
            self._f.seek(off)
            self._f.write(buf)
        except OSError as e:  # disk full, …: the caller's `with` removes the temporary file
            raise io_error(self.path, e, "write the model file") from None
        info = TensorInfo(name, np.dtype(dt), tuple(int(s) for s in a.shape), off, a.nbytes,
                          zlib.crc32(buf), int(format_id))
        self._infos.append(info)
        return info

    def close(self) -> Path:
        """Write the table and header, fsync, and rename into place. Returns the final path."""
        if self._done:
            return self.path
        try:
            have = {i.name: i for i in self._infos}
            if len(have) != len(self._infos):
                raise FormatError(f"{self.path}: a tensor was added twice")
            check_tensor_set(self.path, self.cfg, have)
            end = self._f.tell()
            data_size = max(end - self._data_off, 0)
            table = _pack_table(self._infos)
            table_off = _align(end, 16)
            self._f.seek(table_off)
            self._f.write(table)
            file_size = self._f.tell()
            header = _pack_header(self.cfg, n_tensors=len(self._infos), table_off=table_off,
                                  table_size=len(table), tok_off=self._tok_off,
                                  tok_size=self._tok_size, data_off=self._data_off,
                                  data_size=data_size, file_size=file_size,
                                  table_crc=zlib.crc32(table), tok_crc=self._tok_crc,
                                  text_vocab=self.text_vocab, eog_ids=self.eog_ids)
            self._f.seek(0)
            self._f.write(header)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp, self.path)
            self._done = True
            return self.path
        except OSError as e:
            self.abort()
            raise io_error(self.path, e, "write the model file") from None
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the temporary file; the destination is never touched."""
        self._done = True
        try:
            self._f.close()
        except OSError:
            pass                          # closing flushes: on a full disk that fails too
        finally:
            try:
                self.tmp.unlink(missing_ok=True)
            except OSError:
                pass


def _pack_table(infos: list[TensorInfo]) -> bytes:
    parts = []
    for i in infos:
        nb = i.name.encode("utf-8")
        parts.append(_REC_FIXED.pack(len(nb)) + nb + _REC_TAIL_V3.pack(DTYPE_CODES[i.dtype], i.format_id, len(i.shape))
                     + struct.pack(f"<{len(i.shape)}Q", *i.shape) + _REC_END.pack(i.offset, i.nbytes, i.crc32))
    return b"".join(parts)


def estimated_file_size(cfg: QwenConfig, tokenizer_bytes: int, formats: dict[str, int] | None = None) -> int:
    """Bytes of the `.nanoqwen` file a conversion of `cfg` writes with `formats` (default
    formats when None; dense tensors counted as FP16), for the free-space check before
    converting. Exact but for the table's names."""
    want = expected_tensors(cfg, formats)
    data = sum(_align(int(np.prod(shape, dtype=np.int64)) * dt.itemsize) for dt, shape in want.values())
    table = sum(2 + len(n) + 3 + 8 * len(shape) + 20 for n, (_, shape) in want.items())
    return _align(HEADER_SIZE + tokenizer_bytes) + data + table + DATA_ALIGN


def _pack_header(cfg: QwenConfig, *, n_tensors, table_off, table_size, tok_off, tok_size,
                 data_off, data_size, file_size, table_crc, tok_crc, text_vocab, eog_ids) -> bytes:
    body = _HEADER.pack(
        MAGIC, VERSION, HEADER_SIZE,
        cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
        cfg.num_kv_heads, cfg.head_dim, cfg.max_position,
        cfg.rope_theta, cfg.rms_norm_eps,
        FLAG_TIED_LM_HEAD if cfg.tie_word_embeddings else 0,
        4, quant.GROUP_SIZE, 1, quant.LAYOUT_ID,
        n_tensors,
        table_off, table_size, tok_off, tok_size, data_off, data_size, file_size,
        DATA_ALIGN, table_crc, tok_crc)
    eog = list(eog_ids) + [0] * (MAX_EOG - len(eog_ids))
    rs = cfg.rope_scaling
    rope = (ROPE_YARN, rs.original_max_position, rs.factor, rs.beta_fast, rs.beta_slow, rs.attention_factor,
            ROPE_FLAG_TRUNCATE if rs.truncate else 0) if rs else (0, 0, 0.0, 0.0, 0.0, 0.0, 0)
    body += _HEADER_V2.pack(text_vocab, len(eog_ids), *eog, *rope, 0)
    return body + struct.pack("<I", zlib.crc32(body))


def write_legacy_copy(src: str | Path, dst: str | Path, version: int) -> Path:
    """Write a copy of the current-version file `src` as format version 1, 2 or 3, for the
    tests and the format fuzzer that check old files still open (or are refused). Versions
    1 and 2 have no format ids in the table, so `src`'s formats must be the defaults; version 1
    also zeroes the header fields from byte 156 on. A version-3 copy keeps the table as it is
    (the reader then refuses the formats whose layout changed since).

    Raises:
        FormatError: `src` has per-tensor formats a version-1/2 table cannot express, or a bad version.
    """
    from .nanoqwen import _HEADER_CRC_AT, NanoqwenFile

    if version not in (1, 2, 3):
        raise FormatError(f"write_legacy_copy: version {version}, expected 1, 2 or 3")
    raw = bytearray(Path(src).read_bytes())
    if version == 3:
        struct.pack_into("<I", raw, 8, version)
        struct.pack_into("<I", raw, _HEADER_CRC_AT, zlib.crc32(bytes(raw[:_HEADER_CRC_AT])))
        Path(dst).write_bytes(bytes(raw))
        return Path(dst)
    f = NanoqwenFile(src)
    if not f.has_default_formats:
        raise FormatError(f"{src}: per-tensor formats need format version 3 or later")
    infos = list(f.tensors.values())
    f.close()
    h = f.header
    table = b"".join(_REC_FIXED.pack(len(i.name.encode())) + i.name.encode() + _REC_TAIL.pack(DTYPE_CODES[i.dtype], len(i.shape))
                     + struct.pack(f"<{len(i.shape)}Q", *i.shape) + _REC_END.pack(i.offset, i.nbytes, i.crc32)
                     for i in infos)
    raw = raw[:h.table_offset]
    raw += table
    hdr = bytearray(raw[:HEADER_SIZE])
    struct.pack_into("<I", hdr, 8, version)
    struct.pack_into("<QQ", hdr, 88, h.table_offset, len(table))
    struct.pack_into("<Q", hdr, 136, len(raw))
    struct.pack_into("<I", hdr, 148, zlib.crc32(table))
    if version == 1:
        hdr[156:_HEADER_CRC_AT] = bytes(_HEADER_CRC_AT - 156)
    struct.pack_into("<I", hdr, _HEADER_CRC_AT, zlib.crc32(bytes(hdr[:_HEADER_CRC_AT])))
    raw[:HEADER_SIZE] = hdr
    Path(dst).write_bytes(bytes(raw))
    return Path(dst)
