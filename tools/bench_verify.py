#!/usr/bin/env python3
"""What a verify pass of speculative decoding costs next to one decode step, in one run on the GPU.

    PYTHONPATH=src python3 tools/bench_verify.py                       # synthetic 7B (drvqwen bench's)
    PYTHONPATH=src python3 tools/bench_verify.py --preset 0.5b --reps 50 --json verify.json
    PYTHONPATH=src python3 tools/bench_verify.py --model M.nanoqwen    # an INT4 model's file

Protocol: one backend built as speculation builds it (engine.GPUBackend(speculative=True): CUDA
graphs, the decode step with the plain attention kernel, the verify pass), a random prompt of
--prompt-tokens ids through the prefill, then at its end position p, --reps times each (after
one untimed repetition, which captures the graphs):

- the decode step: the greedy decode graph of `drvqwen bench` (graphs.GraphDecoder of the
  step's own list) at p, its token read back;
- the verify pass for T in 1, 2, 4, 8, 16: `VerifyPass.run` (what GPUBackend.verify runs) of T
  random ids at p … p+T−1 (graph replay; its logits [T, V] come back to the host, as
  speculation reads them);

each followed, untimed, by the rollback to p through the sequence owner (`Sequence.rollback`,
what GPUBackend.rollback runs), so every repetition runs at the same positions and opens the
same pages: with the default prompt of 512 ids (p = 512, a page boundary) the decode step and
every pass open one page each time.
Two times per repetition: the host wall time of the call (what a token stream waits), and the
GPU time between events recorded around the kernels alone (the replay: no ids copy, no logits
download). Reported: their medians, and each pass's median over the decode step's — the figure
to hold against "a verify pass of 8 tokens costs at most 1.25 decode steps". --json writes every
sample, the medians, the protocol, the device and `drvqwen.provenance.source_record()`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from drvqwen.config import PRESETS
from drvqwen.errors import DrvqwenError

VERIFY_TOKENS = (1, 2, 4, 8, 16)
PROMPT_TOKENS = 512
REPS = 30
TARGET_T, TARGET_RATIO = 8, 1.25   # the target: a pass of 8 tokens ≤ 1.25 decode steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (exit status 2 and one line on a bad value)."""
    ap = argparse.ArgumentParser(prog="tools/bench_verify.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .nanoqwen of the INT4 model (default: the synthetic --preset model)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b", help="synthetic model shape (default: 7b)")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help=f"default: {PROMPT_TOKENS}")
    ap.add_argument("--reps", type=int, default=REPS, help=f"timed repetitions of each (default: {REPS})")
    ap.add_argument("--max-context", type=int, default=0, help="KV cache size in tokens (default: the model's)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random ids (default: 0)")
    ap.add_argument("--kernels", action="store_true",
                    help="also time every launch of the decode step and of each pass, by role (eager, behind gpu_sleep)")
    ap.add_argument("--fused", action="store_true",
                    help="also time a pass whose T-token GEMVs normalise their rows themselves, as the "
                         "decode step's do (rows 'verify<T> fused'; the default pass runs the RMSNorms as "
                         "launches of their own)")
    ap.add_argument("--json", help="also write the result as JSON to this file")
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: at least 1")
    if a.prompt_tokens < 1:
        ap.error(f"--prompt-tokens {a.prompt_tokens}: at least 1")
    if a.max_context and a.max_context < a.prompt_tokens + max(VERIFY_TOKENS):
        ap.error(f"--max-context {a.max_context}: the protocol needs {a.prompt_tokens + max(VERIFY_TOKENS)} tokens")
    if a.json and not Path(a.json).resolve().parent.is_dir():
        ap.error(f"--json {a.json}: no folder {Path(a.json).resolve().parent.name!r} to write it in")
    return a


