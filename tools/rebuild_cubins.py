#!/usr/bin/env python3
"""A cubin cache for this checkout, from an older one: the seed a fresh GPU machine needs after a
kernel change, without the stale entries.

    python3 tools/rebuild_cubins.py rebuild OLD_CACHE [--out DIR] [--touching FILE ...] [--dry-run]
    python3 tools/rebuild_cubins.py keep CACHE OUT [--tree ROOT ...] [--seed]

Why: a GPU machine seeded with the cubins of an earlier tree (tools/gpu_check.sh CUBIN_SEED,
docs/gpu-workflow.md#the-cubin-cache-between-machines) misses every build whose kernel file or
headers changed since, and compiles those on the device: with four test parts side by side each
compiling the same builds, minutes of a command's time. A cache entry records its kernel and
NVRTC options (its .json), so the builds a test stage used can be compiled again from the
current sources, on a CPU machine with the same toolchain.

rebuild: every (kernel, defines) recorded in OLD_CACHE, compiled from this checkout's kernels/
and ptx/ into --out (default: the cache this checkout uses, drvqwen.paths.cubin_dir()); an entry
already there is a hit and costs nothing. --touching FILE … keeps the builds whose kernel file or
included headers have one of those names (gemm_epilogue.cuh, gemv_int4.cu: what a change edited).
A recorded kernel this checkout lacks (an experiment since removed) is named and skipped.

keep: copies into OUT the entries of CACHE that the trees ROOT … (default: this checkout; a tree
is a folder with kernels/ and ptx/, e.g. one written by tools/bench_commits.py --prepare) would
hit: the cache key recomputed from each tree's sources for the entry's options and toolchain. So
the seed carried to the GPU machine holds only cubins that can hit there. With --seed, OUT gets
them as the seed itself: OUT/cubins.tar.xz.00, .01, … (one xz-compressed tar in parts of 15 MiB,
what tools/gpu_check.sh's CUBIN_SEED=OUT unpacks), in place of the folders.

After a fresh checkout (no earlier cache at hand), `pytest tests/test_compile.py` fills this
checkout's cache with every kernel's default build and the launchers' variants, and `keep
"$(python3 -c 'from drvqwen import paths; print(paths.cubin_dir())')" .carry/seed --seed` makes
the seed of those; the builds only the GPU tests ask for are then compiled there.

Needs NVRTC for rebuild (no GPU); keep reads files only. Exits 0, 2 on a bad argument (one line).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from drvqwen.cuda import nvrtc, sources  # noqa: E402


def recorded_builds(cache: Path) -> list[tuple[Path, dict]]:
    """(metadata path, metadata) of every entry of `cache` (its .json files, any depth) that
    names its kernel, options and key; unreadable or partial records are skipped."""
    out = []
    for meta in sorted(cache.rglob("*.json")):
        try:
            d = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and {"name", "options", "cache_key", "toolchain"} <= d.keys():
            out.append((meta, d))
    return out


def defines_of(options: list[str]) -> dict[str, int | str]:
    """The -DNAME=VALUE options of a recorded build, as compile_kernel's defines."""
    defines: dict[str, int | str] = {}
    for opt in options:
        if opt.startswith("-D"):
            name, _, value = opt[2:].partition("=")
            defines[name] = int(value) if value.lstrip("-").isdigit() else value
    return defines


def _kernel_source(name: str, kernels_dir: Path | None = None):
    try:
        return sources.kernel_source(name, kernels_dir)
    except FileNotFoundError:
        return None


def rebuild_requests(cache: Path, touching: set[str] | None = None,
                     tree: Path = ROOT) -> tuple[list[tuple[str, dict]], list[str]]:
    """The distinct (kernel, defines) builds recorded in `cache` that `tree` (a folder with
    kernels/ and ptx/) has, those whose kernel file or headers are named in `touching` if given;
    and the recorded kernels it lacks."""
    requests, seen, missing = [], set(), set()
    for _meta, d in recorded_builds(cache):
        source = _kernel_source(d["name"], tree / "kernels")
        if source is None:
            missing.add(d["name"])
            continue
        if touching is not None:
            names = {Path(d["name"]).name + ".cu"} | {Path(h[0]).name for h in d.get("headers", [])}
            if not names & touching:
                continue
        defines = defines_of(d["options"])
        key = (d["name"], tuple(sorted(defines.items())))
        if key not in seen:
            seen.add(key)
            requests.append((d["name"], defines))
    return requests, sorted(missing)


