#!/usr/bin/env python3
"""The cost of `drvqwen serve` over the engine itself: TTFT and decode tok/s, direct and over HTTP.

    PYTHONPATH=src python3 tools/bench_serve.py [--model M | --preset 0.5b] [--device cuda]
        [--prompt-tokens 512] [--new-tokens 128] [--runs 5] [--json out.json]

Direct: `generate()` on a backend built here, greedy, stop tokens ignored (TTFT and tok/s as
GenerationResult measures them: prompt submitted → first token, then the tokens after the
first over their time). Over HTTP: the same prompt ids (sent as a token-id prompt to
/v1/completions, so both run exactly the same ids; `cache_prompt: false`, so both prefill all
of them), `stream: true`, through a server on a loopback port in this process: TTFT = request
sent → first streamed event, tok/s = the tokens after the first (usage.completion_tokens − 1)
over first event → last event. Medians of `--runs` runs after one warm-up run each; JSON with
both and the differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx

from drvqwen.generate import generate
from drvqwen.models import resolve_model
from drvqwen.sampler import SamplingParams


def direct(f, device: str, ctx: int, ids: list[int], n: int, runs: int) -> list[dict]:
    if device == "cuda":
        from drvqwen.engine import GPUBackend

        backend = GPUBackend(f, ctx)
    else:
        from drvqwen.generate import CPUBackend

        backend = CPUBackend(f, ctx)
    out = []
    try:
        for i in range(runs + 1):
            r = generate(backend, ids, n, SamplingParams(), ignore_stop=True)
            backend.reset()
            if i:
                out.append({"ttft_ms": r.ttft_s * 1e3, "tok_s": r.decode_tok_s, "tokens": len(r.tokens)})
    finally:
        if hasattr(backend, "close"):
            backend.close()
    return out


def over_http(f, device: str, ctx: int, ids: list[int], n: int, runs: int) -> list[dict]:
    from drvqwen.server.main import BackgroundServer

    # cache_prompt false: every run prefills the whole prompt, as the direct path does after its
    # reset (the server would otherwise reuse all but the last id of the previous run's prompt).
    body = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": False}
    out = []
    with BackgroundServer(f, device, ctx) as srv, httpx.Client(timeout=600) as client:
        for i in range(runs + 1):
            t0 = time.perf_counter()
            t_first = t_last = None
            usage = None
            with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        continue
                    now = time.perf_counter()
                    t_first = t_first or now
                    t_last = now
            gen = usage["completion_tokens"]
            if i:
                out.append({"ttft_ms": (t_first - t0) * 1e3,
                            "tok_s": (gen - 1) / (t_last - t_first) if gen > 1 and t_last > t_first else float("nan"),
                            "tokens": gen})
    return out


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .nanoqwen (or anything --model takes); default: --preset")
    ap.add_argument("--preset", default="0.5b", help="synthetic weights of this size when --model is not given")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if a.model:
        f = resolve_model(a.model)
    else:
        from drvqwen.bench import ensure_synthetic
        from drvqwen.format.nanoqwen import NanoqwenFile

        f = NanoqwenFile(ensure_synthetic(a.preset))
    # Ids from the text vocabulary, deterministic: the same prompt for both paths.
    ids = [(7 * i + 11) % min(f.text_vocab, 30000) for i in range(a.prompt_tokens)]
    ctx = a.prompt_tokens + a.new_tokens + 16
    d = direct(f, a.device, ctx, ids, a.new_tokens, a.runs)
    h = over_http(f, a.device, ctx, ids, a.new_tokens, a.runs)
    res = {"model": str(f.path), "device": a.device, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
           "runs": a.runs, "direct": d, "http": h,
           "median": {"direct_ttft_ms": med(d, "ttft_ms"), "http_ttft_ms": med(h, "ttft_ms"),
                      "direct_tok_s": med(d, "tok_s"), "http_tok_s": med(h, "tok_s")}}
    m = res["median"]
    m["ttft_overhead_ms"] = m["http_ttft_ms"] - m["direct_ttft_ms"]
    m["tok_s_ratio"] = m["http_tok_s"] / m["direct_tok_s"]
    print(json.dumps(m, indent=2))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
