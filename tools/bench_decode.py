#!/usr/bin/env python3
"""Eager GPU decode step of a (synthetic) model: wall time per step vs the sum of its kernels.

    PYTHONPATH=src python3 tools/bench_decode.py --preset 7b [--model FILE] [--steps 100] [--json OUT]

Writes the synthetic model (format/synthetic.py) to --model if that file does not exist.
Each timed step is queued eagerly (pre-packed parameters) and synchronized; the figure is the
median over --steps. Then every launch is bracketed by CUDA events for 10 steps, and the
per-kernel medians are summed: the difference to the wall time is launch overhead and gaps.
Clocks are left as they are (DESIGN.md §11).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from drvqwen.config import PRESETS
from drvqwen.decode import DecodeStep
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.synthetic import minimal_tokenizer_json, write_synthetic




def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--model", default="/dev/shm/drvqwen_syn_7b.nanoqwen")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--context", type=int, default=1024, help="KV cache size (tokens)")
    ap.add_argument("--json")
    a = ap.parse_args()
    con = Console()
    path = Path(a.model)
    if not path.exists():
        t0 = time.perf_counter()
        write_synthetic(path, PRESETS[a.preset], seed=1, tokenizer_json=minimal_tokenizer_json())
        con.print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    f = NanoqwenFile(path)
    t0 = time.perf_counter()
    step = DecodeStep(f, max_context=a.context)
    con.print(f"{step.device.info.summary()}\nuploaded {step.weights.nbytes / 1e9:.2f} GB in "
              f"{time.perf_counter() - t0:.1f} s; {len(step.launches)} launches per step")
    step.start(token=100)
    for _ in range(10):                                # warm-up: caches, clocks, first-launch costs
        step.step()
    step.sync()
    wall = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step.step()
        step.sync()
        wall.append((time.perf_counter() - t) * 1e3)
    per_kernel = step.time_kernels(10)
    kernel_sum_ms = sum(per_kernel.values()) / 1e3
    # Group by kernel role (the layer prefix removed) for the table.
    groups: dict[str, float] = {}
    for name, us in per_kernel.items():
        key = name.split(".", 1)[1] if name.startswith("L") and "." in name else name
        groups[key] = groups.get(key, 0.0) + us
    bytes_per_step = sum(i.nbytes for i in f)  - f.tensors["model.embed_tokens.weight"].nbytes
    t = Table(title=f"eager decode step, {a.preset} synthetic, {f.config.num_layers} layers")
    for c in ("kernel (summed over layers)", "µs per step", "share"):
        t.add_column(c, justify="right")
    for k, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        t.add_row(k, f"{us:.1f}", f"{us / 1e3 / kernel_sum_ms:.1%}")
    con.print(t)
    med = float(np.median(wall))
    res = {"preset": a.preset, "layers": f.config.num_layers, "launches_per_step": len(step.launches),
           "eager_step_ms_median": med, "eager_step_ms_p90": float(np.percentile(wall, 90)),
           "kernel_sum_ms": kernel_sum_ms, "weight_bytes_read_per_step": bytes_per_step,
           "kernel_sum_effective_GBps": bytes_per_step / (kernel_sum_ms * 1e-3) / 1e9,
           "per_kernel_us": per_kernel, "device": step.device.info.summary()}
    con.print(f"eager step: median {med:.3f} ms (p90 {res['eager_step_ms_p90']:.3f}) over {a.steps} steps; "
              f"sum of kernel times {kernel_sum_ms:.3f} ms "
              f"({res['kernel_sum_effective_GBps']:.0f} GB/s of weights); launch overhead+gaps "
              f"{med - kernel_sum_ms:.3f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    step.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
