"""A structural check of a GGUF file, before the `gguf` package reads it.

`gguf.GGUFReader` trusts the file: an array whose count field says 2^40 sends it into a loop
that never ends, a string length past the end of the file into numpy errors, a duplicate key
into a KeyError. So every count, length, type, dimension, offset and the alignment is checked
here against the file's size first, in one pass over the metadata (the 0.5B's 300 000
vocabulary strings take ~0.3 s), and a bad one is a FormatError naming the file and the field.

Layout (GGUF versions 2 and 3; every integer in the file's byte order, which the version field
reveals — a little-endian reader sees a big-endian 3 as 0x03000000):

    magic "GGUF", u32 version, u64 tensor_count, u64 kv_count
    kv_count × (string key, u32 value_type, value)       string = u64 length + UTF-8 bytes
    tensor_count × (string name, u32 n_dims, n_dims × u64 dim, u32 ggml_type, u64 offset)
    padding to general.alignment (u32, default 32), then the tensor data; a tensor's offset is
    relative to the data start, aligned, and its bytes (dims, type block size) lie in the file.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import FormatError

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                     # GGML_MAX_DIMS

# Value types (gguf.GGUFValueType): code → (struct format, byte size); strings and arrays apart.
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
            6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFSummary:
    """What the check learned: byte order ("<" or ">"), version, and the counts."""

    byte_order: str
    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    data_offset: int


class _Cursor:
    def __init__(self, path: Path, buf, order: str):
        self.path, self.buf, self.order, self.pos, self.size = path, buf, order, 0, len(buf)

    def fail(self, field: str, msg: str) -> FormatError:
        return FormatError(f"{self.path}: GGUF {field}: {msg}")

    def need(self, n: int, field: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(field, f"needs {n} bytes at offset {self.pos}, past the end of the file "
                                   f"({self.size} bytes): truncated or corrupt")

    def scalar(self, fmt: str, size: int, field: str):
        self.need(size, field)
        (v,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, field: str) -> str:
        n = self.scalar("Q", 8, f"{field} length")
        self.need(n, f"{field} (a string of {n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(field, f"not UTF-8 (byte {e.start} of {n})") from None


def _detect_order(path: Path, buf) -> tuple[str, int]:
    if len(buf) < 8 or bytes(buf[:4]) != b"GGUF":
        raise FormatError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    (le,) = struct.unpack_from("<I", buf, 4)
    (be,) = struct.unpack_from(">I", buf, 4)
    for order, v in (("<", le), (">", be)):
        if v in SUPPORTED_VERSIONS:
            return order, v
    raise FormatError(f"{path}: GGUF version field {le} (byte-swapped {be}): this drvqwen reads "
                      f"GGUF versions {', '.join(map(str, SUPPORTED_VERSIONS))}")


def _skip_value(c: _Cursor, vtype: int, key: str, values: dict, top: bool) -> None:
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        v = c.scalar(fmt, size, f"metadata {key!r}")
        if top:
            values[key] = (vtype, v)
        return
    if vtype == _STRING:
        s = c.string(f"metadata {key!r}")
        if top:
            values[key] = (vtype, s)
        return
    if vtype == _ARRAY and top:
        etype = c.scalar("I", 4, f"metadata {key!r} item type")
        count = c.scalar("Q", 8, f"metadata {key!r} item count")
        if etype in _SCALARS:
            size = _SCALARS[etype][1]
            c.need(count * size, f"metadata {key!r} ({count} items of {size} bytes)")
            c.pos += count * size
        elif etype == _STRING:
            # Each string takes its 8-byte length at least: a count the file cannot hold is
            # refused before the loop starts.
            c.need(count * 8, f"metadata {key!r} ({count} strings)")
            for i in range(count):
                c.string(f"metadata {key!r}[{i}]")
        else:
            raise c.fail(f"metadata {key!r}", f"array item type {etype} is not supported")
        return
    raise c.fail(f"metadata {key!r}", f"value type {vtype} is not supported")


def check_gguf(path: str | os.PathLike) -> GGUFSummary:
    """Check the structure of the GGUF file at `path` (see the module doc).

    Returns:
        A GGUFSummary.
    Raises:
        FormatError: a field is out of bounds, unknown or inconsistent; names the file and it.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise FormatError(f"{path}: not a GGUF file ({size} bytes, the header alone is 24)")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _check(path, buf, GGML_QUANT_SIZES, GGMLQuantizationType)
    except FileNotFoundError:
        raise FormatError(f"{path}: file not found") from None
    except (IsADirectoryError, PermissionError, OSError) as e:
        raise FormatError(f"{path}: cannot read ({e.strerror or e})") from None