def entries_hit_by(cache: Path, trees: list[Path]) -> list[Path]:
    """The metadata files of `cache` whose key one of `trees` (folders with kernels/ and ptx/)
    reproduces from its own sources: the entries a machine running that tree would hit."""
    hits = []
    for meta, d in recorded_builds(cache):
        for tree in trees:
            source = _kernel_source(d["name"], tree / "kernels")
            if source is None:
                continue
            headers = sources.included_headers(source, [tree / "ptx"])
            key = nvrtc.cache_key(source, headers, d["options"], d["toolchain"], d.get("arch", nvrtc.ARCH))
            if key == d["cache_key"]:
                hits.append(meta)
                break
    return hits


def keep(cache: Path, out: Path, trees: list[Path]) -> int:
    """Copy the entries of `cache` that `trees` hit into `out`, in the same folders; returns
    their count."""
    n = 0
    for meta in entries_hit_by(cache, trees):
        rel = meta.relative_to(cache)
        for path in (meta, meta.with_suffix(".cubin")):
            if path.exists():
                (out / rel.parent).mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, out / rel.parent / path.name)
        n += 1
    return n


SEED_PART_BYTES = 15 * 2**20  # the most a device command's output carries per file (gpu_check.sh's CUBIN_EXPORT)


def write_seed(entries: Path, out: Path, part_bytes: int = SEED_PART_BYTES) -> list[Path]:
    """The files under `entries` (a cache's folders) as one xz-compressed tar, names relative to
    `entries`, split into OUT/cubins.tar.xz.00, .01, … of at most part_bytes each (earlier parts
    there removed first); returns the parts written, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for path in sorted(p for p in entries.rglob("*") if p.is_file()):
            tar.add(path, arcname=path.relative_to(entries).as_posix())
    data = buf.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("cubins.tar.xz.*"):
        old.unlink()
    parts = []
    for i in range(0, max(len(data), 1), part_bytes):
        part = out / f"cubins.tar.xz.{i // part_bytes:02d}"
        part.write_bytes(data[i:i + part_bytes])
        parts.append(part)
    return parts


def rebuild(requests: list[tuple[str, dict]], out: Path | None, tree: Path = ROOT) -> list:
    """compile_kernels of `requests` from `tree`'s kernels/ and ptx/ into the cache folder `out`
    (None: drvqwen.paths.cubin_dir()); returns the CompiledKernels."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    return nvrtc.compile_kernels(requests, cache_dir=out, kernels_dir=tree / "kernels", include_dir=tree / "ptx")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rb = sub.add_parser("rebuild", help="compile OLD_CACHE's recorded builds from this checkout")
    rb.add_argument("old_cache", type=Path)
    rb.add_argument("--out", type=Path, help="cache folder to fill (default: this checkout's)")
    rb.add_argument("--touching", nargs="+", metavar="FILE", help="only builds including these files (names)")
    rb.add_argument("--dry-run", action="store_true", help="print the builds only")
    kp = sub.add_parser("keep", help="copy the entries the trees would hit")
    kp.add_argument("cache", type=Path)
    kp.add_argument("out", type=Path)
    # extend: `--tree A --tree B` keeps both trees' entries (with nargs="+" alone the last flag
    # would replace the first, and a seed would silently miss the first tree's cubins)
    kp.add_argument("--tree", type=Path, nargs="+", action="extend", default=None,
                    help="folders with kernels/ and ptx/, repeatable (default: this checkout)")
    kp.add_argument("--seed", action="store_true", help="write OUT/cubins.tar.xz.NN (CUBIN_SEED's form)")
    args = ap.parse_args(argv)

    if args.cmd == "rebuild":
        if not args.old_cache.is_dir():
            print(f"rebuild_cubins: {args.old_cache}: no such folder", file=sys.stderr)
            return 2
        requests, missing = rebuild_requests(args.old_cache, set(args.touching) if args.touching else None)
        for name in missing:
            print(f"skipped: {name} (no such kernel file in this checkout)")
        for name, defines in requests:
            print(f"build: {name} {defines or ''}".rstrip())
        if not args.dry_run and requests:
            compiled = rebuild(requests, args.out)
            print(f"{len(compiled)} builds, {sum(not c.cache_hit for c in compiled)} compiled, "
                  f"{sum(c.cache_hit for c in compiled)} already there")
        return 0

    args.tree = args.tree or [ROOT]
    for tree in args.tree:
        if not (tree / "kernels").is_dir():
            print(f"rebuild_cubins: {tree}: no kernels/ folder", file=sys.stderr)
            return 2
    if not args.cache.is_dir():
        print(f"rebuild_cubins: {args.cache}: no such folder", file=sys.stderr)
        return 2
    if not args.seed:
        n = keep(args.cache, args.out, args.tree)
        print(f"{n} entries kept in {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        n = keep(args.cache, Path(tmp), args.tree)
        parts = write_seed(Path(tmp), args.out)
    print(f"{n} entries kept in {', '.join(p.name for p in parts)} "
          f"({sum(p.stat().st_size for p in parts) / 2**20:.1f} MiB) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
