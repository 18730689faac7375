"""NVRTC: `kernels/NAME.cu` → an sm_90a cubin, cached on disk, with its resource report.

Why a cubin and never PTX: PTX is compiled by the *driver* at load time, and a driver only
accepts PTX up to its own ISA version. drvqwen supports drivers from R580 (CUDA 13.0) on;
NVRTC 13.5 already emits PTX 9.5, which such a driver rejects. A cubin is machine code for sm_90a
that the driver loads as is, so the NVRTC version only has to match the driver's major
version (docs/gpu-workflow.md#the-toolchain-nvrtc-to-cubin). It also means CI, which has no GPU, compiles exactly the code that
will run.

Why a cache: compiling a tensor-core kernel takes seconds; a cubin is keyed by sha256 of
everything that decides its bytes — the `.cu` source, every header of ours it includes
(resolved recursively, sources.included_headers), the options, the NVRTC version and the
CUDA headers' version (toolchain.py), and the arch — and stored under `paths.cubin_dir()`.
Include *paths* are not part of the key, only header *contents*, so a cubin compiled on a
CPU-only machine is valid on a GPU machine with the same toolchain (docs/gpu-workflow.md).

NVRTC itself (`cuda.bindings.nvrtc`, and cuda.pathfinder with it) is imported only to compile:
a run whose cubins are all in the cache never loads it (toolchain.py names the toolchain
without it).

The ptxas report (`--ptxas-options=-v`) is always requested: it costs nothing and says per
kernel how many registers it uses and whether it spills to local memory, which
tests/test_compile.py turns into a CI failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths
from .errors import NvrtcError, check
from .sources import IncludedHeader, KernelSource, included_headers, kernel_source, ptx_dir
from .toolchain import checked_toolchain_id, cuda_include_dir, toolchain_id

# NVRTC keeps the cubins it builds in the CUDA compute cache (~/.nv/ComputeCache) wherever a
# driver is installed, and on a hit there ptxas does not run: the program log then lacks the
# --ptxas-options=-v report (registers, spills) that the spill checks and the launchers' register
# choices read — every compile after the first of a source, even in a new process. drvqwen keeps
# its own cache of cubins with their logs (below), so NVRTC's is switched off; the variable is
# read when NVRTC compiles, and nothing here loads PTX through the driver's JIT, the other
# user of that cache.
os.environ["CUDA_CACHE_DISABLE"] = "1"

# The one target. sm_90a, not sm_90: the "a" target unlocks wgmma and setmaxnreg, which the
# tensor-core prefill needs (docs/gpu-workflow.md#the-toolchain-nvrtc-to-cubin); TMA and mbarrier work on either.
ARCH = "sm_90a"

# Options that shape the cubin and therefore go into the cache key.
# - C++17: NVRTC 13's default too, but spelled out so a new default cannot change our code.
# - -lineinfo: source lines in the cubin for compute-sanitizer and Nsight Compute; it does
#   not change the generated code.
# - --ptxas-options=-v: the register/spill/shared-memory report in the program log.
# Not used: -default-device (it would make undecorated functions device code under NVRTC
# but not under nvcc, so a kernel file would mean different things to the two compilers),
# and --use_fast_math (RoPE must not use approximate sin/cos, docs/numerics.md#rope-angles-as-hf-computes-them; kernels that
# want fast intrinsics call them by name).
BASE_OPTIONS: tuple[str, ...] = (
    f"--gpu-architecture={ARCH}",
    "-std=c++17",
    "-lineinfo",
    "--ptxas-options=-v",
)

# Bump when the cache layout or the key recipe changes, so old entries are never misread.
_CACHE_FORMAT = "drvqwen-cubin-v1"

# A cubin is an ELF file.
_ELF_MAGIC = b"\x7fELF"

# rw-r--r--, what a plain `open(..., "w")` gives under the usual umask 022.
_CACHE_FILE_MODE = 0o644


@dataclass(frozen=True)
class KernelResources:
    """One function's line of the ptxas report.

    Attributes:
        function: the symbol (plain for extern "C" kernels, mangled otherwise).
        is_entry: True for a `__global__` kernel, False for a non-inlined device function.
        registers: registers per thread (entries only; None for device functions).
        spill_stores_bytes: bytes stored to local memory because registers ran out.
        spill_loads_bytes: bytes loaded back from those spills.
        stack_frame_bytes: per-thread stack (local arrays indexed at run time, spills, calls).
        static_smem_bytes: statically declared `__shared__` bytes (dynamic smem not included).
        barriers: named barriers used (entries only).
    """

    function: str
    is_entry: bool
    registers: int | None = None
    spill_stores_bytes: int = 0
    spill_loads_bytes: int = 0
    stack_frame_bytes: int = 0
    static_smem_bytes: int = 0
    barriers: int = 0

    @property
    def spills(self) -> bool:
        """True when the function spills registers to local memory (a performance bug here)."""
        return self.spill_stores_bytes > 0 or self.spill_loads_bytes > 0


@dataclass(frozen=True)
class CompiledKernel:
    """The result of compiling one kernel file.

    Attributes:
        name: the kernel file's stem.
        cubin: the sm_90a ELF image, for `cuModuleLoadData`.
        log: the NVRTC program log (warnings and the ptxas report).
        resources: per function, the parsed ptxas report.
        cache_key: the sha256 hex key the cubin is stored under.
        cache_hit: True when the cubin came from the disk cache.
        options: the NVRTC options that are part of the key (include paths excluded).
        headers: our headers the kernel includes, each with its hash.
    """

    name: str
    cubin: bytes
    log: str
    resources: dict[str, KernelResources]
    cache_key: str
    cache_hit: bool
    options: tuple[str, ...]
    headers: tuple[IncludedHeader, ...] = field(default=())


# --- cache key -------------------------------------------------------------------------------


def build_options(
    defines: Mapping[str, int | str] | None = None, extra_options: Sequence[str] = ()
) -> tuple[str, ...]:
    """The key-relevant NVRTC options: BASE_OPTIONS, then `-DNAME=VALUE`s sorted by name, then extras."""
    opts = list(BASE_OPTIONS)
    for k in sorted(defines or {}):
        opts.append(f"-D{k}={defines[k]}")
    opts.extend(extra_options)
    return tuple(opts)


def cache_key(
    source: KernelSource,
    headers: Iterable[IncludedHeader],
    options: Sequence[str],
    toolchain: str,
    arch: str = ARCH,
) -> str:
    """sha256 hex of everything that decides a cubin's bytes.

    Args:
        source: the kernel file (its name and bytes are hashed, not its path).
        headers: our headers it includes (spelling and content hash of each, in order).
        options: key-relevant options (no include paths).
        toolchain: `toolchain_id()`.
        arch: the target, e.g. "sm_90a".
    """
    h = hashlib.sha256()

    def put(tag: str, value: bytes) -> None:
        # Length-prefixed fields, so no two different inputs can hash the same stream.
        h.update(f"{tag}:{len(value)}:".encode())
        h.update(value)

    put("format", _CACHE_FORMAT.encode())
    put("arch", arch.encode())
    put("toolchain", toolchain.encode())
    put("name", source.name.encode())
    put("source", source.text)
    for hdr in headers:
        put("header", f"{hdr.spelled}={hdr.sha256}".encode())
    for opt in options:
        put("option", opt.encode())
    return h.hexdigest()


def _cache_paths(cache_dir: Path, name: str, key: str) -> tuple[Path, Path]:
    stem = f"{name}-{key[:32]}"  # 128 bits of the key: collisions are not a concern
    return cache_dir / f"{stem}.cubin", cache_dir / f"{stem}.json"


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder and os.replace, so a reader (another
    process compiling the same kernel) sees the old file or the whole new one, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, _CACHE_FILE_MODE)  # mkstemp makes 0600; cache files are ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cache_load(cubin_path: Path, meta_path: Path) -> tuple[bytes, str] | None:
    """The cached (cubin, log), or None when absent or damaged (then we recompile)."""
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    if not cubin.startswith(_ELF_MAGIC) or hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
        return None
    log = str(meta.get("log", ""))
    if not _has_report(log):  # a log that lost its report (NVRTC's compute cache, above): compile again
        return None
    return cubin, log


def _cache_store(cubin_path: Path, meta_path: Path, compiled: CompiledKernel, toolchain: str) -> None:
    # The cubin first, the metadata (holding the cubin's hash) last: an entry counts only once
    # its metadata exists and matches, so a crash between the two writes leaves a miss.
    _atomic_write(cubin_path, compiled.cubin)
    meta = {
        "name": compiled.name,
        "cache_key": compiled.cache_key,
        "cubin_sha256": hashlib.sha256(compiled.cubin).hexdigest(),
        "options": list(compiled.options),
        "headers": [[h.spelled, h.sha256] for h in compiled.headers],
        "toolchain": toolchain,
        "arch": ARCH,
        "log": compiled.log,
    }
    _atomic_write(meta_path, json.dumps(meta, indent=1).encode())


# --- compile ---------------------------------------------------------------------------------


def _program_log(prog) -> str:
    from cuda.bindings import nvrtc

    size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    # NVRTC writes into the buffer in place. At least 2 bytes: `b" " * 1` is CPython's shared
    # one-byte b" " itself, and an empty log (size 1, its NUL) would overwrite every b" " of
    # the process.
    buf = b" " * max(size, 2)
    check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return buf.split(b"\0", 1)[0].decode(errors="replace")


def _nvrtc_compile(source: KernelSource, options: Sequence[str]) -> tuple[bytes, str]:
    """Run NVRTC once; return (cubin, log). Raises NvrtcError with the full log on failure."""
    from cuda.bindings import nvrtc

    # The program is named by the file's absolute path: NVRTC then resolves `#include "..."`
    # relative to the kernel's own folder (as nvcc would), and errors point at a real file.
    prog = check(
        nvrtc.nvrtcCreateProgram(source.text, str(source.path).encode(), 0, [], []),
        "nvrtcCreateProgram",
    )
    try:
        encoded = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        log = _program_log(prog)
        if err:
            raise NvrtcError("nvrtcCompileProgram", err.name, log=log, program=str(source.path))
        size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    assert cubin.startswith(_ELF_MAGIC), f"NVRTC returned a non-ELF cubin for {source.name}"
    return cubin, log


def compile_kernel(
    name: str,
    *,
    defines: Mapping[str, int | str] | None = None,
    extra_options: Sequence[str] = (),
    kernels_dir: Path | None = None,
    include_dir: Path | None = None,
    cache_dir: Path | None = None,
    use_cache: bool = True,
) -> CompiledKernel:
    """Compile `kernels/<name>.cu` to an sm_90a cubin, through the on-disk cache.

    Args:
        name: the kernel file's stem, e.g. "rmsnorm", or "dev/NAME" for an experiment in
            `kernels/dev/` (sources.kernel_source); its cache entry goes in a `dev/` subfolder.
        defines: preprocessor definitions (`-DNAME=VALUE`), e.g. tile sizes of a variant.
        extra_options: more NVRTC options, appended after BASE_OPTIONS (part of the key).
        kernels_dir: where `<name>.cu` lives (default: sources.kernels_dir()).
        include_dir: our PTX-header folder passed with -I (default: sources.ptx_dir()).
        cache_dir: cubin cache folder (default: paths.cubin_dir()).
        use_cache: False compiles even when a cached cubin exists (and refreshes it).

    Returns:
        The `CompiledKernel` (cubin, log, per-function resources, key, whether it was a hit).

    Raises:
        FileNotFoundError: no such kernel file.
        NvrtcError: the compile failed; the message carries the whole NVRTC log.
    """
    source = kernel_source(name, kernels_dir)
    inc = ptx_dir() if include_dir is None else Path(include_dir)
    include_dirs = [inc] if inc.is_dir() else []
    headers = tuple(included_headers(source, include_dirs))
    options = build_options(defines, extra_options)
    folder = paths.cubin_dir() if cache_dir is None else Path(cache_dir)

    def look_up(toolchain: str) -> tuple[str, Path, Path, tuple[bytes, str] | None]:
        key = cache_key(source, headers, options, toolchain)
        cubin_path, meta_path = _cache_paths(folder, name, key)
        return key, cubin_path, meta_path, _cache_load(cubin_path, meta_path) if use_cache else None

    toolchain = toolchain_id()
    key, cubin_path, meta_path, cached = look_up(toolchain)
    if cached is None and (checked := checked_toolchain_id()) != toolchain:
        # A compile is due, so NVRTC is loaded now, and it names another toolchain than the
        # record did: the entry is looked up, and stored, under the one that compiles.
        toolchain = checked
        key, cubin_path, meta_path, cached = look_up(toolchain)
    if cached is not None:
        cubin, log = cached
        return CompiledKernel(name, cubin, log, parse_ptxas_report(log), key, True, options, headers)

    # Include paths go to NVRTC but not into the key (see the module docstring).
    search = [f"-I{d}" for d in include_dirs] + [f"-I{cuda_include_dir()}"]
    cubin, log = _nvrtc_compile(source, list(options) + search)
    compiled = CompiledKernel(name, cubin, log, parse_ptxas_report(log), key, False, options, headers)
    cubin_path.parent.mkdir(parents=True, exist_ok=True)
    _cache_store(cubin_path, meta_path, compiled, toolchain)
    return compiled


def compile_kernels(
    requests: Sequence[tuple[str, Mapping[str, int | str]]], *, workers: int | None = None, **common
) -> list[CompiledKernel]:
    """`compile_kernel` of every (name, defines) in `requests`, side by side on threads.

    NVRTC does not hold the GIL while it compiles (cuda.bindings declares nvrtcCompileProgram
    nogil: the main thread runs on meanwhile), so threads compile in parallel, one file per
    core; a cached cubin is read on its thread as well. The files are started longest source
    first, so that the slowest compile does not start last.

    Args:
        requests: (kernel file stem, defines) pairs, as `compile_kernel` takes them.
        workers: threads (default: one per request, at most os.cpu_count()).
        **common: passed to every `compile_kernel` (kernels_dir, cache_dir, use_cache, …).
    Returns:
        The CompiledKernels in the order of `requests`.
    Raises:
        FileNotFoundError, NvrtcError: as `compile_kernel`, for the first request that failed
            (after every thread has finished).
    """
    from concurrent.futures import ThreadPoolExecutor

    if not requests:
        return []
    toolchain_id()          # named once (from the record, or by NVRTC), before the threads need it
    order = sorted(range(len(requests)), key=lambda i: -len(kernel_source(requests[i][0], common.get("kernels_dir")).text))
    n = workers or min(len(requests), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="nvrtc") as pool:
        futures = {i: pool.submit(compile_kernel, requests[i][0], defines=requests[i][1], **common) for i in order}
    return [futures[i].result() for i in range(len(requests))]


# --- the ptxas report ------------------------------------------------------------------------

# The lines ptxas -v prints (seen from NVRTC 13.0, sm_90a):
#   ptxas info    : Compiling entry function 'axpb' for 'sm_90a'
#   ptxas info    : Function properties for axpb
#   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
#   ptxas info    : Used 12 registers, used 0 barriers, 4096 bytes smem
# A "Function properties" block also appears for each non-inlined device function, with a
# stack/spill line but no "Used" line.
_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_BARRIERS_RE = re.compile(r"used (\d+) barriers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def _has_report(log: str) -> bool:
    """Whether an NVRTC log holds the ptxas report of at least one kernel (every kernel file
    defines one)."""
    return _ENTRY_RE.search(log) is not None


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Parse the `--ptxas-options=-v` lines of an NVRTC log.

    Args:
        log: the NVRTC program log.

    Returns:
        {function symbol: KernelResources}, entries and non-inlined device functions alike;
        empty when the log has no ptxas report.
    """
    fields: dict[str, dict] = {}
    entries: set[str] = set()
    entry = props = None
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            entry = m.group(1)
            entries.add(entry)
            fields.setdefault(entry, {})
        elif m := _PROPS_RE.search(line):
            props = m.group(1)
            fields.setdefault(props, {})
        elif (m := _STACK_RE.search(line)) and props is not None:
            f = fields[props]
            f["stack_frame_bytes"], f["spill_stores_bytes"], f["spill_loads_bytes"] = map(int, m.groups())
        elif (m := _USED_RE.search(line)) and entry is not None:
            f = fields[entry]
            f["registers"] = int(m.group(1))
            if b := _BARRIERS_RE.search(line):
                f["barriers"] = int(b.group(1))
            if s := _SMEM_RE.search(line):
                f["static_smem_bytes"] = int(s.group(1))
    return {fn: KernelResources(function=fn, is_entry=fn in entries, **f) for fn, f in fields.items()}


def format_resource_table(compiled: Iterable[CompiledKernel]) -> str:
    """A plain-text table of every function's registers, spills, stack and static smem."""
    rows = [("file", "function", "regs", "spill st B", "spill ld B", "stack B", "smem B", "bar")]
    for ck in compiled:
        for r in sorted(ck.resources.values(), key=lambda r: (not r.is_entry, r.function)):
            rows.append((
                ck.name,
                r.function if r.is_entry else f"{r.function} (device fn)",
                "-" if r.registers is None else str(r.registers),
                str(r.spill_stores_bytes),
                str(r.spill_loads_bytes),
                str(r.stack_frame_bytes),
                str(r.static_smem_bytes),
                str(r.barriers),
            ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
