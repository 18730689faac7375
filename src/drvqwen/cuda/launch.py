"""Queuing work on the GPU: streams, events, and kernel launches with pre-packed parameters.

Why parameters are packed once: `cuLaunchKernel` wants `void** kernelParams`, an array of
pointers to each argument's bytes. cuda.bindings can build that array from a tuple of
(values, ctypes types) on every call, but that costs Python time on the hot path: measured on
the H200 (docs/graphs.md#why-graphs), ~7.0 µs per launch with tuple packing against ~5.6 µs with a
pre-packed array. So a `KernelLaunch` builds the argument storage (one ctypes scalar per
argument) and the `void**` array once, and each launch hands cuda.bindings the array's
address as an int (its "already configured void** address" path: no per-call packing).
Changing a scalar between launches (`set_param`) writes into the same storage, so the
pointer array never changes.

Graphs remove even that cost (~0.7 µs per kernel node, graph.py); eager launches stay for
debugging and for the eager-vs-graph measurement.

Programmatic dependent launch (PDL): a launch made with `programmatic=True` goes through
cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, which lets the
driver start the kernel while the previous kernel on the stream is still running — as soon as
every block of that kernel has executed `griddepcontrol.launch_dependents` (or exited). The
kernel must then call `griddepcontrol.wait` (ptx/griddep.cuh) before it reads anything the
previous kernel writes or writes anything it reads; what comes before the wait (loading
weights, which no kernel writes) overlaps the previous kernel's tail. Stream capture records
the attribute as a programmatic edge, so graphs keep the overlap (CUDA driver API reference,
cuLaunchKernelEx; CUDA C Programming Guide, "Programmatic Dependent Launch").

The launch log: with `DRVQWEN_LAUNCH_LOG=FILE` in the environment (read once, at import), every
launch appends its kernel's name to FILE, one per line; tests/conftest.py adds a `# node ID`
line before each test. The sanitize stage of tools/gpu_check.sh uses it to show that each
sanitized test runs the kernels it claims to cover (tools/sanitize_nodes.txt). Without the
variable a launch costs one test of a module-level None more.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

from cuda.bindings import driver

from .device import get_device
from .errors import check, cuda_error
from .module import Function
from .tensormap import TENSOR_MAP_BYTES

_CU_LAUNCH_KERNEL = driver.cuLaunchKernel  # bound once: one attribute lookup less per launch
_CU_LAUNCH_KERNEL_EX = driver.cuLaunchKernelEx

# The launch log's path (module docstring), or None.
LAUNCH_LOG_ENV = "DRVQWEN_LAUNCH_LOG"
_LAUNCH_LOG = os.environ.get(LAUNCH_LOG_ENV) or None


def _log_launch(name: str) -> None:
    with open(_LAUNCH_LOG, "a", encoding="utf-8") as f:
        f.write(name + "\n")


# --- streams and events ----------------------------------------------------------------------


class Stream:
    """A CUDA stream: an in-order queue of work.

    Created with CU_STREAM_DEFAULT, i.e. a *blocking* stream, on purpose: the synchronous
    copies in memory.py (cuMemcpyHtoD/DtoH) run on the legacy default stream, which waits for
    blocking streams, so a download always sees the kernels queued before it.

    Attributes:
        handle: the `CUstream`.
    """

    def __init__(self) -> None:
        get_device()
        self.handle = check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_DEFAULT), "cuStreamCreate")

    def synchronize(self) -> None:
        """Block until everything queued on this stream has finished.

        Raises:
            CudaError: a kernel on the stream faulted.
        """
        check(driver.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def close(self) -> None:
        """cuStreamDestroy (queued work still completes)."""
        if self.handle is not None:
            check(driver.cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The legacy default stream (handle 0): what every call without a stream uses.
_NULL_STREAM = driver.CUstream(0)


def stream_handle(stream: Stream | None) -> driver.CUstream:
    """The `CUstream` to pass to the driver: the stream's, or the legacy default stream for None."""
    return _NULL_STREAM if stream is None else stream.handle


