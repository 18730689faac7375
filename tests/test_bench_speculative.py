"""`drvqwen bench --lookup/--draft` (bench_speculative.py) without a GPU: the refusals (options
checked as `run` checks them, synthetic weights), the figures on a fake backend whose every
step takes 1 ms of a fake clock, a verify pass that is not lossless caught, the table, and the
whole row on the CPU backend with a tiny model, through `cmd_bench`. No timing is asserted on
a real clock."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from drvqwen import bench, bench_speculative as bs
from drvqwen.edit_prompts import EXAMPLE_FUNCTION, edit_prompt
from drvqwen.errors import DrvqwenError
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.generate import DecodeVerify, HostSampling
from drvqwen.speculative import PromptLookup
from drvqwen.tokenizer import Tokenizer

from helpers import TINY, byte_tokenizer_json, minimal_tokenizer_json, random_dense, write_model

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
# Byte-level ids: the edit prompt in the chat template is ~1100 tokens.
CFG = dataclasses.replace(TINY, max_position=2048)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    return ap.parse_args(argv)


# ---- the options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["--lookup", "8"], "--lookup: needs --model with real weights"),
    (["--draft", "small.nanoqwen"], "--draft: needs --model with real weights"),
    (["--model", "m", "--lookup", "8", "--draft", "d"], "--lookup with --draft: choose one way to propose tokens"),
    (["--model", "m", "--draft-max", "4"], "--draft-max: only with --draft MODEL"),
    (["--model", "m", "--lookup", "16"], "--lookup=16: must be an integer in [1, 15]"),
])
def test_refused_options(argv, message):
    with pytest.raises(DrvqwenError, match=message.replace("[", r"\[").replace("]", r"\]")):
        bs.check_speculative_options(parse(argv))


def test_speculative_row_is_asked_for_by_lookup_or_draft():
    assert not bs.check_speculative_options(parse([]))
    assert not bs.check_speculative_options(parse(["--model", "m"]))
    assert bs.check_speculative_options(parse(["--model", "m", "--lookup", "8"]))
    assert bs.check_speculative_options(parse(["--model", "m", "--draft", "d", "--draft-max", "4"]))


def test_synthetic_preset_is_refused_in_one_line_before_anything_runs(tmp_path):
    # Refused before the GPU is looked for: the same line with or without one.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "drvqwen.bench", "--lookup", "8", "--json", str(tmp_path / "b.json")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "synthetic" in lines[0] and "--model" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "b.json").exists()


def test_synthetic_weights_given_as_model_are_refused(tmp_path):
    syn, real = tmp_path / "syn.nanoqwen", tmp_path / "real.nanoqwen"
    dense = random_dense(TINY, np.random.default_rng(1))
    write_model(syn, TINY, dense, tokenizer_json=minimal_tokenizer_json())
    write_model(real, TINY, dense, tokenizer_json=byte_tokenizer_json())
    with NanoqwenFile(syn) as f, pytest.raises(DrvqwenError, match="syn.nanoqwen: synthetic weights"):
        bs.check_real_weights(f)
    with NanoqwenFile(real) as f:
        bs.check_real_weights(f)


# ---- the figures, on a fake clock ----------------------------------------------------------------
V = 32


def next_token(t: int) -> int:
    """The fake model's greedy choice after t: a cycle through all V ids."""
    return (5 * t + 3) % V


