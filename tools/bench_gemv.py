#!/usr/bin/env python3
"""The decode GEMVs (kernels/gemv_int4.cu) alone, at a model's shapes: µs, GB/s and the share of
the copy bandwidth, for the launch shape the step uses and for variants of it.

    PYTHONPATH=src python3 tools/bench_gemv.py [--preset 7b] [--reps 40] [--json OUT]
        [--warps 4 8] [--blocks 132 264] [--unroll 2 4 8] [--int4-defines GEMV_UNROLL=8,NAME=INT] [--pdl]
        [--tokens [T ...]]
    PYTHONPATH=src python3 tools/bench_gemv.py --formats all [--preset 7b] [--json OUT]
        [--fmt-defines GF_CHAINS=1 GF_CHAINS=2] [--fmt-shapes down_proj gate_up_swiglu] [--warps 4]
        [--fmt-every-format]

--formats times kernels/gemv_fmt.cu (the decode GEMV of the per-tensor weight formats,
format/weight_formats.py) at the preset's o_proj, gate_proj (one matrix) and down_proj shapes,
residual output, the fused gate/up GEMV with SwiGLU (gate_up_swiglu, both matrices) and the
fused q/k/v GEMV with RoPE and the K/V write (qkv_rope, q, k and v in the one format), with
random weights in each format, each compiled as a model of that one format compiles it
(launchers/gemv_fmt.py: format_defines; --fmt-defines adds defines to that build, one row per
set). --fmt-every-format also times the build for every format (WF_FORMATS unset), whose fused
GEMVs need more registers and run one block an SM: not what a model runs; int4_g128 there runs through gemv_fmt's
per-lane-scale engine, beside which gemv_int4.cu's engine (the rows without a format) is the
figure to reach. --warps there adds rows with that many warps a block (e.g. 4 with
GF_UNROLL=4,GF_MIN_BLOCKS=1,GF_GATE_UP_MIN_BLOCKS=1: deeper batches at 3 blocks of 4 warps an SM
where the registers allow; --blocks does not apply).

Each figure is one launch of a CUDA graph of back-to-back launches of the same GEMV, cycling
through enough copies of its weights that they cannot stay in the 60 MB L2 between launches
(so the bytes come from HBM, as in a decode step), divided by the number of launches. With
--pdl the launches are programmatic dependents of each other (the next one's weight loads
start under the previous one's tail), which is how the decode step runs them (with --formats
too).

--tokens T … also times the verify pass's T-token kernels (gemv_int4.cu, "T tokens at once") at
the same shapes, one row per GEMV and T (e.g. `qkv_rope T=8`; default T: 1 2 4 8 16), every
per-token buffer [T, …], the T tokens at positions 512 … 512 + T − 1; the step's launch shape
and the --unroll / --int4-defines builds (e.g. the timing probes GEMV_PROBE_NO_NORM=1,
GEMV_PROBE_NO_EPILOGUE=1, whose results are wrong by design), not --warps / --blocks.

Bytes per launch: the INT4 weights and their fp16 scales (+ the activation, negligible; read once
for all T tokens).
Results are not checked here; tests/test_kernel_gemv_int4.py checks every kernel against the
reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np
from rich.console import Console
from rich.table import Table

from drvqwen.launchers import GemvInt4GateUpSwiglu, GemvInt4QkvRope, GemvInt4Residual, Launcher
from drvqwen.config import PRESETS
from drvqwen.provenance import source_record
from drvqwen.cuda import DeviceArray, DeviceBuffer, Event, Stream, capture, get_device
from drvqwen.cuda.bandwidth import measure_copy_bandwidth
from drvqwen.format.int4_tiles import to_tile_major
from drvqwen.kv_cache import PAGE_TOKENS
from drvqwen.launchers.gemv_int4 import MAX_TOKENS, int4_bytes

L2_BYTES = 60 * 2**20   # H200 (DeviceInfo.l2_bytes); copies cycle through ≥ 2 × this
TOKENS_DEFAULT = [1, 2, 4, 8, 16]   # --tokens without values
TOKENS_POS = 512        # position of token 0 in the --tokens rows (a verify pass mid-sequence)
# The --tokens rows' names: the kernel's GEMV (qkv_proj runs as the fused qkv/RoPE kernel).
TOKENS_ROW = {"qkv_proj": "qkv_rope", "o_proj": "o_proj", "gate_up_swiglu": "gate_up_swiglu", "down_proj": "down_proj"}


class Scratch:
    def __init__(self):
        self.buffers = []

    def array(self, name, shape, dtype, host=None):
        arr_dtype = np.dtype(dtype)
        buf = DeviceBuffer(max(int(np.prod(shape)) * arr_dtype.itemsize, 16), name)
        self.buffers.append(buf)
        arr = DeviceArray(name, buf.ptr, shape, arr_dtype)
        if host is not None:
            arr.upload(np.ascontiguousarray(host, dtype=arr_dtype).reshape(shape))
        return arr

    def close(self):
        for b in self.buffers:
            b.free()


def shapes(cfg) -> dict[str, dict]:
    """The four GEMVs of a layer: rows N (per matrix), K, matrices per tile."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"qkv_proj": dict(n=(cfg.q_dim, cfg.kv_dim, cfg.kv_dim), k=D), "o_proj": dict(n=(D,), k=cfg.q_dim),
            "gate_up_swiglu": dict(n=(F, F), k=D), "down_proj": dict(n=(D,), k=F)}


