"""tools/bench_startup.py's variants: `--variant NAME:ENV=VALUE[,ENV=VALUE]` parsed or refused in
one line, the runs interleaved round by round (a fake runner stands for drvqwen), each run given
its variant's environment, and the JSON and --compare holding each variant's medians."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY, byte_tokenizer_json, load_tool, random_dense, write_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_startup")


@pytest.mark.parametrize("text,name,env", [
    ("late:DRVQWEN_STARTUP_TOKENIZER_WORKER=model", "late", {"DRVQWEN_STARTUP_TOKENIZER_WORKER": "model"}),
    ("both:A=1,B_2=x=y", "both", {"A": "1", "B_2": "x=y"}),
    ("as-is:", "as-is", {}),
    ("empty:A=", "empty", {"A": ""})])
def test_a_variant_is_a_name_and_its_variables(tool, text, name, env):
    assert tool.parse_variant(text) == tool.Variant(name, env)


@pytest.mark.parametrize("text,says", [("noenv", "expected NAME:ENV=VALUE"), (":A=1", "expected NAME"),
                                       ("v:A", "'A' is not ENV=VALUE"), ("v:1A=2", "'1A=2' is not ENV=VALUE"),
                                       ("v:A=1,,B=2", "'' is not ENV=VALUE"), ("v:A=1,A=2", "A is set twice")])
def test_a_bad_variant_is_refused_in_one_line(tool, text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says) as e:
        tool.parse_variant(text)
    assert "\n" not in str(e.value)


def test_two_variants_of_one_name_are_refused(tool, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_startup.py"), "--model", "m", "--variant", "a:X=1",
                        "--variant", "a:X=2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "two variants named 'a'" in r.stderr


def _fake_run(seen: list):
    """A runner standing for drvqwen: records (variant, its environment), 'measures' a time."""
    def run_one(v):
        seen.append((v.name, dict(v.env)))
        return {"first_byte_s": 0.1 * len(seen), "exit_s": 0.2 * len(seen), "returncode": 0, "stdout_bytes": 1,
                "stats": None, "stderr_tail": []}
    return run_one


def test_the_runs_are_interleaved_round_by_round_after_one_unmeasured_run_each(tool):
    a, b, c = (tool.Variant(n, {"K": n}) for n in "ABC")
    seen, said = [], []
    by_name = tool.measure([a, b, c], 3, _fake_run(seen), said.append)
    assert [n for n, _ in seen] == list("ABC") + list("ABC" * 3)
    assert all(env == {"K": n} for n, env in seen)
    # the measured runs of each variant, in its order: the unmeasured first runs (1-3) left out
    assert {n: [r["first_byte_s"] for r in rs] for n, rs in by_name.items()} == \
        {n: [pytest.approx(0.1 * (4 + i + 3 * k)) for k in range(3)] for i, n in enumerate("ABC")}
    assert len(said) == 9 and said[0].startswith("run 1 A:") and said[-1].startswith("run 3 C:")


def test_a_variant_whose_first_run_fails_stops_the_measurement(tool):
    def run_one(v):
        return {"returncode": 2 if v.name == "B" else 0, "stderr_tail": ["DRVQWEN_STARTUP_X='?': bad"]}

    said = []
    assert tool.measure([tool.Variant("A"), tool.Variant("B")], 3, run_one, said.append) is None
    assert said == ["drvqwen run (B) failed (2): DRVQWEN_STARTUP_X='?': bad"]


def test_interleaved_is_every_variant_once_per_round(tool):
    vs = [tool.Variant("x"), tool.Variant("y")]
    assert [(i, v.name) for i, v in tool.interleaved(vs, 2)] == [(0, "x"), (0, "y"), (1, "x"), (1, "y")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = dataclasses.replace(TINY, max_position=256)
    path = tmp_path_factory.mktemp("bench-startup") / "tiny.nanoqwen"
    write_model(path, cfg, random_dense(cfg, np.random.default_rng(5)), tokenizer_json=byte_tokenizer_json())
    return path


def test_variants_run_side_by_side_and_are_compared(tiny, tmp_path, capsys, tool):
    """Two variants on the CPU, one run each: each run had its variant's environment (a bad
    switch value would stop its first run), the JSON holds both, and --compare shows both."""
    out = tmp_path / "variants.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_startup.py"), "--model", str(tiny), "--runs", "1",
                        "--device", "cpu", "--variant", "now:", "--variant",
                        "late:DRVQWEN_STARTUP_TOKENIZER_WORKER=model,DRVQWEN_STARTUP_DRIVER_WARMUP=device",
                        "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "medians (ms), runs interleaved" in r.stdout
    d = json.loads(out.read_text())
    assert "runs" not in d and "median" not in d and d["order"] == "interleaved"
    assert [(v["name"], v["env"]) for v in d["variants"]] == \
        [("now", {}), ("late", {"DRVQWEN_STARTUP_TOKENIZER_WORKER": "model", "DRVQWEN_STARTUP_DRIVER_WARMUP": "device"})]
    for v in d["variants"]:
        (run,) = v["runs"]
        assert run["returncode"] == 0 and v["median"]["first_byte_s"] == run["first_byte_s"]
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_startup.py"), "--model", str(tiny), "--runs",
                          "1", "--device", "cpu", "--variant", "bad:DRVQWEN_STARTUP_GATHERED_UPLOAD=maybe"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1 and "drvqwen run (bad) failed (2): error: DRVQWEN_STARTUP_GATHERED_UPLOAD='maybe': a start-up measurement switch takes on or off" in bad.stderr
    tool.compare(tool.Console(width=200), [str(out)])
    shown = capsys.readouterr().out
    assert "variants now" in shown and "variants late" in shown
