#!/usr/bin/env python3
"""Format fuzzer: mutated `.nanoqwen` and GGUF files fed to `drvqwen info`, `convert` and `run`.

    PYTHONPATH=src python3 tools/fuzz_formats.py --cases 10000 --seed 1
    PYTHONPATH=src python3 tools/fuzz_formats.py --cases 10000 --seed 1 \\
        --real-nanoqwen q05.nanoqwen --real-gguf qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    PYTHONPATH=src python3 tools/fuzz_formats.py --replay 1:4521 -v        # one case again

Every case is a pure function of (seed, index): a seed file — a small synthetic model as
`.nanoqwen` (format version 4 with the default formats and with per-tensor formats, K-quants
included, copies in versions 3, 2 and 1, one with YaRN RoPE scaling) or as GGUF (F32/F16/Q8_0 and one type per tensor,
little- and big-endian, tied or not), or a real model when given — one mutation, and one command
(`convert` with `--weights int4` or `source`):

    flip      bits flipped in a region (header, tokenizer, table, data / metadata, tensor data)
    truncate  the file cut at a boundary or anywhere; extend: bytes appended
    field     one header, table or metadata field set to an extreme (0, 1, 2^k ± 1, all ones,
              NaN, ±inf, huge lengths, counts, offsets, dims, dtypes, the alignment), with the
              header/table/tokenizer CRCs recomputed so that the checks behind them are reached
    tokenizer the embedded tokenizer.json edited, its CRC recomputed

The command runs in process (cli.main, stdout and stderr captured) in a worker process with a
memory limit (RLIMIT_DATA: a few GiB past what it holds) and a time limit enforced by the
parent. The outcome must be one of:

    ok        exit 0 (for convert: the output opens as a valid .nanoqwen)
    error     exit 2 with exactly one stderr line "error: …" naming the mutated file

and never: an exception out of cli.main (a traceback), a MemoryError (a multi-GB allocation),
a hang (the time limit), a crashed worker, another exit status, a second stderr line, or a
file left behind (a partial output or a temporary). The summary counts each; --json writes
every failure with its replay id. Exit status: 0 when every case was clean, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import re
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FAILURES = ("traceback", "memory", "hang", "crash", "status", "bad error line", "leftover", "harness")
SYNTHETIC_TIME_S = 60.0       # a synthetic case is well under a second; past this it hangs
REAL_TIME_S = 900.0           # a real-model conversion or run on 2 CPU cores
SYNTHETIC_MEMORY = 2 << 30    # bytes a case may allocate past what the worker held before it
REAL_MEMORY = 8 << 30


# ---- the seed corpus ----------------------------------------------------------------------------

def small_config():
    from drvqwen.config import QwenConfig

    # 320 rows: the synthetic GGUF vocabulary (256 bytes, "ĠĠ", 9 control tokens) plus padding.
    return QwenConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=64, max_position=128)


def build_corpus(d: Path, real_nanoqwen: str | None, real_gguf: str | None) -> dict[str, Path]:
    """The seed files, written into `d` (deterministic)."""
    from drvqwen.format.convert import convert
    from drvqwen.format.tensor_set import expected_tensors, weight_shapes
    from drvqwen.format.nanoqwen_writer import NanoqwenWriter, write_legacy_copy
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.format.synthetic import (minimal_tokenizer_json, synthetic_dense, synthetic_tensor,
                                          write_synthetic, write_synthetic_gguf)

    d.mkdir(parents=True, exist_ok=True)
    cfg = small_config()
    rng = np.random.default_rng(20240)
    out: dict[str, Path] = {}
    nq = d / "syn.nanoqwen"
    with NanoqwenWriter(nq, cfg, minimal_tokenizer_json()) as w:
        for name, (dt, shape) in expected_tensors(cfg).items():
            w.add(name, synthetic_tensor(name, dt, shape, rng))
    out["syn.nanoqwen"] = nq
    import dataclasses

    from drvqwen.config import RopeScaling

    yarn_cfg = dataclasses.replace(cfg, rope_scaling=RopeScaling(
        factor=2.0, original_max_position=64, attention_factor=RopeScaling.default_attention_factor(2.0)))
    yq = d / "syn_yarn.nanoqwen"
    with NanoqwenWriter(yq, yarn_cfg, minimal_tokenizer_json()) as w:
        for name, (dt, shape) in expected_tensors(yarn_cfg).items():
            w.add(name, synthetic_tensor(name, dt, shape, rng))
    out["syn_yarn.nanoqwen"] = yq
    for v in (1, 2, 3):
        out[f"syn_v{v}.nanoqwen"] = write_legacy_copy(nq, d / f"syn_v{v}.nanoqwen", v)
    # llama.cpp's Q4_K_M recipe: q4_k, q6_k (K = 256) and their 32-input fallbacks (K = 128).
    out["syn_q4km.nanoqwen"] = write_synthetic(d / "syn_q4km.nanoqwen", cfg, 20241, minimal_tokenizer_json(),
                                               formats=recipe_formats(cfg, "q4_k_m"))
    dense = synthetic_dense(cfg, rng)
    mixed = ("Q5_0", "Q8_0", "Q4_1", "Q4_0", "Q5_1")
    types = {p + ".weight": mixed[i % len(mixed)] for i, p in enumerate(weight_shapes(cfg))}
    for name, kw in {"syn_f32.gguf": dict(qtype="F32", n_pad=20, eos_id=259),
                     "syn_f16_be.gguf": dict(qtype="F16", big_endian=True),
                     "syn_q8_tied.gguf": dict(qtype="Q8_0", tied=True),
                     "syn_mixed.gguf": dict(qtype=types)}.items():
        out[name] = write_synthetic_gguf(d / name, cfg, dense, **kw)
    # Per-tensor formats (q5_g32, q8_g32, … and FP32 norms): the mixed GGUF kept as it is.
    with contextlib.redirect_stdout(io.StringIO()):
        convert(out["syn_mixed.gguf"], d / "syn_formats.nanoqwen", weights="source")
    out["syn_formats.nanoqwen"] = d / "syn_formats.nanoqwen"
    if real_nanoqwen:
        out["real.nanoqwen"] = Path(real_nanoqwen).resolve()
    if real_gguf:
        out["real.gguf"] = Path(real_gguf).resolve()
    return out


# ---- where the fields are -------------------------------------------------------------------------

@dataclass
class Field:
    name: str
    offset: int
    fmt: str          # struct format with byte order


@dataclass
class Layout:
    """Regions (name → (start, end)) and fields of a seed file, for aimed mutations."""

    kind: str                                       # "nanoqwen" or "gguf"
    size: int
    regions: dict[str, tuple[int, int]]
    fields: list[Field] = field(default_factory=list)
    crc: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # name → (crc at, start, end)


def nanoqwen_layout(path: Path) -> Layout:
    from drvqwen.format import nanoqwen as nq

    size = path.stat().st_size
    # A small file is read whole; of a real one only the header here and the table below.
    raw = path.read_bytes() if size < 64 << 20 else _read_range(path, 0, nq.HEADER_SIZE)
    h = struct.unpack_from("<8sII8Idd I4I I7Q III", raw, 0)
    version = h[1]
    table_off, table_size, tok_off, tok_size, data_off, data_size = h[19:25]
    names = ["magic", "version", "header_size", "vocab_size", "hidden_size", "intermediate_size",
             "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_position"]
    fmts = ["<8s", "<I", "<I"] + ["<I"] * 8
    offs = [0, 8, 12] + [16 + 4 * i for i in range(8)]
    more = [("rope_theta", 48, "<d"), ("rms_norm_eps", 56, "<d"), ("flags", 64, "<I"), ("quant_bits", 68, "<I"),
            ("quant_group", 72, "<I"), ("quant_symmetric", 76, "<I"), ("layout_id", 80, "<I"),
            ("n_tensors", 84, "<I"), ("table_offset", 88, "<Q"), ("table_size", 96, "<Q"),
            ("tokenizer_offset", 104, "<Q"), ("tokenizer_size", 112, "<Q"), ("data_offset", 120, "<Q"),
            ("data_size", 128, "<Q"), ("file_size", 136, "<Q"), ("data_align", 144, "<I"),
            ("table_crc32", 148, "<I"), ("tokenizer_crc32", 152, "<I")]
    fields = [Field(n, o, f) for n, o, f in zip(names, offs, fmts)] + [Field(n, o, f) for n, o, f in more]
    if version >= 2:
        fields += [Field("text_vocab", 156, "<I"), Field("n_eog", 160, "<I")]
        fields += [Field(f"eog_ids[{i}]", 164 + 4 * i, "<I") for i in range(nq.MAX_EOG)]
        fields += [Field("rope_scaling", 212, "<I"), Field("rope_original_max", 216, "<I"),
                   Field("rope_factor", 220, "<d"), Field("rope_beta_fast", 228, "<f"),
                   Field("rope_beta_slow", 232, "<f"), Field("rope_attention_factor", 236, "<d"),
                   Field("rope_flags", 244, "<I")]
    # Table records: u16 name length, name, u8 dtype, [u8 format id: versions 3, 4], u8 ndim, ndim × u64,
    # u64 offset, u64 nbytes, u32 crc.
    tab = raw[table_off:table_off + table_size] if len(raw) >= table_off + table_size else \
        _read_range(path, table_off, table_size)
    pos = 0
    while pos + 2 <= len(tab):
        (nlen,) = struct.unpack_from("<H", tab, pos)
        name = tab[pos + 2:pos + 2 + nlen].decode("utf-8", "replace")
        base = table_off + pos
        fields.append(Field(f"table[{name}].name_length", base, "<H"))
        p2 = pos + 2 + nlen
        fields.append(Field(f"table[{name}].dtype", table_off + p2, "<B"))
        if version >= 3:
            fields.append(Field(f"table[{name}].format", table_off + p2 + 1, "<B"))
            p2 += 1
        (ndim,) = struct.unpack_from("<B", tab, p2 + 1)
        fields.append(Field(f"table[{name}].ndim", table_off + p2 + 1, "<B"))
        p3 = p2 + 2
        fields += [Field(f"table[{name}].dim{j}", table_off + p3 + 8 * j, "<Q") for j in range(ndim)]
        p4 = p3 + 8 * ndim
        fields += [Field(f"table[{name}].offset", table_off + p4, "<Q"), Field(f"table[{name}].nbytes", table_off + p4 + 8, "<Q"),
                   Field(f"table[{name}].crc32", table_off + p4 + 16, "<I")]
        pos = p4 + 20
    regions = {"header": (0, nq.HEADER_SIZE), "tokenizer": (tok_off, tok_off + tok_size),
               "table": (table_off, table_off + table_size), "data": (data_off, data_off + data_size)}
    crc = {"header": (252, 0, 252), "table": (148, table_off, table_off + table_size),
           "tokenizer": (152, tok_off, tok_off + tok_size)}
    return Layout("nanoqwen", size, regions, fields, crc)


def _read_range(path: Path, off: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


def gguf_layout(path: Path) -> Layout:
    """Walk the GGUF metadata (as format/gguf_check.py does) recording each field's place."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        import mmap

        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        (be,) = struct.unpack_from(">I", buf, 4)
        o = ">" if be in (2, 3) else "<"
        fields = [Field("magic", 0, "<4s"), Field("version", 4, o + "I"), Field("tensor_count", 8, o + "Q"),
                  Field("kv_count", 16, o + "Q")]
        n_t, n_kv = struct.unpack_from(o + "QQ", buf, 8)
        pos = 24
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

        def string(label):
            nonlocal pos
            fields.append(Field(f"{label}.length", pos, o + "Q"))
            (n,) = struct.unpack_from(o + "Q", buf, pos)
            s = bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", "replace")
            pos += 8 + n
            return s

        for _ in range(n_kv):
            key = string("kv key")
            fields.append(Field(f"kv[{key}].type", pos, o + "I"))
            (vt,) = struct.unpack_from(o + "I", buf, pos)
            pos += 4
            if vt in sizes:
                fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[sizes[vt]]
                fields.append(Field(f"kv[{key}]", pos, o + fmt))
                pos += sizes[vt]
            elif vt == 8:
                string(f"kv[{key}]")
            else:
                fields += [Field(f"kv[{key}].item_type", pos, o + "I"), Field(f"kv[{key}].count", pos + 4, o + "Q")]
                et, cnt = struct.unpack_from(o + "IQ", buf, pos)
                pos += 12
                if et == 8:
                    for i in range(cnt):
                        if i < 3 or i + 3 >= cnt:
                            string(f"kv[{key}][{i}]")
                        else:
                            (n,) = struct.unpack_from(o + "Q", buf, pos)
                            pos += 8 + n
                else:
                    if cnt:
                        fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[sizes[et]]
                        fields.append(Field(f"kv[{key}][0]", pos, o + fmt))
                    pos += cnt * sizes[et]
        for _ in range(n_t):
            name = string("tensor name")
            fields.append(Field(f"tensor[{name}].n_dims", pos, o + "I"))
            (nd,) = struct.unpack_from(o + "I", buf, pos)
            pos += 4
            fields += [Field(f"tensor[{name}].dim{j}", pos + 8 * j, o + "Q") for j in range(nd)]
            pos += 8 * nd
            fields += [Field(f"tensor[{name}].type", pos, o + "I"), Field(f"tensor[{name}].offset", pos + 4, o + "Q")]
            pos += 12
        meta_end = pos
    finally:
        buf.close()
    return Layout("gguf", size, {"metadata": (0, meta_end), "data": (meta_end, size)}, fields)


