"""Start the CUDA driver in a background thread while Python imports the rest of drvqwen.

Why: before the first kernel, a process spends about as long bringing up the driver (cuInit
and retaining the primary context: 0.2–0.4 s on an H200) as importing numpy, cuda.bindings
and the engine (0.5 s there) — one after the other, and both on the user's wait for the first
token. The two can overlap only if the driver calls let go of Python's GIL: through
cuda.bindings a thread making them hid 0.05–0.1 s of ~0.35 (measured on the H200), while
ctypes releases the GIL around every foreign call. So the thread loads libcuda with ctypes
and calls cuInit(0), cuDeviceGet and cuDevicePrimaryCtxRetain itself. The driver's state is
per process: when device.py later makes the same calls through cuda.bindings, the driver is
up and the primary context exists, and they return at once.

The context retained here is held until the process ends (the driver releases it then):
drvqwen runs one context per process, and releasing it would destroy what was made — unless the
run goes to the CPU after all (the probe refuses the GPU, or the model needs the CPU): then
`release()` gives it back, so a CPU run holds no GPU memory. Every failure is silent here — no
libcuda, no device, any error code — because device.py's probe makes the same calls and reports
what is wrong, in words.

Only the standard library is imported at the top: this module must start its thread before
numpy or cuda.bindings are imported.
"""

from __future__ import annotations

import ctypes
import threading

_LIBCUDA = "libcuda.so.1"

# (libcuda, device) whose primary context _bring_up retained and nobody released yet.
_retained: list[tuple[ctypes.CDLL, ctypes.c_int]] = []
_lock = threading.Lock()


def _bring_up(ordinal: int) -> None:
    try:
        lib = ctypes.CDLL(_LIBCUDA)
    except OSError:
        return  # no driver: device.py says so
    if lib.cuInit(0) != 0:
        return
    dev = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return
    ctx = ctypes.c_void_p()
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        return
    with _lock:
        _retained.append((lib, dev))
    # NVRTC is not loaded here: a run whose cubins are all in the cache never needs it (the
    # probe and the cache key take its version from the recorded toolchain, toolchain.py), and
    # importing cuda.pathfinder to find it would hold the GIL the main thread's imports need.


_started: threading.Thread | None = None  # the warm-up thread of this process, once started


def start_driver(ordinal: int = 0) -> threading.Thread:
    """Start cuInit and the primary context of GPU `ordinal` in a daemon thread, once per
    process (a second call returns the first call's thread); join() it before the probe
    (device.gpu_unavailable_reason) so that the time spent waiting for it is counted where the
    context is made. Never raises."""
    global _started
    with _lock:
        if _started is None:
            _started = threading.Thread(target=_bring_up, args=(ordinal,), name="cuda-warmup", daemon=True)
            _started.start()
        return _started


# How long the process waits at its end for a warm-up thread still inside libcuda (a run that
# ended before opening a model: a mistyped option, -n 0): a broken driver must not hang it.
EXIT_WAIT_S = 10.0


def join_started(timeout: float | None = None) -> None:
    """Wait for the warm-up thread if one was started (a no-op otherwise). The entry point
    calls it before the process ends: ending (interpreter finalization, then libcuda's own
    exit handlers) while the thread is inside cuInit or cuDevicePrimaryCtxRetain would race
    the driver's teardown against its start-up."""
    thread = _started
    if thread is not None:
        thread.join(timeout)


def release() -> None:
    """Give back the primary context the warm-up retained, if it did (a run that goes to the
    CPU after all). Call it after joining the thread; a second call does nothing."""
    with _lock:
        while _retained:
            lib, dev = _retained.pop()
            lib.cuDevicePrimaryCtxRelease(dev)
