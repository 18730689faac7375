"""Which NVRTC and CUDA headers build the kernels: the toolchain the cubin cache's key names.

Naming it exactly takes NVRTC itself (nvrtcVersion, through cuda.bindings, which finds the
library with cuda.pathfinder), the CUDA headers' CUDART_VERSION and the wheels' versions
(importlib.metadata): ~35 ms of imports before the first token of a run whose every cubin is in
the cache, and which otherwise never calls NVRTC. So the answer is recorded in the cache's
state folder, one record per Python environment, with what it was read from, and taken from
there while none of that has changed:

- the environment variables that steer where cuda.pathfinder looks (`STEERING_ENV`);
- every site-packages folder, where pathfinder finds the wheels and where pip installs,
  upgrades and removes them: each of those adds or removes an entry (a `*.dist-info` folder
  carries its version in its name), which changes the folder's mtime;
- the NVRTC library that was loaded, the CUDA header that was read, and the dynamic loader's
  cache (a system CUDA installed or upgraded runs ldconfig): each by device, inode, size and
  mtime.

A cache miss compiles, and loads NVRTC for it anyway: then the toolchain is named from NVRTC
itself (`checked_toolchain_id`), the record rewritten if it said otherwise, and the entry looked
up and stored under that name — so a cubin is only ever stored under the toolchain that built it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import site
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..errors import DrvqwenError
from .errors import NvrtcError, check

# The environment variables cuda.pathfinder reads to find NVRTC and the CUDA headers outside
# the wheels (conda, a toolkit root), and the dynamic loader's search path.
STEERING_ENV = ("CUDA_HOME", "CUDA_PATH", "CONDA_PREFIX", "LD_LIBRARY_PATH")
# Rebuilt by ldconfig whenever a system library is installed or upgraded.
_LOADER_CACHE = "/etc/ld.so.cache"


@dataclass(frozen=True)
class Toolchain:
    """The toolchain in use, and where it was found.

    Attributes:
        id: the string the cubin cache's key hashes (`toolchain_id`).
        nvrtc: (major, minor) of the NVRTC library, e.g. (13, 0).
        library: the NVRTC library file loaded (None where cuda.pathfinder does not say).
        header: the `cuda_runtime_api.h` whose CUDART_VERSION was read.
    """

    id: str
    nvrtc: tuple[int, int]
    library: str | None
    header: str


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library cuda.bindings loads (loading it), e.g. (13, 0)."""
    from cuda.bindings import nvrtc

    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


@functools.lru_cache(maxsize=1)
def cuda_include_dir() -> Path:
    """The CUDA headers folder (cuda_fp16.h …) NVRTC needs, found through cuda.pathfinder.

    Taken from the installed NVIDIA wheel (nvidia-cuda-runtime), a conda environment or
    CUDA_HOME — whatever cuda.pathfinder finds — never from a hard-coded path (docs/gpu-workflow.md#the-toolchain-nvrtc-to-cubin).

    Raises:
        NvrtcError: no CUDA headers can be found.
    """
    from cuda.pathfinder import find_nvidia_header_directory

    found = find_nvidia_header_directory("cudart")
    if found is None:
        raise NvrtcError(
            "find_nvidia_header_directory",
            "CUDA headers not found",
            log="install the nvidia-cuda-runtime wheel (pyproject.toml pins it) or set CUDA_HOME",
        )
    return Path(found)


