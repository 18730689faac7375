"""Which code produced a measurement: the commit it claims and a digest of what really ran.

Every benchmark JSON drvqwen writes (`drvqwen bench --json`, tools/bench_*.py --json) carries
`source = {"commit": ..., "digest": ...}`. The digest is a sha256 over the files that make up
the runtime — src/drvqwen/**/*.py, kernels/*.cu and *.cuh, ptx/*.cuh (what the wheel ships; not
kernels/dev/, tests or tools) — each as its path relative to the checkout and its bytes, in
path order. It is computed from the files that were imported and compiled, so it holds even
where the commit does not: a copied tree, an uncommitted edit. tests/test_figures.py recomputes
it from the named commit's tree (`digest_of_commit`) for every JSON that README quotes, so a
figure cannot claim code that did not produce it.

The commit is `$DRVQWEN_SOURCE_COMMIT` when set (a tree copied to another machine without its
history; the full 40-digit hash, so that a mistyped or shortened one is refused rather than
recorded), else `git rev-parse HEAD` in a checkout, with "+dirty" appended when the runtime's
files differ from it; None outside a checkout.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

from .cuda.sources import kernels_dir, ptx_dir
from .errors import DrvqwenError

SOURCE_COMMIT_ENV = "DRVQWEN_SOURCE_COMMIT"

# The runtime's files as (folder in the checkout, glob), in the checkout's layout.
_RUNTIME_FILES = (("src/drvqwen", "**/*.py"), ("kernels", "*.cu"), ("kernels", "*.cuh"), ("ptx", "*.cuh"))


def _is_runtime_path(rel: str) -> bool:
    """True for a checkout-relative path that belongs to the digest (same rule as the globs)."""
    p = Path(rel)
    if "__pycache__" in p.parts:
        return False
    if rel.startswith("src/drvqwen/"):
        return p.suffix == ".py"
    if len(p.parts) == 2 and p.parts[0] == "kernels":
        return p.suffix in (".cu", ".cuh")
    return len(p.parts) == 2 and p.parts[0] == "ptx" and p.suffix == ".cuh"


def digest_of(files: Iterable[tuple[str, bytes]]) -> str:
    """sha256 hex of (checkout-relative path, bytes) pairs taken in path order."""
    h = hashlib.sha256()
    for rel, data in sorted(files):
        h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def _runtime_files() -> Iterator[tuple[str, bytes]]:
    package = Path(__file__).resolve().parent
    roots = {"src/drvqwen": package, "kernels": kernels_dir(), "ptx": ptx_dir()}
    for folder, pattern in _RUNTIME_FILES:
        for p in sorted(roots[folder].glob(pattern)):
            rel = f"{folder}/{p.relative_to(roots[folder]).as_posix()}"
            if _is_runtime_path(rel):
                yield rel, p.read_bytes()


def source_digest() -> str:
    """The digest (module docstring) of the runtime files this process runs."""
    return digest_of(_runtime_files())


def _git(root: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(root), *args], input=stdin, capture_output=True, check=True).stdout


def digest_of_commit(commit: str, root: Path) -> str:
    """The digest of the runtime files in `commit`'s tree of the repository at `root`.

    Raises:
        subprocess.CalledProcessError: not a git repository, or no such commit there.
    """
    names = [n for n in _git(root, "ls-tree", "-r", "--name-only", commit, "--", "src/drvqwen", "kernels", "ptx")
             .decode().splitlines() if _is_runtime_path(n)]
    # One `cat-file --batch` for all of them (one process, not one per file): its answer is,
    # per request line, "<oid> blob <size>\n", the bytes, "\n".
    out = _git(root, "cat-file", "--batch", stdin="".join(f"{commit}:{n}\n" for n in names).encode())
    files, at = [], 0
    for name in names:
        header_end = out.index(b"\n", at)
        header = out[at:header_end].split()
        if len(header) != 3 or header[1] != b"blob":          # "<name> missing"
            raise subprocess.CalledProcessError(1, "git cat-file --batch", output=out[at:header_end])
        start, size = header_end + 1, int(header[2])
        files.append((name, out[start:start + size]))
        at = start + size + 1
    return digest_of(files)


def claimed_commit() -> str | None:
    """$DRVQWEN_SOURCE_COMMIT (module docstring) where it is set, else None: what a benchmark asks
    before its run, so that a malformed claim stops it before the minutes it would measure.

    Raises:
        DrvqwenError: $DRVQWEN_SOURCE_COMMIT is set but is not a full 40-digit hex hash.
    """
    claimed = os.environ.get(SOURCE_COMMIT_ENV)
    if claimed and not re.fullmatch(r"[0-9a-f]{40}", claimed):
        raise DrvqwenError(f"${SOURCE_COMMIT_ENV}={claimed!r}: not a full 40-digit commit hash")
    return claimed or None


def source_commit(digest: str | None = None) -> str | None:
    """The commit the running code claims (module docstring), or None outside a checkout.

    Raises:
        DrvqwenError: $DRVQWEN_SOURCE_COMMIT is set but is not a full 40-digit hex hash.
    """
    claimed = claimed_commit()
    if claimed:
        return claimed
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = _git(root, "rev-parse", "HEAD").decode().strip()
        same = digest_of_commit(head, root) == (digest or source_digest())
    except (OSError, subprocess.CalledProcessError):
        return None
    return head if same else head + "+dirty"


def source_record() -> dict:
    """{"commit": ..., "digest": ...} for a benchmark's JSON."""
    digest = source_digest()
    return {"commit": source_commit(digest), "digest": digest}