def summarize(samples: dict[str, dict[str, list[float]]]) -> dict:
    """Medians and ratios of the samples: name ("decode", "verify<T>") → {"host_ms": […],
    "gpu_ms": […]}. Each name gets host_median_ms and gpu_median_ms; each verify<T> also its
    medians over the decode step's (host_over_decode, gpu_over_decode)."""
    out = {}
    dec = {k: statistics.median(samples["decode"][k]) for k in ("host_ms", "gpu_ms")}
    for name, s in samples.items():
        row = {"host_median_ms": statistics.median(s["host_ms"]), "gpu_median_ms": statistics.median(s["gpu_ms"])}
        if name != "decode":
            row["host_over_decode"] = row["host_median_ms"] / dec["host_ms"]
            row["gpu_over_decode"] = row["gpu_median_ms"] / dec["gpu_ms"]
        out[name] = row
    return out


def measure(backend, prompt: list[int], reps: int, rng: np.random.Generator,
            passes: dict | None = None) -> dict[str, dict[str, list[float]]]:
    """The protocol (module doc) on a GPUBackend built with speculative=True: the samples by name.
    passes: row-name suffix → VerifyPass of the backend's decode step (default {"": its own
    pass}); each is timed for every T, rows "verify<T><suffix>"."""
    from drvqwen.cuda import Event
    from drvqwen.graphs import GraphDecoder

    step, seq = backend.decode_step, backend.decode_step.seq
    V, p = backend.config.vocab_size, len(prompt)
    start, end = Event(), Event()
    graph = GraphDecoder(step, fallback=False)
    samples: dict[str, dict[str, list[float]]] = {}
    try:
        backend.prefill(prompt)
        token = step.next_token()
        s = samples["decode"] = {"host_ms": [], "gpu_ms": []}
        for rep in range(reps + 1):                      # the first one untimed
            t0 = time.perf_counter()
            start.record(step.stream)
            graph.decode_token()
            end.record(step.stream)
            graph.next_token()                           # waits: the token is on the host
            host = (time.perf_counter() - t0) * 1e3
            if rep:
                s["host_ms"].append(host)
                s["gpu_ms"].append(start.elapsed_ms(end))
            seq.rollback(p, token)
        runs = [(suffix, vp, T) for suffix, vp in (passes or {"": backend.verify_pass}).items() for T in VERIFY_TOKENS]
        for suffix, vp, T in runs:
            s = samples[f"verify{T}{suffix}"] = {"host_ms": [], "gpu_ms": []}
            tokens = rng.integers(0, V, T).tolist()
            for rep in range(reps + 1):                  # the first one captures T's graph
                t0 = time.perf_counter()
                vp.run(tokens, events=(start, end))      # waits: the logits on the host
                host = (time.perf_counter() - t0) * 1e3
                if rep:
                    s["host_ms"].append(host)
                    s["gpu_ms"].append(start.elapsed_ms(end))
                seq.rollback(p, token)
    finally:
        graph.close()
        start.close()
        end.close()
    return samples


def measure_kernels(backend, reps: int, rng: np.random.Generator,
                    passes: dict | None = None) -> dict[str, dict[str, float]]:
    """µs per role (bench.by_role) of the decode step and of the pass for each T, at the
    sequence's position, eager and queued behind gpu_sleep with an event pair around each launch
    (DecodeStep.time_kernels, VerifyPass.time_kernels; each figure includes its event pair's
    ~2 µs); the sequence is rolled back after each."""
    from drvqwen.bench import by_role

    step, seq = backend.decode_step, backend.decode_step.seq
    step.sync()
    p, token = seq.pos, int(seq.state.download()[1])
    out = {"decode": by_role(step.time_kernels(reps))}
    seq.rollback(p, token)
    for suffix, vp in (passes or {"": backend.verify_pass}).items():
        for T in VERIFY_TOKENS:
            tokens = rng.integers(0, backend.config.vocab_size, T).tolist()
            out[f"verify{T}{suffix}"] = by_role(vp.time_kernels(tokens, reps))
    return out


