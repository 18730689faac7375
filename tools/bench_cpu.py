#!/usr/bin/env python3
"""CPU decode speed of the numpy reference backend (the `drvqwen run` fallback).

    PYTHONPATH=src python3 tools/bench_cpu.py [--model M] [--tokens 64] [--runs 3]

Greedy, stop tokens ignored, a short raw prompt; prints each run's decode tok/s and TTFT and
the median, and writes JSON with --json. Quote figures with the machine (`nproc`, CPU model).
"""

import argparse
import json
import os
import platform
import statistics
import sys

from rich.console import Console
from rich.table import Table

from drvqwen.generate import CPUBackend, generate
from drvqwen.models import resolve_model
from drvqwen.tokenizer import Tokenizer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the real Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", default='def fib(n):\n    """Return the n-th Fibonacci number."""\n')
    ap.add_argument("--json", help="write results here")
    a = ap.parse_args()
    con = Console()
    f = resolve_model(a.model)
    tok = Tokenizer.from_json(f.tokenizer_json, source=str(f.path))
    ids = tok.encode(a.prompt, special=True)   # a raw prompt, as `drvqwen run --raw`
    backend = CPUBackend(f, max_context=len(ids) + a.tokens + 1)
    runs = []
    for i in range(a.runs):
        r = generate(backend, ids, a.tokens, ignore_stop=True)
        runs.append({"decode_tok_s": r.decode_tok_s, "ttft_ms": r.ttft_s * 1e3, "tokens": len(r.tokens)})
    t = Table(title=f"CPU decode, {f.path.name}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    for c in ("run", "tokens", "TTFT ms", "decode tok/s"):
        t.add_column(c, justify="right")
    for i, r in enumerate(runs):
        t.add_row(str(i), str(r["tokens"]), f"{r['ttft_ms']:.0f}", f"{r['decode_tok_s']:.2f}")
    med = statistics.median(r["decode_tok_s"] for r in runs)
    t.add_row("median", "", f"{statistics.median(r['ttft_ms'] for r in runs):.0f}", f"{med:.2f}")
    con.print(t)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"model": str(f.path), "prompt_tokens": len(ids), "runs": runs,
                       "median_decode_tok_s": med, "cores": os.cpu_count()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