# ---- one case -----------------------------------------------------------------------------------

EXTREME_INTS = (0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 4095, 4096, 65535, 65536,
                2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
EXTREME_FLOATS = (0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-300, 1e300,
                  1e-45, 3.4e38, 0.5, 2.0)


def _pack_extreme(fmt: str, rng: np.random.Generator) -> bytes:
    order, code = fmt[0], fmt[1:]
    if code.endswith("s"):
        n = int(code[:-1])
        return bytes(rng.integers(0, 256, n, dtype=np.uint8))
    if code in "fd":
        v = float(rng.choice(EXTREME_FLOATS)) if rng.random() < 0.8 else float(rng.standard_normal() * 10.0 ** int(rng.integers(-5, 10)))
        if code == "f":    # float32 fields: values past its range become ±inf, as a C cast does
            with np.errstate(over="ignore"):
                return np.array([v], dtype=np.dtype(np.float32).newbyteorder(order)).tobytes()
        return struct.pack(order + code, v)
    bits = struct.calcsize(code) * 8
    if rng.random() < 0.8:
        v = int(EXTREME_INTS[rng.integers(len(EXTREME_INTS))])
    else:
        v = int(rng.integers(0, 2**min(bits, 63)))
    if rng.random() < 0.2:
        v += int(rng.choice([-1, 1]))
    v %= 2**bits
    signed = code.islower() and code not in "?"
    if signed and v >= 2**(bits - 1):
        v -= 2**bits
    if code == "?":
        v = v & 1
    return struct.pack(order + code, v)


@dataclass
class Mutation:
    kind: str
    detail: str
    patches: list[tuple[int, bytes]] = field(default_factory=list)   # (offset, new bytes)
    truncate_to: int | None = None
    append: bytes = b""


def _fix_crcs(layout: Layout, read, patches: list[tuple[int, bytes]], which: tuple[str, ...]) -> None:
    """Append patches that make the named CRCs match the patched bytes (header last)."""
    def patched(start, end):
        data = bytearray(read(start, end - start))
        for off, b in patches:
            lo, hi = max(off, start), min(off + len(b), end)
            if lo < hi:
                data[lo - start:hi - start] = b[lo - off:hi - off]
        return bytes(data)

    for name in which:
        if name == "header":
            continue
        at, start, end = layout.crc[name]
        patches.append((at, struct.pack("<I", zlib.crc32(patched(start, end)))))
    if "header" in which:
        patches.append((252, struct.pack("<I", zlib.crc32(patched(0, 252)))))


def make_mutation(layout: Layout, read, rng: np.random.Generator, real: bool) -> Mutation:
    kinds = ["flip", "truncate", "extend", "field", "field"]
    if layout.kind == "nanoqwen":
        kinds += ["tokenizer", "field"]
    kind = str(rng.choice(kinds))
    size = layout.size
    if kind == "flip":
        if layout.kind == "nanoqwen":
            region = str(rng.choice(["header", "tokenizer", "table", "data"], p=[0.25, 0.15, 0.25, 0.35]))
        else:
            region = str(rng.choice(["metadata", "data"], p=[0.7, 0.3]))
        a, b = layout.regions[region]
        if b <= a:
            a, b = 0, size
        patches = []
        for _ in range(int(rng.integers(1, 9))):
            off = int(rng.integers(a, b))
            patches.append((off, bytes([read(off, 1)[0] ^ (1 << int(rng.integers(8)))])))
        m = Mutation("flip", f"{len(patches)} bits in {region}", patches)
        if layout.kind == "nanoqwen" and region in ("header", "table", "tokenizer") and rng.random() < 0.5:
            _fix_crcs(layout, read, m.patches, ("table", "tokenizer", "header") if region != "header" else ("header",))
            m.detail += ", CRCs fixed"
        return m
    if kind == "truncate":
        bounds = sorted({0, size} | {x for r in layout.regions.values() for x in r})
        if rng.random() < 0.5:
            cut = int(rng.choice(bounds)) + int(rng.integers(-3, 4))
        else:
            cut = int(rng.integers(0, size))
        if real:   # keep the work bounded: a real file is cut near its start or its end
            cut = int(rng.integers(0, 16 << 20)) if rng.random() < 0.5 else size - int(rng.integers(1, 16 << 20))
        cut = min(max(cut, 0), size - 1)
        return Mutation("truncate", f"to {cut} of {size} bytes", truncate_to=cut)
    if kind == "extend":
        n = int(rng.choice([1, 7, 4096, 65536]))
        return Mutation("extend", f"{n} bytes appended", append=bytes(rng.integers(0, 256, n, dtype=np.uint8)))
    if kind == "tokenizer":
        a, b = layout.regions["tokenizer"]
        patches = []
        for _ in range(int(rng.integers(1, 4))):
            off = int(rng.integers(a, b))
            patches.append((off, bytes([int(rng.choice(list(b'{}[]",:0\\ \x00\xff')))])))
        m = Mutation("tokenizer", f"{len(patches)} bytes of tokenizer.json, CRC fixed", patches)
        _fix_crcs(layout, read, m.patches, ("tokenizer", "header"))
        return m
    # field
    f = layout.fields[int(rng.integers(len(layout.fields)))]
    new = _pack_extreme(f.fmt, rng)
    m = Mutation("field", f"{f.name} = {new.hex()}", [(f.offset, new)])
    if layout.kind == "nanoqwen" and rng.random() < 0.9:
        _fix_crcs(layout, read, m.patches, ("table", "tokenizer", "header"))
        m.detail += ", CRCs fixed"
    return m


def choose_command(seed_name: str, rng: np.random.Generator, target: Path, out: Path) -> list[str]:
    run = ["run", "--model", str(target), "--device", "cpu", "--prompt", "hi", "--max-new-tokens",
           str(int(rng.choice([1, 2, 4]))), "--ignore-eos"]
    if rng.random() < 0.5:
        run.append("--raw")
    if rng.random() < 0.3:
        run += ["--temperature", "0.8", "--top-k", "7", "--seed", str(int(rng.integers(1 << 20)))]
    if seed_name.endswith(".gguf"):
        conv = ["convert", str(target), "-o", str(out), "--weights", str(rng.choice(["int4", "source"]))]
        if seed_name.startswith("real"):
            return conv
        return [conv, run, ["info", str(target)]][int(rng.choice(3, p=[0.6, 0.3, 0.1]))]
    if seed_name.startswith("real"):
        return [["info", str(target)], ["info", str(target), "--verify"], run][int(rng.choice(3, p=[0.7, 0.2, 0.1]))]
    return [["info", str(target)], ["info", str(target), "--tensors", "--verify"], run][int(rng.choice(3, p=[0.3, 0.2, 0.5]))]


# Shares of the cases that go to the real models (when given); the rest is split evenly over
# the synthetic seeds. Real files cost seconds to minutes a case, synthetic ones milliseconds.
REAL_SHARE = {"real.nanoqwen": 0.05, "real.gguf": 0.01}


def choose_seed(names: list[str], rng: np.random.Generator) -> str:
    """The seed file of a case (the first draw of its generator)."""
    real = sum(REAL_SHARE.get(n, 0.0) for n in names)
    n_syn = sum(1 for n in names if n not in REAL_SHARE)
    w = np.array([REAL_SHARE.get(n, (1 - real) / n_syn) for n in names])
    return names[int(rng.choice(len(names), p=w / w.sum()))]


# ---- the worker ----------------------------------------------------------------------------------

class Worker:
    """Runs cases in this process (started with --worker by the parent)."""

    def __init__(self, workdir: Path, corpus: dict[str, Path]):
        self.workdir, self.corpus = workdir, corpus
        self.cases = workdir / f"w{os.getpid()}"
        self.cases.mkdir(parents=True, exist_ok=True)
        self.layouts: dict[str, Layout] = {}
        self.copies: dict[str, Path] = {}
        os.environ["DRVQWEN_CACHE"] = str(self.cases / "cache")

    def layout(self, name: str) -> Layout:
        if name not in self.layouts:
            p = self.corpus[name]
            self.layouts[name] = nanoqwen_layout(p) if name.endswith(".nanoqwen") else gguf_layout(p)
        return self.layouts[name]

    def _real_copy(self, name: str) -> Path:
        # One working copy per worker, mutated in place and restored after each case.
        if name not in self.copies:
            dst = self.cases / f"work-{name}"
            shutil.copyfile(self.corpus[name], dst)
            self.copies[name] = dst
        return self.copies[name]

    def run_case(self, seed: int, index: int) -> dict:
        rng = np.random.default_rng([seed, index])
        names = sorted(self.corpus)
        seed_name = choose_seed(names, rng)
        src = self.corpus[seed_name]
        real = seed_name.startswith("real")
        layout = self.layout(seed_name)
        with open(src, "rb") as fh:
            def read(off, n):
                fh.seek(off)
                return fh.read(n)

            mut = make_mutation(layout, read, rng, real)
        suffix = ".gguf" if seed_name.endswith(".gguf") else ".nanoqwen"
        stem = f"case-{seed}-{index}"
        target = self.cases / f"{stem}{suffix}"
        out_dir = self.cases / "out"
        out_dir.mkdir(exist_ok=True)
        out = out_dir / f"{stem}-out.nanoqwen"
        undo = None
        if real and not (mut.truncate_to is not None and mut.truncate_to < 16 << 20):
            work = self._real_copy(seed_name)
            undo = self._apply_in_place(work, mut, src)
            os.link(work, target)       # the case's own name (error lines must name it)
        else:
            self._write_mutated(src, target, mut)
        argv = choose_command(seed_name, rng, target, out)
        t0 = time.perf_counter()
        try:
            res = self._execute(argv, real)
        finally:
            secs = time.perf_counter() - t0
            gc.collect()
        res.update(index=index, seed_file=seed_name, mutation=f"{mut.kind}: {mut.detail}",
                   argv=[Path(a).name if a in (str(target), str(out)) else a for a in argv], secs=round(secs, 3))
        # What may be left: nothing but a convert's complete output.
        if res["outcome"] in ("ok", "error"):
            self._check_outputs(res, argv, out, out_dir, stem)
        for p in (target, out):
            with contextlib.suppress(OSError):
                p.unlink()
        shutil.rmtree(self.cases / "cache", ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
        if undo is not None:
            undo()
        return res

    @staticmethod
    def _write_mutated(src: Path, target: Path, mut: Mutation) -> None:
        data = bytearray(src.read_bytes() if mut.truncate_to is None else _read_range(src, 0, mut.truncate_to))
        for off, b in mut.patches:
            if off < len(data):
                data[off:off + len(b)] = b[:max(0, len(data) - off)]
        data += mut.append
        target.write_bytes(bytes(data))

    @staticmethod
    def _apply_in_place(work: Path, mut: Mutation, original: Path):
        saved = []
        size = work.stat().st_size
        with open(work, "r+b") as f:
            for off, b in mut.patches:
                if off < size:
                    f.seek(off)
                    saved.append((off, f.read(len(b))))
                    f.seek(off)
                    f.write(b[:size - off])
        if mut.truncate_to is not None:
            os.truncate(work, mut.truncate_to)
        if mut.append:
            with open(work, "ab") as f:
                f.write(mut.append)

        def undo():
            if mut.truncate_to is not None or mut.append:
                os.truncate(work, mut.truncate_to if mut.truncate_to is not None else size)
                if mut.truncate_to is not None:
                    with open(original, "rb") as src, open(work, "ab") as dst:
                        src.seek(mut.truncate_to)
                        shutil.copyfileobj(src, dst, 8 << 20)
                else:
                    os.truncate(work, size)
            with open(work, "r+b") as f:
                for off, b in reversed(saved):
                    f.seek(off)
                    f.write(b)
        return undo

    def _execute(self, argv: list[str], real: bool) -> dict:
        from drvqwen import cli, paths

        paths._cleaned.clear()
        limit = REAL_MEMORY if real else SYNTHETIC_MEMORY
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (_data_bytes() + limit, hard))
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli.main(argv)
        except MemoryError:
            return {"outcome": "memory", "detail": "MemoryError (an allocation past the limit)"}
        except BaseException as e:  # noqa: BLE001 - anything out of cli.main is the finding
            import traceback

            return {"outcome": "traceback", "detail": f"{type(e).__name__}: {str(e)[:300]}",
                    "trace": traceback.format_exc()[-3000:]}
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        if rc == 0:
            return {"outcome": "ok", "detail": ""}
        if rc != 2:
            return {"outcome": "status", "detail": f"exit status {rc}: {lines[-1:]}"}
        errors = [ln for ln in lines if ln.startswith("error:")]
        if len(errors) != 1 or errors[0] != lines[-1]:
            return {"outcome": "bad error line", "detail": " | ".join(lines)[-400:]}
        return {"outcome": "error", "detail": errors[0]}

    def _check_outputs(self, res: dict, argv: list[str], out: Path, out_dir: Path, stem: str) -> None:
        if res["outcome"] == "error":
            # The line names the file (its path, or the conversion derived from its name).
            if stem not in res["detail"]:
                res["outcome"], res["detail"] = "bad error line", "does not name the file: " + res["detail"]
                return
        left = [p.name for p in out_dir.iterdir() if p != out or res["outcome"] == "error"]
        left += [p.name for d in (self.cases, self.cases / "cache" / "models") if d.is_dir()
                 for p in d.iterdir() if re.search(r"\.(tmp|part)-?\d*|\.wheels-|\.hub-", p.name)]
        if left:
            res["outcome"], res["detail"] = "leftover", f"left behind: {left[:5]}"
            return
        if argv[0] == "convert" and res["outcome"] == "ok":
            from drvqwen.format.nanoqwen import NanoqwenFile

            try:
                NanoqwenFile(out).close()
            except Exception as e:  # noqa: BLE001
                res["outcome"], res["detail"] = "leftover", f"convert wrote an invalid file: {e}"


def _data_bytes() -> int:
    """Private data mapped by this process now (VmData), the base of the memory limit."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_main(workdir: Path, corpus: dict[str, Path]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # the parent stops us
    w = Worker(workdir, corpus)
    # Results go out on a private copy of stdout; fd 1 itself goes to /dev/null, so nothing a
    # case writes there (a library, a stray print) can garble the protocol.
    real_stdout = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    for line in sys.stdin:
        seed, index = map(int, line.split())
        try:
            res = w.run_case(seed, index)
        except Exception as e:  # noqa: BLE001 - the fuzzer's own bug: report it, keep going
            import traceback

            res = {"index": index, "outcome": "harness", "detail": f"{type(e).__name__}: {e}",
                   "trace": traceback.format_exc()[-2000:]}
        real_stdout.write(json.dumps(res) + "\n")
    return 0


# ---- the parent ----------------------------------------------------------------------------------

class WorkerProc:
    def __init__(self, workdir: Path, corpus_json: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                           os.environ.get("PYTHONPATH", "")]))
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", str(workdir), "--corpus-json", corpus_json],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=env, start_new_session=True)

    def ask(self, seed: int, index: int, timeout: float) -> dict | None:
        self.p.stdin.write(f"{seed} {index}\n")
        self.p.stdin.flush()
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not r:
            return None
        line = self.p.stdout.readline()
        return json.loads(line) if line else {"outcome": "crash", "detail": f"worker died ({self.p.poll()})"}

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()


def run_fuzz(cases: int, seed: int, workdir: Path, real_nanoqwen: str | None = None, real_gguf: str | None = None,
             start: int = 0, progress: bool = True, only: list[int] | None = None) -> dict:
    """Run cases start … start+cases-1 of `seed` (or the indices in `only`); returns the summary
    dict with every failure."""
    corpus = build_corpus(workdir / "seeds", real_nanoqwen, real_gguf)
    corpus_json = json.dumps({k: str(v) for k, v in corpus.items()})
    indices = only if only is not None else list(range(start, start + cases))
    results, failures = Counter(), []
    by_seed, errors, slow = Counter(), Counter(), []
    t0 = time.perf_counter()
    worker = WorkerProc(workdir, corpus_json)
    try:
        for n, index in enumerate(indices, 1):
            rng = np.random.default_rng([seed, index])
            real = choose_seed(sorted(corpus), rng).startswith("real")
            limit = REAL_TIME_S if real else SYNTHETIC_TIME_S
            res = worker.ask(seed, index, limit)
            if res is None:
                worker.kill()
                res = {"index": index, "outcome": "hang", "detail": f"no answer in {limit:.0f} s"}
                worker = WorkerProc(workdir, corpus_json)
            elif res["outcome"] == "crash":
                res["index"] = index
                worker.kill()
                worker = WorkerProc(workdir, corpus_json)
            results[res["outcome"]] += 1
            by_seed[res.get("seed_file", "?")] += 1
            if res["outcome"] == "error":
                errors[re.sub(r"\d+", "N", res["detail"].split(": ", 2)[-1])[:90]] += 1
            if res["outcome"] not in ("ok", "error"):
                res["replay"] = f"{seed}:{index}"
                failures.append(res)
            slow.append((res.get("secs", 0.0), index, res.get("seed_file"), res.get("mutation"), res.get("argv")))
            if progress and (n % 100 == 0 or n == len(indices)):
                bad = sum(results[k] for k in FAILURES)
                print(f"[{time.perf_counter() - t0:7.0f} s] {n}/{len(indices)} cases, ok {results['ok']}, "
                      f"error {results['error']}, failures {bad}", file=sys.stderr, flush=True)
    finally:
        worker.kill()
    slow.sort(reverse=True)
    return {"seed": seed, "cases": len(indices), "seconds": round(time.perf_counter() - t0, 1),
            "outcomes": dict(results), "by_seed_file": dict(by_seed), "failures": failures,
            "common_errors": errors.most_common(25), "slowest": slow[:5]}


def print_summary(s: dict) -> None:
    o = s["outcomes"]
    bad = {k: o.get(k, 0) for k in FAILURES}
    print(f"fuzz_formats: {s['cases']} cases (seed {s['seed']}) in {s['seconds']:.0f} s")
    print(f"  clean: {o.get('ok', 0) + o.get('error', 0)} (ok {o.get('ok', 0)}, one-line error {o.get('error', 0)}); "
          f"failures: {sum(bad.values())} ({', '.join(f'{k} {v}' for k, v in bad.items())})")
    print("  by seed file: " + ", ".join(f"{k} {v}" for k, v in sorted(s["by_seed_file"].items())))
    if s["slowest"]:
        secs, index, seed_file, mut, argv = s["slowest"][0]
        print(f"  slowest case: {secs:.1f} s (#{index}: {seed_file}, {mut}, {' '.join(argv or [])[:80]})")
    print("  most common errors (digits as N):")
    for msg, n in s["common_errors"][:12]:
        print(f"    {n:6d}  {msg}")
    for f in s["failures"][:20]:
        print(f"  FAIL {f.get('replay')}: {f['outcome']}: {f.get('seed_file')}, {f.get('mutation')}, "
              f"{' '.join(f.get('argv') or [])[:100]}: {f['detail'][:200]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--real-nanoqwen", help="a real .nanoqwen to fuzz too (5%% of the cases)")
    ap.add_argument("--real-gguf", help="a real GGUF to fuzz too (1%% of the cases, convert only)")
    ap.add_argument("--workdir", help="scratch folder (default: a new one under /tmp)")
    ap.add_argument("--replay", help="SEED:INDEX of one case to run again, with its trace")
    ap.add_argument("--json", help="write the summary and every failure here")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--corpus-json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker_main(Path(a.worker), {k: Path(v) for k, v in json.loads(a.corpus_json).items()})
    import tempfile

    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="drvqwen-fuzz-"))
    try:
        if a.replay:
            seed, index = map(int, a.replay.split(":"))
            s = run_fuzz(1, seed, workdir, a.real_nanoqwen, a.real_gguf, progress=False, only=[index])
            for f in s["failures"]:
                print(json.dumps(f, indent=1))
            if not s["failures"]:
                print(f"case {a.replay}: clean ({s['outcomes']})")
            return 1 if s["failures"] else 0
        s = run_fuzz(a.cases, a.seed, workdir, a.real_nanoqwen, a.real_gguf, start=a.start)
        print_summary(s)
        if a.json:
            Path(a.json).write_text(json.dumps(s, indent=1, default=str))
        return 1 if s["failures"] else 0
    finally:
        if not a.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
