"""Where the kernel sources are, and which headers each one pulls in.

The CUDA C++ lives at the top of the repository (docs/architecture.md): `kernels/*.cu`, the
kernels, and `kernels/*.cuh`, the building blocks several kernel files share; `ptx/*.cuh`, the
inline-PTX instruction wrappers. In a checkout (`PYTHONPATH=src`, or `pip install -e .`) they
are found beside `src/`; in an installed wheel, pyproject.toml ships them as
`drvqwen/_kernels` and `drvqwen/_ptx`, found beside the installed package. The checkout wins
when both exist, so an edit to a kernel is always what gets compiled.

`included_headers()` follows `#include` lines the way NVRTC will (the including file's own
folder first, then `ptx/`), so that the cubin cache key can hash every header a kernel
depends on, not only the `.cu` file (docs/gpu-workflow.md#the-toolchain-nvrtc-to-cubin).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

# `#include "name"` or `#include <name>`. Includes spelled through a macro are not followed
# (none of our kernels do that); hashing every include line, also inside `#if 0`, at worst
# over-invalidates the cache, never under-invalidates it.
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^">]+)[">]', re.MULTILINE)


@dataclass(frozen=True)
class KernelSource:
    """One `kernels/NAME.cu` file.

    Attributes:
        name: the file stem, e.g. "rmsnorm" (also the test's and launcher's name); "dev/NAME"
            for an experiment in kernels/dev/.
        path: absolute path of the file.
        text: its bytes, exactly what is hashed and handed to NVRTC.
    """

    name: str
    path: Path
    text: bytes


@dataclass(frozen=True)
class IncludedHeader:
    """A header from our own tree that a kernel includes, directly or through other headers.

    Attributes:
        spelled: the include as written, e.g. "mbarrier.cuh" or "../ptx/tma.cuh".
        path: where it was found.
        sha256: hex digest of its bytes.
    """

    spelled: str
    path: Path
    sha256: str


def _repo_root() -> Path | None:
    """The checkout root (holding pyproject.toml, kernels/, ptx/, src/), if this is a checkout."""
    root = Path(__file__).resolve().parents[3]  # src/drvqwen/cuda/sources.py → repo root
    if (root / "pyproject.toml").is_file() and (root / "src" / "drvqwen").is_dir():
        return root
    return None


def _source_dir(checkout_name: str, packaged_name: str) -> Path:
    """`<checkout>/<checkout_name>` in a source checkout (edits take effect at once), else the
    copy the wheel installs as `drvqwen/<packaged_name>` (pyproject.toml maps it there).

    The installed copy is found beside the `drvqwen` package itself rather than through
    importlib.resources: the data folders have no __init__.py, so importlib sees namespace
    packages and returns a MultiplexedPath, not a folder NVRTC can read files from.
    """
    root = _repo_root()
    if root is not None and (root / checkout_name).is_dir():
        return root / checkout_name
    installed = Path(__file__).resolve().parents[1] / packaged_name   # drvqwen/cuda/.. → drvqwen/
    if installed.is_dir():
        return installed
    raise FileNotFoundError(f"no {checkout_name}/ folder: neither a checkout nor an installed "
                            f"drvqwen/{packaged_name} (reinstall drvqwen)")


def kernels_dir() -> Path:
    """The folder holding `*.cu` kernel files (checkout first, then the installed wheel).

    Raises:
        FileNotFoundError: neither a checkout `kernels/` nor the installed `drvqwen/_kernels`.
    """
    return _source_dir("kernels", "_kernels")


def ptx_dir() -> Path:
    """The folder holding the inline-PTX headers `*.cuh` (checkout first, then the wheel).

    Raises:
        FileNotFoundError: neither a checkout `ptx/` nor the installed `drvqwen/_ptx`.
    """
    return _source_dir("ptx", "_ptx")


def list_kernels(directory: Path | None = None) -> list[str]:
    """Names (file stems) of every `*.cu` in `directory` (default `kernels_dir()`), sorted."""
    directory = kernels_dir() if directory is None else Path(directory)
    return sorted(p.stem for p in directory.glob("*.cu"))


def kernel_source(name: str, directory: Path | None = None) -> KernelSource:
    """Read `kernels/<name>.cu`.

    Args:
        name: the file's path below the kernels folder without `.cu`: "smoke", or
            "dev/gemv_int4/v2_smem_ring" for a version under `kernels/dev/` (compiled and
            cached the same way; dev kernels exist only in a checkout, the wheel ships none).
        directory: the kernels folder (default `kernels_dir()`; tests pass a temporary one).

    Raises:
        FileNotFoundError: no such kernel file; the message lists the kernels that exist.
    """
    directory = kernels_dir() if directory is None else Path(directory)
    path = (directory / f"{name}.cu").resolve()
    if not path.is_file():
        raise FileNotFoundError(
            f"no kernel file {path}; kernels here: {', '.join(list_kernels(directory)) or 'none'}"
        )
    return KernelSource(name=name, path=path, text=path.read_bytes())


def included_headers(source: KernelSource, include_dirs: list[Path]) -> list[IncludedHeader]:
    """Every header from our own folders that `source` includes, recursively, in visit order.

    Resolution mirrors the preprocessor as NVRTC runs it with the program named by its full
    path: `"quoted"` includes look in the including file's folder first, then in
    `include_dirs` in order; `<angle>` includes look only in `include_dirs`. An include found
    in none of them is a CUDA or NVRTC header (cuda_fp16.h …); those are covered by the
    toolchain version in the cache key rather than hashed one by one.

    Args:
        source: the kernel.
        include_dirs: our header folders, as passed to NVRTC with -I (normally `[ptx_dir()]`).

    Returns:
        The headers, each once (the first time it is reached), with its sha256.
    """
    found: list[IncludedHeader] = []
    seen: set[str] = set()
    dirs = [os.path.abspath(d) for d in include_dirs]

    # Plain os.path: this runs for every kernel file at every start-up (the cache key), and
    # pathlib's resolve() costs several system calls per include line. normpath folds "..", so
    # a header reached by two spellings is one path; one reached through a symlink under
    # another name would be hashed twice, which only repeats a digest in the key.
    def visit(folder: str, text: bytes) -> None:
        for quote, spelled in _INCLUDE_RE.findall(text.decode(errors="replace")):
            for base in ([folder] if quote == '"' else []) + dirs:
                hit = os.path.normpath(os.path.join(base, spelled))
                if os.path.isfile(hit):
                    break
            else:
                continue  # a toolkit header: see the docstring
            if hit in seen:
                continue
            seen.add(hit)
            with open(hit, "rb") as fh:
                data = fh.read()
            found.append(IncludedHeader(spelled, Path(hit), hashlib.sha256(data).hexdigest()))
            visit(os.path.dirname(hit), data)

    visit(os.path.dirname(os.path.abspath(source.path)), source.text)
    return found