def _dist_version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _loaded_library() -> str | None:
    """The NVRTC library file cuda.bindings loaded: cuda.pathfinder keeps what it loaded, so
    asking it again names that file (and loads nothing)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception:  # noqa: BLE001 - only the record's evidence is lost: it is then never reused
        return None


def _measure() -> Toolchain:
    """The toolchain named from NVRTC itself, the headers and the wheels (loads NVRTC).

    nvrtcVersion() gives only major.minor, so the wheels' full versions are added (a patch
    release can change code generation); CUDART_VERSION from the headers covers headers that
    did not come from a wheel.
    """
    major, minor = nvrtc_version()
    header = cuda_include_dir() / "cuda_runtime_api.h"
    m = re.search(rb"#define\s+CUDART_VERSION\s+(\d+)", header.read_bytes()) if header.is_file() else None
    cudart = m.group(1).decode() if m else "unknown"
    name = (
        f"nvrtc={major}.{minor};nvidia-cuda-nvrtc={_dist_version('nvidia-cuda-nvrtc')};"
        f"cudart_headers={cudart};nvidia-cuda-runtime={_dist_version('nvidia-cuda-runtime')}"
    )
    return Toolchain(name, (major, minor), _loaded_library(), str(header))


# --- the record -------------------------------------------------------------------------------


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _site_dirs() -> list[str]:
    """The site-packages folders, in cuda.pathfinder's order (user site after a venv's own)."""
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return dirs


def _surroundings() -> dict:
    """What decides which toolchain is found, apart from its own files (module doc)."""
    return {"env": {name: os.environ.get(name) for name in STEERING_ENV},
            "places": {p: _stat(p) for p in [*_site_dirs(), _LOADER_CACHE]}}


def _files(tc: Toolchain) -> dict:
    return {p: _stat(p) for p in (tc.library, tc.header) if p is not None}


def _record_path() -> Path:
    # One record per Python environment: two venvs sharing a cache keep their own.
    return paths.state_dir() / f"toolchain-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:16]}.json"


def _read_record() -> Toolchain | None:
    """The recorded toolchain, if a record exists and everything it was read from is unchanged."""
    try:
        rec = json.loads(_record_path().read_text())
        tc = Toolchain(str(rec["id"]), (int(rec["nvrtc"][0]), int(rec["nvrtc"][1])), rec["library"],
                       str(rec["header"]))
        fresh = rec["surroundings"] == _surroundings() and rec["files"] == _files(tc)
    except (OSError, ValueError, KeyError, IndexError, TypeError, DrvqwenError):
        return None
    return tc if fresh else None


def _write_record(tc: Toolchain, surroundings: dict) -> None:
    rec = {"id": tc.id, "nvrtc": list(tc.nvrtc), "library": tc.library, "header": tc.header,
           "surroundings": surroundings, "files": _files(tc)}
    try:
        paths.atomic_write_bytes(_record_path(), json.dumps(rec, indent=1).encode())
    except (OSError, DrvqwenError):
        pass  # a record only saves the naming next time: a read-only cache names it every run


# --- this process's answer ----------------------------------------------------------------------

_lock = threading.Lock()
_known: Toolchain | None = None     # the toolchain this process uses: the record's or NVRTC's own
_checked = False                    # _known was named from NVRTC in this process
_record: list[Toolchain | None] = []  # the record as read, once per process (empty: not read yet)


def _recorded() -> Toolchain | None:
    if not _record:
        _record.append(_read_record())
    return _record[0]


def _name_and_record() -> Toolchain:
    """`_measure`, and the record rewritten where it said something else. Call under _lock."""
    global _known, _checked
    surroundings = _surroundings()     # before the naming: a change meanwhile leaves a stale record
    tc = _measure()
    if tc != _recorded():
        _write_record(tc, surroundings)
    _known, _checked = tc, True
    return tc


def toolchain_id() -> str:
    """A string naming the exact NVRTC and CUDA headers in use; part of the cubin cache's key.

    The record's while it holds (NVRTC is not loaded), else named from NVRTC and recorded.

    Raises:
        NvrtcError, RuntimeError: it must be named and NVRTC or the CUDA headers cannot be found.
    """
    global _known
    with _lock:
        if _known is None:
            _known = _recorded()
        return (_known or _name_and_record()).id


def checked_toolchain_id() -> str:
    """`toolchain_id` as NVRTC itself names it (loading NVRTC), once per process: what a
    compile keys its cubin by. Rewrites the record where it said something else.

    Raises:
        NvrtcError, RuntimeError: NVRTC or the CUDA headers cannot be found.
    """
    with _lock:
        return _known.id if _checked and _known is not None else _name_and_record().id


def nvrtc_major() -> int:
    """NVRTC's major version: the record's while it holds (NVRTC is not loaded), else
    nvrtcVersion's. Raises RuntimeError as cuda.bindings does when NVRTC cannot be loaded."""
    with _lock:
        known = _known or _recorded()
    return known.nvrtc[0] if known is not None else nvrtc_version()[0]
