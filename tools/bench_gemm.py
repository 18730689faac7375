#!/usr/bin/env python3
"""The prefill GEMMs of one layer (kernels/gemm_int4.cu) at the real shapes: µs and TFLOP/s.

    PYTHONPATH=src python3 tools/bench_gemm.py [--preset 7b] [--rows 512] [--reps 5] [--samples 5] [--json F]
        [--tiles auto 64 128 256] [--int4-variant NAME:DEFINE=INT[,…]]
        [--kquant q4_k q5_k q6_k] [--kquant-variant NAME:DEFINE=INT[,…]]
        [--formats q4_k q6_k int4_g128 …] [--fmt-mma] [--fmt-variant NAME:DEFINE=INT[,…]]

The INT4 GEMMs run as the prefill runs them, stream-K ranges included (a scratch as the
prefill's); with --tiles each given tile size is a column (auto: the launchers' choice,
gemm_tiling), with --grid each schedule. Their qkv_proj row is the prefill's launch,
gemm_int4_qkv_rope (the bias, the RoPE and the FP16 q and K/V cache writes in its epilogue, the
chunk at positions 0 … M−1 of a cache in order); --qkv-f32 times gemm_int4_qkv instead, the FP32
form `drvqwen bench --prefill-rope apart` runs before rope_kv_rows. --int4-variant
NAME:DEFINE=INT[,…] adds a compile-time build of gemm_int4.cu beside each INT4 column (columns
GRID:NAME), in the same run.

--kquant adds, per --grid and --tiles choice, a column per K-quant format with the GEMMs a model in
that format runs (launchers/gemm_kquant.py: gemm_int4.cu's mainloop over the GGUF's Q4_K, Q5_K or
Q6_K bytes, planned as the prefill plans them); Q6_K, which llama.cpp's *_K_M recipes give only
v_proj and down_proj, has the down_proj row alone. --kquant-variant NAME:DEFINE=INT[,…] adds a
compile-time build of gemm_int4.cu beside each (its timing probes GEMM_PROBE_*), in the same run.

--formats adds a column per weight format (format/weight_formats.py names) with the per-tensor
prefill GEMMs of kernels/gemm_fmt_wgmma.cu on random weights in that format (q, k and v as three
launches, their sum the qkv_proj row), each compiled for that format alone as a model of it is;
--fmt-mma adds kernels/gemm_fmt.cu's beside each, the version before it; --fmt-variant
NAME:DEFINE=INT[,…] adds a compile-time build of gemm_fmt_wgmma.cu beside each format's default
one (columns wgmma:FORMAT:NAME), all in the same run.

Each GEMM is captured in a CUDA graph of --reps calls and replayed (`cuda.graph.graph_time_us`:
no Python launch overhead in the figure); a figure is the median of --samples such replays,
taken in turns across the columns (each column sees the GPU's clock in the same state). The
inputs are random INT4 weights (the INT4 GEMMs' in the device layout, format/int4_tiles.py; the
per-format GEMMs' as weight_formats.py stores them) and activations; the numbers are not checked here
(tests/test_kernel_gemm_int4.py does that against the reference).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from drvqwen.launchers import GemmInt4GateUpSwigluRows, GemmInt4QkvRopeRows, GemmInt4QkvRows, GemmInt4ResidualRows
from drvqwen.launchers.gemm_int4 import SPLIT_UNIT_FLOATS, TILE_TOKENS, SplitKScratch, unit_floats
from drvqwen.config import PRESETS
from drvqwen.cuda import DeviceArray, DeviceBuffer, get_device
from drvqwen.cuda.graph import graph_time_us
from drvqwen.format.int4_tiles import to_tile_major
from drvqwen.provenance import source_record

from bench_attention_prefill import parse_variant  # NAME:DEFINE=INT[,…] (tools/ is the script's path)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (argv: default sys.argv[1:]); argparse errors exit with status 2."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--rows", type=int, default=512, help="prompt rows M (default 512)")
    ap.add_argument("--reps", type=int, default=5, help="calls per timed graph (default 5)")
    ap.add_argument("--samples", type=int, default=5, help="timed graphs per figure, median taken (default 5)")
    ap.add_argument("--json", help="also write the figures (µs, TFLOP/s) to this file")
    ap.add_argument("--grid", nargs="+", default=["persistent", "tiles"],
                    choices=["persistent", "ranges", "whole", "tiles"],
                    help="persistent: at most one block per SM, stream-K ranges that may cut tiles, or one wave of "
                         "whole tiles where the launchers take that (what drvqwen runs); ranges: one block per SM "
                         "and stream-K ranges, the build by the launchers' estimate (their plan without the one-wave "
                         "rule); whole: one block per SM, ranges of whole tiles (no scratch); tiles: one block per "
                         "tile. Each given value is a column (default: persistent and tiles)")
    ap.add_argument("--tiles", nargs="+", default=["auto"], choices=["auto", "64", "128", "256"],
                    help="tokens a tile of the INT4 GEMMs, a column each (auto: the launchers' choice)")
    ap.add_argument("--qkv-f32", action="store_true",
                    help="the INT4 qkv_proj row: gemm_int4_qkv (FP32 out) instead of the prefill's gemm_int4_qkv_rope")
    ap.add_argument("--int4-variant", action="append", type=parse_variant, default=[],
                    help="NAME:DEFINE=INT[,…]: a compile-time build of gemm_int4.cu timed beside each INT4 column "
                         "(repeatable)")
    ap.add_argument("--kquant", nargs="+", default=[], choices=["q4_k", "q5_k", "q6_k"],
                    help="also time the K-quant GEMMs a model in these formats runs (gemm_int4.cu's mainloop), a "
                         "column each per --grid and --tiles choice")
    ap.add_argument("--kquant-variant", action="append", type=parse_variant, default=[],
                    help="NAME:DEFINE=INT[,…] with --kquant: a compile-time build of gemm_int4.cu (its timing probes "
                         "GEMM_PROBE_*) timed beside each K-quant column (repeatable)")
    ap.add_argument("--formats", nargs="+", default=[], help="also time the per-format GEMMs in these formats")
    ap.add_argument("--fmt-mma", action="store_true", help="with --formats: also gemm_fmt.cu (mma.sync)")
    ap.add_argument("--fmt-variant", action="append", type=parse_variant, default=[],
                    help="NAME:DEFINE=INT[,…] with --formats: a compile-time build of gemm_fmt_wgmma.cu (its header "
                         "lists the switches, e.g. ahead2:GW_LOAD_AHEAD=2) timed beside the default (repeatable)")
    a = ap.parse_args(argv)
    if a.fmt_variant and not a.formats:
        ap.error("--fmt-variant needs --formats (the formats whose builds it adds)")
    if a.kquant_variant and not a.kquant:
        ap.error("--kquant-variant needs --kquant (the formats whose builds it adds)")
    return a


def with_defines(cls, defines):
    """Launcher class `cls` whose builds add the compile-time `defines` ((name, int) pairs) to its
    own (the launchers' extra_defines): a variant timed beside the default in one run."""
    return type(cls.__name__, (cls,), {"extra_defines": tuple(defines)}) if defines else cls


def main() -> int:
    a = parse_args()
    cfg, m = PRESETS[a.preset], a.rows
    d, f, nq, nkv, dh = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    rng = np.random.default_rng(0)
    buffers = []

    def upload(name, host):
        buf = DeviceBuffer(max(host.nbytes, 16), name)
        buffers.append(buf)
        arr = DeviceArray(name, buf.ptr, host.shape, host.dtype)
        arr.upload(np.ascontiguousarray(host))
        return arr

    def w(name, n, k, pair_dim=0):
        """Random INT4 weights, the qweight in the device layout the kernels read (q, k and v
        RoPE-paired: pair_dim the head dim)."""
        qw = to_tile_major(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32), pair_dim)
        sc = rng.uniform(0.002, 0.01, size=(n, k // 128)).astype(np.float16)
        return upload(name + ".qweight", qw), upload(name + ".scales", sc)

    get_device()
    x = upload("x", rng.standard_normal((m, d)).astype(np.float16))
    xf = upload("h", (rng.standard_normal((m, f)) * 0.1).astype(np.float16))
    st = upload("prefill_state", np.array([0, m], np.int32))
    out = {"qkv": np.zeros((m, nq + 2 * nkv), np.float32), "res": np.zeros((m, d), np.float32),
           "h_out": np.zeros((m, f), np.float16)}
    o = {k: upload(k, v) for k, v in out.items()}
    # gemm_int4_qkv_rope's other operands: q fp16 [M, Hq, Dh], one layer's K/V cache [P, Hkv, 16, Dh]
    # fp16 with pages 0 … P−1 in order, the biases, and the chunk's cos/sin table fp32 [M, Dh/2, 2].
    pages = -(-m // 16)
    rope = {"q_out": upload("q_out", np.zeros((m, cfg.num_heads, dh), np.float16)),
            "k_cache": upload("k_cache", np.zeros((pages, cfg.num_kv_heads, 16, dh), np.float16)),
            "v_cache": upload("v_cache", np.zeros((pages, cfg.num_kv_heads, 16, dh), np.float16)),
            "block_table": upload("block_table", np.arange(pages, dtype=np.int32)),
            "biases": [upload(f"{n}_bias", (rng.standard_normal(w) * 0.1).astype(np.float16))
                       for n, w in (("q", nq), ("k", nkv), ("v", nkv))]}
    angle = np.arange(m)[:, None] * (cfg.rope_theta ** (-np.arange(dh // 2) * 2 / dh))[None, :]
    rope["cs"] = upload("rope_cs", np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32))
    # Split-K scratch for any plan: a partial a block (the largest tile's) and a counter a block.
    sms = get_device().info.sm_count
    units = sms * max(-(-unit_floats(bm) // SPLIT_UNIT_FLOATS) for bm in TILE_TOKENS)
    tiles = sms
    sk = SplitKScratch(lambda name, shape, dtype: upload(name, np.zeros(shape, dtype)), units, tiles)

    def plan_kw(cl, tile):
        """The launchers' planning arguments of grid `cl` and tile `tile` (--grid, --tiles)."""
        return dict(rows=m, max_blocks=0 if cl == "tiles" else None,
                    split_k=sk if cl in ("persistent", "ranges") else None, blocks=sms if cl == "ranges" else None,
                    tile_tokens=None if tile == "auto" else int(tile))

    def gemms(cl, tile, defines=()):
        """{row: launcher} of the INT4 GEMMs planned for grid `cl` and tile `tile`, built with
        `defines` added (--int4-variant)."""
        kw = plan_kw(cl, tile)
        Qkv, QkvRope, Res, GateUp = (with_defines(c, defines) for c in (
            GemmInt4QkvRows, GemmInt4QkvRopeRows, GemmInt4ResidualRows, GemmInt4GateUpSwigluRows))
        qkv = (Qkv(o["qkv"], x, *wq, *wk, *wv, st, n_q=nq, n_kv=nkv, k=d, head_dim=dh, **kw) if a.qkv_f32
               else QkvRope(rope["q_out"], rope["k_cache"], rope["v_cache"], x, *wq, *wk, *wv,
                                        *rope["biases"], rope["cs"], st, rope["block_table"], n_heads=cfg.num_heads,
                                        n_kv_heads=cfg.num_kv_heads, head_dim=dh, k=d, **kw))
        return {
            "qkv_proj": qkv,
            "o_proj": Res(o["res"], x, *wo, st, n=d, k=nq, **kw),
            "gate_up_swiglu": GateUp(o["h_out"], x, *wg, *wu, st, f=f, k=d, **kw),
            "down_proj": Res(o["res"], xf, *wd, st, n=d, k=f, **kw),
        }

    wq, wk, wv, wo = w("q", nq, d, dh), w("k", nkv, d, dh), w("v", nkv, d, dh), w("o", d, nq)
    wg, wu, wd = w("g", f, d), w("u", f, d), w("d", d, f)
    from drvqwen.format import weight_formats as wf
    from drvqwen.launchers import FmtWeight
    from drvqwen.launchers.gemm_fmt import GemmFmtGateUpSwigluRows, GemmFmtResidualRows, GemmFmtRows
    from drvqwen.launchers.gemm_fmt_wgmma import GemmFmtwGateUpSwigluRows, GemmFmtwResidualRows, GemmFmtwRows
    from drvqwen.launchers.gemv_fmt import device_parts, format_defines

    by_name = {f.name: f for f in wf.FORMATS.values()}
    unknown = [n for n in a.formats if n not in by_name]
    if unknown:
        raise SystemExit(f"--formats: unknown {', '.join(unknown)} (choose from {', '.join(by_name)})")

    def fw(fmt, name, n, k):
        """A random weight [n, k] in `fmt`, uploaded in the device layout."""
        parts = {part: upload(f"{fmt.name}.{name}.{part}", arr)
                 for part, arr in device_parts(fmt, wf.random_weight(fmt, n, k, rng)).items()}
        return FmtWeight(fmt, parts, f"{fmt.name}.{name}")

    def fmt_gemms(fmt, impl, extra: tuple = ()):
        """{row: [launchers]} of one format and implementation (`extra`: more compile-time defines);
        a row's figure sums its launchers."""
        Rows, Res, GateUp = ((GemmFmtwRows, GemmFmtwResidualRows, GemmFmtwGateUpSwigluRows) if impl == "wgmma"
                             else (GemmFmtRows, GemmFmtResidualRows, GemmFmtGateUpSwigluRows))
        defs = format_defines([fmt.id]) + tuple(extra)
        ld = nq + 2 * nkv
        return {
            "qkv_proj": [Rows(o["qkv"], x, fw(fmt, "q", nq, d), st, n=nq, k=d, rows=m, ldo=ld, defines=defs),
                         Rows(o["qkv"], x, fw(fmt, "k", nkv, d), st, n=nkv, k=d, rows=m, ldo=ld, col0=nq, defines=defs),
                         Rows(o["qkv"], x, fw(fmt, "v", nkv, d), st, n=nkv, k=d, rows=m, ldo=ld, col0=nq + nkv,
                              defines=defs)],
            "o_proj": [Res(o["res"], x, fw(fmt, "o", d, nq), st, n=d, k=nq, rows=m, defines=defs)],
            "gate_up_swiglu": [GateUp(o["h_out"], x, fw(fmt, "g", f, d), fw(fmt, "u", f, d), st, f=f, k=d, rows=m,
                                      defines=defs)],
            "down_proj": [Res(o["res"], xf, fw(fmt, "d", d, f), st, n=d, k=f, rows=m, defines=defs)],
        }

    kquant_weights = {}  # (format, role) → FmtWeight: one random weight a role, shared by the format's columns

    def kquant_gemms(name, cl, tile, defines=()):
        """{row: launcher} of the K-quant format `name`, planned as gemms(cl, tile) plans INT4's,
        built with `defines` added (--kquant-variant)."""
        from drvqwen.launchers import gemm_kquant as kq

        def built(cls):
            return with_defines(cls, defines)

        def shared(role, n, k):
            if (name, role) not in kquant_weights:
                kquant_weights[name, role] = fw(by_name[name], role, n, k)
            return kquant_weights[name, role]

        kw = plan_kw(cl, tile)
        if name == "q6_k":
            return {"down_proj": built(kq.GemmQ6kResidualRows)(o["res"], xf, shared("d", d, f), st, n=d, k=f, **kw)}
        q5 = name == "q5_k"
        Qkv, Res, GateUp = map(built, (kq.GemmQ5kQkvRopeRows, kq.GemmQ5kResidualRows, kq.GemmQ5kGateUpSwigluRows) if q5
                               else (kq.GemmQ4kQkvRopeRows, kq.GemmQ4kResidualRows, kq.GemmQ4kGateUpSwigluRows))
        return {
            "qkv_proj": Qkv(rope["q_out"], rope["k_cache"], rope["v_cache"], x, shared("q", nq, d),
                            shared("k", nkv, d), shared("v", nkv, d), *rope["biases"], rope["cs"], st,
                            rope["block_table"], n_heads=cfg.num_heads, n_kv_heads=cfg.num_kv_heads, head_dim=dh,
                            k=d, **kw),
            "o_proj": Res(o["res"], x, shared("o", d, nq), st, n=d, k=nq, **kw),
            "gate_up_swiglu": GateUp(o["h_out"], x, shared("g", f, d), shared("u", f, d), st, f=f, k=d, **kw),
            "down_proj": Res(o["res"], xf, shared("d", d, f), st, n=d, k=f, **kw),
        }

    def label(cl, tile, fmt=None):
        return ":".join([cl] + ([] if a.tiles == ["auto"] else [tile]) + ([fmt] if fmt else []))

    columns = [(label(cl, tile), {name: [g] for name, g in gemms(cl, tile).items()})
               for cl in a.grid for tile in a.tiles]
    columns += [(label(cl, tile, vname), {name: [g] for name, g in gemms(cl, tile, vdefs).items()})
                for vname, vdefs in a.int4_variant for cl in a.grid for tile in a.tiles]
    columns += [(label(cl, tile, name), {row: [g] for row, g in kquant_gemms(name, cl, tile).items()})
                 for name in a.kquant for cl in a.grid for tile in a.tiles]
    columns += [(label(cl, tile, f"{name}:{vname}"),
                 {row: [g] for row, g in kquant_gemms(name, cl, tile, vdefs).items()})
                for name in a.kquant for vname, vdefs in a.kquant_variant for cl in a.grid for tile in a.tiles]
    choices = {cl: {name: f"{gs[0].tile_tokens}×P{gs[0].tiling.blocks}{' stream-K' if gs[0].tiling.split else ''}"
                    for name, gs in launchers.items()}
               for cl, launchers in columns}
    for name in a.formats:
        columns.append((f"wgmma:{name}", fmt_gemms(by_name[name], "wgmma")))
        for vname, vdefs in a.fmt_variant:
            columns.append((f"wgmma:{name}:{vname}", fmt_gemms(by_name[name], "wgmma", vdefs)))
        if a.fmt_mma:
            columns.append((f"mma:{name}", fmt_gemms(by_name[name], "mma")))
    t = Table(title=f"prefill GEMMs, {a.preset}, M = {m} ({get_device().info.name}), µs and TFLOP/s")
    t.add_column("GEMM", justify="right")
    for cl, _ in columns:
        t.add_column(f"{cl}: µs", justify="right")
        t.add_column("TFLOP/s", justify="right")
    rows_out: dict[str, dict[str, list[str]]] = {}  # row → column → its two cells (a Q6_K column has one row)
    layer_ms = {}
    record = {"tool": "bench_gemm", "source": source_record(), "preset": a.preset, "rows": m, "reps": a.reps, "samples": a.samples,
              "int4_qkv_kernel": "gemm_int4_qkv" if a.qkv_f32 else "gemm_int4_qkv_rope",
              "tiling": choices,
              "device": get_device().info.name, "us": {}, "tflops": {}, "layers_ms": {},
              "fmt_variants": {name: dict(defs) for name, defs in a.fmt_variant},
              "int4_variants": {name: dict(defs) for name, defs in a.int4_variant},
              "kquant_variants": {name: dict(defs) for name, defs in a.kquant_variant}}
    # The samples go round the columns (sample 1 of every column, then sample 2, …): the GPU's
    # clock drops under a sustained run of these GEMMs, and a column measured whole after another
    # read up to 10% slower for the same launch (H200: the 7B's gate_up 217 µs first, 239 third).
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(a.samples):
        for cl, launchers in columns:
            for name, gs in launchers.items():
                for i, g in enumerate(gs):
                    times.setdefault((cl, name, i), []).append(graph_time_us(g, reps=a.reps))
    for cl, launchers in columns:
        total_us = total_flops = 0.0
        for name, gs in launchers.items():
            us = sum(statistics.median(times[cl, name, i]) for i in range(len(gs)))
            flops = sum(g.flops for g in gs)
            record["us"].setdefault(cl, {})[name] = us
            record["tflops"].setdefault(cl, {})[name] = flops / us / 1e6
            total_us += us
            total_flops += flops
            tiling = f" ({choices[cl][name]})" if name in choices.get(cl, {}) else ""
            rows_out.setdefault(name, {})[cl] = [f"{us:.1f}{tiling}", f"{flops / us / 1e6:.1f}"]
        rows_out.setdefault("layer", {})[cl] = [f"{total_us:.1f}", f"{total_flops / total_us / 1e6:.1f}"]
        layer_ms[cl] = cfg.num_layers * total_us / 1e3
    rows_out["layer"] = rows_out.pop("layer")  # the sums last
    for name, cells in rows_out.items():
        t.add_row(name, *(c for cl, _ in columns for c in cells.get(cl, ["–", "–"])))
    Console().print(t)
    for cl, ms in layer_ms.items():
        Console().print(f"{cl}: {cfg.num_layers} layers, {ms:.1f} ms of GEMMs")
    record["layers_ms"] = layer_ms
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=1))
    for b in buffers:
        b.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
