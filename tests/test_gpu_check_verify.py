"""tools/gpu_check.sh's verify stage on the CPU: the tests stage in N parts beside the sanitize stage,
each a run of the script of its own, with stand-ins for pytest (a Python that answers `-m pytest`
with a passing summary and runs everything else) and for compute-sanitizer (it runs the command
it is given and reports a finding for FAIL_TOOL). What is checked is the stage's own work: every
part gets its files from tools/split_tests.py and together they are all of them, every tool runs,
the summary names each part's and tool's result, and a failure anywhere fails the stage."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_gpu_check_sanitize import STAND_IN as SANITIZER_STAND_IN  # runs the command, FAIL_TOOL's finding

ROOT = Path(__file__).resolve().parents[1]
NODE = "tests/test_split_tests.py::test_gpu_check_runs_part_k_of_n_from_the_tool"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")

PYTHON_STAND_IN = """#!/usr/bin/env bash
if [[ $1 == -m && $2 == pytest ]]; then
    for a in "$@"; do [[ $a == tests/* ]] && echo "PYTEST_PATH $a"; done
    echo "============ 1 passed in 0.01s ============"
    exit 0
fi
exec {real} "$@"
"""


def _verify(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python-stand-in", PYTHON_STAND_IN.format(real=sys.executable)),
                       ("compute-sanitizer", SANITIZER_STAND_IN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    e = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
         "PYTHON": str(bin_dir / "python-stand-in"), "DRVQWEN_CACHE": str(tmp_path / "cache"),
         "SANITIZE_ONLY": NODE, "VERIFY_PARTS": "2", **env}
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "verify", str(tmp_path / "out")], env=e,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_parts_cover_the_test_files_and_every_tool_runs(tmp_path):
    r = _verify(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    split = [subprocess.run([sys.executable, "tools/split_tests.py", str(k), "2"], capture_output=True, text=True,
                            cwd=ROOT, check=True).stdout.split() for k in (1, 2)]
    for k in (1, 2):
        log = (out / f"tests-{k}" / "tests-gpu.log").read_text()
        given = [line.split()[1] for line in log.splitlines() if line.startswith("PYTEST_PATH ")]
        assert given == split[k - 1] and given, (k, given)
    assert sorted(split[0] + split[1]) == sorted(set(split[0] + split[1]))  # no file in both parts
    summary = (out / "verify-summary.txt").read_text().splitlines()
    for k in (1, 2):
        for log in ("tests-gpu.log", "tests-compile.log"):
            line = next(s for s in summary if s.startswith(f"tests-{k}/{log}:"))
            assert "1 passed" in line and line.endswith("exit 0"), line
    # racecheck in three parts (RACECHECK_PARTS' default here): the one node in the first
    for log in ("memcheck", "racecheck-1", "synccheck"):
        line = next(s for s in summary if s.startswith(f"sanitize/sanitize-{log}.log:"))
        assert re.search(r": 1 clean of 1 runs, === sanitize-[\w-]+: exit 0$", line), line
    for k in (2, 3):
        line = next(s for s in summary if s.startswith(f"sanitize/sanitize-racecheck-{k}.log:"))
        assert line.endswith(f"0 clean of 0 runs, === sanitize-racecheck-{k}: no node"), line
    assert not (out / "sanitize" / "sanitize-racecheck.log").exists()
    assert (out / "verify-summary.txt").read_text() in r.stdout


def test_a_sanitizer_finding_fails_the_stage_and_shows_in_the_summary(tmp_path):
    r = _verify(tmp_path, FAIL_TOOL="racecheck")
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (tmp_path / "out" / "verify-summary.txt").read_text()
    assert "sanitize/sanitize-racecheck-1.log: 0 clean of 1 runs, === sanitize-racecheck-1: exit 99" in summary
    assert "sanitize/sanitize-memcheck.log: 1 clean of 1 runs" in summary


def test_a_bad_part_count_is_refused(tmp_path):
    r = _verify(tmp_path, VERIFY_PARTS="four")
    assert r.returncode == 1 and "VERIFY_PARTS=four: a count of parts" in r.stderr


def test_a_bad_racecheck_part_count_is_refused_before_any_part_runs(tmp_path):
    r = _verify(tmp_path, RACECHECK_PARTS="3x")
    assert r.returncode == 1 and "RACECHECK_PARTS=3x: a count of parts" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out" / "tests-1").exists() and not (tmp_path / "out" / "sanitize").exists()


def test_pack_holds_every_part_and_tool_of_verify(tmp_path):
    """PACK beside verify: the stage packs once, after its parts (which run without it), so the
    file holds each part's folder and the sanitizers' logs."""
    import tarfile

    r = _verify(tmp_path, PACK=str(tmp_path / "v.tgz"))
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(tmp_path / "v.tgz") as tar:
        names = set(tar.getnames())
    assert {"out/verify-summary.txt", "out/tests-1/tests-gpu.log", "out/tests-2/tests-gpu.log",
            "out/sanitize/sanitize-memcheck.log", "out/sanitize/sanitize-racecheck-1.log"} <= names, sorted(names)
    assert r.stdout.count("packed ") == 1, r.stdout
    for part in ("tests-1.out", "tests-2.out", "sanitize.out"):   # the parts did not pack
        assert "packed " not in (tmp_path / "out" / part).read_text(), part
