"""tools/bench_prefill_ablation.py on the CPU: which launches of a prefill chunk list a --leave-out
entry takes away, and its refusals before any GPU work."""

from __future__ import annotations

import pytest

from helpers import load_tool

# Names as Prefill.launches gives them (a launcher of two launches gets .0 and .1).
NAMES = ["embedding", "rope_table", "L0.input_layernorm", "L0.qkv_rope", "L0.attention", "L0.o_proj",
         "L0.post_attention_layernorm", "L0.gate_up_swiglu", "L0.down_proj", "L27.input_layernorm",
         "L27.attention", "L27.attention_late"]  # the range-scheduled twin of a long prompt's late chunks


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_prefill_ablation")


@pytest.mark.parametrize("leave, gone", [
    ([], []),
    (["input_layernorm"], ["L0.input_layernorm", "L27.input_layernorm"]),
    (["attention"], ["L0.attention", "L27.attention", "L27.attention_late"]),
    (["layernorm"], []),  # a name's tail, not a substring
])
def test_a_variant_runs_the_list_without_its_entry(tool, leave, gone):
    assert tool.kept(NAMES, leave) == [n for n in NAMES if n not in gone]


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--prompt-tokens", "0"]])
def test_bad_counts_are_refused_before_any_gpu_work(tool, argv):
    with pytest.raises(SystemExit, match="need >= 1"):
        tool.main(argv)