def make_launcher(name: str, s: Scratch, copy: int, cfg, rng, n_tokens: int | None = None, **variant) -> Launcher:
    """The step's GEMV `name` over copy `copy` of random weights in `s` (anything with Scratch.array);
    n_tokens=T: its `…_tokens` kernel for T tokens at positions TOKENS_POS + j, buffers [T, …]."""
    sh = shapes(cfg)[name]
    k = sh["k"]
    lead, nt = ((), 1) if n_tokens is None else ((n_tokens,), n_tokens)
    variant = dict(variant, n_tokens=n_tokens)

    def w(tag, n, pair_dim=0):
        """Random INT4 weights, the qweight in the device layout the kernels read (q, k and v
        RoPE-paired: pair_dim the head dim)."""
        qw = to_tile_major(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32), pair_dim)
        sc = rng.uniform(0.002, 0.01, size=(n, k // 128)).astype(np.float16)
        return s.array(f"{tag}{copy}.qweight", qw.shape, np.uint32, qw), s.array(f"{tag}{copy}.scales", sc.shape,
                                                                               np.float16, sc)

    x = s.array(f"x{name}{copy}", (*lead, k), np.float16, rng.standard_normal(nt * k))
    residual = s.array(f"residual{name}{copy}", (*lead, k), np.float32, rng.standard_normal(nt * k))
    norm_w = s.array(f"norm{name}{copy}", (k,), np.float16, np.ones(k))
    if name == "qkv_proj":
        hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv = hq * dh, hkv * dh
        pos = 5 if n_tokens is None else TOKENS_POS
        pages = 4 if n_tokens is None else (pos + nt - 1) // PAGE_TOKENS + 1
        cache = [s.array(f"{c}{copy}", (pages, hkv, PAGE_TOKENS, dh), np.float16) for c in "kv"]
        bias = [s.array(f"b{i}{copy}", (n,), np.float16, np.zeros(n)) for i, n in enumerate((nq, nkv, nkv))]
        return GemvInt4QkvRope(s.array(f"q{copy}", (*lead, nq), np.float16), *cache, residual, norm_w,
                                 *w("q", nq, dh), *w("k", nkv, dh), *w("v", nkv, dh), *bias,
                                 s.array(f"inv_freq{copy}", (dh // 2,), np.float32, np.ones(dh // 2)),
                                 s.array(f"state{copy}", (3,), np.int32, np.array([pos, 0, pos + 1])),
                                 s.array(f"bt{copy}", (pages,), np.int32, np.arange(pages)), n_heads=hq, n_kv_heads=hkv,
                                 head_dim=dh, dim=k, eps=1e-6, **variant)
    if name == "gate_up_swiglu":
        f = sh["n"][0]
        return GemvInt4GateUpSwiglu(s.array(f"h{copy}", (*lead, f), np.float16), residual, norm_w, *w("g", f),
                                      *w("u", f), f=f, k=k, eps=1e-6, **variant)
    n = sh["n"][0]
    return GemvInt4Residual(s.array(f"res{name}{copy}", (*lead, n), np.float32, np.zeros(nt * n)), x, *w(name, n),
                              n=n, k=k, **variant)


def plan_rows(gemvs: list[str], tokens: list[int]) -> list[tuple[str, str, int | None]]:
    """(row name, GEMV of shapes(), T or None) of each row: the single-token kernels, then per T
    the `…_tokens` kernels (named as TOKENS_ROW, e.g. "qkv_rope T=8")."""
    return [(g, g, None) for g in gemvs] + [(f"{TOKENS_ROW[g]} T={t}", g, t) for t in tokens for g in gemvs]


Q_SHAPES = ("o_proj", "gate_proj", "down_proj", "gate_up_swiglu", "qkv_rope")


def q_shape(name: str, cfg) -> tuple[int, int]:
    """(N, K) of one matrix for the --formats rows (qkv_rope: q, k and v stacked)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"o_proj": (D, cfg.q_dim), "gate_proj": (F, D), "down_proj": (D, F), "gate_up_swiglu": (F, D),
            "qkv_rope": (cfg.q_dim + 2 * cfg.kv_dim, D)}[name]


def make_q_launcher(fmt, name: str, s: Scratch, copy: int, cfg, rng, defines: tuple = (),
                    warps: int | None = None) -> Launcher:
    """GemvFmtResidual (gate_up_swiglu: GemvFmtGateUpSwiglu; qkv_rope: GemvFmtQkvRope, q, k and
    v in `fmt`, at position 5 as make_launcher's) over random weights in `fmt`
    (weight_formats.random_weight), compiled with `defines`, with `warps` a block (None: the
    launcher's)."""
    from drvqwen.format import weight_formats as wf
    from drvqwen.launchers import FmtWeight, GemvFmtGateUpSwiglu, GemvFmtQkvRope, GemvFmtResidual
    from drvqwen.launchers.gemv_fmt import device_parts

    n, k = q_shape(name, cfg)

    def weight(tag: str, rows: int = n) -> FmtWeight:
        parts = {part: s.array(f"{fmt.name}.{name}{tag}{copy}.{part}", a.shape, a.dtype, a)
                 for part, a in device_parts(fmt, wf.random_weight(fmt, rows, k, rng)).items()}
        return FmtWeight(fmt, parts, f"{fmt.name}.{name}{tag}")

    if name == "qkv_rope":
        hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv, pos, pages = hq * dh, hkv * dh, 5, 4
        cache = [s.array(f"{c}{fmt.name}{copy}", (pages, hkv, PAGE_TOKENS, dh), np.float16) for c in "kv"]
        bias = [s.array(f"b{i}{fmt.name}{copy}", (r,), np.float16, np.zeros(r)) for i, r in enumerate((nq, nkv, nkv))]
        return GemvFmtQkvRope(s.array(f"q{fmt.name}{copy}", (nq,), np.float16), *cache,
                              s.array(f"r{fmt.name}{name}{copy}", (k,), np.float32, rng.standard_normal(k)),
                              s.array(f"nw{fmt.name}{name}{copy}", (k,), np.float16, np.ones(k)),
                              weight("q", nq), weight("k", nkv), weight("v", nkv), *bias,
                              s.array(f"inv_freq{fmt.name}{copy}", (dh // 2,), np.float32, np.ones(dh // 2)),
                              s.array(f"state{fmt.name}{copy}", (3,), np.int32, np.array([pos, 0, pos + 1])),
                              s.array(f"bt{fmt.name}{copy}", (pages,), np.int32, np.arange(pages)),
                              n_heads=hq, n_kv_heads=hkv, head_dim=dh, dim=k, eps=1e-6, defines=defines, warps=warps)

    if name == "gate_up_swiglu":
        residual = s.array(f"r{fmt.name}{name}{copy}", (k,), np.float32, rng.standard_normal(k))
        norm_w = s.array(f"nw{fmt.name}{name}{copy}", (k,), np.float16, np.ones(k))
        h = s.array(f"h{fmt.name}{name}{copy}", (n,), np.float16)
        return GemvFmtGateUpSwiglu(h, residual, norm_w, weight("g"), weight("u"), f=n, k=k, eps=1e-6,
                                   defines=defines, warps=warps)
    x = s.array(f"x{fmt.name}{name}{copy}", (k,), np.float16, rng.standard_normal(k))
    res = s.array(f"res{fmt.name}{name}{copy}", (n,), np.float32, np.zeros(n))
    return GemvFmtResidual(res, x, weight(""), n=n, k=k, defines=defines, warps=warps)


def parse_defines(text: str, option: str = "--fmt-defines") -> dict[str, int]:
    """"NAME=INT,NAME=INT" → {NAME: INT}; a bad item exits with one line naming `option`."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"{option}: {item!r} is not NAME=INT")
        try:
            out[name] = int(value, 0)
        except ValueError:
            raise SystemExit(f"{option}: {item!r}: {value!r} is not an integer") from None
    return out


def format_builds(fmt_id: int, variants: list[dict] | None = None, every_format: bool = False) -> list[tuple]:
    """The defines of each build bench_formats times for format `fmt_id`: with `every_format`
    first the kernels compiled for every format (no defines: WF_FORMATS' default), then for each
    variant {NAME: INT} (default: one, {}) the build of a model of that one format
    (format_defines) with those defines added."""
    from drvqwen.launchers.gemv_fmt import format_defines

    builds = [()] if every_format else []
    return builds + [tuple({**dict(format_defines([fmt_id])), **v}.items()) for v in (variants or [{}])]


def bench_formats(names: list[str], cfg, reps: int, copy_gbps: float, variants: list[dict] | None = None,
                  shapes_: tuple[str, ...] = Q_SHAPES, warps: tuple[int, ...] = (),
                  every_format: bool = False, pdl: bool = False) -> list[dict]:
    """One row per (format, shape, build, warps): µs, GB/s and the share of the copy bandwidth.

    The builds are format_builds': each format's own (a model's), with each variant's defines
    (versions of the kernel compared in the same run), and with `every_format` the build for
    every format before them. Each row runs with the launcher's warps a block and then with each
    of `warps` (the blocks an SM follow from the build's registers: the driver's occupancy), and
    with `pdl` each also as programmatic dependents of each other (the step's way)."""
    from drvqwen.format import weight_formats as wf

    rng = np.random.default_rng(0)
    fmts = [f for f in wf.FORMATS.values() if "all" in names or f.name in names]
    rows = []
    for fmt in fmts:
        for name in shapes_:
            n, k = q_shape(name, cfg)
            nbytes = wf.parts_nbytes(fmt, n, k) * (2 if name == "gate_up_swiglu" else 1)
            copies = max(2, -(-2 * L2_BYTES // nbytes))
            r = -(-reps // copies) * copies
            builds = list(zip(([None] if every_format else []) + list(variants or [{}]),
                              format_builds(fmt.id, variants, every_format)))
            for (variant, defines), w, with_pdl in itertools.product(builds, (None, *warps),
                                                                     (False, True) if pdl else (False,)):
                s = Scratch()
                try:
                    launchers = [make_q_launcher(fmt, name, s, c, cfg, rng, defines, w) for c in range(copies)]
                    us = time_launchers(launchers, r, with_pdl)
                    spec = launchers[0].specs[0]
                    gbps = nbytes / us / 1e3
                    rows.append({"gemv": f"{fmt.name}:{name}",
                                 "variant": {"bits_per_weight": fmt.bits_per_weight,
                                             **({"build": "every format"} if variant is None else variant),
                                             **({"warps": w} if w else {})},
                                 "pdl": with_pdl, "grid": spec.grid, "block": spec.block, "smem": 0, "bytes": nbytes,
                                 "us": us, "GBps": gbps, "of_copy": gbps / copy_gbps, "copies": copies, "reps": r})
                finally:
                    get_device().synchronize()
                    s.close()
    return rows


def time_launchers(launchers: list, reps: int, pdl: bool) -> float:
    """µs per launch of a graph of `reps` launches cycling through `launchers`."""
    for ln in launchers:
        ln.build(pdl=pdl)
    with Stream() as stream:
        with capture(stream) as cap:
            for i in range(reps):
                launchers[i % len(launchers)].launch(stream)
        exe = cap.graph.instantiate()
        cap.graph.destroy()
        exe.launch(stream)                      # warm-up
        t0, t1 = Event(), Event()
        t0.record(stream)
        exe.launch(stream)
        t1.record(stream)
        ms = t0.elapsed_ms(t1)
        exe.destroy()
        t0.close()
        t1.close()
    return ms * 1e3 / reps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad --tokens value exits with one line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--gemv", nargs="+", choices=list(shapes(PRESETS["7b"])), default=list(shapes(PRESETS["7b"])))
    ap.add_argument("--reps", type=int, default=40, help="launches per graph (default 40)")
    ap.add_argument("--warps", type=int, nargs="*", default=[], help="also force these warps per block")
    ap.add_argument("--blocks", type=int, nargs="*", default=[], help="also force these grid sizes")
    ap.add_argument("--unroll", type=int, nargs="*", default=[], help="also compile with GEMV_UNROLL=N")
    ap.add_argument("--int4-defines", nargs="+", default=[], metavar="NAME=INT,...",
                    help="also compile kernels/gemv_int4.cu with these defines, one row per set "
                         "(e.g. GEMV_UNROLL=8; --unroll N is GEMV_UNROLL=N)")
    ap.add_argument("--pdl", action="store_true", help="also time with programmatic dependent launch")
    ap.add_argument("--tokens", type=int, nargs="*", metavar="T",
                    help=f"also time the T-token kernels for these T in 1..{MAX_TOKENS} (no values: "
                         f"{' '.join(map(str, TOKENS_DEFAULT))}), with the --unroll / --int4-defines builds")
    ap.add_argument("--formats", nargs="+", default=[],
                    help="time kernels/gemv_fmt.cu in these weight formats (names of format/weight_formats.py, "
                         "or all) instead of the INT4 GEMVs")
    ap.add_argument("--fmt-defines", nargs="+", default=[], metavar="NAME=INT,...",
                    help="with --formats: compile gemv_fmt.cu for each format alone (as a model of it is) "
                         "plus these defines, one row per set (e.g. GF_CHAINS=1 GF_CHAINS=2)")
    ap.add_argument("--fmt-every-format", action="store_true",
                    help="with --formats: also time the kernels compiled for every format (not a model's build)")
    ap.add_argument("--fmt-shapes", nargs="+", choices=Q_SHAPES, default=list(Q_SHAPES),
                    help="with --formats: the shapes to time (default: all)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    if a.tokens is not None and not a.tokens:
        a.tokens = list(TOKENS_DEFAULT)
    for t in a.tokens or []:
        if not 1 <= t <= MAX_TOKENS:
            raise SystemExit(f"--tokens: T={t} is outside 1..{MAX_TOKENS}")
    if a.formats:
        for opt, given in (("--tokens", a.tokens), ("--blocks", a.blocks), ("--unroll", a.unroll),
                           ("--int4-defines", a.int4_defines)):
            if given:
                raise SystemExit(f"{opt} times the INT4 GEMVs; it does not go with --formats")
    return a


def main() -> int:
    a = parse_args()
    cfg = PRESETS[a.preset]
    dev = get_device()
    copy = measure_copy_bandwidth()
    con = Console()
    con.print(f"{dev.info.summary()}\ncopy bandwidth (D2D, read + write): {copy.gbps:.0f} GB/s")
    rng = np.random.default_rng(0)
    rows = []
    variants = [{}] + [{"warps": w} for w in a.warps] + [{"blocks": b} for b in a.blocks] + \
        [{"defines": {"GEMV_UNROLL": u}} for u in a.unroll] + \
        [{"defines": parse_defines(d, "--int4-defines")} for d in a.int4_defines]
    if a.formats:
        rows += bench_formats(a.formats, cfg, a.reps, copy.gbps, [parse_defines(d) for d in a.fmt_defines] or None,
                              tuple(a.fmt_shapes), tuple(a.warps), a.fmt_every_format, a.pdl)
    for row, name, n_tokens in ([] if a.formats else plan_rows(a.gemv, a.tokens or [])):
        sh = shapes(cfg)[name]
        nbytes = sum(int4_bytes(n, sh["k"]) for n in sh["n"])
        copies = max(2, -(-2 * L2_BYTES // nbytes))
        reps = -(-a.reps // copies) * copies
        row_variants = variants if n_tokens is None else [v for v in variants if set(v) <= {"defines"}]
        for variant, pdl in itertools.product(row_variants, (False, True) if a.pdl else (False,)):
            s = Scratch()
            try:
                kw = {k: v for k, v in variant.items() if k != "defines"}
                if "defines" in variant:
                    kw["defines"] = tuple(variant["defines"].items())
                launchers = [make_launcher(name, s, c, cfg, rng, n_tokens, **kw) for c in range(copies)]
                us = time_launchers(launchers, reps, pdl)
                spec = launchers[0].specs[0]
                gbps = nbytes / us / 1e3
                rows.append({"gemv": row, "tokens": n_tokens, "variant": variant, "pdl": pdl, "grid": spec.grid,
                             "block": spec.block, "smem": spec.smem_bytes, "bytes": nbytes, "us": us, "GBps": gbps,
                             "of_copy": gbps / copy.gbps, "copies": copies, "reps": reps})
            finally:
                get_device().synchronize()
                s.close()
    t = Table(title=f"decode GEMVs alone, {a.preset}, weights rotated past L2 ({dev.info.name})")
    for c in ("GEMV", "variant", "PDL", "grid × block", "MB", "µs", "GB/s", "of copy"):
        t.add_column(c, justify="right")
    for r in rows:
        shown = {**{k: v for k, v in r["variant"].items() if k != "defines"}, **r["variant"].get("defines", {})}
        t.add_row(r["gemv"], " ".join(f"{k}={v}" for k, v in shown.items()) or "step's", "yes" if r["pdl"] else "",
                  f"{r['grid'][0]} × {r['block'][0]}", f"{r['bytes'] / 1e6:.2f}", f"{r['us']:.2f}",
                  f"{r['GBps']:.0f}", f"{r['of_copy']:.1%}")
    con.print(t)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"source": source_record(), "device": dev.info.summary(), "copy_gbps": copy.gbps, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