class ClockBackend(HostSampling, DecodeVerify):
    """A logits backend whose greedy token follows `next_token`, each prefill and decode step
    taking 1 ms of `clock`. lossy: its verify pass disagrees with the decode step at the second
    position (a verify pass that is not bit for bit the decode step's)."""

    name = "fake"
    max_context = 512

    def __init__(self, clock, lossy: bool = False):
        self.clock, self.lossy = clock, lossy
        self.prefills = self.decodes = 0
        self._cached: list[int] = []

    def _logits(self, last: int) -> np.ndarray:
        out = np.zeros(V, np.float32)
        out[next_token(last)] = 1.0
        return out

    def prefill(self, ids, reuse=False):
        self.clock.now += 1e-3
        self.prefills += 1
        self._cached = list(ids)
        return self._logits(ids[-1])

    def decode(self, token):
        self.clock.now += 1e-3
        self.decodes += 1
        self._cached.append(int(token))
        return self._logits(token)

    def verify(self, tokens):
        rows = DecodeVerify.verify(self, tokens)
        if self.lossy and len(rows) > 1:
            rows[1] = np.roll(rows[1], 1)
        return rows

    def verify_greedy(self, tokens):
        return DecodeVerify.verify_greedy(self, tokens)

    def rollback(self, n):
        del self._cached[n:]

    def cached_ids(self):
        return list(self._cached)


def cycle_prompt(n: int = 40) -> list[int]:
    """n tokens of the fake model's own cycle: prompt lookup finds every continuation."""
    out = [0]
    while len(out) < n:
        out.append(next_token(out[-1]))
    return out


@pytest.fixture
def clock(monkeypatch):
    c = SimpleNamespace(now=10.0)
    monkeypatch.setattr(bs, "time", SimpleNamespace(perf_counter=lambda: c.now))
    return c


def test_plain_figures_from_the_token_times(clock):
    n = 20
    r = bs.timed_generation(ClockBackend(clock), cycle_prompt(), n, frozenset())
    # One decode step (1 ms) between consecutive tokens: the last arrives (n - 1) ms after the first.
    assert r.generated == n and r.span_ms == pytest.approx(n - 1)
    assert r.tok_s == pytest.approx(n / ((n - 1) * 1e-3))
    assert r.ms_per_token == pytest.approx((n - 1) / n)
    assert r.speculation is None and r.stopped_by == "max_new_tokens"


def test_lossless_lookup_with_decode_step_verify_costs_what_plain_costs(clock):
    n = 30
    backend = ClockBackend(clock)
    res = bs.measure(backend, PromptLookup(8), cycle_prompt(), n, frozenset())
    plain, spec = res["plain"], res["speculative"]
    assert backend.prefills == 4                       # two warm-ups, then the two timed runs
    assert res["same_tokens"] and spec["tokens"] == plain["tokens"]
    assert plain["tokens"][:3] == [next_token(t) for t in [cycle_prompt()[-1], *plain["tokens"][:2]]]
    s = spec["speculation"]
    # On its own cycle every proposal is right, and each verify pass's rows are decode steps:
    # the same n - 1 steps between the first and the last token as plain decoding, so the
    # same tokens/s, in fewer passes.
    assert s["proposed"] > 0 and s["accepted"] == s["proposed"] and s["acceptance_rate"] == 1.0
    assert s["pass_tokens"] == n - 1 and s["tokens_per_pass"] == pytest.approx((n - 1) / s["verify_passes"])
    assert s["tokens_per_pass"] > 1
    assert spec["span_ms"] == pytest.approx(n - 1) and spec["tok_s"] == pytest.approx(plain["tok_s"])
    assert res["speculative_over_plain_tok_s"] == pytest.approx(1.0)


def test_a_verify_pass_that_is_not_the_decode_step_is_reported(clock, capsys):
    res = bs.measure(ClockBackend(clock, lossy=True), PromptLookup(8), cycle_prompt(), 30, frozenset())
    assert not res["same_tokens"]
    assert res["speculative"]["speculation"]["accepted"] < res["speculative"]["speculation"]["proposed"]
    spec = {"prompt_kind": "edit", "prompt_tokens": 40, "new_tokens": 30, "proposer": "prompt lookup",
            "backend": "fake", "verify": "ClockBackend.verify", **res}
    bs.print_speculative(spec, Console(width=250, force_terminal=False))
    assert "generated DIFFERENT tokens" in capsys.readouterr().out


