"""What every launcher shares: planned buffers, launch specs, occupancy, argument checks.

A launcher knows one kernel family (kernels/NAME.cu ↔ launchers/NAME.py ↔ tests/test_kernel_NAME.py):
which kernel to run, its grid, block and shared memory, the arguments (by the kernel's parameter
names, in its order), and the buffers it reads and writes. It does that work in two steps, so
that a whole decode step can be planned on a machine without a GPU:

    plan    Launcher(...)            checks the buffers against the kernel (shape, dtype),
                                     picks the grid from the occupancy it is given, records
                                     one `LaunchSpec` per kernel launch. Buffers may be
                                     `BufferSpec`s (a name, a shape, a dtype; no memory yet).
    build   launcher.build(resolve)  turns every spec into a pre-packed `KernelLaunch`,
                                     asking `resolve` for the device array behind each
                                     BufferSpec (and the tensor map behind a TensorMapSpec).

A launcher made from real device arrays (the kernel tests do this) builds itself on first
use: `launcher.launch()` just works.

Per-step values (position, token, sequence length) are never launch arguments: kernels read
them from the device `state` array (state[0] = pos, state[1] = token, state[2] = seq_len), so
a captured CUDA graph replays unchanged every step.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cuda import KernelLaunch, Stream, get_device, load_kernel_module


class LaunchError(ValueError):
    """A launcher was given a buffer, shape or size its kernel cannot take.

    These are programming errors of the caller (the engine plans every launch from a
    validated config), raised before anything reaches the GPU, with the buffer and the
    expectation named in the message.
    """


def require(ok: bool, message: str) -> None:
    """Raise LaunchError(message) unless `ok` (an argument check that survives `python -O`)."""
    if not ok:
        raise LaunchError(message)


@dataclass(frozen=True)
class BufferSpec:
    """A device buffer named in a plan before it exists.

    Attributes:
        name: the buffer's name, as the allocated DeviceArray will carry it.
        shape: element shape, row-major.
        dtype: numpy dtype of the elements.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorMapSpec:
    """A TMA descriptor named in a plan: the tensor map of buffer `of`, encoded at build time
    (cuTensorMapEncodeTiled needs the buffer's address).

    Attributes:
        of: the BufferSpec whose memory the map describes.
        shape: the 2-D view the map gives of it, [rows, cols] (elements).
        box: the tile one copy moves, [rows, cols].
    """

    of: BufferSpec
    shape: tuple[int, int]
    box: tuple[int, int]

    @property
    def name(self) -> str:
        return f"tensor map of {self.of.name}"

    @property
    def dtype(self) -> np.dtype:
        return self.of.dtype


@dataclass(frozen=True)
class KernelRef:
    """A kernel by name: `kernel` in kernels/`file`.cu, compiled with `defines` (compile-time
    variants for benchmarks; the step uses the defaults).

    Attributes:
        pdl: the kernel calls griddepcontrol.wait before touching its predecessor's data
            (ptx/griddep.cuh), so it may be launched as a programmatic dependent.
        registers: the registers a thread the kernel must be built with, or 0 for any: a kernel
            whose warpgroups move registers between them (ptx/setmaxnreg.cuh) balances the moves
            at that count, and with fewer its setmaxnreg.inc would wait forever.
    """

    file: str
    kernel: str
    defines: tuple[tuple[str, int], ...] = ()
    pdl: bool = False
    registers: int = 0

    def function(self):
        """The loaded kernel (compiled through the cubin cache, loaded once). Needs a GPU.

        Raises:
            LaunchError: the kernel was built with another register count than `registers`.
        """
        fn = load_kernel_module(self.file, defines=dict(self.defines)).function(self.kernel)
        if self.registers:
            require(fn.num_registers == self.registers,
                    f"{self}: built with {fn.num_registers} registers a thread, not {self.registers}: its "
                    f"setmaxnreg moves would never balance (a hang), so it is not launched")
        return fn

    def __str__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.defines)
        return f"{self.file}.cu:{self.kernel}{extra}"


