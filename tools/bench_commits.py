#!/usr/bin/env python3
"""Decode speed of several commits' trees, in turns on one machine: where a speed change came from.

    PYTHONPATH=src python3 tools/bench_commits.py --commits d1f479d . [--preset 0.5b]
        [--rounds 2] [--mode graph] [--bench-arg=--new-tokens --bench-arg=64] [--out DIR] [--dry-run]

Each commit's runtime tree (src/, kernels/, ptx/ and pyproject.toml: what drvqwen.provenance
hashes) is written by `git archive` into DIR/trees/<commit>/, and `python -m drvqwen.bench` of that
tree runs there: its own code, its own kernels, its own synthetic model. The runs go commit after
commit, round after round, so runs of different commits interleave and a drift of the machine
shows in every commit instead of as a difference between two — the same-run comparison a speed
claim needs. `.` names the tree this tool runs from, as it is (uncommitted edits included; its
runs name the commit $DRVQWEN_SOURCE_COMMIT claims, else drvqwen.provenance's own answer): the
way to compare against a commit the machine's git does not have yet. The file format can differ
between commits, so the synthetic file (drvqwen.bench.default_synthetic_path) is deleted before
every run and each tree writes its own (a few seconds for the 0.5B, ~30 s for the 7B). A tree is not a checkout, so each run is told its
commit through $DRVQWEN_SOURCE_COMMIT; its JSON then names the code that made it, and
tests/test_figures.py can check the claim against the commit's digest.

Prints one line per run and each commit's medians; writes DIR/<commit>_<round>.json per run and
DIR/summary.json. Needs the GPU (the runs), git (the trees) and the commits in this repository's
history (a shallow clone may lack old ones); --dry-run prints the commands only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE_PATHS = ("src", "kernels", "ptx", "pyproject.toml")


def resolve(commits: list[str], root: Path = ROOT) -> list[str]:
    """The full hashes of `commits` (names git understands: hashes, HEAD~3, tags), in order;
    `.` (this tree) stays `.`.

    Raises:
        SystemExit: one line naming the first that is not a commit of the repository at `root`.
    """
    out = []
    for c in commits:
        if c == ".":
            out.append(c)
            continue
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{c}^{{commit}}"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"--commits {c}: not a commit of this repository (a shallow clone may lack it)")
        out.append(r.stdout.strip())
    return out


def write_tree(commit: str, dest: Path, root: Path = ROOT) -> Path:
    """Write `commit`'s TREE_PATHS into `dest` (created; an existing tree of it is kept) by git
    archive; returns dest."""
    if (dest / "src" / "drvqwen").is_dir():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with subprocess.Popen(["git", "-C", str(root), "archive", commit, *TREE_PATHS], stdout=subprocess.PIPE) as p:
        with tarfile.open(fileobj=p.stdout, mode="r|") as tar:
            tar.extractall(dest, filter="data")
    if p.returncode != 0:
        raise SystemExit(f"git archive {commit[:12]} failed (exit {p.returncode})")
    return dest


def bench_command(tree: Path, commit: str, preset: str, mode: str, json_path: Path,
                  extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of one run of `tree`'s drvqwen.bench, told its commit (`.`: the
    environment's claim, if any, stands)."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    if commit != ".":
        env["DRVQWEN_SOURCE_COMMIT"] = commit
    argv = [sys.executable, "-m", "drvqwen.bench", "--preset", preset, "--mode", mode, "--json", str(json_path), *extra]
    return argv, env


def medians(run: dict) -> dict[str, float]:
    """{mode: ITL median ms} and {mode + " ttft": TTFT median ms} of one bench JSON."""
    out = {}
    for mode, m in run.get("modes", {}).items():
        out[mode] = m["itl_median_ms"]
        if m.get("ttft_median_ms") is not None:
            out[f"{mode} ttft"] = m["ttft_median_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commits", nargs="+", required=True, help="commits to compare (at least one)")
    ap.add_argument("--preset", default="0.5b")
    ap.add_argument("--mode", default="graph", choices=("eager", "graph", "both"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bench-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for drvqwen.bench (repeat; write --bench-arg=--new-tokens)")
    ap.add_argument("--out", type=Path, default=Path("bench_commits"))
    ap.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: at least 1")
    commits = resolve(a.commits)

    from drvqwen.bench import default_synthetic_path

    synthetic = default_synthetic_path(a.preset)
    runs = []
    for r in range(1, a.rounds + 1):
        for c in commits:
            name = "this_tree" if c == "." else c[:12]
            tree = ROOT if c == "." else a.out / "trees" / name
            json_path = (a.out / f"{name}_{r}.json").resolve()
            cmd, env = bench_command(tree.resolve(), c, a.preset, a.mode, json_path, a.bench_arg)
            if a.dry_run:
                claim = f"DRVQWEN_SOURCE_COMMIT={env['DRVQWEN_SOURCE_COMMIT']} " if "DRVQWEN_SOURCE_COMMIT" in env else ""
                print(f"rm -f {synthetic}; (cd {tree} && PYTHONPATH={env['PYTHONPATH']} {claim}{' '.join(cmd)})")
                continue
            if c != ".":
                write_tree(c, tree)
            synthetic.unlink(missing_ok=True)
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=a.timeout)
            if done.returncode != 0 or not json_path.is_file():
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                raise SystemExit(f"{name} round {r}: drvqwen.bench exited {done.returncode}: {tail[0]}")
            run = json.loads(json_path.read_text())
            got = medians(run)
            runs.append({"commit": run.get("source", {}).get("commit") if c == "." else c, "tree": name,
                         "round": r, "json": json_path.name, **got})
            print(f"{name} round {r}: " + ", ".join(f"{k} {v:.4f} ms" for k, v in got.items()), flush=True)
    if a.dry_run:
        return 0
    summary = {"preset": a.preset, "mode": a.mode, "bench_args": a.bench_arg, "runs": runs}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("medians over the rounds:")
    for c in commits:
        name = "this_tree" if c == "." else c[:12]
        mine = [run for run in runs if run["tree"] == name]
        keys = [k for k in mine[0] if k not in ("commit", "tree", "round", "json")]
        vals = {k: sorted(run[k] for run in mine)[len(mine) // 2] for k in keys}
        print(f"  {name}: " + ", ".join(f"{k} {v:.4f} ms" for k, v in vals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
