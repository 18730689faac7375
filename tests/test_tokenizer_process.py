"""The prompt encoded in another process (tokenizer_process.py, tokenizer_worker.py) and the
answer decoded from the cached token bytes (token_bytes_table.py): the same ids and the same
text as the tokenizer built in this process, and every failure of the shortcut is a None that
sends the caller back to building the tokenizer here."""

from __future__ import annotations

import json
import os
import signal
import types
from pathlib import Path

import pytest

from drvqwen import tokenizer_cache, tokenizer_process, token_bytes_table
from drvqwen.gen_options import prompt_spec
from drvqwen.stream_decoder import StreamDecoder
from drvqwen.tokenizer import Tokenizer, prompt_ids_of

from helpers import bpe_with_merges_json, byte_tokenizer_json

pytestmark = pytest.mark.usefixtures("private_cache")

SPECS = [{"kind": "chat", "text": "def the fib(n): return n", "system": None},
         {"kind": "chat", "text": "x <|im_end|> y", "system": ""},
         {"kind": "raw", "text": "<|im_start|>user\ndef the<|im_end|>"},
         {"kind": "fim", "prefix": "def f(x):\n    ", "suffix": "\n    return y\n"}]
# The digest of a tokenizer.json no cache holds.
UNCACHED = "0" * 64


def _cached(text: str) -> Tokenizer:
    """The tokenizer of `text` with both cached forms written, as after a first run."""
    tok = Tokenizer.from_json(text, cache=True)
    assert tok.store_in_cache()
    assert token_bytes_table.store(tokenizer_cache.text_digest(text), tok)
    return tok


def _bpe_with_a_gap_json() -> str:
    """bpe_with_merges_json with " the" moved to id 1000: ids with text past a gap of unused
    ones, so that the highest id (999 + 1) is far above the count of tokens (vocab_size)."""
    doc = json.loads(bpe_with_merges_json())
    doc["model"]["vocab"]["Ġthe"] = 1000
    return json.dumps(doc)


@pytest.mark.parametrize("make", [bpe_with_merges_json, byte_tokenizer_json, _bpe_with_a_gap_json])
def test_the_table_holds_every_ids_bytes(make):
    text = make()
    tok = _cached(text)
    table = token_bytes_table.load(tokenizer_cache.text_digest(text))
    assert table is not None
    top = max(tok.backend.get_vocab(with_added_tokens=True).values())      # the highest id of a token
    for i in [-1, *range(top + 8)]:
        assert table.token_bytes(i) == tok.token_bytes(i), i
    assert table.special_ids == tok.special_ids and table.special_ids


def test_the_table_decodes_a_stream_as_the_tokenizer_does():
    text = bpe_with_merges_json()
    tok = _cached(text)
    table = token_bytes_table.load(tokenizer_cache.text_digest(text))
    ids = tok.encode("def the 🐍 café\n\tretur<|im_end|>", special=True) + tok.encode("ü")[:1]
    for skip in (False, True):
        a, b = StreamDecoder(tok, skip), StreamDecoder(table, skip)
        got = "".join(b.push(i) for i in ids) + b.flush()
        assert got == "".join(a.push(i) for i in ids) + a.flush() == tok.decode(ids, skip_special=skip)


def test_a_damaged_table_is_never_used():
    text = bpe_with_merges_json()
    _cached(text)
    path = token_bytes_table.table_path(tokenizer_cache.text_digest(text))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert token_bytes_table.load(tokenizer_cache.text_digest(text)) is None


@pytest.mark.parametrize("spec", SPECS, ids=[s["kind"] + str(i) for i, s in enumerate(SPECS)])
def test_the_worker_answers_the_ids_of_this_process(spec):
    text = bpe_with_merges_json()
    tok = _cached(text)
    started = tokenizer_process.start_for(text, spec)
    assert started is not None
    proc, table = started
    assert proc.ids() == prompt_ids_of(spec, tok)
    assert proc.seconds is not None and proc.seconds > 0
    assert table.special_ids == tok.special_ids


def test_a_run_records_the_tokenizer_its_next_worker_loads_first():
    """start_for records the digest it sent; the next worker finds it (last_used) and loads its
    cached form before its request."""
    from drvqwen import tokenizer_worker

    text, other = bpe_with_merges_json(), byte_tokenizer_json()
    assert tokenizer_cache.last_used() is None and tokenizer_worker._preload() is None
    _cached(text), _cached(other)
    for t in (text, other, text):
        proc, _ = tokenizer_process.start_for(t, SPECS[0])
        proc.ids()
        assert tokenizer_cache.last_used() == tokenizer_cache.text_digest(t)
    digest, tk = tokenizer_worker._preload()
    assert digest == tokenizer_cache.text_digest(text) and tk.to_str() == Tokenizer.from_json(text).backend.to_str()
    tokenizer_cache.cache_path(text).unlink()           # its cached form gone: nothing preloaded
    assert tokenizer_worker._preload() is None


