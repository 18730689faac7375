"""The one cache root (docs/architecture.md#the-parts-and-where-they-live), and the checks
every writer into it makes first.

`$DRVQWEN_CACHE` if set, else `$XDG_CACHE_HOME/drvqwen`, else `~/.cache/drvqwen`. It holds
downloaded models (`models/`, and `hub/` for models fetched by name), converted `.nanoqwen`
files (`models/`), compiled cubins (`cubin/`), tokenizers in their fast-loading form
(`tokenizer/`, tokenizer_cache.py) and small records of work already done
(`state/`: source hashes, verified files, the kernel toolchain named: cuda/toolchain.py).
Tests share its models/, hub/, cubin/ and tokenizer/ (a model fetched once serves every later
run); their state/ records are the test session's own (tests/conftest.py).

Writing into it can fail in ways a user can fix — the directory cannot be created, it is
read-only, the disk is full — and those end in one line naming the path and what is needed,
before the work starts where it can be known (`ensure_writable`, `ensure_free_space`), and
through `io_error` where it cannot. The files a command is told to write (`convert -o`,
`--json-stats`, `--json`) are checked the same way before the work (`check_output`). Every
file is written under a temporary name carrying the writer's pid and renamed into place;
`remove_dead_leftovers` deletes the temporaries of processes that died (a killed download or
conversion) so they do not pile up.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from .errors import DrvqwenError

# Temporary names with the writer's pid, in every folder drvqwen writes to:
#   <name>.part-<pid>          pull.py: a download being assembled
#   .<name>.tmp-<pid>          format/nanoqwen_writer.py: a .nanoqwen being written
#   .<name>.wheels-<pid>-*     pull.py: the folder of the PyPI wheels being read
#   .<name>.hub-<pid>-*        pull.py: the folder of a hub download
#   .<name>.<pid>.tmp          small records and cubins (atomic_write_bytes, cuda/nvrtc.py)
_LEFTOVER = re.compile(r"^(?:.+\.part-(\d+)|\..+\.tmp-(\d+)|\..+\.(?:wheels|hub)-(\d+)-.*|\..+\.(\d+)\.tmp)$")
# A leftover is removed only when its process is gone and it has not changed for this long:
# a live writer in another pid namespace (a container sharing the cache) keeps touching it.
LEFTOVER_QUIET_S = 60.0

# errno: (what happened, what to do where the path is under the cache — setting DRVQWEN_CACHE
# moves it —, what to do elsewhere: `convert -o`, `--json`; None: nothing to add).
_IO_HINTS = {
    errno.ENOSPC: ("no space left on the device", "free some space, or set DRVQWEN_CACHE to a disk with room",
                   "free some space there"),
    errno.EDQUOT: ("disk quota exceeded", "free some space, or set DRVQWEN_CACHE elsewhere", None),
    errno.EROFS: ("read-only file system", "set DRVQWEN_CACHE to a writable directory", None),
    errno.EACCES: ("permission denied", "set DRVQWEN_CACHE to a directory you can write", None),
    errno.EPERM: ("not permitted", "set DRVQWEN_CACHE to a directory you can write", None),
}


def io_advice(err: int | None, path: str | os.PathLike | None) -> str | None:
    """What to do about an OSError of errno `err` at `path`: DRVQWEN_CACHE only for a path under
    the cache (a path not known: as if it were); None where there is nothing to add."""
    hint = _IO_HINTS.get(err)
    if hint is None:
        return None
    return hint[1] if path is None or in_cache(path) else hint[2]


def _io_hint(err: int | None, path: str | os.PathLike) -> str | None:
    """"what happened: what to do" for the errnos of _IO_HINTS, else None."""
    if err not in _IO_HINTS:
        return None
    advice = io_advice(err, path)
    return f"{_IO_HINTS[err][0]}: {advice}" if advice else _IO_HINTS[err][0]


def io_error(path: str | os.PathLike, e: OSError, doing: str) -> DrvqwenError:
    """One line for an OSError met while `doing` something with `path`: the path, what
    failed, and what is needed (space, permission) when the errno says — DRVQWEN_CACHE named
    only for a path under the cache root (io_advice)."""
    return DrvqwenError(f"{path}: cannot {doing} ({_io_hint(e.errno, path) or e.strerror or str(e)})")


def _make_dir(d: Path, what: str) -> Path:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTDIR):  # the path, or a folder on it, is a file
            why = "a file is in the way, not a folder: set DRVQWEN_CACHE to a directory"
        else:
            why = _io_hint(e.errno, d) or f"{e.strerror}; set DRVQWEN_CACHE to a writable directory"
        raise DrvqwenError(f"{d}: cannot create {what} ({why})") from None
    return d


def cache_root(create: bool = True) -> Path:
    """Return the cache root directory: $DRVQWEN_CACHE, else $XDG_CACHE_HOME/drvqwen, else
    ~/.cache/drvqwen. Created if missing, unless `create` is False (commands that only read the
    cache — list, info, rm — leave no folder behind; a missing root reads as empty).

    Raises:
        DrvqwenError: it cannot be created, or (create False) a file is in its place or on its
            path (names the path and the reason).
    """
    env = os.environ.get("DRVQWEN_CACHE")
    if env:
        root = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "drvqwen"
    if create:
        return _make_dir(root, "the cache directory")
    try:
        root.stat()
    except FileNotFoundError:
        return root
    except NotADirectoryError:
        pass
    except OSError as e:
        raise io_error(root, e, "read the cache directory") from None
    else:
        if root.is_dir():
            return root
    raise DrvqwenError(f"{root}: not a folder (a file is in the way: set DRVQWEN_CACHE to a directory)")


_cleaned: set[Path] = set()


def models_dir() -> Path:
    """Directory for downloaded and converted models; leftovers of dead writers removed once
    per process. Raises DrvqwenError if it cannot be created."""
    d = _make_dir(cache_root() / "models", "the model cache")
    if d not in _cleaned:
        _cleaned.add(d)
        remove_dead_leftovers(d)
    return d


def hub_dir() -> Path:
    """Directory of models fetched by name from the Hugging Face hub, in the hub client's own
    layout (`models--owner--name/{blobs,snapshots,refs}`; hub.py)."""
    return _make_dir(cache_root() / "hub", "the hub download cache")


def cubin_dir() -> Path:
    """Directory for NVRTC-compiled cubins (keyed by source hash, options, NVRTC version, arch)."""
    return _make_dir(cache_root() / "cubin", "the cubin cache")


def tokenizer_dir() -> Path:
    """Directory for models' tokenizers in their fast-loading form (tokenizer_cache.py), keyed
    by the tokenizer.json's sha256 and the `tokenizers` version."""
    return _make_dir(cache_root() / "tokenizer", "the tokenizer cache")


