"""Driver and NVRTC results → Python exceptions.

Every call into `cuda.bindings` returns a tuple whose first element is a result code
(`CUresult` or `nvrtcResult`) and whose other elements are the outputs. Every call in
drvqwen goes through `check()`, so an error can never pass silently and always names the
call that failed:

    ptr = check(driver.cuMemAlloc(nbytes), "cuMemAlloc")

Which errors are whose:
- `CudaError`, `NvrtcError` are programming or environment faults (an illegal address, a
  kernel that does not compile): ordinary exceptions, so they keep their tracebacks.
- `GpuUnavailableError`, `DeviceMemoryError` are things a user can cause and fix (no GPU, a
  model too large for the card): `DrvqwenError`s, so the CLI prints their one-line message.
"""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver

from ..errors import DrvqwenError


class CudaError(RuntimeError):
    """A CUDA driver call returned an error.

    Attributes:
        call: the driver function, e.g. "cuMemAlloc".
        error_name: the CUresult name, e.g. "CUDA_ERROR_OUT_OF_MEMORY".
        message: the driver's description of the error (cuGetErrorString).
        code: the CUresult value (an int).
    """

    def __init__(self, call: str, error_name: str, message: str, code: int = -1) -> None:
        self.call = call
        self.error_name = error_name
        self.message = message
        self.code = code
        super().__init__(f"{call} failed: {error_name}: {message}")


class NvrtcError(RuntimeError):
    """An NVRTC call failed; for a failed compile, `log` holds the whole compiler log.

    Attributes:
        call: the NVRTC function, e.g. "nvrtcCompileProgram".
        error_name: the nvrtcResult name, e.g. "NVRTC_ERROR_COMPILATION".
        log: the program log ("" when the failure was not a compile).
        program: the name of the program being compiled ("" if none).
    """

    def __init__(self, call: str, error_name: str, log: str = "", program: str = "") -> None:
        self.call = call
        self.error_name = error_name
        self.log = log
        self.program = program
        where = f" compiling {program}" if program else ""
        text = f"{call} failed{where}: {error_name}"
        if log.strip():
            text += "\n--- NVRTC log ---\n" + log.rstrip()
        super().__init__(text)


class GpuUnavailableError(DrvqwenError):
    """No usable Hopper GPU: no driver, no device, or a device that is not sm_90."""


class DeviceMemoryError(DrvqwenError):
    """A device allocation does not fit; the message names what was asked for and what is free."""


def _driver_error_text(err: driver.CUresult) -> str:
    """The driver's own description of `err`, or "" when it cannot give one.

    cuGetErrorString needs libcuda; an error report must never raise a second error, so any
    failure here degrades to an empty description.
    """
    try:
        res, text = driver.cuGetErrorString(err)
    except Exception:  # noqa: BLE001 - reporting must not mask the original error
        return ""
    if res != driver.CUresult.CUDA_SUCCESS or text is None:
        return ""
    return text.decode() if isinstance(text, bytes) else str(text)


def cuda_error(err: driver.CUresult, call: str) -> CudaError:
    """Build the `CudaError` for a failed driver call (used by hot paths that skip `check`)."""
    return CudaError(call, err.name, _driver_error_text(err), int(err))


def check(result: tuple, call: str) -> Any:
    """Raise if a `cuda.bindings` call failed; otherwise return its outputs.

    Args:
        result: the tuple a `cuda.bindings.driver` or `cuda.bindings.nvrtc` function returned;
            element 0 is the `CUresult` / `nvrtcResult`.
        call: the name of the function that was called, for the message.

    Returns:
        None when the call has no outputs, the single output when it has one, otherwise a
        tuple of the outputs.

    Raises:
        CudaError: a driver call returned anything but CUDA_SUCCESS.
        NvrtcError: an NVRTC call returned anything but NVRTC_SUCCESS (without a log; the
            compile path in nvrtc.py attaches the log itself).
    """
    err = result[0]
    # Both result enums are int subclasses whose success value is 0, so `if err` is the
    # cheapest correct test. A result that is not the driver's is NVRTC's, the only other
    # library called through here: told apart without importing cuda.bindings.nvrtc, which
    # a run whose cubins all come from the cache never loads (nvrtc.py).
    if err:
        if isinstance(err, driver.CUresult):
            raise cuda_error(err, call)
        raise NvrtcError(call, err.name)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return tuple(result[1:])
