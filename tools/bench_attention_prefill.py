"""Prefill attention timing: kernels/attention_prefill.cu and attention_prefill_wgmma.cu alone,
at the 0.5B and 7B shapes.

    PYTHONPATH=src python tools/bench_attention_prefill.py [--models 0.5b 7b]
        [--cases 0:512 7680:512 31744:512] [--splits 1 2 4] [--engines mma wgmma]
        [--variant NAME:DEFINE=V[,DEFINE=V]] [--reps 20] [--samples 5] [--json out.json]

A case START:ROWS is one prompt chunk of ROWS queries at positions START … START+ROWS-1 over a
paged cache holding START+ROWS positions (shuffled pages), the launch grid sized for the chunk's
row bucket as the prefill sizes it. Each launcher is captured in a graph of --reps back-to-back
calls and replayed (`cuda.graph.graph_time_us`, median of --samples replays): no host launch
gaps. Reports µs per call and TFLOP/s of the causal work actually needed (`flops_for`: QKᵀ and PV,
2 FLOPs per multiply-add). Outputs are checked against the numpy reference on a few query rows
first (the tests own correctness; this only guards the timing against a broken build).

--splits times each case at every KV split count S (the launcher's kv_splits; S = 1 runs no
combine), --engines each kernel (the launcher's engine), --variant adds compile-time builds of the kernel (its header lists the switches, e.g.
`stages2:APF_STAGES=2`) beside the default one, all in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from drvqwen import reference as ref
from drvqwen.cuda import get_device
from drvqwen.cuda.graph import graph_time_us
from drvqwen.kv_cache import PAGE_TOKENS
from drvqwen.launchers import AttentionPrefill
from drvqwen.launchers.attention_prefill import ENGINES, AttentionSplitScratch, engine_build, tile_splits_needed
from drvqwen.prefill import ROW_BUCKET
from drvqwen.provenance import source_record

from bench_attention import Scratch  # device buffers freed together (tools/ is the script's path)

SHAPES = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}  # (Hq, Hkv, Dh)
CHECK_ROWS = 8  # query rows checked against the reference per case (the last ones: the longest)


def bench_case(rng, model: str, start: int, n_rows: int, splits: list[int], variants: list[tuple[str, tuple]],
               reps: int, samples: int, engines: tuple[str, ...] = ("mma",)) -> list[dict]:
    hq, hkv, dh = SHAPES[model]
    s_len = start + n_rows
    rows = -(-n_rows // ROW_BUCKET) * ROW_BUCKET
    n_pages = -(-s_len // PAGE_TOKENS)
    s = Scratch()
    try:
        bt = rng.permutation(n_pages).astype(np.int32)
        k_seq = rng.standard_normal((s_len, hkv, dh), np.float32).astype(np.float16)
        v_seq = rng.standard_normal((s_len, hkv, dh), np.float32).astype(np.float16)
        k_cache = np.zeros((n_pages, hkv, PAGE_TOKENS, dh), np.float16)
        v_cache = np.zeros_like(k_cache)
        ref.write_pages(k_cache, bt, np.arange(s_len), k_seq)
        ref.write_pages(v_cache, bt, np.arange(s_len), v_seq)
        q = np.zeros((rows, hq, dh), np.float16)
        q[:n_rows] = (1.5 * rng.standard_normal((n_rows, hq, dh), np.float32)).astype(np.float16)
        out = s.array("out", (rows, hq, dh), np.float16)
        bufs = (s.array("q", q.shape, np.float16, q), s.array("k", k_cache.shape, np.float16, k_cache),
                s.array("v", v_cache.shape, np.float16, v_cache), s.array("bt", bt.shape, np.int32, bt),
                s.array("ps", (2,), np.int32, np.array([start, n_rows], np.int32)))
        scratch = AttentionSplitScratch(s.array, max(tile_splits_needed(rows, max(splits), hq, hkv, e, d)
                                                     for e in engines for _name, d in variants), hq, hkv, dh)
        pos = start + np.arange(n_rows - CHECK_ROWS, n_rows)
        want = ref.attention(q[n_rows - CHECK_ROWS:n_rows].astype(np.float64), k_seq.astype(np.float64),
                             v_seq.astype(np.float64), pos)
        found = []
        for engine, (name, defines), S in ((e, v, S) for e in engines for v in variants for S in splits):
            attn = AttentionPrefill(out, *bufs, rows=rows, n_heads=hq, n_kv_heads=hkv, head_dim=dh,
                                    kv_splits=S, scratch=scratch, defines=defines, engine=engine)
            attn.launch()
            got = out.download()[n_rows - CHECK_ROWS:n_rows].astype(np.float64)
            rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            if not rel < 1e-2:
                raise SystemExit(f"{model} {start}:{n_rows} {engine} {name} S={S}: output rel L2 {rel:.2e} against the reference")
            us = statistics.median(graph_time_us(attn, reps) for _ in range(samples))
            flops = attn.flops_for(start, n_rows)
            found.append({"model": model, "start": start, "rows": n_rows, "engine": engine, "variant": name,
                          "defines": dict(engine_build(engine, defines)), "kv_splits": S, "us": us, "tflops": flops / us / 1e6,
                          "flops": flops, "rel_l2_last_rows": rel,
                          "grid": list(attn.launches[0].grid), "block": list(attn.launches[0].block)})
        return found
    finally:
        get_device().synchronize()
        s.close()


def parse_case(text: str) -> tuple[int, int]:
    try:
        start, rows = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"case {text!r}: write START:ROWS, e.g. 0:512") from None
    if start < 0 or rows < 1:
        raise argparse.ArgumentTypeError(f"case {text!r}: START ≥ 0 and ROWS ≥ 1")
    return start, rows


def parse_variant(text: str) -> tuple[str, tuple]:
    name, _, defs = text.partition(":")
    try:
        defines = tuple((k, int(v)) for k, v in (d.split("=") for d in defs.split(",") if d))
    except ValueError:
        raise argparse.ArgumentTypeError(f"variant {text!r}: write NAME:DEFINE=INT[,DEFINE=INT]") from None
    return name, defines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=["0.5b", "7b"])
    ap.add_argument("--cases", nargs="+", type=parse_case, default=[(0, 128), (0, 512), (7680, 512)])
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=["mma"])
    ap.add_argument("--variant", action="append", type=parse_variant, default=[],
                    help="NAME:DEFINE=INT[,…] a compile-time build timed beside each engine's own (its defines "
                         "replacing the engine's: launchers/attention_prefill.py ENGINE_BUILDS; repeatable)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)

    print(get_device().info.summary())
    rng = np.random.default_rng(a.seed)
    variants = [("default", ())] + a.variant
    rows = [r for m in a.models for st, n in a.cases
            for r in bench_case(rng, m, st, n, a.splits, variants, a.reps, a.samples, tuple(a.engines))]
    print(f"\nattention_prefill per call (graph of {a.reps}, median of {a.samples})")
    print(f"{'model':>5} {'start':>6} {'rows':>5} {'engine':>6} {'variant':>10} {'S':>2} | {'grid':>14} | {'µs':>9} "
          f"{'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['model']:>5} {r['start']:>6} {r['rows']:>5} {r['engine']:>6} {r['variant']:>10} {r['kv_splits']:>2} | "
              f"{str(tuple(r['grid'])):>14} | {r['us']:>9.2f} {r['tflops']:>8.1f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"source": source_record(), "reps": a.reps, "samples": a.samples, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
