#!/usr/bin/env python3
"""Greedy tokens and a hash of every logit vector, for a few prompts: a fingerprint of what the
GPU path computes, to compare two versions of drvqwen bit for bit.

    PYTHONPATH=src python3 tools/decode_fingerprint.py --model M.nanoqwen [--tokens 48] --json OUT

Per prompt (fixed token ids, so no tokenizer is involved):
  - tokens: the greedy tokens `GPUBackend.token_stream` streams (prefill, then graph decode);
  - eager_tokens / logits_sha256: the prompt prefilled again and the same number of steps decoded
    eagerly, feeding the GPU's own choices back (GPUBackend.prefill / decode), with the sha256
    of every fp32 logit vector in order — equal hashes mean equal bits.
It also records each launch of layer 0 and of the model's tail (kernel, grid, block, shared
memory): where two versions differ in a launch shape, the order of a reduction may differ and
with it the last bits, while the tokens must still agree.

Only the engine's public API is used (GPUBackend), so the same script runs against an older
checkout through PYTHONPATH.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

from drvqwen.engine import GPUBackend
from drvqwen.format.nanoqwen import NanoqwenFile

# Token ids of a few prompts (ids < 151 643: every Qwen2.5 vocabulary has them): a short one,
# one across a page boundary, and one of 100 tokens.
PROMPTS = {
    "def_fib": [750, 15801, 1445, 1648, 198, 262],
    "seventeen": [40, 1079, 264, 2025, 13, 576, 4226, 374, 220, 16, 17, 18, 19, 20, 21, 22, 23],
    "hundred": [int(x) for x in np.random.default_rng(7).integers(100, 150000, 100)],
}


def fingerprint(path: str, n_tokens: int) -> dict:
    f = NanoqwenFile(path)
    backend = GPUBackend(f, max_context=512)
    out: dict = {"model": path, "prompts": {}}
    try:
        for name, ids in PROMPTS.items():
            tokens = list(backend.token_stream(ids, n_tokens))
            h = hashlib.sha256()
            logits = backend.prefill(ids)
            h.update(np.ascontiguousarray(logits, np.float32).tobytes())
            eager = [int(np.argmax(logits))]
            for _ in range(n_tokens - 1):
                logits = backend.decode(eager[-1])
                h.update(np.ascontiguousarray(logits, np.float32).tobytes())
                eager.append(int(np.argmax(logits)))
            backend.reset()
            out["prompts"][name] = {"tokens": tokens, "eager_tokens": eager, "logits_sha256": h.hexdigest()}
        # The launch list the engine decoded with (greedy, publish_token included); a baseline
        # checkout run through PYTHONPATH may keep it as `step.launches`.
        launches = backend.launch_list.launches if hasattr(backend, "launch_list") else backend.step.launches
        tail = [nl for nl in launches if not nl.name.startswith("L")]
        out["launch_shapes"] = [
            {"name": nl.name, "kernel": nl.launch.label, "grid": list(nl.launch.grid),
             "block": list(nl.launch.block), "smem": nl.launch.smem_bytes}
            for nl in launches if nl.name.startswith("L0.") or nl in tail]
    finally:
        backend.close()
        f.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a .nanoqwen file")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    ap.add_argument("--json", help="write the fingerprint here")
    a = ap.parse_args()
    res = fingerprint(a.model, a.tokens)
    for name, p in res["prompts"].items():
        same = "graph == eager tokens" if p["tokens"] == p["eager_tokens"] else "graph != eager TOKENS"
        print(f"{name}: {same}; logits sha256 {p['logits_sha256'][:16]}…; tokens {p['tokens'][:12]}…")
    for s in res["launch_shapes"]:
        print(f"  {s['name']:28s} {s['kernel']:32s} grid {s['grid']} block {s['block']} smem {s['smem']}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
