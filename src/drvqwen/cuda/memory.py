"""Device memory: raw buffers, a pool carved from one allocation, typed arrays, pinned staging.

Why a pool: the runtime's buffers (weights, activations, KV pages, per-step state) all live
as long as the engine does, so they are carved in order from one large cuMemAlloc rather
than allocated one by one. That keeps allocation out of the decode path entirely (a
captured graph's addresses must never change), lets us check up front that a model fits
(cuMemGetInfo, before any upload), and makes alignment explicit: 256 B by default (what
cuMemAlloc itself guarantees, enough for 128-bit vector loads and TMA's 16 B), 16 KiB for
KV pages (one page of one layer's K for the 7B is 16 tokens × 4 heads × 128 × 2 B = 16 KiB,
docs/kv-cache.md#layout).

Each pool buffer is a `DeviceArray` with a name, shape and dtype, so a buffer can be
printed, checked and downloaded by name (tests, tools).

Copies: `upload`/`download` use the synchronous cuMemcpy on the legacy default stream
(pageable host memory; the driver stages it). Large uploads (weights) go through
`StagingUploader`: page-locked (pinned) host memory that the copy engine reads directly,
double-buffered so filling one half overlaps the DMA of the other, and each half filled by
several threads (numpy's copy releases the GIL), because one CPU thread copying out of the
page cache is the slower side of a load: ~3–5 GB/s against the copy engine's tens of GB/s.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
from cuda.bindings import driver

from .device import get_device
from .errors import DeviceMemoryError, check
from .launch import Event, Stream, stream_handle

# cuMemAlloc returns addresses aligned to at least 256 bytes (CUDA driver API reference,
# cuMemAlloc); sub-allocations keep that guarantee.
DEFAULT_ALIGN_BYTES = 256
# KV pages start on 16 KiB boundaries (docs/kv-cache.md#layout): a page is exactly 16 KiB for the 7B.
KV_PAGE_ALIGN_BYTES = 16 * 1024

_GiB = float(2**30)


def _gib(nbytes: int) -> str:
    return f"{nbytes / _GiB:.2f} GiB"


def _alloc_device(nbytes: int, what: str) -> int:
    """cuMemAlloc after checking it fits; returns the device address.

    Raises:
        DeviceMemoryError: more than the free device memory, or the driver is out of memory.
    """
    device = get_device()
    free, total = device.memory_info()
    if nbytes > free:
        raise DeviceMemoryError(
            f"cannot allocate {what} of {_gib(nbytes)} ({nbytes} B): only {_gib(free)} of "
            f"{_gib(total)} free on {device.info.name}"
        )
    err, ptr = driver.cuMemAlloc(max(nbytes, 1))
    if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
        # Free memory can still be too fragmented, or taken between the check and the call.
        raise DeviceMemoryError(f"cannot allocate {what} of {_gib(nbytes)}: cuMemAlloc is out of memory")
    check((err,), "cuMemAlloc")
    return int(ptr)


class DeviceBuffer:
    """A raw device allocation of its own (cuMemAlloc / cuMemFree).

    Attributes:
        ptr: the device address (int).
        nbytes: its size in bytes.
    """

    def __init__(self, nbytes: int, name: str = "buffer") -> None:
        """Allocate `nbytes` of device memory.

        Raises:
            DeviceMemoryError: it does not fit; the message names `name` and the sizes.
        """
        self.nbytes = int(nbytes)
        self.name = name
        self.ptr = _alloc_device(self.nbytes, f"device buffer '{name}'")

    def free(self) -> None:
        """cuMemFree; idempotent."""
        if self.ptr:
            check(driver.cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.free()


class DeviceArray:
    """A named, typed region of device memory (usually carved from a `Pool`).

    Attributes:
        name: the buffer's name, e.g. "layer3.attn.q_proj.qweight".
        ptr: device address (int); aligned as requested from the pool.
        shape: element shape, row-major.
        dtype: numpy dtype of the elements.
        nbytes: product(shape) × itemsize.
    """

    def __init__(self, name: str, ptr: int, shape: Sequence[int], dtype) -> None:
        self.name = name
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def _check_host(self, array: np.ndarray) -> np.ndarray:
        if array.shape != self.shape or array.dtype != self.dtype:
            raise ValueError(
                f"{self.name}: host array is {array.dtype}{list(array.shape)}, "
                f"device buffer is {self.dtype}{list(self.shape)}"
            )
        return np.ascontiguousarray(array)

    def upload(self, array: np.ndarray) -> None:
        """Copy a host array of the same shape and dtype into this buffer (synchronous).

        Raises:
            ValueError: shape or dtype differ (the message names the buffer).
        """
        src = self._check_host(array)
        if self.nbytes:
            check(driver.cuMemcpyHtoD(self.ptr, src.ctypes.data, self.nbytes), "cuMemcpyHtoD")

    def upload_at(self, start: int, array: np.ndarray, stream: Stream | None = None) -> None:
        """Copy `array` (same dtype, 1-D) into elements [start, start + len) of this buffer.

        With a stream, the copy is queued after the stream's kernels and the stream is then
        synchronized (the host array may be reused at once); without one, a synchronous copy.
        Used for small in-place updates such as one block-table entry at a page boundary.

        Raises:
            ValueError: dtype differs, or the range falls outside the buffer.
        """
        src = np.ascontiguousarray(array).reshape(-1)
        if src.dtype != self.dtype:
            raise ValueError(f"{self.name}: host dtype {src.dtype}, device dtype {self.dtype}")
        n = src.nbytes
        off = int(start) * self.dtype.itemsize
        if start < 0 or off + n > self.nbytes:
            raise ValueError(f"{self.name}: elements [{start}, {start + src.size}) outside {list(self.shape)}")
        if not n:
            return
        if stream is None:
            check(driver.cuMemcpyHtoD(self.ptr + off, src.ctypes.data, n), "cuMemcpyHtoD")
        else:
            check(driver.cuMemcpyHtoDAsync(self.ptr + off, src.ctypes.data, n, stream.handle), "cuMemcpyHtoDAsync")
            stream.synchronize()

    def download(self, stream: Stream | None = None) -> np.ndarray:
        """Copy the buffer back into a new host array.

        Args:
            stream: if given, the copy is queued on it (after its kernels) and the stream is
                synchronized; else a synchronous copy on the legacy default stream, which
                waits for all work in blocking streams (launch.Stream).
        """
        out = np.empty(self.shape, self.dtype)
        if self.nbytes:
            if stream is None:
                check(driver.cuMemcpyDtoH(out.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
            else:
                check(
                    driver.cuMemcpyDtoHAsync(out.ctypes.data, self.ptr, self.nbytes, stream.handle),
                    "cuMemcpyDtoHAsync",
                )
                stream.synchronize()
        return out

    def copy_from(self, src: DeviceArray, stream: Stream | None = None) -> None:
        """Copy the first self.nbytes bytes of `src` (another device buffer) into this one
        (cuMemcpyDtoD[Async]: with a stream, queued on it, not waited for).

        Raises:
            ValueError: `src` is smaller than this buffer.
        """
        if src.nbytes < self.nbytes:
            raise ValueError(f"{self.name}: {self.nbytes} bytes to copy, {src.name} has {src.nbytes}")
        if self.nbytes:
            if stream is None:
                check(driver.cuMemcpyDtoD(self.ptr, src.ptr, self.nbytes), "cuMemcpyDtoD")
            else:
                check(driver.cuMemcpyDtoDAsync(self.ptr, src.ptr, self.nbytes, stream.handle), "cuMemcpyDtoDAsync")

    def fill_bytes(self, byte: int, stream: Stream | None = None) -> None:
        """Set every byte of the buffer to `byte` (cuMemsetD8[Async]).

        0xFF poisons with NaN: every 0xFF..FF bit pattern is a NaN in fp16 and fp32 (all-ones
        exponent, non-zero mantissa), so tests fill outputs with it before a launch and check
        afterwards that every element was written.

        Raises:
            ValueError: `byte` outside 0..255.
        """
        if not 0 <= byte <= 0xFF:
            raise ValueError(f"{self.name}: fill byte {byte} outside 0..255")
        if self.nbytes:
            if stream is None:
                check(driver.cuMemsetD8(self.ptr, byte, self.nbytes), "cuMemsetD8")
            else:
                check(driver.cuMemsetD8Async(self.ptr, byte, self.nbytes, stream.handle), "cuMemsetD8Async")

    def __repr__(self) -> str:
        return f"DeviceArray({self.name!r}, {self.dtype}{list(self.shape)}, 0x{self.ptr:x})"


class Pool:
    """One cuMemAlloc, carved into aligned, named `DeviceArray`s in order (a bump allocator).

    Buffers are never freed one by one: they live as long as the pool (the engine's
    lifetime), which is what keeps their addresses stable for captured graphs.
    """

    def __init__(self, capacity_bytes: int, name: str = "pool") -> None:
        """Allocate the pool.

        Args:
            capacity_bytes: total size in bytes.
            name: for messages ("weights", "kv", "activations" …).

        Raises:
            DeviceMemoryError: the pool does not fit in free device memory.
        """
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self.base = _alloc_device(self.capacity_bytes, f"pool '{name}'")
        self.used_bytes = 0
        self.arrays: dict[str, DeviceArray] = {}
        self._offsets: dict[str, int] = {}

    @property
    def free_bytes(self) -> int:
        """Bytes not yet handed out (before alignment padding of the next buffer)."""
        return self.capacity_bytes - self.used_bytes

    def alloc(self, name: str, shape: Sequence[int], dtype, *, align: int = DEFAULT_ALIGN_BYTES) -> DeviceArray:
        """Carve a named buffer of `shape` × `dtype` from the pool.

        Args:
            name: unique within the pool.
            shape: element shape.
            dtype: numpy dtype (np.float16, np.int32, ml_dtypes.bfloat16 …).
            align: start alignment in bytes, a power of two (DEFAULT_ALIGN_BYTES, or
                KV_PAGE_ALIGN_BYTES for KV pages).

        Raises:
            ValueError: the name is taken, or `align` is not a power of two.
            DeviceMemoryError: the buffer does not fit in what is left of the pool; the
                message names the buffer and the sizes.
        """
        if name in self.arrays:
            raise ValueError(f"pool '{self.name}' already has a buffer named '{name}'")
        if align < 1 or align & (align - 1):
            raise ValueError(f"alignment must be a power of two, got {align}")
        arr = DeviceArray(name, 0, shape, dtype)
        # Align the *address*, not the offset: the base is only guaranteed 256 B-aligned.
        start = -(-(self.base + self.used_bytes) // align) * align
        offset = start - self.base
        if offset + arr.nbytes > self.capacity_bytes:
            raise DeviceMemoryError(
                f"pool '{self.name}' cannot fit '{name}' {arr.dtype}{list(arr.shape)} of {arr.nbytes} B "
                f"(align {align}): {self.capacity_bytes - self.used_bytes} of {self.capacity_bytes} B left"
            )
        arr.ptr = start
        self.used_bytes = offset + arr.nbytes
        self.arrays[name] = arr
        self._offsets[name] = offset
        return arr

    def __getitem__(self, name: str) -> DeviceArray:
        return self.arrays[name]

    def report(self) -> str:
        """A table of the pool's buffers: name, dtype, shape, offset and size."""
        lines = [f"pool '{self.name}': {_gib(self.used_bytes)} used of {_gib(self.capacity_bytes)}"]
        for name, arr in self.arrays.items():
            lines.append(
                f"  {name:<40} {str(arr.dtype):<8} {str(list(arr.shape)):<20} "
                f"@{self._offsets[name]:>14,}  {arr.nbytes / 2**20:10.3f} MiB"
            )
        return "\n".join(lines)

    def close(self) -> None:
        """cuMemFree the whole pool; every array carved from it becomes invalid. Idempotent."""
        if self.base:
            check(driver.cuMemFree(self.base), "cuMemFree")
            self.base = 0
            self.arrays.clear()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PinnedHostBuffer:
    """Page-locked host memory (cuMemHostAlloc), which the GPU's copy engines read directly.

    Pageable memory is first copied by the driver into its own pinned bounce buffer; pinned
    memory skips that copy and lets cuMemcpyHtoDAsync run truly asynchronously.

    Attributes:
        ptr: the host address (int).
        nbytes: the size in bytes.
    """

    def __init__(self, nbytes: int) -> None:
        get_device()
        self.nbytes = int(nbytes)
        # Flags 0: plain pinned memory, visible to this context; no mapping or write-combining
        # (write-combined memory is slow to read back from the CPU).
        self.ptr = int(check(driver.cuMemHostAlloc(max(self.nbytes, 1), 0), "cuMemHostAlloc"))

    def view(self, dtype=np.uint8, count: int | None = None, offset_bytes: int = 0) -> np.ndarray:
        """A 1-D numpy array over the pinned bytes (no copy); valid until `free()`.

        Raises:
            ValueError: the view would reach past the buffer.
        """
        dtype = np.dtype(dtype)
        if count is None:
            count = (self.nbytes - offset_bytes) // dtype.itemsize
        if offset_bytes < 0 or offset_bytes + count * dtype.itemsize > self.nbytes:
            raise ValueError(f"pinned view of {count} × {dtype} at byte {offset_bytes} exceeds {self.nbytes} B")
        raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(self.ptr + offset_bytes)
        return np.frombuffer(raw, dtype=dtype, count=count)

    def free(self) -> None:
        """cuMemFreeHost; idempotent."""
        if self.ptr:
            check(driver.cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0

    def __enter__(self) -> PinnedHostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.free()


# 64 MiB per staging half: large enough that each cuMemcpyHtoDAsync runs near PCIe speed
# (per-copy overhead is microseconds against ~1 ms of transfer), small enough to pin cheaply.
STAGING_CHUNK_BYTES = 64 * 2**20
# Pieces of one chunk that the copy threads take: large enough that a thread's start costs
# nothing beside its copy (8 MiB is ~1 ms of memcpy), small enough to split a chunk 8 ways.
STAGING_PIECE_BYTES = 8 * 2**20
# Threads that fill a chunk at most: copying from the page cache scales with threads until it
# meets memory bandwidth, which a handful of cores reach.
STAGING_COPY_THREADS = 8


def default_copy_threads() -> int:
    """The copy threads a StagingUploader uses by default: STAGING_COPY_THREADS, or fewer where
    this process may run on fewer cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(STAGING_COPY_THREADS, cores)


def parallel_copy(dst: np.ndarray, src: np.ndarray, pool: ThreadPoolExecutor | None,
                  piece_bytes: int = STAGING_PIECE_BYTES) -> None:
    """dst[:] = src for 1-D uint8 arrays of equal size, in pieces of `piece_bytes` on `pool`'s
    threads where there are at least two pieces (else, or without a pool, on this thread).
    Returns when every piece is copied; a piece's error is raised here."""
    n = src.size
    if dst.size != n:
        raise ValueError(f"parallel_copy: {dst.size} B into {n} B")
    if pool is None or n < 2 * piece_bytes:
        dst[:] = src
        return
    jobs = [pool.submit(dst[a : a + piece_bytes].__setitem__, slice(None), src[a : a + piece_bytes])
            for a in range(0, n, piece_bytes)]
    wait(jobs)  # every piece has ended before an error is raised: none still writes into dst
    for job in jobs:
        job.result()


class StagingUploader:
    """Uploads host arrays of any size through two pinned chunks, double-buffered.

    While the copy engine moves chunk A to the device, the CPU fills chunk B; an event per
    chunk says when it may be refilled. A chunk is filled by up to `copy_threads` threads in
    pieces of `piece_bytes` (numpy releases the GIL while it copies); the copy of a
    chunk has ended before its DMA is queued, so the order of the device writes is the order
    of the uploads. Use one for all the weights of a model load.

    Small arrays bound for one device allocation (`region` = (base, nbytes): a Pool's, whose
    allocations follow each other in upload order) share a chunk: each is copied to its place
    relative to the first, and one DMA carries them all, the alignment padding between them
    included (padding of that allocation, which nothing reads). A model has hundreds of small
    tensors (norms, biases, scales); one DMA and one event wait each cost about as much as their
    bytes.
    """

    def __init__(self, chunk_bytes: int = STAGING_CHUNK_BYTES, stream: Stream | None = None,
                 copy_threads: int | None = None, piece_bytes: int = STAGING_PIECE_BYTES,
                 region: tuple[int, int] | None = None) -> None:
        self.chunk_bytes = int(chunk_bytes)
        self.piece_bytes = int(piece_bytes)
        self._region = region
        self._pinned = PinnedHostBuffer(2 * self.chunk_bytes)
        self._own_stream = stream is None
        self.stream = Stream() if stream is None else stream
        self._done = [Event(), Event()]
        self._used = [False, False]
        self._next = 0
        self._open: list[int] | None = None  # [half, device start, device end] of the chunk being filled
        self.dmas = 0                         # copies queued so far
        threads = copy_threads if copy_threads is not None else default_copy_threads()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="staging") if threads > 1 else None

    def _take_half(self) -> int:
        """The next half to fill, once the DMA that last read it is done."""
        half = self._next
        self._next ^= 1
        if self._used[half]:
            self._done[half].synchronize()
        return half

    def _dma(self, dst_ptr: int, half: int, offset: int, n: int) -> None:
        check(driver.cuMemcpyHtoDAsync(dst_ptr, self._pinned.ptr + half * self.chunk_bytes + offset, n,
                                       stream_handle(self.stream)), "cuMemcpyHtoDAsync")
        self._done[half].record(self.stream)
        self._used[half] = True
        self.dmas += 1

    def _flush(self) -> None:
        """Queue the DMA of the chunk being filled with small arrays, if any."""
        if self._open is not None:
            half, start, end = self._open
            self._open = None
            self._dma(start, half, 0, end - start)

    def _shares_chunk(self, ptr: int, n: int) -> bool:
        if self._region is None or n > self.chunk_bytes // 2:
            return False
        base, size = self._region
        return base <= ptr and ptr + n <= base + size

    def upload(self, dst: DeviceArray, array: np.ndarray) -> None:
        """Queue the copy of `array` into `dst` (same shape and dtype); call `finish()` before use.

        Raises:
            ValueError: shape or dtype differ.
        """
        src = dst._check_host(array).reshape(-1).view(np.uint8)
        pinned = self._pinned.view()
        if self._shares_chunk(dst.ptr, src.size):
            if self._open is not None:
                half, start, end = self._open
                if dst.ptr >= end and dst.ptr + src.size - start <= self.chunk_bytes:  # after the last, fits
                    lo = half * self.chunk_bytes + (dst.ptr - start)
                    parallel_copy(pinned[lo : lo + src.size], src, self._pool, self.piece_bytes)
                    self._open[2] = dst.ptr + src.size
                    return
                self._flush()
            half = self._take_half()
            lo = half * self.chunk_bytes
            parallel_copy(pinned[lo : lo + src.size], src, self._pool, self.piece_bytes)
            self._open = [half, dst.ptr, dst.ptr + src.size]
            return
        self._flush()
        for start in range(0, src.size, self.chunk_bytes):
            n = min(self.chunk_bytes, src.size - start)
            half = self._take_half()
            lo = half * self.chunk_bytes
            parallel_copy(pinned[lo : lo + n], src[start : start + n], self._pool, self.piece_bytes)
            self._dma(dst.ptr + start, half, 0, n)

    def finish(self) -> None:
        """Queue what is still being gathered, then wait until every queued upload has landed."""
        self._flush()
        self.stream.synchronize()

    def close(self) -> None:
        """Finish, then release the copy threads, pinned memory, events and (if created here)
        the stream."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._pinned.ptr:
            self.finish()
            for e in self._done:
                e.close()
            self._pinned.free()
            if self._own_stream:
                self.stream.close()

    def __enter__(self) -> StagingUploader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
