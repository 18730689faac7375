#!/usr/bin/env python3
"""The prefill GEMMs of one layer (kernels/gemm_int4.cu) at the real shapes: µs and TFLOP/s.

    PYTHONPATH=src python3 tools/bench_gemm.py [--preset 7b] [--rows 512] [--reps 5] [--samples 5] [--json F]

Each GEMM is captured in a CUDA graph of --reps calls and replayed (`cuda.graph.graph_time_us`:
no Python launch overhead in the figure); a figure is the median of --samples such replays. The
inputs are random INT4 weights and activations; the numbers are not checked here
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

from drvqwen.launchers import GemmInt4GateUpSwigluRows, GemmInt4QkvRows, GemmInt4ResidualRows
from drvqwen.config import PRESETS
from drvqwen.cuda import DeviceArray, DeviceBuffer, get_device
from drvqwen.cuda.graph import graph_time_us
from drvqwen.provenance import source_record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--rows", type=int, default=512, help="prompt rows M (default 512)")
    ap.add_argument("--reps", type=int, default=5, help="calls per timed graph (default 5)")
    ap.add_argument("--samples", type=int, default=5, help="timed graphs per figure, median taken (default 5)")
    ap.add_argument("--json", help="also write the figures (µs, TFLOP/s) to this file")
    ap.add_argument("--grid", nargs="+", default=["persistent", "tiles"], choices=["persistent", "tiles"],
                    help="persistent: one block per SM looping over the tiles (what drvqwen runs); tiles: "
                         "one block per tile. Each given value is a column (default: both)")
    a = ap.parse_args()
    cfg, m = PRESETS[a.preset], a.rows
    d, f, nq, nkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim
    rng = np.random.default_rng(0)
    buffers = []

    def upload(name, host):
        buf = DeviceBuffer(max(host.nbytes, 16), name)
        buffers.append(buf)
        arr = DeviceArray(name, buf.ptr, host.shape, host.dtype)
        arr.upload(np.ascontiguousarray(host))
        return arr

    def w(name, n, k):
        qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.01, size=(n, k // 128)).astype(np.float16)
        return upload(name + ".qweight", qw), upload(name + ".scales", sc)

    get_device()
    x = upload("x", rng.standard_normal((m, d)).astype(np.float16))
    xf = upload("h", (rng.standard_normal((m, f)) * 0.1).astype(np.float16))
    st = upload("prefill_state", np.array([0, m], np.int32))
    out = {"qkv": np.zeros((m, nq + 2 * nkv), np.float32), "res": np.zeros((m, d), np.float32),
           "h_out": np.zeros((m, f), np.float16)}
    o = {k: upload(k, v) for k, v in out.items()}
    def gemms(cl):
        return {
            "qkv_proj": GemmInt4QkvRows(o["qkv"], x, *wq, *wk, *wv, st, n_q=nq, n_kv=nkv, k=d, rows=m, max_blocks=None if cl == 'persistent' else 0),
            "o_proj": GemmInt4ResidualRows(o["res"], x, *wo, st, n=d, k=nq, rows=m, max_blocks=None if cl == 'persistent' else 0),
            "gate_up_swiglu": GemmInt4GateUpSwigluRows(o["h_out"], x, *wg, *wu, st, f=f, k=d, rows=m, max_blocks=None if cl == 'persistent' else 0),
            "down_proj": GemmInt4ResidualRows(o["res"], xf, *wd, st, n=d, k=f, rows=m, max_blocks=None if cl == 'persistent' else 0),
        }

    wq, wk, wv, wo = w("q", nq, d), w("k", nkv, d), w("v", nkv, d), w("o", d, nq)
    wg, wu, wd = w("g", f, d), w("u", f, d), w("d", d, f)
    t = Table(title=f"prefill GEMMs, {a.preset}, M = {m} ({get_device().info.name}), µs and TFLOP/s")
    t.add_column("GEMM", justify="right")
    for cl in a.grid:
        t.add_column(f"{cl}: µs", justify="right")
        t.add_column("TFLOP/s", justify="right")
    rows_out: dict[str, list[str]] = {}
    layer_ms = {}
    record = {"tool": "bench_gemm", "source": source_record(), "preset": a.preset, "rows": m, "reps": a.reps, "samples": a.samples,
              "device": get_device().info.name, "us": {}, "tflops": {}, "layers_ms": {}}
    for cl in a.grid:
        total_us = total_flops = 0.0
        for name, g in gemms(cl).items():
            us = statistics.median(graph_time_us(g, reps=a.reps) for _ in range(a.samples))
            record["us"].setdefault(cl, {})[name] = us
            record["tflops"].setdefault(cl, {})[name] = g.flops / us / 1e6
            total_us += us
            total_flops += g.flops
            rows_out.setdefault(name, []).extend([f"{us:.1f}", f"{g.flops / us / 1e6:.1f}"])
        rows_out.setdefault("layer", []).extend([f"{total_us:.1f}", f"{total_flops / total_us / 1e6:.1f}"])
        layer_ms[cl] = cfg.num_layers * total_us / 1e3
    for name, cells in rows_out.items():
        t.add_row(name, *cells)
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
