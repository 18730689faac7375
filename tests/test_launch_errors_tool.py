"""tools/launch_errors.py's ranking (CPU): the output that departs at the focus position leads."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("launch_errors", Path(__file__).parent.parent / "tools" / "launch_errors.py")
launch_errors = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch_errors)


def test_the_departing_output_leads():
    errors = {"L0.qkv_rope:q": {12: 2e-4, 13: 2.1e-4, 14: 2.2e-4, 15: 1.9e-4},
              "L3.o_proj:residual": {12: 3e-8, 13: 3e-8, 14: 9e-6, 15: 3.2e-8},
              "embedding:x": {12: 0.0, 13: 0.0, 14: 0.0, 15: 0.0},
              "sample:next_token": {12: 0.0, 13: 0.0, 14: 1.0, 15: 0.0}}
    r = launch_errors.focus_ratios(errors, 14)
    assert [name for _, name in r] == ["sample:next_token", "L3.o_proj:residual", "L0.qkv_rope:q", "embedding:x"]
    assert r[0][0] == float("inf") and r[1][0] == pytest.approx(9e-6 / 3e-8) and r[-1][0] == 0.0


def test_bad_positions_exit_with_one_line():
    with pytest.raises(SystemExit, match="--positions"):
        launch_errors.main(["--positions", "12", "13", "--focus", "14"])
    with pytest.raises(SystemExit, match="--positions"):
        launch_errors.main(["--positions", "14", "25", "--focus", "14"])