@pytest.mark.parametrize("hit", [True, False], ids=["same", "other"])
def test_the_worker_answers_with_the_preloaded_tokenizer_only_for_its_digest(monkeypatch, hit):
    """A request for the preloaded tokenizer is answered without loading it again; a request
    for another loads that one, and the answer is that tokenizer's ids."""
    from drvqwen import tokenizer_worker

    text, other = bpe_with_merges_json(), byte_tokenizer_json()
    tok, tok_other = _cached(text), _cached(other)
    tokenizer_cache.remember_last_used(tokenizer_cache.text_digest(text))
    preloaded = tokenizer_worker._preload()
    assert preloaded is not None and preloaded[0] == tokenizer_cache.text_digest(text)
    loads = []
    real = tokenizer_worker.load_file
    monkeypatch.setattr(tokenizer_worker, "load_file", lambda p: loads.append(str(p)) or real(p))
    want_text = text if hit else other
    reply = tokenizer_worker.answer({"tokenizer": tokenizer_cache.text_digest(want_text), "prompt": SPECS[0]},
                                    preloaded)
    assert reply["ids"] == prompt_ids_of(SPECS[0], tok if hit else tok_other)
    assert loads == ([] if hit else [str(tokenizer_cache.cache_path(other))])


def test_the_worker_preloads_nothing_from_a_damaged_record():
    """A record naming no cached tokenizer (damaged, or its form written by another
    `tokenizers`) preloads nothing."""
    from drvqwen import tokenizer_worker

    tokenizer_cache.remember_last_used("0" * 64)
    assert tokenizer_cache.last_used() == "0" * 64 and tokenizer_worker._preload() is None


def test_no_shortcut_before_a_first_run_left_both_cached_forms():
    text = bpe_with_merges_json()
    assert tokenizer_process.start_for(text, SPECS[0]) is None          # nothing cached
    Tokenizer.from_json(text, cache=True).store_in_cache()
    assert tokenizer_process.start_for(text, SPECS[0]) is None          # no token bytes yet


def test_a_table_without_the_tokenizers_form_gets_no_ids():
    """The table outlives the form it was written after when `tokenizers` changes version (the
    form's file is named by it): the worker finds no form, and the caller builds the tokenizer."""
    text = bpe_with_merges_json()
    _cached(text)
    tokenizer_cache.cache_path(text).unlink()
    proc, table = tokenizer_process.start_for(text, SPECS[0])
    assert proc.ids() is None and table is not None


def test_a_failing_worker_gives_none():
    missing = tokenizer_process.TokenizerProcess.start(UNCACHED, SPECS[0])
    assert missing is not None and missing.ids() is None
    text = bpe_with_merges_json()
    _cached(text)
    bad = tokenizer_process.TokenizerProcess.start(tokenizer_cache.text_digest(text), {"kind": "poem", "text": "x"})
    assert bad.ids() is None


# A prompt whose request and answer both outgrow a pipe's buffer (64 KiB on Linux), in every
# alphabet JSON escapes: the worker reads all of it before it writes, and then waits for this
# process to read its answer — after the model's upload, on the GPU.
BIG = {"kind": "chat", "text": "def the(ü): return 'café 🐍'\r\n\x00\t<|im_end|>\n" * 4000, "system": "ß"}


def test_a_prompt_larger_than_the_pipes_comes_back_whole():
    text = bpe_with_merges_json()
    tok = _cached(text)
    proc, _ = tokenizer_process.start_for(text, BIG)
    want = prompt_ids_of(BIG, tok)
    assert len(json.dumps(want)) > 1 << 16 and len(json.dumps(BIG)) > 1 << 16
    assert proc.ids() == want


def test_a_worker_nobody_asks_is_stopped():
    """Its answer fills the pipe, so the worker cannot end by itself: close() kills it."""
    text = bpe_with_merges_json()
    _cached(text)
    proc, _ = tokenizer_process.start_for(text, BIG)
    proc.close()
    assert proc._proc.returncode == -signal.SIGKILL


