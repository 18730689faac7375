"""tools/bench_sm_stream.py on the CPU: its --variant syntax and the slice each block reads."""

from __future__ import annotations

import argparse

import pytest

from helpers import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_sm_stream")


def test_parse_variant(tool):
    assert tool.parse_variant("ld16:ld:SR_UNROLL=16") == ("ld16", "ld", (("SR_UNROLL", 16),))
    assert tool.parse_variant("b:bulk:SR_STAGES=3,SR_CHUNK=65536") == ("b", "bulk", (("SR_STAGES", 3),
                                                                                    ("SR_CHUNK", 65536)))
    assert tool.parse_variant("plain:ld") == ("plain", "ld", ())
    for bad in ("ld16", "x:tma:SR_UNROLL=2", "x:ld:SR_UNROLL=two"):
        with pytest.raises(argparse.ArgumentTypeError, match="variant"):
            tool.parse_variant(bad)


def test_slices_fill_the_buffer_at_most_and_keep_the_unit(tool):
    mib = 1 << 20
    assert tool.slice_bytes(1, 256, 16) == 256 * mib
    assert tool.slice_bytes(264, 256, 16) * 264 <= tool.BUFFER_MIB * mib
    assert tool.slice_bytes(264, 256, 32768) % 32768 == 0 and tool.slice_bytes(7, 4096, 65536) % 65536 == 0
    assert tool.slice_bytes(10**6, 256, 32768) == 32768  # never below one unit (main refuses such counts)


@pytest.mark.parametrize("argv, why", [
    (["--blocks", "0"], "need >= 1"), (["--samples", "0"], "need >= 1"), (["--reps", "0"], "need >= 1"),
    (["--blocks", "200000"], "would run past the 4096 MiB buffer"),
    (["--variant", "big:bulk:SR_STAGES=4,SR_CHUNK=65536"], "variant big: a ring of 4 × 65536 B"),
    (["--variant", "odd:bulk:SR_CHUNK=1000"], "variant odd: a ring of 4 × 1000 B"),
])
def test_arguments_that_cannot_run_are_refused_in_one_line_before_any_gpu_work(tool, monkeypatch, argv, why):
    monkeypatch.setattr(tool, "get_device", lambda: pytest.fail("reached the GPU"))
    with pytest.raises(SystemExit, match=f"^bench_sm_stream.py: .*{why}"):
        tool.main(argv)