def run(a: argparse.Namespace) -> dict:
    """Build the backend, measure, and return the JSON-ready result.

    Raises:
        DrvqwenError: no usable GPU, a model without a verify pass, or one that does not fit.
    """
    from drvqwen.bench import ensure_synthetic
    from drvqwen.cuda import gpu_unavailable_reason
    from drvqwen.engine import GPUBackend
    from drvqwen.format.nanoqwen import NanoqwenFile

    reason = gpu_unavailable_reason()
    if reason is not None:
        raise DrvqwenError(f"bench_verify needs a Hopper GPU: {reason}")
    path = Path(a.model) if a.model else ensure_synthetic(a.preset)
    f = NanoqwenFile(path)
    backend = GPUBackend(f, a.max_context or None, speculative=True)
    try:
        if backend.verify_pass is None:
            raise DrvqwenError(f"{path.name}: no verify pass for this model (per-tensor formats verify per token)")
        rng = np.random.default_rng(a.seed)
        prompt = rng.integers(0, backend.config.vocab_size, a.prompt_tokens).tolist()
        passes = {"": backend.verify_pass}
        if a.fused:
            from drvqwen.verify_pass import VerifyPass

            passes[" fused"] = VerifyPass(backend.decode_step, graphs=True, prenorm=False)
        try:
            samples = measure(backend, prompt, a.reps, rng, passes)
            kernels = measure_kernels(backend, a.reps, rng, passes) if a.kernels else None
        finally:
            if a.fused:
                passes[" fused"].close()
        return {"device": backend.decode_step.device.info.summary(),
                "model": path.name,                  # the file's name: no path of the machine it ran on
                "config": backend.config.to_dict(),
                "protocol": {"prompt_tokens": a.prompt_tokens, "reps": a.reps, "seed": a.seed,
                             "max_context": backend.max_context, "verify_tokens": list(VERIFY_TOKENS),
                             "attention": backend.decode_step.attention,
                             "verify_mode": backend.verify_pass.mode,
                             "prenorm": backend.verify_pass.prenorm,
                             "fused": "rows 'verify<T> fused': the RMSNorms inside the T-token GEMVs "
                                      "(verify_plan prenorm=False)" if a.fused else None,
                             "host_ms": "host wall time of the call: decode step with its token read back, "
                                        "verify pass with its logits [T, V] read back",
                             "gpu_ms": "GPU time between events around the graph replay alone",
                             "rollback": "to the prompt's end after every repetition, untimed"},
                "target": {"verify_tokens": TARGET_T, "max_over_decode": TARGET_RATIO},
                "samples": samples,
                "medians": summarize(samples),
                **({"kernels_us": kernels} if kernels is not None else {})}
    finally:
        backend.close()
        f.close()


def print_table(res: dict, console: Console | None = None) -> None:
    """The medians as a rich table, one row per decode step / verify pass."""
    t = Table(title=f"verify pass vs decode step, {res['model']} at position {res['protocol']['prompt_tokens']}")
    for c in ("what", "host median ms", "GPU median ms", "host ÷ decode", "GPU ÷ decode"):
        t.add_column(c, justify="left" if c == "what" else "right")
    for name, r in res["medians"].items():
        ratios = [f"{r[k]:.2f}" if k in r else "" for k in ("host_over_decode", "gpu_over_decode")]
        t.add_row(name, f"{r['host_median_ms']:.3f}", f"{r['gpu_median_ms']:.3f}", *ratios)
    (console or Console()).print(t)
    if "kernels_us" in res:
        k = res["kernels_us"]
        t = Table(title="µs per pass by kernel role (eager, an event pair around each launch)")
        t.add_column("role")
        for name in k:
            t.add_column(name, justify="right")
        roles = list(dict.fromkeys(r for per in k.values() for r in per))
        for role in [*roles, "sum"]:
            t.add_row(role, *(f"{sum(per.values()) if role == 'sum' else per.get(role, 0.0):.1f}" for per in k.values()))
        (console or Console()).print(t)


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write --json; a DrvqwenError prints one line and exits 2."""
    a = parse_args(argv)
    err = Console(stderr=True)
    try:
        res = run(a)
    except DrvqwenError as e:
        err.print(f"error: {e}", soft_wrap=True, markup=False)
        return 2
    print_table(res)
    if a.json:
        from drvqwen.paths import atomic_write_bytes
        from drvqwen.provenance import source_record

        res["source"] = source_record()
        atomic_write_bytes(Path(a.json), json.dumps(res, indent=1).encode())
        err.print(f"wrote {a.json}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
