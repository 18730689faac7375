"""What the cache holds, finding it by name, and removing it: `drvqwen list`, `rm`, and the
names `info` and `--model` take.

Entries, each with the name `rm`, `info` and `--model` take (`select`: the name, or the start
of one that names only it):

- `models/<name>.gguf` — the default 0.5B (`drvqwen pull`), named by its file name;
- `models/<source>-<key>.nanoqwen` — conversions (models.py), by file name; their source is
  the model name or the path they were converted from (the record beside them);
- `hub/models--owner--name/` — models fetched by name (hub.py): one entry per GGUF file
  (`owner/name:Q4_K_M`) and one for an HF checkpoint (`owner/name`).

Removal deletes only what an entry lists, and each path is checked to lie inside the cache
root first (its folder resolved, so a symlinked root works and nothing outside it can be
reached through a link). What other processes may be doing is left alone: a file being
written has a temporary name (paths.py, the hub client's `*.incomplete`) that is not an
entry; a conversion another run has mapped stays readable to it after the unlink (POSIX);
and a hub repo with a download in progress keeps its folder.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from .errors import DrvqwenError


@dataclass
class Entry:
    """One model or conversion in the cache.

    Attributes:
        name: what `drvqwen rm` takes (a file name, or `owner/name[:TAG]`).
        format: 'GGUF', 'HF safetensors', 'nanoqwen INT4 g128' or 'nanoqwen, GGUF formats'
            (a conversion keeping its GGUF's formats), 'nanoqwen' (a conversion without record).
        size: bytes on disk (hub blobs counted once).
        mtime: newest modification time of its files (seconds since the epoch).
        source: where it came from (a model name, a path, or the built-in source).
        files: what removing it deletes (files and symlinks inside the cache root).
    """

    name: str
    format: str
    size: int
    mtime: float
    source: str
    files: list[Path] = field(default_factory=list)


def human_size(n: int) -> str:
    """Bytes for people: GiB, MiB or KiB (binary units, as `du -h` and `ls -lh` count)."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}" if shift == 30 else f"{n / (1 << shift):.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def entries() -> list[Entry]:
    """Every model and conversion in the cache, sorted by name. Reads only metadata.

    A missing cache root reads as empty and is not created (listing leaves nothing behind).

    Raises:
        DrvqwenError: a file is where the cache root or a folder on its path should be.
    """
    root = paths.cache_root(create=False)
    out = _model_files(root / "models") + _hub_entries(root / "hub")
    return sorted(out, key=lambda e: e.name.lower())


def _stat(p: Path) -> os.stat_result | None:
    try:
        return p.stat()
    except OSError:
        return None


# A conversion's format, by the weight policy its record names (models.read_conversion_record:
# records written before there were two policies name none, and are INT4).
_CONVERSION_FORMAT = {"int4": "nanoqwen INT4 g128", "source": "nanoqwen, GGUF formats"}


def _model_files(d: Path) -> list[Entry]:
    from .models import read_conversion_record
    from .pull import DEFAULT_GGUF

    out = []
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return out
    for n in names:
        p = d / n
        st = _stat(p)
        if n.startswith(".") or st is None or not p.is_file():
            continue
        if n.endswith(".nanoqwen"):
            rec = read_conversion_record(p)
            src = rec.get("name") or rec.get("source") or "unknown (no record)"
            gone = bool(rec.get("source")) and not Path(rec["source"]).exists()
            if not rec.get("name") and Path(src).parent == d:
                src = f"{Path(src).name} (in the cache)"
            if gone:
                src += " (no longer there)"
            fmt = _CONVERSION_FORMAT.get(rec.get("weights", "int4"), "nanoqwen") if rec else "nanoqwen"
            out.append(Entry(n, fmt, st.st_size, st.st_mtime, f"converted from {src}",
                             [p, d / f".{n}.source.json"]))
        elif n.endswith(".gguf"):
            src = (f"{DEFAULT_GGUF.what} (drvqwen pull)" if n == DEFAULT_GGUF.filename
                   else "downloaded")
            out.append(Entry(n, "GGUF", st.st_size, st.st_mtime, src, [p, d / f"{n}.sha256-ok"]))
    return out


def _hub_entries(hub: Path) -> list[Entry]:
    from .hub import quant_of

    out = []
    try:
        repos = sorted(p for p in hub.iterdir() if p.name.startswith("models--") and p.is_dir())
    except OSError:
        return out
    for repo_dir in repos:
        repo = repo_dir.name[len("models--"):].replace("--", "/", 1)
        groups: dict[str, list[Path]] = {}
        for snap in sorted((repo_dir / "snapshots").glob("*")):
            for link in sorted(snap.rglob("*")):
                if link.is_dir() and not link.is_symlink():
                    continue
                if link.name.lower().endswith(".gguf"):
                    key = f"{repo}:{quant_of(link.name)}"
                else:
                    key = repo
                groups.setdefault(key, []).append(link)
        for name, links in groups.items():
            blobs = {}
            for link in links:
                st = _stat(link)
                if st is not None:
                    blobs[(st.st_dev, st.st_ino)] = st
            fmt = "GGUF" if ":" in name else "HF safetensors"
            out.append(Entry(name, fmt, sum(s.st_size for s in blobs.values()),
                             max((s.st_mtime for s in blobs.values()), default=0.0),
                             f"Hugging Face hub ({repo})", links))
    return out


def find(name: str, among: list[Entry] | None = None) -> list[Entry]:
    """The entries `name` selects: the one with exactly that name, else those whose name starts
    with it (case-insensitive; an empty or blank name selects none). Several means the name is
    ambiguous."""
    among = entries() if among is None else among
    exact = [e for e in among if e.name == name]
    if exact:
        return exact
    low = name.lower()
    if not low.strip():
        return []  # an empty name is a prefix of every name: it selects none
    return [e for e in among if e.name.lower().startswith(low)]


def select(name: str, among: list[Entry] | None = None) -> Entry | None:
    """The one entry `name` selects (`find`), or None when it selects none.

    Raises:
        DrvqwenError: it selects several (names them).
    """
    chosen = find(name, among)
    if len(chosen) > 1:
        raise DrvqwenError(f"{name}: ambiguous, it names {len(chosen)} entries: "
                           + ", ".join(e.name for e in chosen))
    return chosen[0] if chosen else None


def model_path(entry: Entry) -> Path:
    """What `--model` reads for `entry`: a conversion's `.nanoqwen`, a download's GGUF file,
    or the snapshot folder of a checkpoint fetched by name."""
    first = entry.files[0]
    if entry.format == "HF safetensors":      # <repo>/snapshots/<commit>/<file…>
        return next(p for p in first.parents if p.parent.name == "snapshots")
    return first


def nanoqwen_path(entry: Entry, among: list[Entry] | None = None) -> Path:
    """The `.nanoqwen` of `entry`: itself for a conversion, else the conversion `--model` reads
    for its download — found by the download's content where its sha256 is already known (the
    key `run` finds it by: models.resolve_model; so also after the cache was moved), or else
    the newest conversion whose record names the download as its source. Reads no source file:
    a download never hashed is looked up by record only.

    Raises:
        DrvqwenError: a download with no conversion yet (says how to make one).
    """
    from .models import conversion_path, known_source_digest, read_conversion_record

    src = model_path(entry)
    if src.suffix == ".nanoqwen":
        return src
    try:
        digest = known_source_digest(src)
    except DrvqwenError:  # a checkpoint whose file list cannot be read: by record only
        digest = None
    if digest is not None and (by_content := conversion_path(src, digest, paths.models_dir())).is_file():
        return by_content
    source = os.path.realpath(src)
    made = [model_path(e) for e in (entries() if among is None else among) if e.files[0].suffix == ".nanoqwen"
            and os.path.realpath(read_conversion_record(e.files[0]).get("source", "") or os.devnull) == source]
    if not made:
        how = entry.name if "/" in entry.name else src
        raise DrvqwenError(f"{entry.name}: a {entry.format} download with no conversion in the cache yet "
                           f"(drvqwen run --model {how} converts it)")
    return max(made, key=lambda p: p.stat().st_mtime)


def remove(entry: Entry) -> int:
    """Delete `entry`'s files (hub: its snapshot links, then the blobs no other link uses, then
    the repo folder once nothing is left in it and no download is running). Returns the bytes
    freed.

    Raises:
        DrvqwenError: a path lies outside the cache root (nothing of the entry is deleted), or
            a file cannot be deleted (names it and why).
    """
    root = paths.cache_root()
    for p in entry.files:
        _check_inside(root, p)
    blobs = set()
    for p in entry.files:
        if p.is_symlink():
            target = Path(os.path.realpath(p))
            _check_inside(root, target)
            blobs.add(target)
    for p in entry.files:
        _unlink(p)
        if _repo_dir_of(p) is not None:
            try:
                p.parent.rmdir()        # a snapshot folder left empty; fails when it is not
            except OSError:
                pass
    repo_dirs = {_repo_dir_of(p) for p in entry.files} - {None}
    for repo_dir in repo_dirs:
        still_used = {Path(os.path.realpath(q)) for q in (repo_dir / "snapshots").rglob("*") if q.is_symlink()}
        for b in blobs - still_used:
            if b.is_relative_to(repo_dir):
                _unlink(b)
        _remove_repo_if_empty(root, repo_dir)
    return entry.size


def _repo_dir_of(p: Path) -> Path | None:
    # <root>/hub/models--o--n/snapshots/<sha>/<file…>
    for parent in p.parents:
        if parent.name.startswith("models--") and parent.parent.name == "hub":
            return parent
    return None


def _remove_repo_if_empty(root: Path, repo_dir: Path) -> None:
    """Delete a hub repo folder with no snapshot files left, unless a download is writing into
    it (a `*.incomplete` file changed in the last paths.LEFTOVER_QUIET_S seconds)."""
    if any(q.is_file() or q.is_symlink() for q in (repo_dir / "snapshots").rglob("*")):
        return
    now = time.time()
    for q in (repo_dir / "blobs").glob("*.incomplete"):
        st = _stat(q)
        if st is not None and now - st.st_mtime < paths.LEFTOVER_QUIET_S:
            return
    _check_inside(root, repo_dir)
    shutil.rmtree(repo_dir, ignore_errors=True)
    shutil.rmtree(repo_dir.parent / ".locks" / repo_dir.name, ignore_errors=True)


def _check_inside(root: Path, p: Path) -> None:
    """Refuse `p` unless it lies inside `root`: its folder resolved (links followed), then its
    own name, which is what unlink removes (never a link's target)."""
    real_root = os.path.realpath(root)
    where = os.path.join(os.path.realpath(p.parent), p.name)
    if os.path.commonpath([real_root, where]) != real_root or where == real_root:
        raise DrvqwenError(f"{p}: outside the cache root {root}; not removed")


def _unlink(p: Path) -> None:
    try:
        p.unlink(missing_ok=True)
    except OSError as e:
        raise paths.io_error(p, e, "remove it") from None
