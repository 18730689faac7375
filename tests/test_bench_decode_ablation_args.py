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


@pytest.mark.parametrize("text", ["attention_prefill_wgmma:APW_WARPGROUPS=2", "attention_prefill_wgmma:APW_Q_SMEM=1",
                                  "attention_prefill_wgmma:APW_STAGES=3", "attention_decode_cluster:ACL_CLUSTER=16",
                                  "gemm_int4:GEMM_BM=64", "attention_decode:ATTN_COMBINE_THREADS=512"])
def test_a_define_the_launchers_size_launches_by_is_refused(tool, text):
    """A build whose grid, block, shared memory or scratch the launchers take from their own
    constants cannot be given by --define: it would run with another build's launch shape."""
    with pytest.raises(SystemExit, match=f"--define '{text}': the launchers size"):
        tool.parse_define(text)


@pytest.mark.parametrize("text", ["attention_decode:ATTN_SHORT_MAX_PAGES=2", "l2_prefetch:L2P_PROBE_NO_PREFETCH=1",
                                  "gemv_int4:GEMV_UNROLL=2"])
def test_kernel_only_defines_are_taken(tool, text):
    file, rest = text.split(":")
    name, value = rest.split("=")
    assert tool.parse_define(text) == (file, name, int(value))


@pytest.mark.parametrize("argv, want", [([], ["attention", "attention.1", "o_proj"]),
                                        (["--attention", "cluster"], ["attention", "o_proj"])])
def test_the_default_variants_follow_the_attention(tool, monkeypatch, argv, want):
    """The one-launch cluster attention has no attention.1 to leave out by default."""
    seen = {}
    monkeypatch.setattr(tool, "measure", lambda a, defines: seen.setdefault("leave_out", a.leave_out) and 0)
    assert tool.main(argv) == 0 and seen["leave_out"] == want


@pytest.mark.parametrize("mb", ["nan", "inf", "-1", "1e-9"])
def test_a_budget_that_is_not_a_finite_byte_count_is_refused_in_one_line(tool, mb):
    with pytest.raises(SystemExit, match=r"^bench_decode_ablation.py: --l2-prefetch-mb .*: need 0 \(off\)"):
        tool.main(["--l2-prefetch-mb", mb])