@dataclass
class LaunchSpec:
    """One kernel launch as planned: what a `KernelLaunch` will be built from.

    Attributes:
        kernel: which kernel.
        grid, block: launch dimensions (blocks, threads).
        smem_bytes: dynamic shared memory per block.
        args: the arguments in the kernel's order, by the names its `.cu` declaration gives them
            (e.g. {"out": …, "x": …, "weight": …, "D": i32(…), "eps": f32(…)}): ctypes scalars,
            BufferSpec / DeviceArray (or NULL), TensorMapSpec / TensorMap. Checked against the
            declarations by tests/test_kernel_signatures.py (signatures.py).
        reads, writes: names of the buffers the launch reads and writes (every one it writes,
            scratch included), for the step's documentation and the tests.
        bytes_moved: bytes the launch reads + writes in device memory at its planned size.
    """

    kernel: KernelRef
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: dict[str, object]
    smem_bytes: int = 0
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    bytes_moved: int = 0

    @property
    def params(self) -> list:
        """The arguments in order, as the launch packs them."""
        return list(self.args.values())


Resolver = Callable[[object], object]


def _name(buf) -> str:
    """A buffer's name for reads/writes lists: its `.name`, a string as given, else its address."""
    if isinstance(buf, str):
        return buf
    return getattr(buf, "name", None) or f"<pointer {getattr(buf, 'ptr', buf)}>"


# Output rows of a GEMV tile (gemv_int4.cu's INT4_TILE_ROWS, which gemv_fmt.cu shares): the unit
# a GEMV block's range of weights is counted in (Launcher.weight_tiles).
WEIGHT_TILE_ROWS = 16


