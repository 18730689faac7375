"""Prefill's argument checks, on the CPU: they refuse before any GPU work."""

import pytest

from drvqwen.errors import DrvqwenError
from drvqwen.prefill import FMT_GEMMS, PREFILL_MODES, Prefill


@pytest.mark.parametrize("kwargs,match", [({"max_chunk_rows": 0}, "max_chunk_rows=0"),
                                          ({"mode": "batched"}, "prefill mode 'batched'"),
                                          ({"fmt_gemm": "cutlass"}, "fmt_gemm 'cutlass'"),
                                          ({"attention_engine": "mma", "attention_defines": (("APW_Q_SMEM", 1),)},
                                           "^attention defines APW_Q_SMEM=1: .*the mma engine takes none$")])
def test_prefill_refuses_bad_arguments(kwargs, match):
    with pytest.raises(DrvqwenError, match=match):
        Prefill(None, **kwargs)


def test_the_choices_name_what_the_refusals_list():
    assert "gemm" in PREFILL_MODES and "per_token" in PREFILL_MODES
    assert FMT_GEMMS[0] == "wgmma"  # the default comes first