class Event:
    """A CUDA event, for timing GPU work (and ordering it).

    Attributes:
        handle: the `CUevent`.
    """

    def __init__(self) -> None:
        get_device()
        # CU_EVENT_DEFAULT keeps timing on (CU_EVENT_DISABLE_TIMING would turn it off).
        self.handle = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")

    def record(self, stream: Stream | None = None) -> None:
        """Mark this point of `stream`'s queue (default: the legacy default stream)."""
        check(driver.cuEventRecord(self.handle, stream_handle(stream)), "cuEventRecord")

    def synchronize(self) -> None:
        """Block until the work before the recorded point has finished."""
        check(driver.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds of GPU time from this event to `end` (both recorded; waits for `end`).

        Resolution is about 0.5 µs (CUDA driver API reference, cuEventElapsedTime).
        """
        end.synchronize()
        return float(check(driver.cuEventElapsedTime(self.handle, end.handle), "cuEventElapsedTime"))

    def close(self) -> None:
        """cuEventDestroy."""
        if self.handle is not None:
            check(driver.cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


# --- parameters ------------------------------------------------------------------------------


class TensorMapParam(ctypes.Structure):
    """128 bytes of a CUtensorMap, passed by value (`const __grid_constant__ CUtensorMap`)."""

    _fields_ = [("opaque", ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8))]


def pack_param(index: int, value) -> ctypes._CData:
    """One kernel argument → a ctypes object we own, whose bytes are the argument.

    Accepted:
        - a ctypes scalar (c_int32(3), c_float(1.5), c_uint64(ptr) …): copied;
        - anything with an int `.ptr` (DeviceArray, DeviceBuffer): its device address as
          c_uint64 (a `T*` kernel parameter is 8 bytes);
        - a `driver.CUdeviceptr`: likewise;
        - a `driver.CUtensorMap` or anything with `raw_bytes()` of 128 bytes (tensormap.py):
          its 128 bytes, copied, so the launch does not depend on the object staying alive;
        - a ctypes Structure/Array: copied byte for byte.

    Plain Python ints and floats are refused: the kernel's parameter width cannot be known
    from them, and a float64 where the kernel reads a float32 would be silently wrong.

    Raises:
        TypeError: an unsupported value; the message names the argument's index.
    """
    if isinstance(value, ctypes._SimpleCData):  # c_int32, c_float, c_uint64 …
        return type(value)(value.value)
    if isinstance(value, (ctypes.Structure, ctypes.Array)):
        return type(value).from_buffer_copy(value)
    if isinstance(value, driver.CUdeviceptr):
        return ctypes.c_uint64(int(value))
    if isinstance(value, driver.CUtensorMap):
        return TensorMapParam.from_buffer_copy(ctypes.string_at(value.getPtr(), TENSOR_MAP_BYTES))
    raw = getattr(value, "raw_bytes", None)
    if callable(raw):
        data = raw()
        if len(data) != TENSOR_MAP_BYTES:
            raise TypeError(
                f"kernel argument {index}: raw_bytes() gave {len(data)} bytes, want {TENSOR_MAP_BYTES}"
            )
        return TensorMapParam.from_buffer_copy(data)
    ptr = getattr(value, "ptr", None)
    if isinstance(ptr, int):
        return ctypes.c_uint64(ptr)
    raise TypeError(
        f"kernel argument {index}: {type(value).__name__} is not a kernel parameter; wrap scalars "
        f"in the ctypes type the kernel declares (ctypes.c_int32, c_uint32, c_float, c_uint64 …)"
    )


class KernelLaunch:
    """One kernel launch — function, grid, block, shared memory, arguments — packed once.

    Build it once, launch it many times:

        step = KernelLaunch(fn, grid=(n_blocks,), block=(256,),
                            params=[y, x, ctypes.c_float(2.0), ctypes.c_int32(n)])
        step.launch(stream)

    Attributes:
        function: the `Function`.
        grid, block: (x, y, z) in blocks and threads.
        smem_bytes: dynamic shared memory per block in bytes.
        label: a name for debugging and messages (default: the kernel's name).
        values: the packed ctypes arguments, in order.
        programmatic: launched with programmatic stream serialization (PDL, module doc).
    """

    def __init__(
        self,
        function: Function,
        grid: Sequence[int],
        block: Sequence[int],
        params: Sequence,
        *,
        smem_bytes: int = 0,
        stream: Stream | None = None,
        label: str | None = None,
        programmatic: bool = False,
    ) -> None:
        """Pack the arguments and check them against the kernel's parameter list.

        Args:
            function: the kernel.
            grid: 1 to 3 grid dimensions, in blocks.
            block: 1 to 3 block dimensions, in threads.
            params: the arguments in order (see `pack_param` for what is accepted).
            smem_bytes: dynamic shared memory per block, in bytes; above 48 KiB the kernel's
                opt-in attribute is set here (Function.ensure_dynamic_smem).
            stream: the default stream for `launch()` (None: the legacy default stream).
            label: a name for messages.
            programmatic: launch with programmatic stream serialization (PDL); only for kernels
                that call griddepcontrol.wait before touching their predecessor's data.

        Raises:
            TypeError: an argument that cannot be packed, or whose size differs from the
                kernel's parameter (read from the cubin with cuFuncGetParamInfo).
            ValueError: bad grid/block shapes, or too many arguments for the kernel.
        """
        self.function = function
        self.grid = _dims(grid, "grid")
        self.block = _dims(block, "block")
        self.smem_bytes = int(smem_bytes)
        self.label = label or function.name
        self.values = [pack_param(i, p) for i, p in enumerate(params)]
        self._check_sizes(function.param_sizes)
        function.ensure_dynamic_smem(self.smem_bytes)
        # The void** array: entry i points at argument i's bytes. The driver copies the bytes
        # at launch time, so later set_param() writes are seen by later launches.
        self._ptrs = (ctypes.c_void_p * max(1, len(self.values)))(*[ctypes.addressof(v) for v in self.values])
        self._params_addr = ctypes.addressof(self._ptrs) if self.values else 0
        self._stream = stream_handle(stream)
        self._args = (function.handle, *self.grid, *self.block, self.smem_bytes)
        self.programmatic = bool(programmatic)
        self._config = self._launch_config() if self.programmatic else None

    def _launch_config(self) -> driver.CUlaunchConfig:
        """The CUlaunchConfig of a programmatic launch, built once (only hStream changes)."""
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
        cfg.sharedMemBytes = self.smem_bytes
        cfg.hStream = self._stream
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        return cfg

    def _check_sizes(self, sizes: tuple[int, ...]) -> None:
        if len(sizes) != len(self.values):
            raise ValueError(f"{self.label}: kernel takes {len(sizes)} parameters, {len(self.values)} given")
        for i, (v, want) in enumerate(zip(self.values, sizes)):
            if ctypes.sizeof(v) != want:
                raise TypeError(
                    f"{self.label}: argument {i} is {type(v).__name__} ({ctypes.sizeof(v)} B), "
                    f"the kernel's parameter is {want} B"
                )

    def set_param(self, index: int, value) -> None:
        """Change argument `index` in place for later launches (same type, new value).

        Raises:
            TypeError: the new value packs to a different ctypes type than the old one.
        """
        new = pack_param(index, value)
        old = self.values[index]
        if type(new) is not type(old):
            raise TypeError(
                f"{self.label}: argument {index} was {type(old).__name__}, got {type(new).__name__}"
            )
        ctypes.memmove(ctypes.addressof(old), ctypes.addressof(new), ctypes.sizeof(old))

    @property
    def params_address(self) -> int:
        """Address of the packed void** array (0 for a kernel without parameters)."""
        return self._params_addr

    def launch(self, stream: Stream | None = None) -> None:
        """Queue the kernel on `stream` (default: the stream given at construction).

        The hot path: one cuLaunchKernel call with the pre-packed array's address; no
        packing, no allocation.

        Raises:
            CudaError: the launch was refused (a fault of an *earlier* kernel may also
                surface here, since errors are sticky).
        """
        h = self._stream if stream is None else stream.handle
        if self._config is None:
            (err,) = _CU_LAUNCH_KERNEL(*self._args, h, self._params_addr, 0)
        else:
            self._config.hStream = h
            (err,) = _CU_LAUNCH_KERNEL_EX(self._config, self._args[0], self._params_addr, 0)
        if err:
            raise cuda_error(err, f"cuLaunchKernel{'Ex' if self._config is not None else ''}({self.label})")
        if _LAUNCH_LOG is not None:
            _log_launch(self.function.name)

    __call__ = launch

    def __repr__(self) -> str:
        return f"KernelLaunch({self.label!r}, grid={self.grid}, block={self.block}, smem={self.smem_bytes})"


def _dims(dims: Sequence[int], what: str) -> tuple[int, int, int]:
    d = tuple(int(x) for x in dims)
    if not 1 <= len(d) <= 3 or any(x < 1 for x in d):
        raise ValueError(f"{what} must be 1 to 3 positive dimensions, got {dims!r}")
    return d + (1,) * (3 - len(d))
