"""`drvqwen step` on the GPU: a whole decode step launch by launch, every output against the
reference computed from that launch's own inputs (reference_steps.py, the kernel tests' bounds).

- the real Qwen2.5-Coder-0.5B-Instruct (`real_nanoqwen`) and a synthetic model of its shape:
  a prompt, a few launches with details, `until lm_head`, `token` — every launch ok, the
  greedy token equal to the argmax of the step's own logits;
- a step at a position that opens a KV page (eager: its page reserved and written in the
  device block table first) is ok too, `kv` and `graph` name the graph that replays there, and
  `gen` replays both graphs (the counts it prints), continuing the sequence the eager steps
  left.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from rich.console import Console

from drvqwen.config import QWEN25_CODER_05B
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.synthetic import minimal_tokenizer_json, write_synthetic
from drvqwen.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("syn") / "0.5b.nanoqwen"
    write_synthetic(path, QWEN25_CODER_05B, seed=4321, tokenizer_json=minimal_tokenizer_json())
    f = NanoqwenFile(path)
    yield f
    f.close()


@pytest.fixture(params=["real-0.5b", "synthetic-0.5b"])
def model(request):
    """(name, file): the real model, or the synthetic one of its shape."""
    name = "real_nanoqwen" if request.param == "real-0.5b" else "synthetic"
    return request.param, request.getfixturevalue(name)


class _Walk:
    """A GPU session driven line by line, its transcript in `out`."""

    def __init__(self, f, max_context: int = 512):
        from drvqwen.step.machine_gpu import GpuMachine
        from drvqwen.step.repl import Repl
        from drvqwen.step.session import Session

        self.buf = io.StringIO()
        console = Console(file=self.buf, width=1 << 16, soft_wrap=True, highlight=False, color_system=None)
        self.m = GpuMachine(f, max_context)
        # No end-of-generation ids: `gen` runs its full count on every model.
        self.s = Session(self.m, Tokenizer.from_json(f.tokenizer_json), console)
        self.repl = Repl(self.s, console, echo=True)

    def run(self, *lines: str) -> str:
        start = len(self.buf.getvalue())
        for line in lines:
            self.repl.run_lines([line])
        said = self.buf.getvalue()[start:]
        print(said)
        return said

    def close(self):
        self.m.close()


def _all_ok(said: str, walk: _Walk, first: int) -> None:
    """`token`'s verdict line: every launch from `first` run, every checked one ok."""
    n = len(walk.m.entries)
    m = re.search(rf"(\d+) launches \[{first}…{n - 1}\]: [\d.]+ µs of GPU time; (\d+) checked: all ok", said)
    assert m, said
    assert int(m.group(1)) == n - first
    assert "MISMATCH" not in said and "error:" not in said


def test_walk_one_step(model, rng):
    name, f = model
    w = _Walk(f)
    try:
        if name == "real-0.5b":
            ids = Tokenizer.from_json(f.tokenizer_json).encode("def fib(n):\n    ", special=True)
        else:
            ids = rng.integers(0, f.config.vocab_size, 12).tolist()
        w.s.start_ids(ids)
        said = w.run("list", "next 4", "until lm_head", "next", "show logits 0:4")
        assert f"the decode step: {len(w.m.entries)} launches" in said
        # Every group finished so far compared ok, with its comparison lines.
        assert "MISMATCH" not in said and "error:" not in said
        assert re.search(r"^\s+q\s+rel L2 \S+\s+max abs \S+\s+first diff \S+\s+ok", said, re.MULTILINE)
        assert re.search(r"^\s+attn\s+rel L2 .* ok", said, re.MULTILINE)
        assert re.search(r"\]\s+norm\s+rmsnorm.*\bok$", said, re.MULTILINE)
        logits = w.m.logits()
        said = w.run("token")
        assert re.search(r"\d+ launches \[\d+…\d+\]: [\d.]+ µs of GPU time; \d+ checked: all ok", said), said
        # The token chosen on the GPU is the argmax of the step's logits.
        assert w.s.tokens[-1] == int(np.argmax(logits))
        # A whole step from its boundary: every launch checked, all ok.
        _all_ok(w.run("token"), w, 0)
        assert w.s.mismatches == 0
    finally:
        w.close()


def test_real_page_boundary_eager_and_graphs(real_nanoqwen):
    w = _Walk(real_nanoqwen)
    try:
        ids = Tokenizer.from_json(real_nanoqwen.tokenizer_json).encode(
            "def is_palindrome(s):\n    s = ''.join(c for c in s.lower() if c.isalnum())\n", special=True)[:15]
        assert len(ids) == 15
        w.s.start_ids(ids)                            # the first step decodes at position 15
        said = w.run("kv", "token", "kv", "graph")
        assert "so the next step replays 'opens_page'" in said     # position 16 needs page 1
        assert re.search(r"next: 'opens_page', for position 16", said)
        nodes = re.search(r"decode\s+(\d+)\s.*\n\s*opens_page\s+(\d+)\s", said)
        assert nodes and int(nodes.group(2)) == int(nodes.group(1)) + 1 == len(w.m.entries) + 1
        _all_ok(w.run("token"), w, 0)                 # the page-opening step, eager: all ok
        assert w.m.dec.seq.pages.block_table[1] == int(w.m.array("block_table")[1])
        said = w.run("gen 20", "kv", "graph")         # positions 17 … 36: page 2 opens at 32
        assert "decode ×19, opens_page ×1" in said
        assert re.search(r"steps replayed so far: decode ×19, opens_page ×1", said)
        _all_ok(w.run("token"), w, 0)                 # eager again after the graphs: all ok
        assert w.s.mismatches == 0
    finally:
        w.close()
