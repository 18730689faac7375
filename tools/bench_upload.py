#!/usr/bin/env python3
"""Where the weights' upload spends its time: each piece of GPUWeights' upload timed alone, and
the whole with other staging settings, in one process on the GPU.

    PYTHONPATH=src python3 tools/make_synthetic.py --preset 0.5b --recipe q4_k_m -o /tmp/syn05-q4km.nanoqwen
    PYTHONPATH=src python3 tools/bench_upload.py --model /tmp/syn05-q4km.nanoqwen --json upload.json
    PYTHONPATH=src python3 tools/bench_upload.py --list        # the variants (no GPU, no model)
    PYTHONPATH=src python3 tools/bench_upload.py --model M --only dma --only register

Runtime, estimated from the sizes (not yet measured): make_synthetic writes the 0.5B in a few
seconds; the bench takes about 40 s on an H200 for the 0.5B's 0.5 GB, start-up included, well
under 2 minutes. A 7B (5.5 GB) takes about ten times as long.

Each variant runs once unmeasured, then --reps times (default 5); the table and the JSON give
the median of each part and of the whole (ms), and bytes moved per second. A variant that fails
prints one line with the reason, and the others still run. The variants (--list says what each
does) time: the pinned staging buffer's allocation, and a few other sizes'; the page faults of a
fresh mapping of the file (page cache warm); the host copy alone (the file's mapping → the pinned
staging halves, memory.parallel_copy, with the uploader's thread count and 1/2/4/8 threads, fresh
mapping or touched, tensor by tensor); the DMA alone (pinned → device: one copy, the uploader's
chunks with and without its event waits, one copy per tensor; "copy engine" is the GPU time
between events around the copies); the weight pool's cuMemAlloc; GPUWeights(f) itself (the file
opened afresh, untimed; for an INT4 model it includes the rearrangement of the projections into
the device layout, gpu_weights.py) with the defaults (DMA from the registered mapping), a touched mapping,
the staging uploader, with the gathered upload off and with other chunk_bytes / copy_threads /
piece_bytes; and the registration on its own, cuMemHostRegister of the file's mapping, read-only
(cuda/host_dma.py), with the DMA straight from it (the unregistration is timed, not counted in
the total).

The host copy, DMA and register variants move the data region as it lies in the file (an F32
tensor stays F32 there; GPUWeights uploads it as FP16). --json OUT writes every sample, the
medians, the model's sizes, the device and `drvqwen.provenance.source_record()`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable
from unittest.mock import patch

import numpy as np
from rich.console import Console
from rich.table import Table

from drvqwen import startup
from drvqwen.cuda import (DeviceBuffer, Event, PinnedHostBuffer, Pool, RegisteredHostRange, Stream,
                          copy_to_device_async, get_device, gpu_unavailable_reason, read_only_register_supported)
from drvqwen.cuda.host_dma import PAGE_BYTES
from drvqwen.cuda.memory import (STAGING_CHUNK_BYTES, STAGING_COPY_THREADS, STAGING_PIECE_BYTES,
                                 default_copy_threads, parallel_copy)
from drvqwen.errors import DrvqwenError
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.gpu_weights import GPUWeights, weight_pool_bytes
from drvqwen.provenance import source_record

MiB = 2**20
PINNED_SIZES = (16 * MiB, 64 * MiB, 512 * MiB)
THREAD_COUNTS = (1, 2, 4, 8)
CHUNK_SIZES = (16 * MiB, 32 * MiB, 128 * MiB, 256 * MiB)
COPY_THREADS = (1, 2, 4, 16)
PIECE_SIZES = (2 * MiB, 4 * MiB, 32 * MiB)

Parts = dict[str, float]   # part → seconds; "total" is the whole


class Laps:
    """Seconds between successive marks, by name (perf_counter)."""

    def __init__(self) -> None:
        self.parts: Parts = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self._t
        self._t = now

    def done(self, *total_of: str) -> Parts:
        """The parts with "total": the sum of the parts named (all of them when none is)."""
        return {**self.parts, "total": sum(v for k, v in self.parts.items() if not total_of or k in total_of)}


def copy_in_chunks(region: np.ndarray, staging: np.ndarray, chunk: int, pool: ThreadPoolExecutor | None,
                   piece: int) -> None:
    """region → staging's two halves of `chunk` bytes in turn, as StagingUploader fills them
    (parallel_copy in pieces on `pool`), without its DMA. Both are 1-D uint8; staging ≥ 2 chunks."""
    for i, a in enumerate(range(0, region.size, chunk)):
        m = min(chunk, region.size - a)
        lo = (i % 2) * chunk
        parallel_copy(staging[lo:lo + m], region[a:a + m], pool, piece)


def copy_by_tensor(region: np.ndarray, spans: list[tuple[int, int]], staging: np.ndarray,
                   pool: ThreadPoolExecutor | None, piece: int) -> None:
    """Each (offset, nbytes) span of region → staging, one parallel_copy a tensor (a large one
    in pieces of staging's size), packed one after the other, from the start again when full."""
    at = 0
    for off, n in spans:
        for a in range(off, off + n, staging.size):
            m = min(staging.size, off + n - a)
            at = 0 if at + m > staging.size else at
            parallel_copy(staging[at:at + m], region[a:a + m], pool, piece)
            at += m


def touch_pages(region: np.ndarray, page: int) -> int:
    """Read one byte of every page of `region` (faults each in); returns their sum."""
    return int(region[::page].sum(dtype=np.uint64))


class Setup:
    """The model's sizes, and the buffers the GPU variants share: each made on first use (a
    variant that cannot get one fails alone), all freed by close()."""

    def __init__(self, path: str) -> None:
        self.path, self._made = Path(path), []
        with NanoqwenFile(self.path) as f:
            self.data_bytes = f.header.data_size
            self.spans = [(i.offset - f.header.data_offset, i.nbytes) for i in f]
            self.pool_bytes = weight_pool_bytes(f)

    def open(self) -> NanoqwenFile:
        """The model file opened afresh: a new mapping, none of its pages touched yet."""
        return NanoqwenFile(self.path)

    def mapping(self, fresh: bool):
        """The model file, to use in `with`: opened afresh (closed after), or the touched one."""
        return self.open() if fresh else nullcontext(self.touched)

    def _keep(self, *things):
        self._made += things
        return things if len(things) > 1 else things[0]

    @cached_property
    def touched(self) -> NanoqwenFile:
        """The model file opened once, every page of its data region touched."""
        f = self.open()
        touch_pages(f.data_region(), PAGE_BYTES)
        return f

    @cached_property
    def source(self) -> PinnedHostBuffer:
        """Pinned memory of the data region's size, filled from the file."""
        buf = self._keep(PinnedHostBuffer(self.data_bytes))
        buf.view()[:] = self.touched.data_region()
        return buf

    stream = cached_property(lambda self: self._keep(Stream()))
    events = cached_property(lambda self: self._keep(Event(), Event(), Event(), Event()))
    staging = cached_property(lambda self: self._keep(PinnedHostBuffer(2 * STAGING_CHUNK_BYTES)))  # the uploader's
    device = cached_property(lambda self: self._keep(DeviceBuffer(self.data_bytes, "bench_upload.dst")))

    def close(self) -> None:
        """Wait for the stream, free what was made, close the touched file."""
        if "stream" in self.__dict__:
            self.stream.synchronize()
        for thing in reversed(self._made):
            (thing.free if hasattr(thing, "free") else thing.close)()
        self._made.clear()
        if "touched" in self.__dict__:
            self.touched.close()


@dataclass(frozen=True)
class Variant:
    """One measurement: a name, the piece it times, what it does, and run(setup) → (bytes moved,
    seconds by part, "total" among them)."""
    name: str
    group: str
    what: str
    run: Callable[[Setup], tuple[int, Parts]] = field(repr=False, compare=False)


def _alloc_free(make: Callable[[Setup], object], nbytes: Callable[[Setup], int]):
    def run(s: Setup):
        c = Laps()
        thing = make(s)
        c.lap("alloc")
        (thing.free if hasattr(thing, "free") else thing.close)()
        c.lap("free")
        return nbytes(s), c.done()
    return run


def _page_faults(s: Setup):
    with s.mapping(fresh=True) as f:
        c = Laps()
        touch_pages(f.data_region(), PAGE_BYTES)
        c.lap("faults")
    return s.data_bytes, c.done()


def _host_copy(threads: int, fresh: bool = True, by_tensor: bool = False):
    def run(s: Setup):
        staging = s.staging.view()
        with s.mapping(fresh) as f:
            region = f.data_region()
            c = Laps()
            with ThreadPoolExecutor(threads, thread_name_prefix="staging") if threads > 1 else nullcontext() as pool:
                if by_tensor:
                    copy_by_tensor(region, s.spans, staging[:STAGING_CHUNK_BYTES], pool, STAGING_PIECE_BYTES)
                else:
                    copy_in_chunks(region, staging, STAGING_CHUNK_BYTES, pool, STAGING_PIECE_BYTES)
            c.lap("copy")
        return s.data_bytes, c.done()
    return run


def _timed_dma(s: Setup, queue: Callable[[], None], c: Laps) -> Parts:
    """Queue the copies between two events and wait for them: the wall time is c's lap "dma",
    the GPU time between the events "copy engine"."""
    e0, e1 = s.events[:2]
    e0.record(s.stream)
    queue()
    e1.record(s.stream)
    s.stream.synchronize()
    c.lap("dma")
    return {"copy engine": e0.elapsed_ms(e1) / 1e3}


def _dma(mode: str):
    def run(s: Setup):
        dst, n = s.device.ptr, s.data_bytes
        src = s.staging if mode == "halves" else s.source
        chunk = STAGING_CHUNK_BYTES

        def queue():
            if mode == "one":
                copy_to_device_async(dst, src.ptr, n, s.stream)
            elif mode == "tensors":
                for off, m in s.spans:
                    copy_to_device_async(dst + off, src.ptr + off, m, s.stream)
            else:
                # "halves" times StagingUploader's DMA pattern without its CPU copy: a half is
                # reused once the event recorded after its last copy has passed (a deliberate
                # look-alike of its _take_half / _dma); "chunks" the same copies without waits.
                done = s.events[2:]
                for i, a in enumerate(range(0, n, chunk)):
                    half = i % 2
                    if mode == "halves" and i >= 2:
                        done[half].synchronize()
                    copy_to_device_async(dst + a, src.ptr + (half * chunk if mode == "halves" else a),
                                         min(chunk, n - a), s.stream)
                    if mode == "halves":
                        done[half].record(s.stream)

        c = Laps()
        engine = _timed_dma(s, queue, c)
        return n, {**c.done(), **engine}
    return run


def _gpu_weights(staging: dict[str, int] | None = None, env: dict[str, str] | None = None, fresh: bool = True):
    def run(s: Setup):
        with s.mapping(fresh) as f, patch.dict(os.environ, env or {}):
            c = Laps()
            w = GPUWeights(f, staging=staging)
            c.lap("upload")
        w.close()
        return w.nbytes, c.done()
    return run


def _register(by_tensor: bool = False, fresh: bool = True):
    def run(s: Setup):
        if not read_only_register_supported():
            raise RuntimeError("the device cannot register host memory read-only "
                               "(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0)")
        dst = s.device.ptr
        with s.mapping(fresh) as f:
            region = f.data_region()
            c = Laps()
            with RegisteredHostRange(region, read_only=True) as reg:
                c.lap("register")

                def queue():
                    for off, m in (s.spans if by_tensor else [(0, region.size)]):
                        copy_to_device_async(dst + off, reg.ptr + off, m, s.stream)
                engine = _timed_dma(s, queue, c)
            c.lap("unregister")
        return s.data_bytes, {**c.done("register", "dma"), **engine}
    return run


def variant_list(threads: int | None = None) -> list[Variant]:
    """Every variant, in the order they run; `threads` is the uploader's copy-thread count
    (default: memory.default_copy_threads() of this process)."""
    threads = default_copy_threads() if threads is None else threads
    chunk, piece = STAGING_CHUNK_BYTES // MiB, STAGING_PIECE_BYTES // MiB
    v = [Variant(f"pinned alloc {n // MiB} MiB{' (staging)' * (n == 2 * STAGING_CHUNK_BYTES)}", "pinned alloc",
                 "PinnedHostBuffer: cuMemHostAlloc and cuMemFreeHost",
                 _alloc_free(lambda s, n=n: PinnedHostBuffer(n), lambda s, n=n: n))
         for n in sorted({2 * STAGING_CHUNK_BYTES, *PINNED_SIZES})]
    v.append(Variant("page faults", "page faults", "one byte of every page of a fresh mapping", _page_faults))
    counts = sorted({threads, *THREAD_COUNTS})
    v += [Variant(f"host copy {t} thread{'s' * (t > 1)}{' (uploader)' if t == threads else ''}", "host copy",
                  f"data region → staging halves, {chunk} MiB chunks, {piece} MiB pieces, fresh mapping",
                  _host_copy(t)) for t in counts]
    v.append(Variant(f"host copy {threads} threads, touched", "host copy",
                     "the same from a mapping touched before (no faults)", _host_copy(threads, fresh=False)))
    v.append(Variant(f"host copy by tensor, {threads} threads", "host copy",
                     "one parallel_copy per tensor into one staging chunk, fresh mapping",
                     _host_copy(threads, by_tensor=True)))
    v += [Variant("dma one copy", "dma", "pinned → device, the whole data region in one copy", _dma("one")),
          Variant(f"dma {chunk} MiB chunks, halves", "dma",
                  "the uploader's chunks through two pinned halves, an event wait before reuse", _dma("halves")),
          Variant(f"dma {chunk} MiB chunks, no waits", "dma", "the same chunks from one pinned buffer", _dma("chunks")),
          Variant("dma by tensor", "dma", "one copy per tensor", _dma("tensors")),
          Variant("pool alloc", "device alloc", "the weight pool: cuMemAlloc and cuMemFree",
                  _alloc_free(lambda s: Pool(s.pool_bytes, name="weights"), lambda s: s.pool_bytes)),
          Variant("GPUWeights defaults", "GPUWeights",
                  "GPUWeights(f) as drvqwen runs it (DMA from the registered mapping), fresh mapping", _gpu_weights()),
          Variant("GPUWeights touched", "GPUWeights", "the same from a mapping touched before",
                  _gpu_weights(fresh=False)),
          Variant("GPUWeights staging", "GPUWeights", f"{startup.UPLOAD}=staging",
                  _gpu_weights(env={startup.UPLOAD: "staging"})),
          Variant("GPUWeights staging touched", "GPUWeights", "the same from a mapping touched before",
                  _gpu_weights(env={startup.UPLOAD: "staging"}, fresh=False)),
          Variant("GPUWeights staging, one DMA per tensor", "GPUWeights",
                  f"{startup.UPLOAD}=staging, {startup.GATHERED_UPLOAD}=off",
                  _gpu_weights(env={startup.UPLOAD: "staging", startup.GATHERED_UPLOAD: "off"}))]
    knobs = ([("chunk_bytes", n, f"{n // MiB} MiB") for n in CHUNK_SIZES if n != STAGING_CHUNK_BYTES]
             + [("copy_threads", n, str(n)) for n in COPY_THREADS if n != threads]
             + [("piece_bytes", n, f"{n // MiB} MiB") for n in PIECE_SIZES if n != STAGING_PIECE_BYTES])
    v += [Variant(f"GPUWeights {k} {shown}", "GPUWeights", f"{k}={n}", _gpu_weights({k: n})) for k, n, shown in knobs]
    v += [Variant("register + one DMA", "register", "cuMemHostRegister (read-only) of a fresh mapping, one copy",
                  _register()),
          Variant("register + DMA by tensor", "register", "the same, one copy per tensor", _register(by_tensor=True)),
          Variant("register touched + one DMA", "register", "a mapping touched before, one copy",
                  _register(fresh=False))]
    return v


def select(variants: list[Variant], only: list[str]) -> list[Variant]:
    """The variants whose name holds any of `only` (case-insensitive); all for an empty list."""
    keys = [o.lower() for o in only]
    return [v for v in variants if not keys or any(k in v.name.lower() for k in keys)]


@dataclass
class Result:
    """A variant's samples (seconds by part, one dict a repetition), or why it failed."""
    variant: Variant
    nbytes: int = 0
    samples: list[Parts] = field(default_factory=list)
    error: str | None = None

    @property
    def median(self) -> Parts:
        parts = [k for k in self.samples[0] if k != "total"] + ["total"] if self.samples else []
        return {k: statistics.median(s[k] for s in self.samples) for k in parts}


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def measure(variants: list[Variant], setup, reps: int, say: Callable[[str], None]) -> list[Result]:
    """Each variant once unmeasured, then `reps` times; one that raises is a Result with the
    reason (said in one line), and the next runs."""
    results = []
    for v in variants:
        r = Result(v)
        try:
            v.run(setup)
            for _ in range(reps):
                r.nbytes, parts = v.run(setup)
                r.samples.append(parts)
            say(f"{v.name}: {_ms(r.median['total'])} ms")
        except Exception as e:   # noqa: BLE001 — fail soft: one line, the next variant runs
            r.error = one_line(e)
            say(f"{v.name}: failed: {r.error}")
        results.append(r)
    return results


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def table(results: list[Result], title: str) -> Table:
    """One row a variant: median total (ms), GB/s (bytes ÷ median total), the median of each
    part, min–max of the total; a failed variant's row gives its reason."""
    t = Table(title=title)
    for name, justify in (("variant", "left"), ("median ms", "right"), ("GB/s", "right"),
                          ("parts, median ms", "left"), ("min–max ms", "right")):
        t.add_column(name, justify=justify)
    for r in results:
        if r.error is not None:
            t.add_row(r.variant.name, "", "", f"failed: {r.error}", "")
            continue
        med = r.median
        totals = [s["total"] for s in r.samples]
        gbps = r.nbytes / med["total"] / 1e9 if med["total"] > 0 else float("nan")
        parts = ", ".join(f"{k} {_ms(v)}" for k, v in med.items() if k != "total")
        t.add_row(r.variant.name, _ms(med["total"]), f"{gbps:.1f}", parts, f"{_ms(min(totals))}–{_ms(max(totals))}")
    return t


def record(results: list[Result], meta: dict) -> dict:
    """The JSON: `meta`, then each variant's name, group, what, bytes, median and samples (s), error."""
    return {**meta, "variants": [
        {"name": r.variant.name, "group": r.variant.group, "what": r.variant.what, "bytes": r.nbytes,
         "median_s": r.median, "samples_s": r.samples, "error": r.error} for r in results]}


def write_json(path: str, data: dict) -> None:
    """Write through a temporary name, then rename: never half a file at `path`."""
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def shown_command(argv: list[str], model_name: str) -> list[str]:
    """The command line for the record, with no path of this machine: the model by its file
    name, the JSON's path as OUT.json."""
    shown, swap = [], {"--model": model_name, "--json": "OUT.json"}
    for i, word in enumerate(argv):
        flag, eq, _ = word.partition("=")
        if eq and flag in swap:
            word = f"{flag}={swap[flag]}"
        elif i and argv[i - 1] in swap:
            word = swap[argv[i - 1]]
        shown.append(word)
    return ["python", "tools/bench_upload.py", *shown]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the .nanoqwen to upload")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions of each variant (default 5)")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="only the variants whose name holds TEXT (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the variants and exit (no GPU needed)")
    ap.add_argument("--json", metavar="OUT", help="write the samples and medians here")
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: at least 1")
    if not select(variant_list(), a.only):
        ap.error(f"--only {' '.join(a.only)}: no variant's name holds it (--list names them)")
    if not a.list and not a.model:
        ap.error("--model is needed (or --list)")
    if a.json and not Path(a.json).resolve().parent.is_dir():
        ap.error(f"--json {a.json}: no folder {Path(a.json).resolve().parent}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = Console(width=160)
    variants = select(variant_list(), a.only)
    if a.list:
        for v in variants:
            out.print(f"{v.group:<13} {v.name:<36} {v.what}", soft_wrap=True, highlight=False)
        return 0
    err = Console(stderr=True)
    try:
        if reason := gpu_unavailable_reason():
            raise DrvqwenError(f"no usable GPU: {reason}")
        setup = Setup(a.model)
    except DrvqwenError as e:
        err.print(f"bench_upload: {e}", soft_wrap=True)
        return 1
    device = get_device()
    say = lambda m: err.print(m, soft_wrap=True, highlight=False)  # noqa: E731
    try:
        results = measure(variants, setup, a.reps, say)
    finally:
        try:
            setup.close()
        except Exception as e:   # noqa: BLE001 — the measurements stand; say why the freeing failed
            say(f"freeing the shared buffers failed: {one_line(e)}")
    title = (f"weight upload, {setup.path.name}: {setup.data_bytes / 1e9:.3f} GB in {len(setup.spans)} tensors, "
             f"{device.info.name}, {os.cpu_count()} cores, medians of {a.reps} after 1 warm-up")
    out.print(table(results, title))
    if a.json:
        shown = shown_command(argv if argv is not None else sys.argv[1:], setup.path.name)
        staging = {"chunk_bytes": STAGING_CHUNK_BYTES, "piece_bytes": STAGING_PIECE_BYTES,
                   "copy_threads": default_copy_threads(), "copy_threads_max": STAGING_COPY_THREADS}
        write_json(a.json, record(results, {
            "source": source_record(), "tool": "tools/bench_upload.py", "command": shown, "model": setup.path.name,
            "data_bytes": setup.data_bytes, "tensors": len(setup.spans), "pool_bytes": setup.pool_bytes,
            "reps": a.reps, "warmup": 1, "device": device.info.summary(), "cores": os.cpu_count(),
            "machine": platform.machine(), "staging_defaults": staging}))
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