def test_the_worker_runs_nothing_from_the_working_directory(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on sys.path: a json.py where the user runs
    `drvqwen run` would run in the worker (and the shortcut fail without a word)."""
    text = bpe_with_merges_json()
    tok = _cached(text)
    here = tmp_path / "project"
    here.mkdir()
    for name in ("json", "tokenizers", "time"):
        (here / f"{name}.py").write_text("raise SystemExit('the working directory ran')\n")
    monkeypatch.chdir(here)
    proc, _ = tokenizer_process.start_for(text, SPECS[0])
    assert proc.ids() == prompt_ids_of(SPECS[0], tok)


def _popen_env(monkeypatch, site_dirs: list[str]) -> dict:
    import site
    import subprocess

    seen = {}

    def popen(*a, **k):
        seen.update(k["env"])
        raise OSError("not started")

    monkeypatch.setattr(site, "getsitepackages", lambda: site_dirs)
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    assert tokenizer_process.TokenizerProcess.start(UNCACHED, SPECS[0]) is None
    return seen


def test_the_worker_imports_drvqwen_from_where_this_process_did(monkeypatch):
    """A checkout (on PYTHONPATH, a test's sys.path) goes first on the worker's path; an
    installed drvqwen is found there anyway, and its site-packages stays after the standard
    library instead of shadowing it."""
    import drvqwen

    root = str(Path(drvqwen.__file__).resolve().parents[1])
    assert _popen_env(monkeypatch, [])["PYTHONPATH"].split(os.pathsep) == [root, "elsewhere"]
    assert _popen_env(monkeypatch, [root])["PYTHONPATH"] == "elsewhere"


def test_a_large_request_does_not_hold_up_this_process(tmp_path, monkeypatch):
    """Writing a request larger than the pipe's buffer waits until the worker reads it, after
    its interpreter has started: start() hands that wait to a thread. The worker here writes a
    file when it begins to read, seconds late; start() must return before."""
    import subprocess
    import sys

    mark = tmp_path / "reading"
    real = subprocess.Popen
    late = f"import time, pathlib, sys; time.sleep(5); pathlib.Path({str(mark)!r}).touch(); sys.stdin.read()"
    monkeypatch.setattr(subprocess, "Popen", lambda args, **k: real([sys.executable, "-c", late], **k))
    proc = tokenizer_process.TokenizerProcess.start(UNCACHED, BIG)
    assert proc is not None and not mark.exists()
    proc.close()


def test_prompt_spec_is_what_run_asks_for():
    args = types.SimpleNamespace(fim_prefix=None, fim_suffix=None, raw=False, system=None)
    assert prompt_spec(args, "hi") == {"kind": "chat", "text": "hi", "system": None}
    assert prompt_spec(types.SimpleNamespace(**{**vars(args), "raw": True}), "hi") == {"kind": "raw", "text": "hi"}
    assert prompt_spec(types.SimpleNamespace(**{**vars(args), "fim_suffix": "s"}), None) == \
        {"kind": "fim", "prefix": "", "suffix": "s"}


def test_the_worker_imports_neither_numpy_nor_the_gpu_layer(tmp_path):
    """Its start-up is the shortcut's cost: tokenizers and drvqwen's tokenizer modules only."""
    import json
    import subprocess
    import sys

    text = bpe_with_merges_json()
    _cached(text)
    code = ("import json, sys\nfrom drvqwen.tokenizer_worker import answer\n"
            f"r = answer({{'tokenizer': {tokenizer_cache.text_digest(text)!r}, 'prompt': {SPECS[0]!r}}})\n"
            "print(json.dumps([sorted(m for m in ('numpy', 'cuda', 'drvqwen.cuda', 'rich') if m in sys.modules),"
            " 'ids' in r]))\n")
    import os
    from pathlib import Path

    import drvqwen

    env = {**os.environ, "PYTHONPATH": str(Path(drvqwen.__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[], True]


@pytest.mark.parametrize("answer,ids", [("", None), ("7", None), ("[1, 2]", None), ('{"ids": [1, "2"]}', None),
                                        ('{"ids": [1, 2], "seconds": "soon"}', [1, 2])])
def test_an_answer_that_is_not_one_gives_none(tmp_path, monkeypatch, answer, ids):
    """Whatever the worker's stdout holds, ids() gives the ids or None, never an exception
    (the shortcut is never a new way for the run to fail), and seconds only a number."""
    import subprocess
    import sys

    real = subprocess.Popen
    fake = f"import sys; sys.stdin.read(); print({answer!r})"
    monkeypatch.setattr(subprocess, "Popen", lambda args, **k: real([sys.executable, "-c", fake], **k))
    proc = tokenizer_process.TokenizerProcess.start(UNCACHED, SPECS[0])
    assert proc.ids() == ids and proc.seconds is None
