#!/usr/bin/env python3
"""How long a person waits for `drvqwen run`: exec of the process → the first byte of the answer
on stdout, measured from outside, as a user would run it.

    PYTHONPATH=src python3 tools/bench_startup.py --model M.nanoqwen [--runs 5] [--cold-cache] [--json OUT]
    PYTHONPATH=src python3 tools/bench_startup.py --compare warm.json cold.json   # medians side by side
    PYTHONPATH=src python3 tools/bench_startup.py --model M.nanoqwen --runs 7 \
        --variant now: --variant late-worker:DRVQWEN_STARTUP_TOKENIZER_WORKER=model \
        --variant one-by-one:DRVQWEN_STARTUP_GATHERED_UPLOAD=off                # variants in one run

Each run is `python -m drvqwen run --model M -v --json-stats …` in a process of its own, with
this checkout's src/ (or --src) on PYTHONPATH. The clock starts just before the process is
spawned; stdout is a pipe read unbuffered, and the first byte that arrives stops the first
clock (the answer's first text: drvqwen flushes each piece as it is decoded); the exit stops
the second. Beside those, each run's own `--json-stats` phases (measured inside the process,
from its exec) say where the time went; the table lists both, run by run, with the medians.

Python's bytecode is written and used as an installed package has it: PYTHONDONTWRITEBYTECODE is
removed from the runs' environment (the unmeasured first run writes the .pyc files).

--cold-cache gives each run an empty kernel cache and nothing else new: a fresh cache root
whose cubin/ folder is empty and whose other entries (models/, state/, hub/, tokenizer/ — the
model, its verified-CRC record, the tokenizer's cached form) are links to those of $DRVQWEN_CACHE. Without it the runs share the
ordinary cache. Either way one unmeasured run (of each variant) goes first: it fills an empty kernel cache,
reads the model into the page cache and writes the .pyc files.

--variant NAME:ENV=VALUE[,ENV=VALUE] (repeatable; `NAME:` alone runs the environment as it is)
times variants of the same command against each other: each variant's environment is the runs'
with its variables set, and the runs are interleaved — A B C, A B C, … — so that whatever drifts
during the measurement (the machine's clocks, its other load, the page cache) falls on every
variant alike. Each variant has one unmeasured run first. The start-up's measurement switches
(DRVQWEN_STARTUP_*: src/drvqwen/startup.py, docs/gpu-workflow.md) are what it is for.

The JSON (--json) holds every run, the medians, the command line and
`drvqwen.provenance.source_record()` of the code that ran (asked of that code itself); with
--variant, `variants` holds each one's name, environment, runs and medians instead of `runs`
and `median`.

A synthetic model of a real shape with the real tokenizer embedded starts up as the real model
does; on a machine without the network, carry the tokenizer (5 MB) instead of the model:

    # where the real 0.5B is in the cache (or can be pulled):
    mkdir -p .carry && PYTHONPATH=src python3 -c "from drvqwen.models import resolve_model; \
        open('.carry/qwen2.5-coder-tokenizer.json', 'w', encoding='utf-8').write(resolve_model(None).tokenizer_json)"
    # on the other machine:
    PYTHONPATH=src python3 tools/make_synthetic.py --preset 0.5b --tokenizer .carry/qwen2.5-coder-tokenizer.json -o /tmp/syn05.nanoqwen
    PYTHONPATH=src python3 tools/bench_startup.py --model /tmp/syn05.nanoqwen --json warm.json
"""

from __future__ import annotations

import argparse
import json
import re
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPT = "Write a Python function is_palindrome(s) that ignores case and punctuation."
# The -v phases in the order a GPU run meets them (drvqwen.stats), for the table's rows.
PHASE_ORDER = ("start", "import", "context", "read", "verify", "compile", "modules", "upload", "load",
               "tokenizer", "tokenize", "prefill", "first token", "graph capture", "decode", "generate",
               "tokenizer cache")


