"""tools/bench_gemv.py's argument parsing on the CPU: the compile variants of --fmt-defines and --int4-defines,
and the builds --formats times (a model's, and with --fmt-every-format the build for every format)."""

from __future__ import annotations


import pytest

from helpers import load_tool


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_gemv")


def test_parse_defines(bench):
    assert bench.parse_defines("GF_CHAINS=2,GF_UNROLL=0x4") == {"GF_CHAINS": 2, "GF_UNROLL": 4}
    assert bench.parse_defines("") == {}


@pytest.mark.parametrize("text", ["GF_CHAINS", "GF CHAINS=2", "GF_CHAINS=two"])
def test_parse_defines_refuses(bench, text):
    with pytest.raises(SystemExit, match="--fmt-defines"):
        bench.parse_defines(text)


def test_gate_up_shape_is_the_feature_count_by_hidden(bench):
    from drvqwen.config import PRESETS

    cfg = PRESETS["7b"]
    assert bench.q_shape("gate_up_swiglu", cfg) == (cfg.intermediate_size, cfg.hidden_size)
    assert bench.q_shape("down_proj", cfg) == (cfg.hidden_size, cfg.intermediate_size)


def test_parse_defines_names_the_option(bench):
    with pytest.raises(SystemExit, match="--int4-defines: 'GEMV_X' is not NAME=INT"):
        bench.parse_defines("GEMV_X", "--int4-defines")


@pytest.mark.parametrize("extra", [["--tokens", "2"], ["--blocks", "132"], ["--unroll", "4"],
                                   ["--int4-defines", "GEMV_UNROLL=8"]])
def test_int4_options_refused_with_formats(bench, extra):
    with pytest.raises(SystemExit, match=f"{extra[0]} times the INT4 GEMVs; it does not go with --formats"):
        bench.parse_args(["--formats", "q4_k", *extra])


def test_warps_go_with_formats(bench):
    a = bench.parse_args(["--formats", "q4_k", "--warps", "4", "--fmt-defines", "GF_UNROLL=4,GF_MIN_BLOCKS=1"])
    assert a.warps == [4] and a.fmt_defines == ["GF_UNROLL=4,GF_MIN_BLOCKS=1"]


def test_pdl_times_each_format_row_both_ways(bench, monkeypatch):
    """--pdl with --formats: every (format, shape, build) row once without and once with
    programmatic dependent launch, the flag passed to the timing and recorded in the row."""
    seen = []
    monkeypatch.setattr(bench, "make_q_launcher", lambda *a, **k: type("L", (), {"specs": [type("S", (), {
        "grid": (1, 1, 1), "block": (32, 1, 1)})()]})())
    monkeypatch.setattr(bench, "time_launchers", lambda launchers, reps, pdl: seen.append(pdl) or (5.0 if pdl else 6.0))
    monkeypatch.setattr(bench, "get_device", lambda: type("D", (), {"synchronize": lambda self: None})())
    from drvqwen.config import PRESETS

    assert bench.parse_args(["--formats", "q4_k", "--pdl"]).pdl
    rows = bench.bench_formats(["q4_k"], PRESETS["0.5b"], 4, 1000.0, shapes_=("o_proj", "qkv_rope"), pdl=True)
    assert seen == [False, True, False, True]
    assert [(r["gemv"], r["pdl"], r["us"]) for r in rows] == [("q4_k:o_proj", False, 6.0), ("q4_k:o_proj", True, 5.0),
                                                            ("q4_k:qkv_rope", False, 6.0), ("q4_k:qkv_rope", True, 5.0)]


def test_formats_are_timed_in_a_models_build(bench):
    """--formats times each format compiled as a model of it compiles it (format_defines), with
    --fmt-defines added to that build; --fmt-every-format adds the build for every format (no
    defines) first: the fused GEMVs there run one block an SM, which no model does."""
    from drvqwen.format import weight_formats as wf
    from drvqwen.launchers.gemv_fmt import format_defines

    q4k = next(f.id for f in wf.FORMATS.values() if f.name == "q4_k")
    model = format_defines([q4k])
    assert dict(model)["WF_FORMATS"] == 1 << q4k
    assert bench.format_builds(q4k) == [model]
    assert bench.format_builds(q4k, [{"GF_TINY": 0}]) == [tuple({**dict(model), "GF_TINY": 0}.items())]
    assert bench.format_builds(q4k, None, every_format=True) == [(), model]
    a = bench.parse_args(["--formats", "q4_k", "--fmt-every-format"])
    assert a.fmt_every_format and not bench.parse_args(["--formats", "q4_k"]).fmt_every_format
