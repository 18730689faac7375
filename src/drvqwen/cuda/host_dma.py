"""DMA straight from host memory the process already holds: a registered range, and the copy.

The weights' upload copies the file's mapping into pinned staging memory on the CPU, and the
copy engine reads the staging memory (memory.StagingUploader). The other way: register the
mapping itself with cuMemHostRegister, which page-locks the page-cache pages the mapping shows,
and let the copy engine read the file's bytes where they lie: no staging buffer and no CPU copy.
What it costs instead is the registration: pinning every page, and faulting in the pages this
process has not touched yet. tools/bench_upload.py times both ways.

A file mapped read-only (np.memmap mode "r", as format/nanoqwen.py maps a model) can only be
registered with CU_MEMHOSTREGISTER_READ_ONLY: the kernel refuses to pin its pages writable. The
flag needs a device with CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED; elsewhere the
driver answers "not supported" (CUDA driver API reference, cuMemHostRegister).

Registration works on whole pages (the driver API's older references require a page-aligned
start and size), so the range registered is the cover of the array's bytes by pages: every such
page is mapped, since each holds at least one byte of the array. Two registrations must not share
a page (the driver answers "already registered"), and the memory must stay mapped until
`unregister()`.
"""

from __future__ import annotations

import mmap

import numpy as np
from cuda.bindings import driver

from .device import get_device
from .errors import check
from .launch import Stream, stream_handle

PAGE_BYTES = mmap.PAGESIZE


def page_cover(ptr: int, nbytes: int, page: int = PAGE_BYTES) -> tuple[int, int]:
    """(start, size) of the smallest run of whole pages that holds bytes [ptr, ptr + nbytes).

    Raises:
        ValueError: nbytes < 1, or `page` not a power of two.
    """
    if nbytes < 1 or page < 1 or page & (page - 1):
        raise ValueError(f"page cover of {nbytes} B with {page} B pages: need nbytes >= 1 and a power-of-two page")
    start = ptr & ~(page - 1)
    end = -(-(ptr + nbytes) // page) * page
    return start, end - start


def read_only_register_supported() -> bool:
    """True where the current device can register host memory read-only
    (CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)."""
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
    return bool(check(driver.cuDeviceGetAttribute(attr, get_device().handle), "cuDeviceGetAttribute"))


class RegisteredHostRange:
    """The pages under a host array, page-locked for the copy engine (cuMemHostRegister).

    Attributes:
        ptr: the array's first byte (int), what copies read from.
        nbytes: the array's size in bytes.
        read_only: registered with CU_MEMHOSTREGISTER_READ_ONLY.
    """

    def __init__(self, array: np.ndarray, read_only: bool = True) -> None:
        """Register the page cover of `array`'s bytes (C-contiguous, at least one byte); it must
        stay mapped, and `array` alive, until `unregister()`.

        Raises:
            ValueError: `array` is empty or not C-contiguous.
            CudaError: the driver refused ("not supported" for read_only on a device without
                the attribute, "already registered" for a page registered before,
                CUDA_ERROR_INVALID_VALUE for memory it cannot pin).
        """
        if not array.flags.c_contiguous or array.nbytes < 1:
            raise ValueError(f"register host memory: need a non-empty C-contiguous array, got "
                             f"{array.dtype}{list(array.shape)} ({'' if array.flags.c_contiguous else 'not '}contiguous)")
        get_device()
        self._array = array   # keeps the memory (and a mapping) alive while registered
        self.ptr = int(array.ctypes.data)
        self.nbytes = int(array.nbytes)
        self.read_only = read_only
        self._base = 0        # the registered page cover's start; 0 once unregistered (or never)
        base, size = page_cover(self.ptr, self.nbytes)
        flags = driver.CU_MEMHOSTREGISTER_READ_ONLY if read_only else 0
        check(driver.cuMemHostRegister(base, size, flags), "cuMemHostRegister")
        self._base = base

    @property
    def registered(self) -> bool:
        """True until `unregister()`."""
        return bool(self._base)

    def unregister(self) -> None:
        """cuMemHostUnregister; the pages are pageable again. Idempotent."""
        if self._base:
            check(driver.cuMemHostUnregister(self._base), "cuMemHostUnregister")
            self._base = 0
            self._array = None

    def __enter__(self) -> RegisteredHostRange:
        return self

    def __exit__(self, *exc) -> None:
        self.unregister()


def copy_to_device_async(dst_ptr: int, src_ptr: int, nbytes: int, stream: Stream | None) -> None:
    """Queue a copy of `nbytes` from host address `src_ptr` to device address `dst_ptr` on
    `stream` (None: the legacy default stream), cuMemcpyHtoDAsync. From pinned or registered
    memory it is a DMA that returns at once; the source must stay unchanged until the stream
    has passed the copy."""
    check(driver.cuMemcpyHtoDAsync(dst_ptr, src_ptr, nbytes, stream_handle(stream)), "cuMemcpyHtoDAsync")


class RegisteredUploader:
    """Uploads arrays that lie in one host array (a model file's mapping) by DMA straight from
    its pages, registered read-only for the whole upload; no staging buffer, no CPU copy.

    Why: the staging uploader's pinned buffer alone costs ~70 ms to allocate and free (128 MiB,
    cuMemHostAlloc pins every page), and its CPU copy ~25 ms per 0.5 GB; registering the file's
    mapping costs ~20–30 ms per 0.5 GB of page cache and the copy engine then reads the bytes
    where they lie (tools/bench_upload.py times both). Same interface as memory.StagingUploader
    (upload, finish, close, a context manager), so the weights' upload takes either.

    An array outside the registered range (a tensor converted on the host, e.g. FP32 → FP16) is
    copied from its pageable memory: the driver stages such a copy itself before the call returns.
    """

    def __init__(self, source: np.ndarray, stream: Stream | None = None) -> None:
        """Register `source` (C-contiguous, read-only pages are fine) until `close()`.

        Raises:
            ValueError: `source` empty or not C-contiguous.
            CudaError: the driver refused the registration (RegisteredHostRange); nothing is
                held then.
        """
        self._range = RegisteredHostRange(source, read_only=True)
        self._own_stream = stream is None
        self.stream = Stream() if stream is None else stream
        self._held: list[np.ndarray] = []   # copies from outside the range, alive until finish()
        self.dmas = 0                        # copies queued so far

    def upload(self, dst, array: np.ndarray) -> None:
        """Queue the copy of `array` into `dst` (a memory.DeviceArray of the same shape and
        dtype); call `finish()` before the device reads it.

        Raises:
            ValueError: shape or dtype differ.
        """
        src = dst._check_host(array)
        if not src.nbytes:
            return
        ptr = int(src.ctypes.data)
        if not (self._range.ptr <= ptr and ptr + src.nbytes <= self._range.ptr + self._range.nbytes):
            self._held.append(src)
        copy_to_device_async(dst.ptr, ptr, src.nbytes, self.stream)
        self.dmas += 1

    def finish(self) -> None:
        """Wait until every queued upload has landed."""
        self.stream.synchronize()
        self._held.clear()

    def close(self) -> None:
        """Finish, unregister the pages (pageable again), and close the stream if created here.
        Idempotent."""
        if self._range.registered:
            self.finish()
            self._range.unregister()
            if self._own_stream:
                self.stream.close()

    def __enter__(self) -> RegisteredUploader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
