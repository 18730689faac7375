"""Every kernel is under the sanitizers: tools/sanitize_nodes.txt names, for every extern "C"
entry point of kernels/*.cu, a small-shape test that launches it, and every node there exists.

CPU only: the kernel list is read from the cubins NVRTC builds here (macro-generated entry points
such as attention_decode_hd64 included), the nodes are collected by pytest in a subprocess. That
a node really launches what it claims is checked on the GPU, where the sanitize stage logs the
launches (tools/check_sanitize_coverage.py, whose rules are tested here on made-up logs).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from drvqwen.cuda.nvrtc import compile_kernel
from drvqwen.cuda.sources import list_kernels

from helpers import UNUSED_GEMV_Q

ROOT = Path(__file__).resolve().parents[1]
NODES_FILE = ROOT / "tools" / "sanitize_nodes.txt"

sys.path.insert(0, str(ROOT / "tools"))
import check_sanitize_coverage as cov  # noqa: E402

NODES = cov.read_nodes(NODES_FILE)


def entry_points() -> dict[str, str]:
    """{kernel entry point: its kernel file}, for every file of kernels/ (not kernels/dev/)."""
    out = {}
    for name in list_kernels():
        for r in compile_kernel(name).resources.values():
            if r.is_entry:
                out[r.function] = name
    return out


def test_every_kernel_has_a_sanitize_node():
    kernels = entry_points()
    assert len(kernels) > 40, sorted(kernels)  # the list itself is read, not empty
    claimed = set().union(*NODES.values())
    missing = sorted(f"{k} ({f}.cu)" for k, f in kernels.items() if k not in claimed | UNUSED_GEMV_Q)
    assert not missing, f"kernels no node of {NODES_FILE.name} covers: {', '.join(missing)}"
    unknown = sorted(claimed - set(kernels))
    assert not unknown, f"{NODES_FILE.name} names kernels that do not exist: {', '.join(unknown)}"


def test_every_sanitize_node_exists():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *NODES],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pytest could not collect every node:\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}"
    collected = [line for line in r.stdout.splitlines() if "::" in line]
    for node in NODES:
        assert any(cov.owns(node, c) for c in collected), f"{node}: collects no test"


def test_gpu_check_reads_the_nodes_file():
    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    assert "tools/sanitize_nodes.txt" in script
    assert "tests/test_kernel_" not in script.split("stage_sanitize()", 1)[1].split("\n}\n", 1)[0], \
        "the sanitize stage names tests of its own instead of reading the nodes file"


@pytest.mark.parametrize("log,problem", [
    ("# node a.py::t[1]\nk1\nk2\n# node b.py::u\nk3\n", None),
    ("# node a.py::t[1]\nk1\n# node b.py::u\nk3\n", "a.py::t: claims k2"),
    ("# node a.py::t[1]\nk1\nk2\n", "b.py::u: no test of this node ran"),
    ("# node a.py::tt\nk1\nk2\n# node b.py::u\nk3\n", "a.py::t: no test of this node ran"),
])
def test_coverage_check_rules(tmp_path, log, problem):
    nodes = {"a.py::t": {"k1", "k2"}, "b.py::u": {"k3"}}
    p = tmp_path / "log"
    p.write_text(log)
    problems = cov.check(nodes, cov.read_log(p))
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(problem), problems
