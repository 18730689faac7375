"""tools/bench_decode_ablation.py on the CPU: which launches a --leave-out entry names, and --define."""

from __future__ import annotations

import pytest

from helpers import load_tool

# Names as DecodeStep.launch_list gives them (a launcher of two launches gets .0 and .1).
NAMES = ["embedding", "L0.qkv_rope", "L0.attention.0", "L0.attention.1", "L0.o_proj", "L0.gate_up_swiglu",
         "L0.down_proj", "L12.attention.1", "L12.o_proj", "norm", "lm_head", "argmax", "advance_state"]


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_decode_ablation")


@pytest.mark.parametrize("entry, want", [
    ("attention", ["L0.attention.0", "L0.attention.1", "L12.attention.1"]),
    ("attention.1", ["L0.attention.1", "L12.attention.1"]),
    ("o_proj", ["L0.o_proj", "L12.o_proj"]),
    ("proj", []),  # a name's tail, not a substring: down_proj and o_proj are not "proj"
])
def test_left_out_names_whole_launch_names(tool, entry, want):
    assert [n for n in NAMES if tool.left_out(n, entry)] == want


def test_parse_define(tool):
    assert tool.parse_define("attention_decode:ATTN_SHORT_SPLITS=64") == ("attention_decode", "ATTN_SHORT_SPLITS", 64)


@pytest.mark.parametrize("text", ["ATTN_SHORT_SPLITS=64", "attention_decode:ATTN_SHORT_SPLITS", "f:N=two"])
def test_parse_define_refuses(tool, text):
    with pytest.raises(SystemExit, match="--define"):
        tool.parse_define(text)


def test_left_out_takes_the_one_launch_attention_too(tool):
    """With --attention cluster a layer's attention is one launch, named without a suffix."""
    names = ["L0.qkv_rope", "L0.attention", "L0.o_proj", "L7.attention"]
    assert [n for n in names if tool.left_out(n, "attention")] == ["L0.attention", "L7.attention"]
    assert [n for n in names if tool.left_out(n, "attention.1")] == []