def _check(path: Path, buf, quant_sizes, qtype_enum) -> GGUFSummary:
    order, version = _detect_order(path, buf)
    c = _Cursor(path, buf, order)
    c.pos = 8
    n_tensors = c.scalar("Q", 8, "tensor_count")
    n_kv = c.scalar("Q", 8, "kv_count")
    # Every key-value pair takes at least 12 bytes and every tensor record 24.
    if n_kv * 12 > c.size - c.pos:
        raise c.fail("kv_count", f"{n_kv} pairs cannot fit in a file of {c.size} bytes")
    if n_tensors * 24 > c.size - c.pos:
        raise c.fail("tensor_count", f"{n_tensors} tensors cannot fit in a file of {c.size} bytes")
    values: dict = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        if key in values:
            raise c.fail(f"metadata {key!r}", "the key appears twice")
        vtype = c.scalar("I", 4, f"metadata {key!r} type")
        values[key] = None
        _skip_value(c, vtype, key, values, top=True)
    atype, alignment = values.get("general.alignment") or (4, DEFAULT_ALIGNMENT)
    if atype != 4 or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 20:
        raise c.fail("metadata 'general.alignment'", f"{alignment!r} (type {atype}): must be a u32 "
                                                     f"power of two up to 1 MiB")
    tensors = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = c.string(f"tensor {i} name")
        if name in names:
            raise c.fail(f"tensor {name!r}", "the name appears twice")
        names.add(name)
        n_dims = c.scalar("I", 4, f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name!r} n_dims", f"{n_dims}, must be in [1, {MAX_DIMS}]")
        dims = [c.scalar("Q", 8, f"tensor {name!r} dims") for _ in range(n_dims)]
        ttype = c.scalar("I", 4, f"tensor {name!r} type")
        offset = c.scalar("Q", 8, f"tensor {name!r} offset")
        tensors.append((name, dims, ttype, offset))
    data_offset = -(-c.pos // alignment) * alignment
    data_size = c.size - data_offset
    for name, dims, ttype, offset in tensors:
        try:
            qt = qtype_enum(ttype)
        except ValueError:
            raise c.fail(f"tensor {name!r} type", f"{ttype} is not a GGML type") from None
        if qt not in quant_sizes:
            raise c.fail(f"tensor {name!r} type", f"{qt.name} has no known block size")
        block, type_size = quant_sizes[qt]
        if any(d == 0 for d in dims) or dims[0] % block:
            raise c.fail(f"tensor {name!r} dims", f"{dims}: every dimension must be positive and the "
                                                  f"first a multiple of {qt.name}'s block of {block}")
        nbytes = math.prod(dims) // block * type_size
        if offset % alignment:
            raise c.fail(f"tensor {name!r} offset", f"{offset} is not a multiple of the alignment {alignment}")
        if offset + nbytes > data_size:
            raise c.fail(f"tensor {name!r} offset", f"bytes [{offset}, {offset + nbytes}) of the data "
                                                    f"lie past the end of the file (data: {data_size} bytes)")
    return GGUFSummary(order, version, n_tensors, n_kv, alignment, data_offset)
