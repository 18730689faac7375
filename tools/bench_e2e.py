#!/usr/bin/env python3
"""End to end on the GPU engine: TTFT of a prompt and the inter-token latency of decoding.

    PYTHONPATH=src python3 tools/bench_e2e.py --preset 7b [--model FILE] [--prompt-tokens 512]
        [--new-tokens 128] [--runs 3] [--json OUT]

DESIGN.md §11's protocol: a 512-token prompt, 128 generated tokens, greedy, stop tokens ignored,
clocks left as they are. Writes the synthetic model (format/synthetic.py) to --model if that
file does not exist. The figures are `engine.measure_generation`'s (host clock, as a user
sees them: TTFT = call → first token on the host; ITL = between consecutive tokens), after a
warm-up run; the decode step runs eagerly (graphs: the `drvqwen bench` command). Then the
prefill's kernels are timed one by one on the GPU (events, queued behind a hold) and the INT4
GEMMs' TFLOP/s is reported.
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
from drvqwen.engine import GPUBackend, measure_generation
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.synthetic import minimal_tokenizer_json, write_synthetic




def prefill_kernel_report(backend: GPUBackend, ids: list[int]) -> dict:
    """GPU time of every prefill launch of `ids` (one chunk), grouped by role, with GEMM TFLOP/s."""
    times = backend.prompt.time_kernels(ids)
    rows = -(-len(ids) // 64) * 64
    launchers = dict((name, l) for name, l, _b in backend.prompt.launchers[rows])
    groups: dict[str, float] = {}
    gemm_us = gemm_flops = 0.0
    cfg = backend.config
    for name, us in times.items():
        role = name.split(".", 1)[1] if name.startswith("L") and "." in name else name
        groups[role] = groups.get(role, 0.0) + us
        l = launchers.get(name)
        if getattr(l, "flops", 0):
            gemm_us += us
            gemm_flops += l.flops * len(ids) / rows   # useful FLOPs: the live rows only
    return {"per_role_us": groups, "kernel_sum_ms": sum(times.values()) / 1e3,
            "gemm_ms": gemm_us / 1e3, "gemm_tflops": gemm_flops / (gemm_us * 1e-6) / 1e12 if gemm_us else float("nan"),
            "useful_tflop": backend.prompt.flops(len(ids)) / 1e12, "layers": cfg.num_layers}


def bench_e2e(model: Path, prompt_tokens: int = 512, new_tokens: int = 128, runs: int = 3,
              context: int = 2048) -> dict:
    """The whole measurement on one model file; returns a JSON-able dict."""
    f = NanoqwenFile(model)
    t0 = time.perf_counter()
    backend = GPUBackend(f, max_context=min(context, f.config.max_position))
    upload_s = time.perf_counter() - t0
    try:
        ids = np.random.default_rng(0).integers(0, f.config.vocab_size, prompt_tokens).tolist()
        res = measure_generation(backend, ids, new_tokens, runs=runs)
        res["prefill_kernels"] = prefill_kernel_report(backend, ids[:backend.prompt.chunk_rows])
        res["prefill_effective_tflops"] = res["prefill_kernels"]["useful_tflop"] / (res["ttft_ms_median"] * 1e-3)
        res.update(device=backend.step.device.info.summary(), layers=f.config.num_layers, upload_s=upload_s,
                   weight_bytes=backend.step.weights.nbytes, decode_mode="eager")
        return res
    finally:
        backend.close()
        f.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--model", default=None, help="default: /dev/shm/drvqwen_syn_<preset>.nanoqwen")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    con = Console()
    path = Path(a.model or f"/dev/shm/drvqwen_syn_{a.preset}.nanoqwen")
    if not path.exists():
        t0 = time.perf_counter()
        write_synthetic(path, PRESETS[a.preset], seed=1, tokenizer_json=minimal_tokenizer_json())
        con.print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    res = bench_e2e(path, a.prompt_tokens, a.new_tokens, a.runs)
    res["preset"] = a.preset
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    pk = res["prefill_kernels"]
    t = Table(title=f"prefill kernels, {a.preset} synthetic, {res['layers']} layers, "
                    f"{a.prompt_tokens} tokens (GPU time, summed over layers)")
    for c in ("kernel", "ms", "share"):
        t.add_column(c, justify="right")
    for k, us in sorted(pk["per_role_us"].items(), key=lambda kv: -kv[1]):
        t.add_row(k, f"{us / 1e3:.3f}", f"{us / 1e3 / pk['kernel_sum_ms']:.1%}")
    con.print(t)
    con.print(f"{res['device']}\nTTFT {res['ttft_ms_median']:.1f} ms (min {res['ttft_ms_min']:.1f}) for "
              f"{a.prompt_tokens} tokens = {res['prefill_effective_tflops']:.0f} TFLOP/s effective; prefill "
              f"kernels {pk['kernel_sum_ms']:.1f} ms, INT4 GEMMs {pk['gemm_ms']:.1f} ms at {pk['gemm_tflops']:.0f} "
              f"TFLOP/s\nITL median {res['itl_ms_median']:.3f} ms, p99 {res['itl_ms_p99']:.3f} ms "
              f"({res['decode_tok_s']:.0f} tok/s, eager decode) over {a.new_tokens} tokens × {a.runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
