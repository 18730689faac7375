#!/usr/bin/env python3
"""Did each sanitized test launch the kernels tools/sanitize_nodes.txt says it covers?

    python3 tools/check_sanitize_coverage.py tools/sanitize_nodes.txt LOG

LOG is what a pytest run over the nodes wrote under DRVQWEN_LAUNCH_LOG: `# node ID`
before each test, then one kernel name per launch (drvqwen.cuda.launch). A line of the nodes
file names a test file, a test function or one parametrized case; it owns every logged test
whose id it is, or starts with followed by `::` or `[`. Prints one line per node and exits 1 if
a node launched none of the tests it names or fewer kernels than it claims, so the sanitizers'
"0 errors" cannot stand for a kernel they never saw.
"""

from __future__ import annotations

import sys
from pathlib import Path


def read_nodes(path: Path) -> dict[str, set[str]]:
    """{node id: the kernels it claims}, from the nodes file (comments and blank lines skipped)."""
    nodes: dict[str, set[str]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) < 2:
            raise SystemExit(f"{path}:{n}: a node needs at least one kernel: {line.strip()!r}")
        nodes[words[0]] = set(words[1:])
    return nodes


def read_log(path: Path) -> dict[str, set[str]]:
    """{test id: the kernels it launched}, from a launch log."""
    launched: dict[str, set[str]] = {}
    current = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# node "):
            current = line[len("# node "):]
            launched.setdefault(current, set())
        elif line and current is not None:
            launched[current].add(line)
    return launched


def owns(node: str, test_id: str) -> bool:
    return test_id == node or test_id.startswith(node + "::") or test_id.startswith(node + "[")


def check(nodes: dict[str, set[str]], launched: dict[str, set[str]]) -> list[str]:
    """One line per node that fails (never ran, or launched less than it claims)."""
    problems = []
    for node, claimed in nodes.items():
        tests = [t for t in launched if owns(node, t)]
        if not tests:
            problems.append(f"{node}: no test of this node ran")
            continue
        seen = set().union(*(launched[t] for t in tests))
        missing = claimed - seen
        if missing:
            problems.append(f"{node}: claims {', '.join(sorted(missing))} but never launched it "
                            f"(launched: {', '.join(sorted(seen)) or 'nothing'})")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    nodes = read_nodes(Path(argv[0]))
    # No log at all (the memcheck run launched nothing, or never started): every node uncovered.
    problems = check(nodes, read_log(Path(argv[1])) if Path(argv[1]).is_file() else {})
    for p in problems:
        print(f"NOT COVERED  {p}")
    print(f"sanitize coverage: {len(nodes) - len(problems)} of {len(nodes)} nodes launched what they claim")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
