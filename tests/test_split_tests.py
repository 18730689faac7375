"""tools/split_tests.py: the GPU test stage's files in N parts of about equal time (TESTS_PART=K/N
of tools/gpu_check.sh)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_tool

ROOT = Path(__file__).resolve().parent.parent


def _tree(tmp_path, files):
    """A throw-away repository root with `files` {relative path: text}."""
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_every_unit_is_in_exactly_one_part_and_the_parts_are_balanced():
    tool = load_tool("split_tests")
    units = tool.units()
    assert "tests/dev/" in units and "tests/test_split_tests.py" in units
    seconds = json.loads((ROOT / "tools" / "gpu_test_seconds.json").read_text())["seconds"]
    for n in (1, 2, 3, 4, 6):
        parts = tool.split(units, seconds, n)
        flat = [u for p in parts for u in p]
        assert sorted(flat) == sorted(units) and len(flat) == len(set(flat)), n
        loads = [sum(seconds.get(u, 0.0) for u in p) for p in parts]
        # Longest processing time first: no part exceeds the mean by more than its last unit.
        assert max(loads) <= sum(loads) / n + max(seconds.values()), (n, loads)


def test_costs_from_junit_the_table_and_the_gpu_marker(tmp_path):
    tool = load_tool("split_tests")
    root = _tree(tmp_path, {"tests/test_a.py": "pytestmark = pytest.mark.gpu\n", "tests/test_b.py": "x = 1\n",
                            "tests/test_c.py": "@pytest.mark.gpu\ndef test(): pass\n",
                            "tests/dev/test_d.py": "pytestmark = pytest.mark.gpu\n"})
    assert tool.units(root) == ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py", "tests/dev/"]
    xml = tmp_path / "gpu.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.test_a" name="x" time="30"/>'
                   '<testcase classname="tests.test_a.TestK" name="y" time="10"/>'
                   '<testcase classname="tests.dev.test_d" name="z" time="12.5"/>'
                   '</testsuite></testsuites>')
    seconds = tool.junit_seconds([xml])
    assert seconds == {"tests/test_a.py": 40.0, "tests/dev/": 12.5}
    # test_c has GPU tests but no time: DEFAULT_SECONDS; test_b none: nothing. Three parts:
    # test_a (40), tests/dev/ (12.5), then test_c (5) to the lightest, test_b (0) after it.
    parts = tool.split(tool.units(root), seconds, 3, root)
    assert parts == [["tests/test_a.py"], ["tests/dev/"], ["tests/test_b.py", "tests/test_c.py"]]
    assert tool.DEFAULT_SECONDS == 5.0
    bad = tmp_path / "bad.xml"
    bad.write_text("not xml")
    with pytest.raises(ValueError, match="bad.xml: not a junit XML file"):
        tool.junit_seconds([bad])


@pytest.mark.parametrize("argv,message", [(["5", "4"], "part '5/4'"), (["0", "4"], "part '0/4'")])
def test_a_part_outside_1_to_n_is_refused_in_one_line(argv, message):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "split_tests.py"), *argv], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "" and message in r.stderr and len(r.stderr.splitlines()) == 1


def test_gpu_check_runs_part_k_of_n_from_the_tool():
    """tools/gpu_check.sh's tests stage takes TESTS_PART=K/N's files from split_tests.py."""
    text = (ROOT / "tools" / "gpu_check.sh").read_text()
    assert 'tools/split_tests.py "${TESTS_PART%/*}" "${TESTS_PART#*/}"' in text
