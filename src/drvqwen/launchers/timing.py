"""Launcher of kernels/timing.cu: hold a stream for a while (honest per-kernel timing).

    GpuSleep   one thread spins on %globaltimer for `ms` milliseconds

Queued first, it lets the host enqueue a whole step of launches and event pairs before the
GPU starts, so each event pair brackets one kernel's GPU time and not the host's launch
latency (DecodeStep.time_kernels).
"""

from __future__ import annotations

import ctypes

from ..cuda import Stream
from .base import KernelRef, Launcher, require


class GpuSleep(Launcher):
    """Spin one GPU thread for `ms` milliseconds.

    Raises:
        LaunchError: ms not positive.
    """

    def __init__(self, ms: float, *, stream: Stream | None = None):
        super().__init__(stream)
        require(ms > 0, f"gpu_sleep: {ms} ms must be positive")
        self._add(KernelRef("timing", "gpu_sleep"), (1,), (1,), dict(ns=ctypes.c_uint64(int(ms * 1e6))))