class Launcher:
    """Base of every launcher: an ordered list of planned launches, built into KernelLaunches.

    Attributes:
        specs: the LaunchSpecs, in the order they must run.
        bytes_moved: bytes read + written in device memory per call (for GB/s figures).
    """

    bytes_moved: int = 0

    def __init__(self, stream: Stream | None = None, pdl: bool = False) -> None:
        self.specs: list[LaunchSpec] = []
        self.stream = stream
        self.pdl = pdl  # launch the kernels that support it as programmatic dependents
        self._launches: list[KernelLaunch] | None = None

    def _add(self, kernel: KernelRef, grid: Sequence[int], block: Sequence[int], args: dict[str, object], *,
             smem_bytes: int = 0, reads: Sequence = (), writes: Sequence = (), bytes_moved: int = 0) -> LaunchSpec:
        """Plan one launch of `kernel` with `args`, the kernel's parameters by name, in its order."""
        spec = LaunchSpec(kernel, tuple(int(g) for g in grid), tuple(int(b) for b in block), dict(args),
                          int(smem_bytes), tuple(_name(b) for b in reads), tuple(_name(b) for b in writes),
                          int(bytes_moved))
        self.specs.append(spec)
        return spec

    def _set_weight_tiles(self, n_tiles: int, grid: int, weights: Sequence[tuple[object, int]]) -> None:
        """Record how this GEMV's blocks read their weights (`weight_tiles`): `weights` are
        (buffer, rows) pairs of buffers that hold their 16-row tiles one after another (row-major,
        or the INT4 device layout with rows a multiple of 16), `rows` the output's rows."""
        self._weight_tiles = (int(n_tiles), int(grid),
                              [(buf, WEIGHT_TILE_ROWS * (int(buf.nbytes) // int(rows))) for buf, rows in weights])

    def weight_tiles(self) -> tuple[int, int, list[tuple[object, int]]]:
        """(T tiles, G blocks, [(weight buffer, bytes of one tile in it)]) of a GEMV whose block b
        reads tiles [b·T/G, (b+1)·T/G) (16 rows each) of every weight buffer front to back
        (gemv_int4.cu, gemv_fmt.cu): what an L2 prefetch of every block's first tiles needs
        (launchers/l2_prefetch.py).

        Raises:
            LaunchError: a launcher that does not read its weights that way (qkv_rope's RoPE-paired
                tiles, attention, ...).
        """
        tiles = getattr(self, "_weight_tiles", None)
        require(tiles is not None, f"{type(self).__name__}: its weights are not read in row tiles; no weight_tiles")
        return tiles

    def build(self, resolve: Resolver | None = None, stream: Stream | None = None,
              pdl: bool | None = None) -> list[KernelLaunch]:
        """Pack every spec into a KernelLaunch (once; later calls return the same launches).

        resolve(spec) gives the DeviceArray behind a BufferSpec and the TensorMap behind a
        TensorMapSpec; arguments that are already device arrays or scalars pass through.
        `stream` (if given) becomes the launches' default stream. `pdl` (if given) replaces the
        launcher's choice of programmatic dependent launch for the kernels that support it.

        Raises:
            LaunchError: a planned buffer and no resolver (or one that returned nothing).
            TypeError, ValueError: from KernelLaunch, when an argument does not match the
                kernel's parameter list.
        """
        if self._launches is not None:
            return self._launches
        if stream is not None:
            self.stream = stream
        if pdl is not None:
            self.pdl = pdl
        launches = []
        for spec in self.specs:
            params = []
            for p in spec.params:
                if isinstance(p, (BufferSpec, TensorMapSpec)):
                    got = resolve(p) if resolve is not None else None
                    require(got is not None, f"{spec.kernel}: {p.name} is only planned (no device "
                                             f"memory): build the launcher with a resolver")
                    p = got
                params.append(p)
            launches.append(KernelLaunch(spec.kernel.function(), spec.grid, spec.block, params,
                                         smem_bytes=spec.smem_bytes, stream=self.stream,
                                         programmatic=self.pdl and spec.kernel.pdl))
        self._launches = launches
        return launches

    def set_arg(self, name: str, value, launch: int = 0) -> None:
        """Change the argument `name` of launch number `launch` (of the built launches) for later
        launches, e.g. a chunk's first position; the spec records the new value too.

        Raises:
            KeyError: the kernel has no parameter `name`.
            TypeError: the value packs to another ctypes type than the planned one.
        """
        spec = self.specs[launch]
        index = list(spec.args).index(name) if name in spec.args else None
        if index is None:
            raise KeyError(f"{spec.kernel}: no parameter {name!r} ({', '.join(spec.args)})")
        self.launches[launch].set_param(index, value)
        spec.args[name] = value

    @property
    def launches(self) -> list[KernelLaunch]:
        """The built KernelLaunches (built now if every argument is a real device buffer)."""
        return self.build()

    def launch(self, stream: Stream | None = None) -> None:
        """Queue every launch on `stream` (default: the launcher's stream)."""
        for ln in self.launches:
            ln.launch(stream)

    __call__ = launch

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{s.kernel} grid={s.grid} block={s.block}' for s in self.specs)})"


def check_resolved(spec: BufferSpec, arr):
    """`arr`, the device array a resolver found for the planned buffer `spec`, if its shape and
    dtype are the plan's.

    Raises:
        LaunchError: they differ (names the buffer, both shapes and dtypes).
    """
    if tuple(arr.shape) != spec.shape or arr.dtype != spec.dtype:
        raise LaunchError(f"{spec.name}: planned {spec.dtype}{list(spec.shape)}, allocated "
                          f"{arr.dtype}{list(arr.shape)}")
    return arr


# ---- constants shared with the kernel files -------------------------------------------------

# (kernel file, C expression, value) of every constant Python mirrors from kernels/*.cu:
# tests/test_kernel_constants.py compiles `static_assert((expression) == value)` into each
# file with NVRTC, so a Python copy can never drift from the kernel it describes.
MIRRORED: list[tuple[str, str, int]] = []


def mirrored(file: str, expression: str, value: int) -> int:
    """Record that `value` equals the C expression `expression` in kernels/`file`.cu (a #define
    or a constexpr, e.g. "EMBEDDING_THREADS" or "AtmaShape<128>::SMEM_BYTES"); returns value."""
    MIRRORED.append((file, expression, int(value)))
    return int(value)


# ---- argument checks -------------------------------------------------------------------------


class NullPointer:
    """The null device pointer, for a kernel's optional buffer (gemv_fmt's `<w>_qhigh` when a
    format has no high bits): packs as the 8 zero bytes of a `T*` parameter."""

    name = "null"
    ptr = 0

    def __repr__(self) -> str:
        return "NULL"


NULL = NullPointer()


def i32(v: int) -> ctypes.c_int32:
    """An int32 kernel argument."""
    return ctypes.c_int32(int(v))


def f32(v: float) -> ctypes.c_float:
    """A float32 kernel argument."""
    return ctypes.c_float(float(v))


def check_buffer(buf, what: str, n_elements: int, dtype) -> None:
    """Check a buffer that knows its shape (DeviceArray, BufferSpec) against the kernel's
    expectation: `n_elements` elements of `dtype`. A raw pointer is taken as it is.

    Raises:
        LaunchError: the element count or dtype differs; the message names both buffers.
    """
    shape, dt = getattr(buf, "shape", None), getattr(buf, "dtype", None)
    if shape is None or dt is None:
        return
    # The message is built only on failure: a decode step checks ~1000 buffers, and formatting
    # their dtypes took most of plan_decode's time (a start-up cost of every run).
    if math.prod(shape) != n_elements or np.dtype(dt) != np.dtype(dtype):
        raise LaunchError(f"{what}: expected {n_elements} elements of {np.dtype(dtype)}, got "
                          f"{_name(buf)} {np.dtype(dt)}{list(shape)}")


def check_state(state) -> None:
    """The decode state int32 [3] = (pos, token, seq_len)."""
    check_buffer(state, "state", 3, np.int32)


def check_prefill_state(prefill_state) -> None:
    """The prefill chunk state int32 [2] = (start, n_rows)."""
    check_buffer(prefill_state, "prefill_state", 2, np.int32)


# ---- occupancy ---------------------------------------------------------------------------------


class Occupancy:
    """How many blocks of a kernel fit on one SM, and how many SMs there are: what the launch
    shapes of the bandwidth-bound kernels (GEMV, split-KV attention) are sized from.

    The default asks the driver (cuOccupancyMaxActiveBlocksPerMultiprocessor) for the kernel as
    compiled, so register or shared-memory changes in a kernel change its grid without any
    number copied into Python. Plans made without a GPU (tests, documentation) pass a
    `FixedOccupancy` instead.
    """

    @property
    def sm_count(self) -> int:
        raise NotImplementedError

    def blocks_per_sm(self, kernel: KernelRef, threads: int, smem_bytes: int) -> int:
        raise NotImplementedError


class DriverOccupancy(Occupancy):
    """Occupancy from the driver for the current GPU (needs one)."""

    @property
    def sm_count(self) -> int:
        return get_device().info.sm_count

    def blocks_per_sm(self, kernel: KernelRef, threads: int, smem_bytes: int) -> int:
        fn = kernel.function()
        fn.ensure_dynamic_smem(smem_bytes)  # above 48 KiB the driver counts only opted-in sizes
        return fn.max_active_blocks_per_sm(threads, smem_bytes)


@dataclass
class FixedOccupancy(Occupancy):
    """Occupancy given by the caller: `blocks(kernel, threads, smem_bytes)` → blocks per SM.

    For plans without a GPU. Example: FixedOccupancy(132, lambda k, t, s: 2).
    """

    sms: int
    blocks: Callable[[KernelRef, int, int], int] = field(default=lambda _k, _t, _s: 1)

    @property
    def sm_count(self) -> int:
        return self.sms

    def blocks_per_sm(self, kernel: KernelRef, threads: int, smem_bytes: int) -> int:
        return int(self.blocks(kernel, threads, smem_bytes))


DEFAULT_OCCUPANCY = DriverOccupancy()
