"""drvqwen.tokenizer_cache: a model's tokenizer kept in the cache in a faster-loading spelling of
its tokenizer.json. The cached form must build the very same tokenizer (compared field by field
through `to_str` and by encoding thousands of texts: code, unicode, control characters, the
special tokens written out), a damaged file is never used, and a file belongs to one
tokenizer.json and one `tokenizers` version."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers

from drvqwen import tokenizer_cache
from drvqwen.tokenizer import Tokenizer

from helpers import bpe_with_merges_json, byte_tokenizer_json

pytestmark = pytest.mark.usefixtures("private_cache")

SNIPPETS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "#include <vector>\nint main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v[0] != 1;\n}\n",
    "# 计算斐波那契数列\ndef 斐波那契(n):", 'print("🐍🎉 done ✅")  # 👍🏽 👨‍👩‍👧', "café = 'naïve Zürich'",
    "It's what they'll do, I'M sure", "a    b\t\t c\n\n\n   \n\t\n  d   \r\n  ", "12345 67.89e-3",
    "<|im_start|>system\nhi<|im_end|>\n", "<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>", "<|endoftext|>",
    "<tool_call>{\"a\": 1}</tool_call>", "e\u0301 A\u030a", "\x00\x01\x1b[0m\x7f", "Ġ Ċ ĉ",
]


def _texts(tk: tokenizers.Tokenizer, rng: np.random.Generator, n: int) -> list[str]:
    """`n` texts: the snippets, random code points from every plane drvqwen meets (ASCII,
    controls, Latin, CJK, emoji, combining marks), decoded runs of random ids, and mixes."""
    ranges = [(0, 0x20), (0x20, 0x7F), (0x80, 0x250), (0x300, 0x370), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF),
              (0x0600, 0x06FF), (0x3040, 0x30FF)]
    vocab = tk.get_vocab_size(with_added_tokens=True)
    out = list(SNIPPETS)
    while len(out) < n:
        kind = rng.integers(4)
        if kind == 0:
            lo, hi = ranges[rng.integers(len(ranges))]
            out.append("".join(chr(c) for c in rng.integers(lo, hi, rng.integers(1, 40))))
        elif kind == 1:
            out.append(tk.decode([int(i) for i in rng.integers(0, vocab, rng.integers(1, 30))], skip_special_tokens=False))
        elif kind == 2:
            out.append("".join(SNIPPETS[i] for i in rng.integers(0, len(SNIPPETS), rng.integers(1, 5))))
        else:
            out.append(" " * int(rng.integers(0, 9)) + out[int(rng.integers(len(out)))][::-1])
    return out


def _assert_same_tokenizer(text: str, n_texts: int, rng) -> None:
    built = Tokenizer.from_json(text, cache=True)           # no cache file yet: built …
    assert not built.from_cache and built.store_pending
    assert not tokenizer_cache.cache_path(text).exists()
    assert built.store_in_cache()                           # … and stored when asked, once
    assert tokenizer_cache.cache_path(text).is_file()
    assert not built.store_pending and not built.store_in_cache()
    cached = Tokenizer.from_json(text, cache=True)
    assert cached.from_cache
    assert cached.backend.to_str() == built.backend.to_str() == tokenizers.Tokenizer.from_str(text).to_str()
    for t in _texts(built.backend, rng, n_texts):
        for special in (False, True):
            assert cached.encode(t, special=special) == built.encode(t, special=special), (t, special)
    ids = [int(i) for i in rng.integers(0, built.vocab_size, 4000)]
    assert cached.decode(ids) == built.decode(ids)
    assert [cached.token_bytes(i) for i in ids[:500]] == [built.token_bytes(i) for i in ids[:500]]


def test_the_cached_form_is_the_same_tokenizer(rng):
    _assert_same_tokenizer(bpe_with_merges_json(), 3000, rng)


def test_the_cached_real_tokenizer_encodes_every_text_alike(real_nanoqwen, rng):
    text = real_nanoqwen.tokenizer_json
    assert json.loads(text)["model"]["type"] == "BPE"
    _assert_same_tokenizer(text, 3000, rng)


def test_the_cached_form_is_the_faster_spelling():
    text = bpe_with_merges_json()
    doc = json.loads(tokenizer_cache.compact_json(tokenizers.Tokenizer.from_str(text)))
    vocab = list(doc["model"]["vocab"])
    assert vocab == sorted(vocab) and vocab != list(json.loads(text)["model"]["vocab"])
    assert all(isinstance(m, str) and m.count(" ") == 1 for m in doc["model"]["merges"])


def test_merges_with_a_space_keep_the_pair_form():
    from tokenizers import models

    tk = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, " ": 1, "a ": 2}, merges=[("a", " ")]))
    merges = json.loads(tokenizer_cache.compact_json(tk))["model"]["merges"]
    assert merges == [["a", " "]]
    assert tokenizer_cache.store(tk.to_str(), tk)        # still the same tokenizer: cached


def test_a_form_that_builds_another_tokenizer_is_not_stored(monkeypatch):
    text = bpe_with_merges_json()
    other = json.loads(text)
    other["model"]["merges"] = other["model"]["merges"][:-1]          # one merge lost
    monkeypatch.setattr(tokenizer_cache, "compact_json", lambda tk: json.dumps(other))
    tok = Tokenizer.from_json(text, cache=True)
    assert not tok.store_in_cache()
    assert not tok.from_cache and not tokenizer_cache.cache_path(text).exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "header"])
def test_a_damaged_cache_file_is_rebuilt_not_used(damage):
    text = bpe_with_merges_json()
    Tokenizer.from_json(text, cache=True).store_in_cache()
    path = tokenizer_cache.cache_path(text)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw[0:1] = b"0" if raw[0:1] != b"0" else b"1"
    path.write_bytes(bytes(raw))
    assert tokenizer_cache.load(text) is None
    tok = Tokenizer.from_json(text, cache=True)
    assert not tok.from_cache                              # built from the text again …
    assert tok.store_in_cache()
    again = Tokenizer.from_json(text, cache=True)          # … and the file written anew
    assert again.from_cache and again.backend.to_str() == tok.backend.to_str()


def test_a_file_belongs_to_one_json_and_one_tokenizers_version(monkeypatch):
    text = bpe_with_merges_json()
    Tokenizer.from_json(text, cache=True).store_in_cache()
    assert Tokenizer.from_json(text, cache=True).from_cache
    other = byte_tokenizer_json()
    assert tokenizer_cache.cache_path(other) != tokenizer_cache.cache_path(text)
    assert not Tokenizer.from_json(other, cache=True).from_cache
    monkeypatch.setattr(tokenizers, "__version__", tokenizers.__version__ + ".post1")
    assert not Tokenizer.from_json(text, cache=True).from_cache


def test_written_through_a_temporary_name_and_a_rename(monkeypatch):
    from drvqwen import paths

    text = bpe_with_merges_json()
    seen = []
    real = paths.atomic_write_bytes
    monkeypatch.setattr(paths, "atomic_write_bytes", lambda p, data: seen.append(p) or real(p, data))
    assert Tokenizer.from_json(text, cache=True).store_in_cache()
    assert seen == [tokenizer_cache.cache_path(text)]
    assert [p.name for p in seen[0].parent.iterdir()] == [seen[0].name]     # no temporary left


def test_a_cache_that_cannot_be_written_only_costs_the_build(monkeypatch):
    from drvqwen import paths

    def refuse(p, data):
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(paths, "atomic_write_bytes", refuse)
    text = bpe_with_merges_json()
    tok = Tokenizer.from_json(text, cache=True)
    assert not tok.store_in_cache()
    assert not tok.from_cache and tok.encode("def the") == Tokenizer.from_json(text).encode("def the")


def test_an_invalid_json_still_fails_with_one_line():
    from drvqwen.errors import DrvqwenError

    with pytest.raises(DrvqwenError, match="m.nanoqwen: embedded tokenizer.json is invalid"):
        Tokenizer.from_json("{not json", source="m.nanoqwen", cache=True)


def test_a_run_says_where_its_tokenizer_came_from(tmp_path, capsys):
    import dataclasses

    from drvqwen.cli import main

    from helpers import TINY, random_dense, write_model

    cfg = dataclasses.replace(TINY, max_position=256)
    model = tmp_path / "tiny.nanoqwen"
    write_model(model, cfg, random_dense(cfg, np.random.default_rng(5)), tokenizer_json=bpe_with_merges_json())
    seen = []
    for _ in range(2):
        js = tmp_path / "stats.json"
        assert main(["run", "-m", str(model), "--device", "cpu", "-n", "2", "--ignore-eos", "-v",
                     "--json-stats", str(js), "def the"]) == 0
        d = json.loads(js.read_text())
        assert "tokenizer" in d["phases_s"]
        seen.append((d["counts"]["tokenizer_cached"], capsys.readouterr().err))
    assert seen[0][0] == 0 and "load the tokenizer (built from tokenizer.json)" in seen[0][1]
    assert "write the tokenizer's cached form (once)" in seen[0][1]
    assert seen[1][0] == 1 and "load the tokenizer (from the cache)" in seen[1][1]
    assert "cached form" not in seen[1][1]


def test_of_model_writes_the_cached_form_once_and_reads_it_after(tmp_path, monkeypatch):
    """Tokenizer.of_model (serve, step, eval, bench): built from the file's JSON and its form
    written the first time; from the cache the next."""
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.format.synthetic import write_synthetic
    from drvqwen.tokenizer import Tokenizer
    from helpers import TINY, byte_tokenizer_json

    monkeypatch.setenv("DRVQWEN_CACHE", str(tmp_path / "cache"))
    f = NanoqwenFile(write_synthetic(tmp_path / "m.nanoqwen", TINY, seed=1, tokenizer_json=byte_tokenizer_json()))
    first = Tokenizer.of_model(f)
    assert not first.from_cache and not first.store_pending
    second = Tokenizer.of_model(f)
    assert second.from_cache
    text = "def f(x):\n    return x * 2  # ünïcode"
    assert second.encode(text) == first.encode(text)