def test_one_token_has_no_rate(clock):
    r = bs.timed_generation(ClockBackend(clock), cycle_prompt(), 1, frozenset())
    assert r.generated == 1 and r.span_ms is None and r.tok_s is None and r.ms_per_token is None


def test_print_speculative(clock, capsys):
    res = bs.measure(ClockBackend(clock), PromptLookup(8), cycle_prompt(), 30, frozenset())
    spec = {"prompt_kind": "edit", "prompt_tokens": 40, "new_tokens": 30, "proposer": "prompt lookup",
            "backend": "fake", "verify": "DecodeVerify.verify", **res}
    bs.print_speculative(spec, Console(width=250, force_terminal=False))
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    s = res["speculative"]["speculation"]
    assert f"{res['plain']['tok_s']:.1f}" in rows["plain"] and "n/a" in rows["plain"]
    assert f"{s['proposed']}" in rows["speculative"] and f"{s['tokens_per_pass']:.2f}" in rows["speculative"]
    assert "100.0%" in rows["speculative"] and "1.00×" in rows["speculative ÷ plain"]
    assert "edit prompt (40 tokens)" in out and "generated the same tokens" in out


# ---- the whole row on the CPU backend ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_spec") / "tiny.nanoqwen"
    write_model(path, CFG, random_dense(CFG, np.random.default_rng(4)), tokenizer_json=byte_tokenizer_json())
    return path


@pytest.mark.parametrize("option", [["--lookup", "8"], ["--draft", "TINY", "--draft-max", "4"]],
                         ids=["lookup", "draft"])
def test_cmd_bench_speculative_row_on_the_cpu(tiny, tmp_path, monkeypatch, capsys, option):
    """cmd_bench with the GPU parts replaced: the model opened on the CPU, run_bench's plain
    modes a stand-in record; the speculative row runs for real on the CPU reference."""
    from drvqwen import cuda, loading

    plain_modes = {"modes": {"graph": {"itl_median_ms": 1.0}}, "protocol": {"max_context": CFG.max_position}}
    monkeypatch.setattr(cuda, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(loading, "open_model", lambda model, device, **kw: loading.OpenedModel(
        NanoqwenFile(model), "cpu", "a test"))
    monkeypatch.setattr(bench, "run_bench", lambda path, **kw: json.loads(json.dumps(plain_modes)))
    monkeypatch.setattr(bench, "print_table", lambda res: bs.print_speculative(res["speculative"]))
    out = tmp_path / "b.json"
    argv = ["--model", str(tiny), "--new-tokens", "40", "--json", str(out), *option]
    args = parse([a.replace("TINY", str(tiny)) for a in argv])
    assert bench.cmd_bench(args) == 0
    res = json.loads(out.read_text())
    assert {k: res[k] for k in plain_modes} == plain_modes      # the plain modes' keys as they were
    spec = res["speculative"]
    with NanoqwenFile(tiny) as f:
        prompt = edit_prompt(Tokenizer.from_json(f.tokenizer_json), EXAMPLE_FUNCTION)
    assert spec["prompt_kind"] == "edit" and spec["prompt_tokens"] == len(prompt)
    assert spec["backend"].startswith("cpu") and spec["verify"] == "DecodeVerify.verify"
    assert spec["same_tokens"] and spec["speculative"]["tokens"] == spec["plain"]["tokens"]
    assert 2 <= spec["plain"]["generated"] <= 40
    s = spec["speculative"]["speculation"]
    assert s["proposed"] > 0 and 0 <= s["accepted"] <= s["proposed"]
    if option[0] == "--lookup":
        assert (spec["proposer"], spec["lookup"], spec["draft_max"]) == ("prompt lookup", 8, None)
    else:
        assert spec["proposer"] == "draft model tiny.nanoqwen" and spec["draft_max"] == 4
    assert "speculative and plain greedy decoding generated the same tokens" in capsys.readouterr().out
