"""tools/bench_attention_prefill.py's argument parsing on the CPU: --cases START:ROWS and
--variant NAME:DEFINE=INT[,…], each refused with the text it could not read."""

from __future__ import annotations

import argparse

import pytest

from helpers import load_tool


@pytest.fixture(scope="module")
def bench():
    load_tool("bench_attention")  # its Scratch, imported by name as the script does
    return load_tool("bench_attention_prefill")


def test_parse_case(bench):
    assert bench.parse_case("7680:512") == (7680, 512)
    assert bench.parse_case("0:1") == (0, 1)


@pytest.mark.parametrize("text,why", [("512", "write START:ROWS"), ("a:b", "write START:ROWS"),
                                      ("0:0", "ROWS ≥ 1"), ("-1:64", "START ≥ 0")])
def test_parse_case_refuses(bench, text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=f"case '{text}': .*{why}"):
        bench.parse_case(text)


def test_parse_variant(bench):
    assert bench.parse_variant("stages2:APF_STAGES=2") == ("stages2", (("APF_STAGES", 2),))
    assert bench.parse_variant("plain:") == ("plain", ())


@pytest.mark.parametrize("text", ["s:APF_STAGES", "s:APF_STAGES=two"])
def test_parse_variant_refuses(bench, text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"variant '{text}': write NAME:DEFINE=INT"):
        bench.parse_variant(text)
