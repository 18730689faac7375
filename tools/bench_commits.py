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

The synthetic file is written once, not before every run, when every tree's code that writes it
(src/drvqwen/format/, config.py, bench.py: `synthetic_key`) is byte for byte the same — the
7B's ~30 s a run then go to the first run only.

On a machine without this repository's history (a GPU machine that gets a copy of the working
tree), prepare the trees here and carry DIR there:

    tools/bench_commits.py --commits 194fb36 . --out .carry/bc --prepare       # here: git archive
    tools/bench_commits.py --commits 194fb36 . --out .carry/bc --preset 7b     # there: no git needed

Each tree written holds a COMMIT file (the full hash); a commit that git cannot resolve is found
by it among DIR/trees/*.

Prints one line per run and each commit's medians; writes DIR/<commit>_<round>.json per run and
DIR/summary.json. Needs the GPU (the runs), and git with the commits in this repository's history
(a shallow clone may lack old ones) or trees prepared in DIR; --dry-run prints the commands only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE_PATHS = ("src", "kernels", "ptx", "pyproject.toml")


def resolve(commits: list[str], root: Path = ROOT, trees: Path | None = None) -> list[str]:
    """The full hashes of `commits` (names git understands: hashes, HEAD~3, tags), in order;
    `.` (this tree) stays `.`. A commit git cannot resolve (no repository here, or not in its
    history) is looked up by its hash prefix among the COMMIT files of `trees` (write_tree's).

    Raises:
        SystemExit: one line naming the first that is neither.
    """
    out = []
    for c in commits:
        if c == ".":
            out.append(c)
            continue
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{c}^{{commit}}"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            out.append(r.stdout.strip())
            continue
        prepared = prepared_commits(trees) if trees is not None else []
        found = [h for h in prepared if h.startswith(c.lower())]
        if len(found) != 1:
            where = f" nor a tree prepared in {trees}" if trees is not None else ""
            raise SystemExit(f"--commits {c}: not a commit of this repository (a shallow clone may lack it){where}")
        out.append(found[0])
    return out


def prepared_commits(trees: Path) -> list[str]:
    """The full hashes named by the COMMIT files of the trees under `trees` (none if it is absent)."""
    if not trees.is_dir():
        return []
    return sorted({f.read_text().strip() for f in trees.glob("*/COMMIT")})


def synthetic_key(tree: Path) -> str:
    """sha256 over the files of `tree` that decide the synthetic model bench writes — src/drvqwen/format/
    (the file format and the synthetic weights), config.py (the presets) and bench.py (the seed) —
    names and bytes. Equal keys: the trees write the same file."""
    src = tree / "src" / "drvqwen"
    files = sorted(p for p in (src / "format").rglob("*.py")) + [src / "config.py", src / "bench.py"]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(tree)).encode() + b"\0" + (f.read_bytes() if f.is_file() else b"") + b"\0")
    return h.hexdigest()


def write_tree(commit: str, dest: Path, root: Path = ROOT) -> Path:
    """Write `commit`'s TREE_PATHS into `dest` (created; an existing tree of it is kept) by git
    archive, and its full hash into dest/COMMIT; returns dest."""
    if (dest / "src" / "drvqwen").is_dir():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with subprocess.Popen(["git", "-C", str(root), "archive", commit, *TREE_PATHS], stdout=subprocess.PIPE) as p:
        with tarfile.open(fileobj=p.stdout, mode="r|") as tar:
            tar.extractall(dest, filter="data")
    if p.returncode != 0:
        raise SystemExit(f"git archive {commit[:12]} failed (exit {p.returncode})")
    (dest / "COMMIT").write_text(commit + "\n")
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
    ap.add_argument("--prepare", action="store_true",
                    help="write the commits' trees into OUT/trees (git archive) and run nothing: for a machine "
                         "without this repository's history")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: at least 1")
    commits = resolve(a.commits, trees=a.out / "trees")
    if a.prepare:
        for c in commits:
            if c != ".":
                print(write_tree(c, a.out / "trees" / c[:12]))
        return 0

    from drvqwen.bench import default_synthetic_path

    synthetic = default_synthetic_path(a.preset)
    runs = []
    keys = set()
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
            if not keys:  # before the first run: the trees' keys, once
                keys = {synthetic_key(ROOT if c2 == "." else write_tree(c2, a.out / "trees" / c2[:12]))
                        for c2 in commits}
                if len(keys) == 1:
                    print(f"one synthetic file for every run (the trees write the same: {synthetic})", flush=True)
            if len(keys) > 1 or not runs:
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
