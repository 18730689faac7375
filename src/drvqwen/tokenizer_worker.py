"""`python -m drvqwen.tokenizer_worker`: encode one prompt in a process of its own
(tokenizer_process.py starts it and reads its answer).

It imports what the answer needs first (`tokenizers` and drvqwen's tokenizer modules: no numpy,
no GPU), and only then reads its request: started at the entry point of `drvqwen run`, it does
its imports while that process does its own, and then waits. The request is one JSON line on
stdin — {"tokenizer": the sha256 of the tokenizer.json, "prompt": a prompt spec
(gen_options.prompt_spec)}; it loads the tokenizer from its cache file
(tokenizer_cache.digest_path: named by this process's `tokenizers` version) and writes one JSON line
to stdout: {"ids": [...], "seconds": time from the request to the answer}, or {"error": "one line"}
when the file is missing or damaged or the spec is bad. Then it exits. End of input before a
request (the command needed no worker after all, or died) ends it, writing nothing.

Before it reads the request, it loads the cached form of the tokenizer the last run used
(tokenizer_cache.last_used): loading Qwen's tokenizer takes a few hundred milliseconds, and the
request only comes once the other process has its model open, so the load would otherwise
start that late and finish after the weights are on the GPU. Every Qwen2.5-Coder model has the
same tokenizer, so the guess is right unless the run's model family changed; then the requested
one is loaded once the request comes ("seconds" counts only the time after the request).
"""

from __future__ import annotations

import json
import os
import sys
import time

from .errors import DrvqwenError
from .tokenizer import Tokenizer, prompt_ids_of
from .tokenizer_cache import digest_path, last_used, load_file


def answer(request: dict, preloaded: tuple[str, object] | None = None) -> dict:
    """The reply to one request (module doc); `preloaded` = (tokenizer.json digest, its
    tokenizer) loaded before the request came."""
    return _answer(request, preloaded)[0]


def _preload() -> tuple[str, object] | None:
    """(the last used tokenizer's digest, its tokenizer from the cache), or None when none was
    recorded, or its cached form is missing or damaged."""
    try:
        digest = last_used()
        tk = load_file(digest_path(digest)) if digest is not None else None
    except DrvqwenError:         # no cache root
        return None
    return None if tk is None else (digest, tk)


def _answer(request: dict, preloaded: tuple[str, object] | None = None) -> tuple[dict, object]:
    """(the reply, the tokenizer it used or None)."""
    t0 = time.perf_counter()
    digest = str(request["tokenizer"])
    path = digest_path(digest)
    tk = preloaded[1] if preloaded is not None and preloaded[0] == digest else load_file(path)
    if tk is None:
        return {"error": f"{path}: no usable cached tokenizer"}, None
    try:
        ids = prompt_ids_of(request["prompt"], Tokenizer(tk, source=str(path)))
    except DrvqwenError as e:
        return {"error": str(e)}, tk
    return {"ids": ids, "seconds": time.perf_counter() - t0}, tk


def main() -> None:
    preloaded = _preload()
    line = sys.stdin.readline()
    if not line:                 # EOF: no request will come
        os._exit(0)
    try:
        reply, tokenizer = _answer(json.loads(line), preloaded)     # held, never freed (below)
    except (ValueError, KeyError, TypeError, DrvqwenError) as e:   # DrvqwenError: no cache root
        reply, tokenizer = {"error": f"bad request ({type(e).__name__}: {e})"}, None
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    # The caller waits for this process's exit after the answer: freeing Qwen's tokenizer
    # (tens of milliseconds) and the interpreter's teardown would be on its wait, so the
    # process leaves without them, `tokenizer` still held.
    os._exit(0)


if __name__ == "__main__":
    main()
