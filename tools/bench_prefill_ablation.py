#!/usr/bin/env python3
"""What each op of the prefill costs inside the whole prompt pass: TTFT with launches left out.

    PYTHONPATH=src python3 tools/bench_prefill_ablation.py [--preset 7b | --model FILE]
        [--prompt-tokens 512] [--leave-out input_layernorm post_attention_layernorm ...]
        [--reps 20] [--define FILE:NAME=INT ...] [--json OUT]

The prefill's chunk launch lists (Prefill.launches: what `drvqwen bench` times as TTFT) run whole
and once per --leave-out entry without the launches whose name ends in `.<entry>` or contains
`.<entry>.` (every layer's; the last layer's last-row tail, which runs apart, keeps its own), each
--reps times on a random --prompt-tokens prompt, timed as `drvqwen bench` times TTFT (host time
from the submission to the first token read back; median). "whole" runs first and last, to show
the drift between the two. A variant's values are WRONG by design (an op's output is missing):
only its time means anything. The difference to "whole" is what the op costs the prompt pass —
its own run, its launch boundaries and what it does to its neighbours' overlap (programmatic
dependent launch) — which `drvqwen bench --kernels`, timing each launch alone, cannot say.

--define FILE:NAME=INT compiles every kernel of kernels/FILE.cu with -DNAME=INT (as
tools/bench_decode_ablation.py). The model is the synthetic --preset file
(drvqwen.bench.ensure_synthetic) or --model; its KV cache the model's full context, as
`drvqwen bench` sizes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_ablation import install_defines, left_out, parse_define  # noqa: E402

WARMUP_RUNS = 2  # untimed prompt passes per variant (first launches of a new list, clocks)


def left_out_of_chunk(name: str, entry: str) -> bool:
    """Whether prefill launch `name` is one of `entry`'s: its own, or the range-scheduled twin a
    long prompt's late chunks run instead (`L{l}.attention_late` for "attention")."""
    return left_out(name, entry) or left_out(name, entry + "_late")


def kept(names: list[str], leave: list[str]) -> list[str]:
    """The launch names of a chunk list that a variant leaving out `leave` runs."""
    return [n for n in names if not any(left_out_of_chunk(n, e) for e in leave)]


def ttft_runs_ms(prefill, dec, prompt: list[int], reps: int) -> list[float]:
    """`reps` prompt passes, each a new sequence: ms from the submission to the token on the host."""
    out = []
    for _ in range(reps):
        dec.sync()
        t0 = time.perf_counter()
        prefill.run(prompt)
        dec.next_token()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--model", help="a .nanoqwen file to measure instead of the --preset synthetic one")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--leave-out", nargs="*", default=["input_layernorm", "post_attention_layernorm", "attention"],
                    help="launch names (their layer-free tail) to leave out, one variant each")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--define", action="append", default=[], metavar="FILE:NAME=INT")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    if a.prompt_tokens < 1 or a.reps < 1:
        raise SystemExit(f"--prompt-tokens {a.prompt_tokens} / --reps {a.reps}: need >= 1")
    defines = [parse_define(d) for d in a.define]
    install_defines(defines)
    from drvqwen.errors import DrvqwenError
    from drvqwen.launchers import LaunchError

    try:
        return measure(a, defines)
    except (DrvqwenError, LaunchError) as e:  # a model or option refused: one line
        raise SystemExit(f"bench_prefill_ablation.py: {e}") from None


def measure(a, defines) -> int:
    """The variants of the parsed arguments `a` timed; the JSON written. Returns 0."""
    from drvqwen.bench import ensure_synthetic, load_prefill
    from drvqwen.decode import DecodeStep
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.prefill import ROW_BUCKET
    from drvqwen.provenance import source_record

    f = NanoqwenFile(a.model or ensure_synthetic(a.preset))
    dec = DecodeStep(f)
    prefill = load_prefill(dec)
    if prefill.per_token:
        raise SystemExit("this model's prefill runs one decode step per token: no chunk launch list to ablate")
    rows = -(-min(a.prompt_tokens, prefill.chunk_rows) // ROW_BUCKET) * ROW_BUCKET
    names = [nl.name for nl in prefill.launches(rows)]
    for entry in a.leave_out:
        if not any(left_out(n, entry) for n in names):
            raise SystemExit(f"--leave-out {entry}: no launch of the prefill is named so (layer 0: "
                             f"{', '.join(n[3:] for n in names if n.startswith('L0.'))})")
    leave: list[str] = []
    full = type(prefill).launches

    def launches(self, rows: int, late: bool = False):
        return [nl for nl in full(self, rows, late) if not any(left_out_of_chunk(nl.name, e) for e in leave)]

    prefill.launches = types.MethodType(launches, prefill)
    prompt = np.random.default_rng(0).integers(0, f.config.vocab_size, a.prompt_tokens).tolist()
    label = Path(a.model).name if a.model else a.preset
    rows_out = []
    for variant in ["whole", *a.leave_out, "whole"]:
        leave[:] = [] if variant == "whole" else [variant]
        ttft_runs_ms(prefill, dec, prompt, WARMUP_RUNS)
        runs = ttft_runs_ms(prefill, dec, prompt, a.reps)
        row = {"variant": variant, "launches_per_chunk": len(kept(names, leave)),
               "ttft_median_ms": float(np.median(runs)), "ttft_runs_ms": runs}
        rows_out.append(row)
        print(f"{label} prompt {a.prompt_tokens:6d}  {variant:26s} {row['launches_per_chunk']:4d} launches a chunk  "
              f"TTFT median {row['ttft_median_ms']:.3f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"source": source_record(), "device": dec.device.info.summary(),
                       "preset": None if a.model else a.preset, "model": Path(a.model).name if a.model else None,
                       "prompt_tokens": a.prompt_tokens, "reps": a.reps, "chunk_rows": prefill.chunk_rows,
                       "defines": [f"{fi}:{n}={v}" for fi, n, v in defines], "rows": rows_out}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
