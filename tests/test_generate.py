"""The generation loop's host-side logic with a fake backend: stop tokens, the context cap,
prompt checks, and the step-indexed random numbers."""

import numpy as np
import pytest

from drvqwen.errors import DrvqwenError
from drvqwen.generate import HostSampling, generate
from drvqwen.sampler import SamplingParams


class ScriptedBackend(HostSampling):
    """Returns logits whose argmax follows a script; records what it was fed."""

    name = "scripted"

    def __init__(self, script, vocab=50, max_context=100):
        self.script, self.vocab, self.max_context = list(script), vocab, max_context
        self.fed: list[int] = []
        self.prefills = 0

    def _logits(self):
        i = len(self.fed) - self.n_prompt
        z = np.zeros(self.vocab, np.float32)
        z[self.script[i % len(self.script)]] = 10.0
        return z

    def prefill(self, ids):
        self.prefills += 1
        self.fed = list(ids)
        self.n_prompt = len(ids)
        return self._logits()

    def decode(self, tok):
        self.fed.append(tok)
        return self._logits()

    def reset(self):
        self.fed = []


def test_stops_on_stop_token_unless_ignored():
    b = ScriptedBackend([5, 6, 7, 1, 8])
    r = generate(b, [3, 4], 10, stop_ids=frozenset({1}))
    assert r.tokens == [5, 6, 7] and r.stopped_by == "stop token"
    b = ScriptedBackend([5, 6, 7, 1, 8])
    r = generate(b, [3, 4], 10, stop_ids=frozenset({1}), ignore_stop=True)
    assert r.tokens == [5, 6, 7, 1, 8, 5, 6, 7, 1, 8] and r.stopped_by == "max_new_tokens"
    # The backend saw each chosen token except the last, in order, after the prompt.
    assert b.fed == [3, 4] + r.tokens[:-1]


def test_capped_by_context():
    b = ScriptedBackend([2], max_context=10)
    r = generate(b, list(range(7)), 100)
    assert len(r.tokens) == 3           # 7 prompt + 3 generated = the context of 10
    assert r.stopped_by == "context full"
    # Exactly max_new_tokens fit: the user's limit is what ended it.
    r = generate(ScriptedBackend([2], max_context=10), list(range(7)), 3)
    assert len(r.tokens) == 3 and r.stopped_by == "max_new_tokens"
    # A stop token on the last position that fits is a stop token.
    r = generate(ScriptedBackend([2, 2, 1], max_context=10), list(range(7)), 100, stop_ids=frozenset({1}))
    assert r.tokens == [2, 2] and r.stopped_by == "stop token"


def test_summary_never_shows_an_unmeasured_rate():
    for n_new in (0, 1, 2, 5):
        r = generate(ScriptedBackend([2]), [3, 4], n_new)
        line = r.summary()
        assert "nan" not in line.lower() and f"generated {n_new} (max_new_tokens)" in line
        assert ("TTFT" in line) == (n_new >= 1)
        assert ("decode" in line) == (n_new >= 2)


def test_max_context_rule():
    from drvqwen.generate import resolve_max_context

    assert resolve_max_context(0, 64) == 64 and resolve_max_context(None, 64) == 64
    assert resolve_max_context(10, 64) == 10 and resolve_max_context(64, 64) == 64
    for bad in (65, 100, -1):
        with pytest.raises(DrvqwenError, match=rf"--max-context={bad}: must be 0 or in \[1, 64\] \(the model's "
                                               rf"max_position; 0 = all of it\)$"):
            resolve_max_context(bad, 64)
    # chat's 0 is its own default, and its message says which
    assert resolve_max_context(0, 64, default=32) == 32 and resolve_max_context(5, 64, default=32) == 5
    with pytest.raises(DrvqwenError, match=r"--max-context=-5: .*0 = 32\)$"):
        resolve_max_context(-5, 64, default=32)


def test_prompt_checks():
    with pytest.raises(DrvqwenError, match="does not fit"):
        generate(ScriptedBackend([1], max_context=8), list(range(8)), 4)
    with pytest.raises(DrvqwenError, match="empty"):
        generate(ScriptedBackend([1]), [], 4)


def test_sampling_is_reproducible():
    class Flat(ScriptedBackend):
        def _logits(self):
            return np.zeros(self.vocab, np.float32)

    p = SamplingParams(temperature=1.0, seed=11)
    a = generate(Flat([0]), [1], 30, p).tokens
    assert a == generate(Flat([0]), [1], 30, p).tokens
    assert a != generate(Flat([0]), [1], 30, SamplingParams(temperature=1.0, seed=12)).tokens
    assert len(set(a)) > 10


def test_both_backends_implement_the_backend_protocol():
    """Every member `generate.Backend` names is on CPUBackend and engine.GPUBackend (read from
    the classes and their __init__, so no GPU is needed), with the same call shapes: callers
    use them directly, without hasattr."""
    import ast
    import inspect
    import textwrap

    from drvqwen.engine import GPUBackend
    from drvqwen.generate import Backend, CPUBackend

    members = {n for n in vars(Backend) if not n.startswith("_")} | set(Backend.__annotations__)
    assert {"token_stream", "prefill", "decode", "cached_ids", "reset", "close", "decode_mode",
            "last_reused", "name", "max_context"} <= members
    for cls in (CPUBackend, GPUBackend):
        init = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
        assigned = {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Attribute)}
        assert sorted(m for m in members if not hasattr(cls, m) and m not in assigned) == [], cls.__name__
        for name in ("token_stream", "prefill", "decode", "cached_ids", "reset", "close"):
            want = [p for p in inspect.signature(getattr(Backend, name)).parameters]
            got = [p for p in inspect.signature(getattr(cls, name)).parameters]
            assert got[:len(want)] == want, (cls.__name__, name, got)
