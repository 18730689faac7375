"""The GPU test stage's files in N parts of about equal time, for N pytest processes side by side.

    python3 tools/split_tests.py K N [--junit XML ...]    # the paths of part K (1 … N), one a line

tools/gpu_check.sh runs it for TESTS_PART=K/N. Most of the stage's time is the test files'
own host work (writing synthetic models, the numpy reference, compiling), not the GPU, so N
processes on one GPU machine finish in about 1/N of the time — as long as the parts are
balanced. The units are tests/test_*.py and tests/dev/ (one unit). Each unit's cost: the
seconds its tests took in the junit XML files given (`--junit`, e.g. the tests-gpu.xml of the
last run), else tools/gpu_test_seconds.json's, else DEFAULT_SECONDS for a file with GPU tests not
measured yet and nothing for one without (its tests are deselected: `-m gpu`).
The parts: longest processing time first (units by cost, most first, each to the part with the
least so far; ties by name and by part number), so the split is the same on every machine and
every unit is in exactly one part.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COSTS_FILE = ROOT / "tools" / "gpu_test_seconds.json"
DEFAULT_SECONDS = 5.0  # a unit with GPU tests neither the junit files nor the table know


def units(root: Path = ROOT) -> list[str]:
    """The stage's units, as paths relative to the repository root: tests/test_*.py, then tests/dev/."""
    found = sorted(p.relative_to(root).as_posix() for p in (root / "tests").glob("test_*.py"))
    return found + (["tests/dev/"] if (root / "tests" / "dev").is_dir() else [])


def unit_of(classname: str) -> str | None:
    """The unit of a junit testcase's classname: a module's dotted path, with its test class if any."""
    parts = [p for p in classname.split(".") if p]
    if parts and parts[-1][:1].isupper():
        parts = parts[:-1]
    if len(parts) < 2 or parts[0] != "tests":
        return None
    return "tests/dev/" if parts[1] == "dev" else "/".join(parts) + ".py"


def junit_seconds(paths: list[Path]) -> dict[str, float]:
    """Seconds per unit, summed over the testcases of the junit XML files `paths`.

    Raises:
        ValueError: a file that is not junit XML (its path and the parser's reason).
    """
    seconds: dict[str, float] = {}
    for path in paths:
        try:
            cases = ET.parse(path).getroot().iter("testcase")
        except (ET.ParseError, OSError) as e:
            raise ValueError(f"{path}: not a junit XML file ({e})") from None
        for case in cases:
            unit = unit_of(case.get("classname") or "")
            if unit is not None:
                seconds[unit] = seconds.get(unit, 0.0) + float(case.get("time") or 0.0)
    return seconds


def has_gpu_tests(unit: str, root: Path = ROOT) -> bool:
    """Whether a unit's files mark any test `gpu` (pytest.mark.gpu, or the gpu marker by name)."""
    path = root / unit
    files = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
    return any("mark.gpu" in f.read_text(encoding="utf-8") for f in files if f.is_file())


def split(all_units: list[str], seconds: dict[str, float], n: int, root: Path = ROOT) -> list[list[str]]:
    """`all_units` in n parts by longest processing time first (module doc); each part sorted."""
    cost = {u: seconds.get(u, DEFAULT_SECONDS if has_gpu_tests(u, root) else 0.0) for u in all_units}
    parts: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for unit in sorted(all_units, key=lambda u: (-cost[u], u)):
        k = min(range(n), key=lambda i: (load[i], i))
        parts[k].append(unit)
        load[k] += cost[unit]
    return [sorted(p) for p in parts]


def parse_part(text: str) -> tuple[int, int]:
    """"K/N" → (K, N), 1 ≤ K ≤ N.

    Raises:
        ValueError: anything else, naming the text.
    """
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"part {text!r}: want K/N with 1 ≤ K ≤ N, e.g. 2/4")
    return int(k), int(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("k", type=int, help="the part to print, 1 … N")
    p.add_argument("n", type=int, help="the number of parts")
    p.add_argument("--junit", type=Path, nargs="+", default=[], help="junit XML files whose test times to use")
    a = p.parse_args(argv)
    try:
        k, n = parse_part(f"{a.k}/{a.n}")
        seconds = json.loads(COSTS_FILE.read_text())["seconds"] if COSTS_FILE.is_file() else {}
        seconds.update(junit_seconds(a.junit))
    except ValueError as e:
        print(f"split_tests.py: {e}", file=sys.stderr)
        return 2
    print("\n".join(split(units(), seconds, n)[k - 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
