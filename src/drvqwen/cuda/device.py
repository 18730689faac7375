"""The GPU: driver start-up, the primary context, and the device's numbers.

drvqwen runs on one GPU with one context, the device's *primary* context (the one the CUDA
runtime and PyTorch also use), so memory and modules are shared with anything else in the
process that touches the same GPU. `get_device()` starts the driver, retains that context
and makes it current on the calling thread; every other module in this package calls it
before its first driver call.

A machine without a usable GPU must not crash on import: importing `cuda.bindings.driver`
never loads libcuda, only the first call does. `gpu_unavailable_reason()` turns every way
of not having a GPU into a one-line reason (the test suite skips GPU tests with it).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

from cuda.bindings import driver

from . import toolchain
from .errors import GpuUnavailableError, check

# drvqwen's cubins are built for sm_90a (nvrtc.ARCH). Arch-specific "a" targets (wgmma,
# setmaxnreg) run on exactly compute capability 9.0 — not on 10.x or later — so 9.0 is
# required, not "at least 9.0" (CUDA C Programming Guide, "Feature Availability").
REQUIRED_COMPUTE_CAPABILITY = (9, 0)

# cuDeviceGetName writes at most this many bytes; 256 is the size the CUDA samples use.
_DEVICE_NAME_BYTES = 256

_ATTR = driver.CUdevice_attribute


@dataclass(frozen=True)
class DeviceInfo:
    """The numbers of one GPU that kernels and launch shapes are built around.

    Attributes:
        ordinal: the device index as CUDA sees it (after CUDA_VISIBLE_DEVICES).
        name: e.g. "NVIDIA H200".
        compute_capability: (major, minor), (9, 0) for H100/H200.
        sm_count: streaming multiprocessors (132 on H100 SXM / H200).
        l2_bytes: L2 cache size in bytes (50 MiB on H100 SXM, 60 MiB on H200).
        max_smem_per_block_optin_bytes: the most dynamic shared memory a block may use after
            opting in with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (227 KiB on sm_90).
        total_memory_bytes: device memory in bytes.
        driver_version: cuDriverGetVersion, e.g. 13000 for CUDA 13.0.
    """

    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    l2_bytes: int
    max_smem_per_block_optin_bytes: int
    total_memory_bytes: int
    driver_version: int

    def summary(self) -> str:
        """One line for logs and benchmark headers."""
        major, minor = self.compute_capability
        return (
            f"GPU {self.ordinal}: {self.name}, sm_{major}{minor}, {self.sm_count} SMs, "
            f"L2 {self.l2_bytes / 2**20:.0f} MiB, "
            f"smem/block {self.max_smem_per_block_optin_bytes // 1024} KiB, "
            f"{self.total_memory_bytes / 2**30:.1f} GiB, "
            f"driver CUDA {self.driver_version // 1000}.{self.driver_version % 1000 // 10}"
        )


class Device:
    """One GPU with its primary context retained. Build it with `get_device()`.

    Attributes:
        ordinal: device index.
        handle: the `CUdevice`.
        context: the retained primary `CUcontext`.
        info: the device's `DeviceInfo`.
    """

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.handle = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(driver.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self.make_current()
        self.info = _read_info(ordinal, self.handle)

    def make_current(self) -> None:
        """Make this device's primary context current on the calling thread.

        Needed once per thread: a context is current per thread, and `get_device()` only sets
        it on the thread that first called it.
        """
        check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def synchronize(self) -> None:
        """Block until all work queued in this context has finished.

        Raises:
            CudaError: a kernel launched earlier faulted (the fault surfaces here).
        """
        check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def memory_info(self) -> tuple[int, int]:
        """Return (free_bytes, total_bytes) of device memory as the driver sees it now."""
        free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)


def _attribute(handle: driver.CUdevice, attr: driver.CUdevice_attribute) -> int:
    return int(check(driver.cuDeviceGetAttribute(attr, handle), "cuDeviceGetAttribute"))


def _read_info(ordinal: int, handle: driver.CUdevice) -> DeviceInfo:
    raw_name = check(driver.cuDeviceGetName(_DEVICE_NAME_BYTES, handle), "cuDeviceGetName")
    name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
    return DeviceInfo(
        ordinal=ordinal,
        name=name,
        compute_capability=(
            _attribute(handle, _ATTR.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            _attribute(handle, _ATTR.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        ),
        sm_count=_attribute(handle, _ATTR.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        l2_bytes=_attribute(handle, _ATTR.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        max_smem_per_block_optin_bytes=_attribute(
            handle, _ATTR.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        ),
        total_memory_bytes=int(check(driver.cuDeviceTotalMem(handle), "cuDeviceTotalMem")),
        driver_version=int(check(driver.cuDriverGetVersion(), "cuDriverGetVersion")),
    )


def _probe(ordinal: int) -> str | None:
    """Every reason `ordinal` cannot run drvqwen, or None. Never raises."""
    # Without libcuda, cuda.bindings raises on the first driver call (a RuntimeError from
    # cuda.pathfinder, "Failed to dlopen libcuda.so.1") instead of returning an error code;
    # with a driver but no GPU, cuInit returns CUDA_ERROR_NO_DEVICE. Both mean "no GPU".
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # noqa: BLE001 - this probe must answer, never raise
        return f"no CUDA driver (libcuda could not be loaded: {e})"
    if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        return "a CUDA driver is installed but it sees no GPU (cuInit: CUDA_ERROR_NO_DEVICE)"
    if err:
        return f"cuInit failed: {err.name}"
    err, count = driver.cuDeviceGetCount()
    if err or count == 0:
        return "the CUDA driver reports no GPU (cuDeviceGetCount)"
    if ordinal >= count:
        return f"GPU {ordinal} asked for, but only {count} visible"
    err, handle = driver.cuDeviceGet(ordinal)
    if err:
        return f"cuDeviceGet({ordinal}) failed: {err.name}"
    err, major = driver.cuDeviceGetAttribute(_ATTR.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle)
    err2, minor = driver.cuDeviceGetAttribute(_ATTR.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle)
    if err or err2:
        return "could not read the GPU's compute capability"
    if (major, minor) != REQUIRED_COMPUTE_CAPABILITY:
        _, raw = driver.cuDeviceGetName(_DEVICE_NAME_BYTES, handle)
        name = raw.split(b"\0", 1)[0].decode(errors="replace")
        return (
            f"GPU {ordinal} is {name} with compute capability {major}.{minor}; drvqwen's kernels "
            f"are sm_90a cubins and run only on compute capability 9.0 (Hopper: H100, H200)"
        )
    # A cubin is only guaranteed to load on a driver of at least the compiling toolkit's
    # major version (CUDA minor-version compatibility stops at the major version).
    err, drv_version = driver.cuDriverGetVersion()
    try:
        nvrtc_major = toolchain.nvrtc_major()   # the recorded toolchain's: NVRTC is not loaded for it
    except RuntimeError as e:
        return f"NVRTC could not be loaded: {e}"
    if not err and drv_version // 1000 < nvrtc_major:
        return (
            f"the driver supports CUDA {drv_version // 1000}.{drv_version % 1000 // 10}, older "
            f"than NVRTC {nvrtc_major}.x that builds the kernels; install a CUDA {nvrtc_major} driver"
        )
    return None


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason(ordinal: int = 0) -> str | None:
    """Why drvqwen cannot use GPU `ordinal` here, or None when it can.

    Handles every way of not having a usable GPU without raising: no libcuda at all (CI),
    a driver with no device, a device that is not compute capability 9.0, a driver older
    than the NVRTC that builds the cubins. The answer is cached for the process.

    Args:
        ordinal: the device index (after CUDA_VISIBLE_DEVICES).

    Returns:
        None if the GPU is usable, else a short human-readable reason.
    """
    return _probe(ordinal)


_current = threading.local()  # per thread: the Device whose context this thread made current


def get_device(ordinal: int = 0) -> Device:
    """Start the driver, retain GPU `ordinal`'s primary context and make it current.

    Cached: every later call returns the same `Device` (drvqwen is single-GPU, one context).
    A context is current per thread, so the first call on each thread (a server's engine worker,
    say) makes it current there too.

    Args:
        ordinal: the device index (after CUDA_VISIBLE_DEVICES).

    Returns:
        The `Device`, with its context current on the calling thread.

    Raises:
        GpuUnavailableError: no usable sm_90 GPU; the message says why.
    """
    dev = _open_device(ordinal)
    if getattr(_current, "device", None) is not dev:
        dev.make_current()
        _current.device = dev
    return dev


@functools.lru_cache(maxsize=None)
def _open_device(ordinal: int) -> Device:
    reason = gpu_unavailable_reason(ordinal)
    if reason is not None:
        raise GpuUnavailableError(f"no usable Hopper GPU: {reason}")
    return Device(ordinal)
