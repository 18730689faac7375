"""tools/bench_gemm.py's command line on the CPU: --fmt-variant NAME:DEFINE=INT[,…] (a build of
gemm_fmt_wgmma.cu beside each format's default), refused when unreadable or without --formats."""

from __future__ import annotations

import pytest

from helpers import load_tool


@pytest.fixture(scope="module")
def bench():
    load_tool("bench_attention")           # what bench_attention_prefill imports by name
    load_tool("bench_attention_prefill")   # parse_variant, imported by name as the script does
    return load_tool("bench_gemm")


def test_fmt_variants_parsed(bench):
    a = bench.parse_args(["--formats", "int4_g128", "q4_k", "--fmt-variant", "ahead2:GW_LOAD_AHEAD=2",
                          "--fmt-variant", "wait:GW_MMA_IN_FLIGHT=0,GW_LOAD_AHEAD=1"])
    assert a.formats == ["int4_g128", "q4_k"]
    assert a.fmt_variant == [("ahead2", (("GW_LOAD_AHEAD", 2),)),
                             ("wait", (("GW_MMA_IN_FLIGHT", 0), ("GW_LOAD_AHEAD", 1)))]
    assert bench.parse_args([]).fmt_variant == []


@pytest.mark.parametrize("argv,why", [
    (["--formats", "q4_k", "--fmt-variant", "x:GW_LOAD_AHEAD=two"], "write NAME:DEFINE=INT"),
    (["--fmt-variant", "ahead2:GW_LOAD_AHEAD=2"], "needs --formats"),
])
def test_fmt_variant_refused_with_its_reason(bench, capsys, argv, why):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert why in capsys.readouterr().err


def test_kquant_formats_parsed_and_unknown_refused(bench, capsys):
    assert bench.parse_args(["--kquant", "q4_k", "q6_k"]).kquant == ["q4_k", "q6_k"]
    assert bench.parse_args([]).kquant == []
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--kquant", "q8_0"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    a = bench.parse_args(["--kquant", "q5_k", "--kquant-variant", "nohigh:GEMM_PROBE_NO_HIGH_COPY=1"])
    assert a.kquant_variant == [("nohigh", (("GEMM_PROBE_NO_HIGH_COPY", 1),))]
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--kquant-variant", "nohigh:GEMM_PROBE_NO_HIGH_COPY=1"])
    assert e.value.code == 2
    assert "needs --kquant" in capsys.readouterr().err


def test_int4_variant_parsed_and_a_bad_one_refused(bench, capsys):
    a = bench.parse_args(["--int4-variant", "desc:GEMM_A=1,GEMM_B=2", "--int4-variant", "x:GEMM_C=0"])
    assert a.int4_variant == [("desc", (("GEMM_A", 1), ("GEMM_B", 2))), ("x", (("GEMM_C", 0),))]
    assert bench.parse_args([]).int4_variant == []
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--int4-variant", "desc:GEMM_A=one"])
    assert e.value.code == 2
    assert "int4-variant" in capsys.readouterr().err


def test_with_defines_adds_to_the_launchers_builds_only(bench):
    from drvqwen.launchers import GemmInt4ResidualRows
    v = bench.with_defines(GemmInt4ResidualRows, (("GEMM_X", 1),))
    assert issubclass(v, GemmInt4ResidualRows) and v.extra_defines == (("GEMM_X", 1),)
    assert GemmInt4ResidualRows.extra_defines == ()
    assert bench.with_defines(GemmInt4ResidualRows, ()) is GemmInt4ResidualRows
