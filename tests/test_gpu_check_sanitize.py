"""tools/gpu_check.sh's sanitize stage on the CPU, with a stand-in for compute-sanitizer that runs
the command it is given: one process per tool, in turn or side by side (SANITIZE_PARALLEL=1),
each tool's log whole, and a finding of any tool failing the stage."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NODE = "tests/test_split_tests.py::test_gpu_check_runs_part_k_of_n_from_the_tool"  # a quick CPU test

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")

# The stand-in: skips the sanitizer's own options (each "--name value"), runs the rest, prints
# a summary as compute-sanitizer does, and reports a finding for the tool named in FAIL_TOOL.
STAND_IN = """#!/usr/bin/env bash
tool=""
while [[ $# -gt 0 && $1 == --* ]]; do [[ $1 == --tool ]] && tool=$2; shift 2; done
"$@"; rc=$?
if [[ $tool == "${FAIL_TOOL:-}" ]]; then echo "========= ERROR SUMMARY: 1 error"; exit 99; fi
echo "========= ERROR SUMMARY: 0 errors ($tool)"
exit $rc
"""


def _run_stage(tmp_path: Path, stand_in: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """gpu_check.sh sanitize into tmp_path/out, with `stand_in` as compute-sanitizer on the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(stand_in)
    fake.chmod(0o755)
    e = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
         "DRVQWEN_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "sanitize", str(tmp_path / "out")], env=e,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def _stage(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return _run_stage(tmp_path, STAND_IN, {"SANITIZE_ONLY": NODE, **env})


@pytest.mark.parametrize("parallel", ["0", "1"])
def test_every_tool_runs_the_nodes_into_its_own_log(tmp_path, parallel):
    r = _stage(tmp_path, SANITIZE_PARALLEL=parallel)
    assert r.returncode == 0, r.stdout + r.stderr
    for tool in ("memcheck", "racecheck", "synccheck"):
        log = (tmp_path / "out" / f"sanitize-{tool}.log").read_text()
        assert "1 passed" in log and f"ERROR SUMMARY: 0 errors ({tool})" in log, log
        assert log.rstrip().endswith(f"=== sanitize-{tool}: exit 0"), log
        assert f"sanitize-{tool}.log:=== sanitize-{tool}: exit 0" in r.stdout  # the summary at the end


@pytest.mark.parametrize("parallel", ["0", "1"])
def test_a_finding_of_one_tool_fails_the_stage(tmp_path, parallel):
    r = _stage(tmp_path, SANITIZE_PARALLEL=parallel, FAIL_TOOL="racecheck")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "sanitize-racecheck.log:=== sanitize-racecheck: exit 99" in r.stdout
    assert "sanitize-synccheck.log:=== sanitize-synccheck: exit 0" in r.stdout


# A stand-in that only names the pytest nodes it was given, one a line, without running them
# (the nodes of tools/sanitize_nodes.txt are GPU tests).
ECHO_STAND_IN = """#!/usr/bin/env bash
while [[ $# -gt 0 && $1 != -m ]]; do shift; done
for a in "$@"; do [[ $a == tests/* ]] && echo "NODE $a"; done
echo "========= ERROR SUMMARY: 0 errors"
"""


def _kernels_stage(tmp_path: Path, kernels: str) -> subprocess.CompletedProcess:
    return _run_stage(tmp_path, ECHO_STAND_IN, {"SANITIZE_KERNELS": kernels, "SANITIZE_TOOLS_ONLY": "memcheck",
                                                "SANITIZE_ONLY": ""})


def test_sanitize_kernels_keeps_the_nodes_that_launch_them(tmp_path):
    """SANITIZE_KERNELS (tools/changed_kernels.py's list) runs exactly the nodes of
    tools/sanitize_nodes.txt that name one of the kernels, and the coverage check reads those."""
    kernels = {"l2_prefetch", "stream_read_ld"}
    r = _kernels_stage(tmp_path, " ".join(sorted(kernels)))
    lines = [ln for ln in (ROOT / "tools" / "sanitize_nodes.txt").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#") and kernels & set(ln.split()[1:])]
    assert len(lines) >= 2, lines
    selected = (tmp_path / "out" / "sanitize-nodes.txt").read_text().splitlines()
    assert selected == lines
    log = (tmp_path / "out" / "sanitize-memcheck.log").read_text()
    assert sorted(ln.split()[1] for ln in log.splitlines() if ln.startswith("NODE ")) == sorted(
        ln.split()[0] for ln in lines), log
    # Nothing was launched (the stand-in ran no test): the coverage check over those nodes fails.
    cov = (tmp_path / "out" / "sanitize-coverage.log").read_text()
    assert "NOT COVERED" in cov and f"0 of {len(lines)} nodes" in cov, cov
    assert r.returncode == 1


def test_every_kernel_of_a_node_counts_as_launched(tmp_path):
    """A node that launches two of the named kernels covers both: the second kernel on its line
    (gemv_fmt_residual after gemv_fmt_f16) counts as launched by that node, so the stage takes a
    list straight from tools/changed_kernels.py."""
    lines = [ln.split() for ln in (ROOT / "tools" / "sanitize_nodes.txt").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    # Two kernels (a, b) of one line such that every line naming b names a before it: a scan
    # that stopped at a line's first named kernel never saw b.
    def hides(a: str, b: str) -> bool:
        return all(a in ln[1:ln.index(b)] for ln in lines if b in ln[1:])
    pair = next((ln[i], ln[j]) for ln in lines for i in range(1, len(ln)) for j in range(i + 1, len(ln))
                if hides(ln[i], ln[j]))
    r = _kernels_stage(tmp_path, " ".join(pair))
    assert "no node of tools/sanitize_nodes.txt launches" not in r.stderr, r.stderr
    assert r.returncode != 2, r.stdout + r.stderr
    assert (tmp_path / "out" / "sanitize-memcheck.log").exists()


def test_sanitize_kernels_refuses_a_kernel_no_node_launches(tmp_path):
    r = _kernels_stage(tmp_path, "l2_prefetch no_such_kernel")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "SANITIZE_KERNELS: no node of tools/sanitize_nodes.txt launches no_such_kernel" in r.stderr
    assert not (tmp_path / "out" / "sanitize-memcheck.log").exists()


def test_racecheck_parts_split_the_nodes_every_nth(tmp_path):
    """RACECHECK_PARTS=2 beside SANITIZE_PARALLEL=1: racecheck runs as two processes, the first
    over nodes 1, 3, 5, the second over 2, 4, each into its own log; together every node once."""
    nodes = [f"tests/test_x.py::test_{i}" for i in range(1, 6)]
    r = _run_stage(tmp_path, ECHO_STAND_IN, {"SANITIZE_ONLY": " ".join(nodes), "SANITIZE_TOOLS_ONLY": "racecheck",
                                             "SANITIZE_PARALLEL": "1", "RACECHECK_PARTS": "2"})
    assert r.returncode == 0, r.stdout + r.stderr
    got = [[ln.split()[1] for ln in (tmp_path / "out" / f"sanitize-racecheck-{k}.log").read_text().splitlines()
            if ln.startswith("NODE ")] for k in (1, 2)]
    assert got == [nodes[0::2], nodes[1::2]], got
    assert not (tmp_path / "out" / "sanitize-racecheck.log").exists()
    for k in (1, 2):
        assert f"sanitize-racecheck-{k}.log:=== sanitize-racecheck-{k}: exit 0" in r.stdout


def test_a_bad_racecheck_part_count_is_refused(tmp_path):
    """Refused in one line, and an earlier run's logs are gone, not left to read as this run's."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sanitize-racecheck.log").write_text("=== sanitize-racecheck: exit 0\n")
    r = _stage(tmp_path, SANITIZE_PARALLEL="1", RACECHECK_PARTS="three")
    assert r.returncode == 1 and "RACECHECK_PARTS=three: a count of parts" in r.stderr, r.stdout + r.stderr
    assert not list((tmp_path / "out").glob("sanitize-*.log"))
