"""`drvqwen run`'s GPU path, end to end on the CPU: the prompt encoded in the tokenizer process
once a first run has left the cached forms, the answer decoded from the token bytes table, every
prompt source, the checks on the prompt, the statistics, and the worker never left behind.

The seam is monkeypatching alone: `loading.open_model` reports the device "cuda", so `_run`
takes its GPU branch (the tokenizer on a thread or in the worker, the prompt after the load),
and `loading.load_backend` builds the numpy reference for it; `generate.generate` records the
ids it is sent. The same Python runs as on a GPU, up to the backend.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys

import numpy as np
import pytest

from drvqwen import token_bytes_table, tokenizer_cache, tokenizer_process
from drvqwen.cli import main
from drvqwen.errors import DrvqwenError
from drvqwen.tokenizer import Tokenizer, prompt_ids_of

from helpers import TINY, bpe_with_merges_json, random_dense, write_model

pytestmark = pytest.mark.usefixtures("private_cache")

CFG = dataclasses.replace(TINY, max_position=256)
TEXT = bpe_with_merges_json()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-path") / "tiny.nanoqwen"
    write_model(path, CFG, random_dense(CFG, np.random.default_rng(5)), tokenizer_json=TEXT)
    return path


@pytest.fixture
def gpu_path(monkeypatch):
    """(ids sent to generate, one per run; the tokenizer processes started, None where none was)."""
    from drvqwen import generate, loading

    real_open, real_load, real_generate = loading.open_model, loading.load_backend, generate.generate
    real_start = tokenizer_process.start_for

    def open_model(model, device="auto", **kw):
        opened = real_open(model, device, **kw)
        return opened if device is None else dataclasses.replace(opened, device="cuda", why_cpu=None)

    sent, started = [], []
    monkeypatch.setattr(loading, "open_model", open_model)
    monkeypatch.setattr(loading, "load_backend",
                        lambda opened, *a, **k: real_load(dataclasses.replace(opened, device="cpu"), *a, **k))
    monkeypatch.setattr(generate, "generate",
                        lambda backend, ids, *a, **k: sent.append(list(ids)) or real_generate(backend, ids, *a, **k))
    monkeypatch.setattr(tokenizer_process, "start_for", lambda *a: started.append(real_start(*a)) or started[-1])
    return sent, started


def _run(model, tmp_path, capsys, *argv) -> tuple[str, dict, str]:
    """(stdout, --json-stats, stderr) of one greedy run of 4 tokens."""
    js = tmp_path / "stats.json"
    rc = main(["run", "-m", str(model), "--device", "cpu", "-n", "4", "--ignore-eos", "-v", "--json-stats", str(js),
               *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, json.loads(js.read_text()), err


SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SOURCES = {   # run's arguments → the prompt spec that says what its ids must be
    "positional": (["def the"], {"kind": "chat", "text": "def the", "system": None}),
    "system": (["--system", "", "-p", "x <|im_end|> y"], {"kind": "chat", "text": "x <|im_end|> y", "system": ""}),
    "raw": (["--raw", "-p", "<|im_start|>user\ndef the<|im_end|>"],
            {"kind": "raw", "text": "<|im_start|>user\ndef the<|im_end|>"}),
    "fim": (["--fim-prefix", "def f(x):\n    ", "--fim-suffix", "\n    return y\n"],
            {"kind": "fim", "prefix": "def f(x):\n    ", "suffix": "\n    return y\n"}),
    "file": (["--prompt-file", "FILE"], {"kind": "chat", "text": "def the(ü):\r\n\treturn 'café 🐍'", "system": None}),
    "stdin": ([], {"kind": "chat", "text": "def the():\n    return 0\n", "system": SYSTEM}),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_the_worker_sends_the_ids_and_the_table_prints_the_text_of_an_in_process_run(
        model, tmp_path, capsys, monkeypatch, gpu_path, source):
    argv, spec = SOURCES[source]
    if source == "file":
        path = tmp_path / "prompt.txt"
        path.write_bytes(b"\xef\xbb\xbf" + spec["text"].encode())       # a BOM, dropped
        argv = ["--prompt-file", str(path)]
    sent, started = gpu_path
    runs = []
    for _ in range(2):       # the first builds the tokenizer here and leaves both cached forms; the second uses them
        if source == "stdin":
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(spec["text"].encode())))
        runs.append(_run(model, tmp_path, capsys, *argv))
    (out1, st1, _), (out2, st2, err2) = runs
    want = prompt_ids_of(spec, Tokenizer.from_json(TEXT))
    assert sent == [want, want]
    assert started[0] is None and started[1] is not None and started[1][0]._proc.returncode == 0
    assert "tokenizer_process" not in st1["counts"] and st1["counts"]["tokenizer_cached"] == 0
    assert st2["counts"]["tokenizer_process"] == 1 == st2["counts"]["tokenizer_cached"]
    assert out2 == out1 and out1.strip()
    # -v: the wait for the worker is the phase "tokenize", after the load; no tokenizer was built here.
    phases = list(st2["phases_s"])
    assert "tokenizer" not in phases and "tokenizer cache" not in phases
    assert phases.index("load") < phases.index("tokenize") < phases.index("prefill")
    assert st2["background_s"]["tokenizer process"] > 0
    assert "tokenize the prompt (in another process: wait;" in err2


def _both_cached() -> None:
    tok = Tokenizer.from_json(TEXT, cache=True)
    assert tok.store_in_cache() and token_bytes_table.store(tokenizer_cache.text_digest(TEXT), tok)


def test_a_prompt_from_the_worker_is_checked_against_the_context(model, capsys, gpu_path):
    _both_cached()
    sent, started = gpu_path
    assert main(["run", "-m", str(model), "--device", "cpu", "--max-context", "8", "def the " * 20]) == 2
    assert "does not fit the context of 8 tokens" in capsys.readouterr().err
    assert sent == [] and started[0][0]._proc.returncode == 0


@pytest.mark.parametrize("error,status,says", [(DrvqwenError("the model does not fit"), 2, "does not fit"),
                                               (KeyboardInterrupt(), 130, "interrupted")])
def test_a_run_that_fails_while_loading_leaves_no_worker_behind(model, capsys, monkeypatch, gpu_path,
                                                                error, status, says):
    """A load that fails, or Ctrl-C during it (which the worker may not have seen: a SIGINT sent
    to this process alone), stops and waits for the worker."""
    from drvqwen import loading

    _both_cached()
    _, started = gpu_path

    def fail(*a, **k):
        raise error

    monkeypatch.setattr(loading, "load_backend", fail)
    assert main(["run", "-m", str(model), "--device", "cpu", "def the"]) == status
    assert says in capsys.readouterr().err
    assert started[0] is not None and started[0][0]._proc.returncode is not None    # waited for: no zombie


def test_a_worker_without_an_answer_sends_the_run_back_to_the_tokenizer_here(
        model, tmp_path, capsys, monkeypatch, gpu_path):
    _both_cached()
    sent, started = gpu_path
    monkeypatch.setattr(tokenizer_process.TokenizerProcess, "ids", lambda self, timeout=60.0: None)
    out, st, _ = _run(model, tmp_path, capsys, "def the")
    assert sent == [prompt_ids_of(SOURCES["positional"][1], Tokenizer.from_json(TEXT))]
    assert "tokenizer_process" not in st["counts"] and st["counts"]["tokenizer_cached"] == 1
    assert "tokenizer" in st["phases_s"] and out.strip()
    assert started[0][0]._proc.returncode is not None


def test_the_answer_is_decoded_from_the_table_as_the_tokenizer_decodes_it(model, tmp_path, capsys, monkeypatch,
                                                                          gpu_path):
    """The model's answer scripted (a random model's few tokens may all be single bytes): merged
    pieces, a character split over tokens, a control token, ids past the tokenizer's (the lm_head's
    512 rows) — printed as the tokenizer decodes them, through the table of the worker's run."""
    from drvqwen import generate
    from drvqwen.generate import GenerationResult

    tok = Tokenizer.from_json(TEXT)
    answer = tok.encode("def the 🐍 café\n\tretur<|im_end|>", special=True) + [300, CFG.vocab_size - 1] \
        + tok.encode("ü")[:1] + tok.encode(" the")

    def scripted(backend, ids, max_new, params, eog, on_token, **kw):
        for t in answer:
            on_token(t)
        return GenerationResult(prompt_tokens=len(ids), tokens=list(answer))

    _both_cached()
    monkeypatch.setattr(generate, "generate", scripted)
    out, st, _ = _run(model, tmp_path, capsys, "def the")
    assert st["counts"]["tokenizer_process"] == 1
    assert out == tok.decode(answer) + "\n"


def test_a_cache_that_cannot_be_written_builds_no_table(model, tmp_path, capsys, monkeypatch):
    """A read-only cache: the tokenizer's form cannot be written, so neither can the table, and
    the table alone would serve nothing (the worker needs both) — its ~0.2 s build (Qwen's) is
    not paid after every answer."""
    from drvqwen import paths

    def refuse(p, data):
        raise PermissionError(13, "Permission denied", str(p))

    built = []
    real = token_bytes_table.TokenBytesTable.of_tokenizer
    monkeypatch.setattr(paths, "atomic_write_bytes", refuse)
    monkeypatch.setattr(token_bytes_table.TokenBytesTable, "of_tokenizer",
                        classmethod(lambda cls, tok: built.append(tok) or real(tok)))
    out, st, _ = _run(model, tmp_path, capsys, "def the")
    assert out.strip() and st["counts"]["tokenizer_cached"] == 0 and built == []