def cache_root() -> Path:
    """The cache root drvqwen uses (paths.cache_root's rule), not created."""
    env = os.environ.get("DRVQWEN_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "drvqwen"


def cold_cache_root(parent: Path) -> Path:
    """A new cache root under `parent`: an empty cubin/ folder, every other entry of the real
    cache root linked."""
    root = Path(tempfile.mkdtemp(prefix="cache-", dir=parent))
    real = cache_root()
    if real.is_dir():
        # The tokenizer's cached form is written by the first run (the unmeasured one) and
        # read by the rest, as it is with the ordinary cache: its folder is shared too.
        (real / "tokenizer").mkdir(exist_ok=True)
        for entry in real.iterdir():
            if entry.name != "cubin":
                (root / entry.name).symlink_to(entry.resolve())
    (root / "cubin").mkdir()
    return root


def run_environment(src: str, base: dict[str, str]) -> dict[str, str]:
    """The runs' environment: `base` with `src` first on PYTHONPATH, and bytecode as an
    installed drvqwen has it (pip writes the .pyc files at install) — PYTHONDONTWRITEBYTECODE
    removed: an environment that forbids writing them has every run compile ~240 modules from
    source, half a second that no user of a package waits for."""
    env = dict(base, PYTHONPATH=os.pathsep.join([src, *filter(None, [base.get("PYTHONPATH")])]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_once(cmd: list[str], env: dict[str, str], stats_path: Path, stderr_path: Path) -> dict:
    """One run of `cmd`: seconds from just before the spawn to the first byte on stdout and to
    the exit, the exit status, the bytes of stdout, and the run's --json-stats."""
    stats_path.unlink(missing_ok=True)
    with open(stderr_path, "wb") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env, bufsize=0)
        first = os.read(p.stdout.fileno(), 1)
        t_first = time.perf_counter()
        rest = p.stdout.read()
        p.wait()
        t_exit = time.perf_counter()
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else None
    return {"first_byte_s": t_first - t0 if first else None, "exit_s": t_exit - t0, "returncode": p.returncode,
            "stdout_bytes": len(first) + len(rest or b""), "stats": stats,
            "stderr_tail": stderr_path.read_text(errors="replace").strip().splitlines()[-1:]}


def provenance(python: str, env: dict[str, str]) -> dict | None:
    """source_record() of the drvqwen that `env` runs, asked of that code."""
    r = subprocess.run([python, "-c", "import json; from drvqwen.provenance import source_record; "
                                      "print(json.dumps(source_record()))"],
                       env=env, capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else None


def medians(runs: list[dict]) -> dict:
    """Median first byte, exit, internal first output and every phase over the runs that
    succeeded (a phase a run lacks counts as 0 there)."""
    ok = [r for r in runs if r["returncode"] == 0 and r["first_byte_s"] is not None]
    if not ok:
        return {}
    phases = sorted({k for r in ok for k in (r["stats"] or {}).get("phases_s", {})},
                    key=lambda k: (PHASE_ORDER.index(k) if k in PHASE_ORDER else len(PHASE_ORDER), k))

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    return {
        "first_byte_s": med(r["first_byte_s"] for r in ok),
        "exit_s": med(r["exit_s"] for r in ok),
        "first_output_s": med((r["stats"] or {}).get("first_output_s") for r in ok),
        "phases_s": {k: med((r["stats"] or {}).get("phases_s", {}).get(k, 0.0) for r in ok) for k in phases},
        "runs": len(ok),
    }


def _ms(x) -> str:
    return "" if x is None else f"{x * 1e3:.0f}"


def print_runs(con: Console, title: str, runs: list[dict], med: dict) -> None:
    """Rows: the outside figures, then the run's own phases; columns: each run, the median."""
    t = Table(title=title)
    t.add_column("ms")
    for i in range(len(runs)):
        t.add_column(f"run {i + 1}", justify="right")
    t.add_column("median", justify="right", style="bold")
    t.add_row("exec → first byte on stdout", *(_ms(r["first_byte_s"]) for r in runs), _ms(med.get("first_byte_s")))
    t.add_row("exec → exit", *(_ms(r["exit_s"]) for r in runs), _ms(med.get("exit_s")))
    t.add_row("first text, the run's own clock", *(_ms((r["stats"] or {}).get("first_output_s")) for r in runs),
              _ms(med.get("first_output_s")))
    for k, v in med.get("phases_s", {}).items():
        t.add_row(f"  {k}", *(_ms((r["stats"] or {}).get("phases_s", {}).get(k)) for r in runs), _ms(v))
    counts = [(r["stats"] or {}).get("counts", {}) for r in runs]
    if any(counts):
        t.add_row("kernels compiled / cached", *(f"{c.get('kernels_compiled', '')}/{c.get('kernels_cached', '')}"
                                                 for c in counts), "")
    con.print(t)


def medians_table(title: str, columns: list[tuple[str, dict]]) -> Table:
    """A table of medians (`medians`' dicts), one column per (heading, medians)."""
    t = Table(title=title)
    t.add_column("ms")
    for heading, med in columns:
        t.add_column(f"{heading}\n{med.get('runs', 0)} runs", justify="right")
    t.add_row("exec → first byte on stdout", *(_ms(m.get("first_byte_s")) for _, m in columns))
    t.add_row("exec → exit", *(_ms(m.get("exit_s")) for _, m in columns))
    phases = [k for k in PHASE_ORDER if any(k in m.get("phases_s", {}) for _, m in columns)]
    for k in phases:
        t.add_row(f"  {k}", *(_ms(m.get("phases_s", {}).get(k)) for _, m in columns))
    return t


def compare(con: Console, paths: list[str]) -> int:
    """One table of the medians of several saved runs (--json files), side by side: a column
    per file, or per variant of a file written with --variant."""
    columns = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        cache = "cold" if d["cold_cache"] else "warm"
        for v in d.get("variants") or [{"name": None, "median": d["median"]}]:
            name = Path(p).stem + (f" {v['name']}" if v["name"] is not None else "")
            columns.append((f"{name}\n{cache} cache", v["median"]))
    con.print(medians_table("exec → first byte, medians (ms)", columns))
    return 0


@dataclass(frozen=True)
class Variant:
    """A name and the environment variables its runs set (on top of the runs' environment)."""
    name: str
    env: dict[str, str] = field(default_factory=dict)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_variant(text: str) -> Variant:
    """`NAME:ENV=VALUE[,ENV=VALUE]` (or `NAME:`, no variable set) → Variant.

    Raises:
        argparse.ArgumentTypeError: no name, an item without `=`, a name that is not an
            environment variable's, a variable set twice (one line, quoting the text).
    """
    name, colon, rest = text.partition(":")
    if not colon or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:ENV=VALUE[,ENV=VALUE] (or NAME: for no change)")
    env: dict[str, str] = {}
    for item in rest.split(",") if rest else []:
        key, eq, value = item.partition("=")
        if not eq or not _ENV_NAME.fullmatch(key):
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not ENV=VALUE")
        if key in env:
            raise argparse.ArgumentTypeError(f"{text!r}: {key} is set twice")
        env[key] = value
    return Variant(name.strip(), env)


def interleaved(variants: list[Variant], runs: int) -> list[tuple[int, Variant]]:
    """(round, variant) in the order they run: every variant once per round, A B C, A B C, …"""
    return [(i, v) for i in range(runs) for v in variants]


def measure(variants: list[Variant], runs: int, run_one: Callable[[Variant], dict],
            say: Callable[[str], None]) -> dict[str, list[dict]] | None:
    """Each variant's measured runs, by name: one unmeasured run of each variant first (it
    fills an empty kernel cache, reads the model into the page cache, writes the .pyc files,
    and shows that the variant runs at all), then `runs` rounds (`interleaved`). run_one(v)
    runs the command once with v's environment and returns run_once's dict. None when a
    variant's first run fails (said)."""
    for v in variants:
        warm = run_one(v)
        if warm["returncode"]:
            say(f"drvqwen run ({v.name}) failed ({warm['returncode']}): {' '.join(warm['stderr_tail'])}")
            return None
    out: dict[str, list[dict]] = {v.name: [] for v in variants}
    for i, v in interleaved(variants, runs):
        r = run_one(v)
        out[v.name].append(r)
        say(f"run {i + 1}{f' {v.name}' if len(variants) > 1 else ''}: first byte {_ms(r['first_byte_s'])} ms, "
            f"exit {_ms(r['exit_s'])} ms" + (f", failed ({r['returncode']}): {' '.join(r['stderr_tail'])}"
                                              if r["returncode"] else ""))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the model to run (a .nanoqwen, or anything --model takes)")
    ap.add_argument("--runs", type=int, default=5, help="measured runs (default 5), of each variant")
    ap.add_argument("--cold-cache", action="store_true", help="an empty kernel cache for every run")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--src", default=str(REPO / "src"), help="the drvqwen source tree to run (default: this checkout's)")
    ap.add_argument("--variant", action="append", type=parse_variant, default=[], metavar="NAME:ENV=VALUE[,ENV=VALUE]",
                    help="a variant of the runs' environment, timed interleaved with the others (repeatable)")
    ap.add_argument("--json", help="write every run and the medians here")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="print the medians of saved runs side by side")
    a = ap.parse_args()
    con = Console(stderr=True)
    if a.compare:
        return compare(Console(width=140), a.compare)
    if not a.model or a.runs < 1:
        ap.error("--model and --runs >= 1 are needed (or --compare)")
    names = [v.name for v in a.variant]
    if len(set(names)) != len(names):
        ap.error(f"--variant: two variants named {next(n for n in names if names.count(n) > 1)!r}")
    variants = a.variant or [Variant("default")]
    env = run_environment(a.src, os.environ)
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    stats_path, stderr_path = work / "stats.json", work / "stderr.txt"
    cmd = [sys.executable, "-m", "drvqwen", "run", "--model", a.model, "--device", a.device, "--prompt", a.prompt,
           "--max-new-tokens", str(a.max_new_tokens), "--ignore-eos", "-v", "--json-stats", str(stats_path)]
    try:
        def run_one(v: Variant) -> dict:
            base = dict(env, DRVQWEN_CACHE=str(cold_cache_root(work))) if a.cold_cache else env
            return run_once(cmd, {**base, **v.env}, stats_path, stderr_path)

        by_name = measure(variants, a.runs, run_one, lambda m: con.print(m, soft_wrap=True))
        if by_name is None:
            return 1
        meds = {v.name: medians(by_name[v.name]) for v in variants}
        backend = next(((r["stats"] or {}).get("backend") for rs in by_name.values() for r in rs if r["stats"]), "?")
        title = (f"drvqwen run, {Path(a.model).name}, {backend}, {'cold' if a.cold_cache else 'warm'} kernel cache, "
                 f"{os.cpu_count()} cores")
        out_con = Console(width=140)
        for v in variants:
            named = f"{title}, {v.name} ({' '.join(f'{k}={x}' for k, x in v.env.items()) or 'as is'})" \
                if a.variant else title
            print_runs(out_con, named, by_name[v.name], meds[v.name])
        if a.variant:
            out_con.print(medians_table("medians (ms), runs interleaved", [(v.name, meds[v.name]) for v in variants]))
        if a.json:
            shown = ["python", "-m", "drvqwen", *cmd[3:]]      # no paths of this machine in the record
            shown[shown.index("--model") + 1] = Path(a.model).name
            shown[-1] = "STATS.json"
            out = {"source": provenance(sys.executable, env), "tool": "tools/bench_startup.py",
                   "command": shown,
                   "model": Path(a.model).name, "cold_cache": a.cold_cache, "cores": os.cpu_count(),
                   "machine": platform.machine()}
            if a.variant:
                out["order"] = "interleaved"
                out["variants"] = [{"name": v.name, "env": v.env, "runs": by_name[v.name], "median": meds[v.name]}
                                   for v in variants]
            else:
                out.update(runs=by_name[variants[0].name], median=meds[variants[0].name])
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        return 0 if all(meds.values()) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