def state_dir() -> Path:
    """Directory for records of work done (source hashes, verified files): small files whose
    loss only costs the work again."""
    return _make_dir(cache_root() / "state", "the cache's state folder")


def ensure_writable(d: Path, what: str) -> None:
    """Check that files can be created in folder `d` (by creating and removing one).

    Raises:
        DrvqwenError: they cannot — read-only, no permission, missing — naming `d` and `what`.
    """
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=f".drvqwen-probe.{os.getpid()}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise io_error(d, e, f"write {what} there") from None


def check_output(path: str | os.PathLike, what: str,
                 inputs: dict[str, str | os.PathLike | None] | None = None) -> Path:
    """Check an output file named on the command line before any work is done for it: it is
    no folder, no file the command reads (`inputs`: what each is, e.g. {"the model": path};
    None entries and names that are no file are skipped), and its folder exists and takes files
    (`ensure_writable`). Returns it as a Path.

    Raises:
        DrvqwenError: names the path and what is wrong.
    """
    p = Path(path)
    if p.is_dir():
        raise DrvqwenError(f"{p}: is a directory; give the output file name")
    if p.is_file():
        for role, src in (inputs or {}).items():
            try:
                same = src is not None and os.path.samefile(p, src)
            except (OSError, ValueError):   # no such file (a cache name, a repo id), an odd name
                same = False
            if same:
                raise DrvqwenError(f"{p}: is {role}, which this command reads; give another file for {what}")
    ensure_writable(p.parent, what)
    return p


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def in_cache(path: str | os.PathLike) -> bool:
    """Whether `path` lies under the cache root (where setting DRVQWEN_CACHE moves it); False
    where the root cannot be read."""
    try:
        root = cache_root(create=False).resolve()
        return Path(os.path.abspath(path)).resolve().is_relative_to(root)
    except (OSError, DrvqwenError, RuntimeError, ValueError):
        return False


def ensure_free_space(d: Path, need: int, what: str) -> None:
    """Check that the file system of folder `d` has `need` bytes free.

    Raises:
        DrvqwenError: it has less; names `d`, `what`, the bytes needed and free.
    """
    free = shutil.disk_usage(d).free
    if free < need:
        raise DrvqwenError(f"{d}: {what} needs {_size(need)} free, the disk has {_size(free)} ({io_advice(errno.ENOSPC, d)})")


def open_fresh_temp(path: Path) -> tuple[Path, int]:
    """Create `path`'s temporary `.<name>.<pid>.tmp` beside it and open it for writing.

    The name is created afresh (O_EXCL) and never through a link planted there (O_NOFOLLOW): a
    symlink at the temporary name cannot send the write elsewhere. A leftover of this pid's
    earlier run is removed first (no other process writes under our pid). The file gets the
    permissions of any file the user creates (0666 less the umask).

    Returns (temporary path, file descriptor open for writing). Raises OSError as the file
    system does.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        return tmp, os.open(tmp, flags, 0o666)
    except FileExistsError:
        tmp.unlink()
        return tmp, os.open(tmp, flags, 0o666)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary name (open_fresh_temp) and a rename: readers
    see the old file or the whole new one. Raises OSError as the file system does."""
    tmp, fd = open_fresh_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:   # a write or close: name the file it was for
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0                  # someone else's live process (or an absurd pid: keep)
    return True


def remove_dead_leftovers(d: Path, now: float | None = None) -> list[Path]:
    """Delete the temporaries in `d` whose writer process is gone (see _LEFTOVER).

    A download or conversion killed with SIGKILL (or a power cut) cannot clean up after
    itself: its `.part-<pid>` (up to the model's size), wheel folder (85 MB) or `.tmp-<pid>`
    (the whole converted model) would stay forever. Returns what was removed; errors while
    removing are ignored (another process may be removing the same leftover).
    """
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(d.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if not m:
            continue
        pid = int(next(g for g in m.groups() if g))
        try:
            quiet = now - p.lstat().st_mtime >= LEFTOVER_QUIET_S
        except OSError:
            continue
        if not quiet or _pid_alive(pid):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed
