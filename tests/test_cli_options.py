"""`drvqwen run`'s prompt sources, --stop, sampling options and statistics, on a TINY model on
the CPU: the same prompt gives the same output whichever way it comes in; --stop cuts the text
where a stop string appears, also across tokens; a sampling run without --seed prints the
seed that repeats it; --json-stats and --verbose report every phase."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from drvqwen.sampler import PENALTY_WINDOW, SamplingParams, kept_tokens, penalize, sample, uniform

from helpers import TINY, byte_tokenizer_json, random_dense, write_model

pytestmark = pytest.mark.usefixtures("private_cache")
CFG = dataclasses.replace(TINY, max_position=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("opts") / "tiny.nanoqwen"
    write_model(path, CFG, random_dense(CFG, np.random.default_rng(11)), tokenizer_json=byte_tokenizer_json())
    return path


def _run(capsys, tiny, *args):
    from drvqwen.cli import main

    rc = main(["run", "-m", str(tiny), "--device", "cpu", "-n", "12", "--ignore-eos", *args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out, out.err


def _proc(tiny, *args, stdin=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "drvqwen.cli", "run", "-m", str(tiny), "--device", "cpu",
                           "-n", "12", "--ignore-eos", *args], input=stdin, capture_output=True, env=env,
                          timeout=120)


def test_every_prompt_source_gives_the_same_output(tiny, capsys, tmp_path):
    want, _ = _run(capsys, tiny, "--prompt", "def f(x):")
    assert _run(capsys, tiny, "def f(x):")[0] == want
    assert _run(capsys, tiny, "-p", "def f(x):")[0] == want
    (tmp_path / "p.txt").write_text("def f(x):")
    assert _run(capsys, tiny, "-f", str(tmp_path / "p.txt"))[0] == want
    piped = _proc(tiny, stdin=b"def f(x):")
    assert piped.returncode == 0 and piped.stdout.decode() == want
    dash = _proc(tiny, "--prompt-file", "-", stdin=b"def f(x):")
    assert dash.returncode == 0 and dash.stdout.decode() == want
    empty = _proc(tiny, stdin=b"")
    assert empty.returncode == 2 and b"stdin is empty" in empty.stderr


def test_stop_string_spanning_tokens_cuts_the_text_and_ends_generation(tiny, capsys):
    full, _ = _run(capsys, tiny, "--raw", "--prompt", "abc", "-n", "24")
    text = full.rstrip("\n")
    assert len(text) >= 6
    stop = text[3:5]              # two characters: two byte tokens at least
    out, err = _run(capsys, tiny, "--raw", "--prompt", "abc", "-n", "24", "--stop", stop, "--stop", "never here")
    assert out == text[:text.index(stop)] + "\n"
    assert "(stop string)" in err


def test_sampling_without_seed_prints_one_that_repeats_the_run(tiny, capsys):
    out, err = _run(capsys, tiny, "hi", "-t", "0.9", "--top-k", "40")
    seed = int(err.split("sampling with --seed ")[1].split()[0])
    again, err2 = _run(capsys, tiny, "hi", "-t", "0.9", "--top-k", "40", "--seed", str(seed))
    assert again == out and "sampling with --seed" not in err2
    _, greedy_err = _run(capsys, tiny, "hi")
    assert "--seed" not in greedy_err


def test_repeat_penalty_and_min_p_change_the_run_as_the_reference_says(tiny, capsys):
    base, _ = _run(capsys, tiny, "--raw", "-p", "aaaa", "-n", "16")
    pen, _ = _run(capsys, tiny, "--raw", "-p", "aaaa", "-n", "16", "--repeat-penalty", "5")
    assert pen != base                      # a strong penalty steers a tiny random model away


def test_json_stats_and_verbose(tiny, capsys, tmp_path):
    (tmp_path / "out").mkdir()
    js = tmp_path / "out" / "stats.json"
    _, err = _run(capsys, tiny, "hi", "--json-stats", str(js), "--verbose")
    d = json.loads(js.read_text())
    assert d["generated_tokens"] == 12 and d["prompt_tokens"] > 0 and d["reused_tokens"] == 0
    assert d["ttft_s"] > 0 and d["prompt_tok_s"] > 0 and d["decode_tok_s"] > 0
    assert d["total_s"] >= d["load_s"] > 0 and set(d["phases_s"]) >= {"read", "tokenize", "load", "generate"}
    assert [p.name for p in js.parent.iterdir()] == ["stats.json"]          # no temporary left
    for phase in ("read + validate the model", "build the backend (CPU: dequantize)", "TTFT", "decode 11 tokens"):
        assert phase in err
    line = err.strip().splitlines()[-1]
    for part in ("load ", "prompt ", " tok/s", "TTFT", "decode", "total "):
        assert part in line, line


# ---- the reference sampler's repeat penalty and min-p -------------------------------------------
def test_penalize_is_llama_cpps_rule(rng):
    logits = (rng.standard_normal(300) * 3).astype(np.float32)
    logits[7] = 0.0
    recent = [5, 5, 7, 9, 299, 1000, -1]                     # duplicates, out-of-range ids skipped
    got = penalize(logits.copy(), recent, 1.3)
    want = logits.copy()
    for t in {5, 7, 9, 299}:
        want[t] = want[t] / np.float32(1.3) if want[t] > 0 else want[t] * np.float32(1.3)
    np.testing.assert_array_equal(got, want)
    assert penalize(logits.copy(), recent, 1.0).tobytes() == logits.tobytes()


def test_min_p_keeps_the_tokens_at_least_that_likely(rng):
    for _ in range(50):
        logits = (rng.standard_normal(500) * rng.uniform(0.5, 4)).astype(np.float32)
        p = SamplingParams(temperature=float(rng.uniform(0.3, 2)), min_p=float(rng.uniform(0.01, 0.5)),
                           top_k=int(rng.choice([0, 20])))
        kept, _ = kept_tokens(logits, p)
        rel = np.exp((logits.astype(np.float64) - logits.max()) / p.temperature)
        clear = (rel > p.min_p * 1.001) | (rel < p.min_p * 0.999)           # away from rounding
        top = set(np.argsort(-logits, kind="stable")[:p.top_k]) if p.top_k else set(range(500))
        want = {i for i in range(500) if rel[i] >= p.min_p and i in top}
        assert {i for i in kept if clear[i]} == {i for i in want if clear[i]}
        assert int(np.argmax(logits)) in kept
        for step in range(5):
            assert sample(logits, p, uniform(3, step)) in set(kept.tolist())


def test_host_loop_applies_the_penalty_over_the_last_window():
    from drvqwen.generate import HostSampling, generate

    class Echo(HostSampling):
        """Logits that favour the last token: without a penalty the loop repeats it."""
        name, max_context = "echo", 1000

        def prefill(self, ids):
            return self._l(ids[-1])

        def decode(self, t):
            return self._l(t)

        def _l(self, t):
            l = np.zeros(50, np.float32)
            l[t] = 2.0
            l[(t + 1) % 50] = 1.9
            return l

    assert generate(Echo(), [3], 4).tokens == [3, 3, 3, 3]
    r = generate(Echo(), [3], 4, SamplingParams(repeat_penalty=1.2))
    assert r.tokens == [4, 5, 6, 7]                          # 2.0 / 1.2 < 1.9: the next id wins
    assert PENALTY_WINDOW == 64


def test_sampling_options_without_temperature_are_said_to_do_nothing(capsys, tiny):
    """--top-p, --top-k, --min-p and --seed at the default temperature 0 change nothing: the run
    says so in one line instead of ignoring them; with --temperature it does not."""
    plain, _ = _run(capsys, tiny, "--raw", "-p", "ab")
    out, err = _run(capsys, tiny, "--raw", "-p", "ab", "--top-p", "0.5", "--top-k", "5", "--min-p", "0.1", "--seed", "3")
    assert out == plain
    assert "--top-p, --min-p, --seed, --top-k: no effect at temperature 0 (greedy); give --temperature to sample" in err
    _, err = _run(capsys, tiny, "--raw", "-p", "ab", "--top-p", "0.5", "--temperature", "0.7", "--seed", "3")
    assert "no effect" not in err
