"""Helpers for the server tests: a tiny model served on a free loopback port, `drvqwen run`'s
text for the same options, a backend slowed down so a generation is still running when the
test acts on it, the check that no KV page leaked, a backend that answers a scripted text, and
the /infill bodies llama.vim sends."""

from __future__ import annotations

import time

import numpy as np

from helpers import TINY, byte_tokenizer_json, random_dense, write_model


def write_tiny(path, seed: int = 1):
    """A TINY model with the byte-level tokenizer (any text encodes) at `path`."""
    write_model(path, TINY, random_dense(TINY, np.random.default_rng(seed)), tokenizer_json=byte_tokenizer_json())
    return path


def run_text(capsys, model, *args: str) -> str:
    """stdout of `drvqwen run --device cpu --no-verify` with `args`, without run's final newline."""
    from drvqwen.cli import main

    capsys.readouterr()
    rc = main(["run", "--model", str(model), "--device", "cpu", "--no-verify", *args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.endswith("\n")
    return out.out[:-1]


def slow_down(worker, seconds: float):
    """Make every decode step of the worker's CPU backend take `seconds` longer; returns undo()."""
    backend = worker.model.backend
    decode = backend.decode

    def slow(token):
        time.sleep(seconds)
        return decode(token)

    backend.decode = slow
    return lambda: setattr(backend, "decode", decode)


def wait_idle(worker, timeout_s: float = 20.0) -> None:
    """Wait until the worker runs nothing and nothing waits."""
    end = time.monotonic() + timeout_s
    while worker.busy or worker.queue_length():
        assert time.monotonic() < end, "the worker did not become idle"
        time.sleep(0.01)


def assert_no_page_leaked(url: str) -> dict:
    """/health, checked: the KV pages in use are exactly those of the sequence the server keeps
    cached for the next request (`tokens_cached` positions), none held by a request that ended."""
    import httpx

    from drvqwen.kv_cache import n_pages_for

    h = httpx.get(url + "/health").json()
    assert h["kv_pages_total"] - h["kv_pages_free"] == n_pages_for(h["tokens_cached"]), h
    return h


def script_answer(worker, text: str, delay_s: float = 0.0):
    """Make the worker's CPU backend answer `text`, then an end-of-generation token, whatever the
    prompt and the sampling: every step's logits are -inf but for the next scripted id (the
    sampler can choose nothing else). Each prefill and decode step takes `delay_s` longer.
    Returns undo()."""
    m = worker.model
    backend = m.backend
    ids = m.tokenizer.encode(text) + [min(m.eog_ids)]
    prefill, decode = backend.prefill, backend.decode
    vocab = backend.config.vocab_size
    at = [0]

    def next_logits():
        out = np.full(vocab, -np.inf, np.float32)
        out[ids[min(at[0], len(ids) - 1)]] = 0.0
        at[0] += 1
        time.sleep(delay_s)
        return out

    def scripted_prefill(prompt_ids, reuse=False):
        at[0] = 0
        return next_logits()

    backend.prefill = scripted_prefill
    backend.decode = lambda token: next_logits()

    def undo():
        backend.prefill, backend.decode = prefill, decode

    return undo


# llama.vim (github.com/ggml-org/llama.vim, autoload/llama.vim): the fields its response_fields
# asks for, and the bodies it POSTs to /infill.
LLAMA_VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                    "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                    "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                    "tokens_cached"]


def llama_vim_chunk(lines: list[str], filename: str) -> dict:
    """One ring-buffer chunk of extra context as llama.vim sends it (`s:ring_get_extra`): the
    lines joined and ended with a newline, the file's name, and when it was picked (reltime())."""
    return {"text": "\n".join(lines) + "\n", "time": [1733061234, 512345], "filename": filename}


def llama_vim_fim_body(lines: list[str], pos_y: int, pos_x: int, extra: list[dict] = (), *,
                       n_prefix: int = 256, n_suffix: int = 64, n_predict: int = 128,
                       t_max_predict_ms: int = 1000) -> dict:
    """The body of llama.vim's `llama#fim` for the cursor at line `pos_y` (1-based) and column
    `pos_x` (0-based, bytes) of a buffer holding `lines` (`s:fim_ctx_local` with no previous
    suggestion): up to n_prefix lines above as input_prefix, the current line left of the cursor
    as prompt, its rest and up to n_suffix lines below as input_suffix, the current line's
    indentation as n_indent (0 on a blank line, whose text is then left out)."""
    cur = lines[pos_y - 1]
    cur_prefix, cur_suffix = cur[:pos_x], cur[pos_x:]
    above = lines[max(1, pos_y - n_prefix) - 1: pos_y - 1]
    below = lines[pos_y: min(len(lines), pos_y + n_suffix)]
    if not cur.strip():
        indent, cur_prefix, cur_suffix = 0, "", ""
    else:
        indent = len(cur) - len(cur.lstrip(" \t"))
    return {"id_slot": 0, "input_prefix": "\n".join(above) + "\n",
            "input_suffix": cur_suffix + "\n" + "\n".join(below) + "\n",
            "input_extra": list(extra), "prompt": cur_prefix, "n_predict": n_predict, "stop": [], "n_indent": indent,
            "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False,
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": t_max_predict_ms,
            "response_fields": list(LLAMA_VIM_FIELDS)}


def llama_vim_ring_body(extra: list[dict]) -> dict:
    """llama.vim's `s:ring_update` request: the extra context alone, nothing to generate, sent as
    the cursor moves so that the server has the chunks in its cache before the next /infill."""
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": list(extra), "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}


def python_source(n_lines: int) -> list[str]:
    """`n_lines` lines of plausible Python: small functions with an indented body."""
    out: list[str] = []
    i = 0
    while len(out) < n_lines:
        out += [f"def step_{i}(a, b):", f'    """Return step {i} of the walk."""', f"    x = a + b * {i}",
                "    return x - 1", ""]
        i += 1
    return out[:n_lines]
