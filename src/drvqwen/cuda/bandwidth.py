"""The device's copy bandwidth, measured: the ceiling a memory-bound decode step is judged by.

Decode reads every weight once per token, so its speed is bounded by how fast HBM can be read.
The datasheet figure (4.8 TB/s on an H200) is not reachable; a large device-to-device copy is
the practical ceiling, measured in the same run as the thing it is compared with (clocks and
the card's state are then the same). docs/benchmarks.md#the-protocol.

Convention: a copy of N bytes moves 2·N bytes (N read + N written), the convention of the
4.3 TB/s figure recorded for the H200 (docs/benchmarks.md). The copy is several times larger than the
60 MB L2, so it measures HBM, not the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver

from .errors import check
from .launch import Event, Stream
from .memory import DeviceBuffer

# ≥ 2 GB per copy (the benchmark protocol): ~1 ms on an H200, far above event resolution
# (~0.5 µs) and launch latency, and ~36× the L2.
DEFAULT_COPY_BYTES = 2 * 2**30


@dataclass(frozen=True)
class CopyBandwidth:
    """A device-to-device copy measurement.

    Attributes:
        copy_bytes: bytes per copy (each copy reads and writes this many).
        times_ms: GPU time of each timed copy, in ms.
        gbps: median bandwidth in GB/s (1e9 B/s), counting read + write bytes (2 × copy_bytes).
    """

    copy_bytes: int
    times_ms: tuple[float, ...]

    @property
    def gbps(self) -> float:
        return 2 * self.copy_bytes / (float(np.median(self.times_ms)) * 1e-3) / 1e9


def measure_copy_bandwidth(copy_bytes: int = DEFAULT_COPY_BYTES, reps: int = 10) -> CopyBandwidth:
    """Time `reps` cuMemcpyDtoDAsync copies of `copy_bytes` (after one untimed warm-up copy).

    Each copy is bracketed by its own pair of CUDA events on one stream; the buffers (two of
    `copy_bytes`) are allocated for the measurement and freed before returning.

    Raises:
        DeviceMemoryError: the two buffers do not fit in free device memory.
        ValueError: copy_bytes or reps not positive.
    """
    if copy_bytes <= 0 or reps <= 0:
        raise ValueError(f"copy bandwidth: copy_bytes={copy_bytes} and reps={reps} must be positive")
    src = DeviceBuffer(copy_bytes, "copy_bandwidth.src")
    try:
        dst = DeviceBuffer(copy_bytes, "copy_bandwidth.dst")
    except BaseException:
        src.free()
        raise
    stream = Stream()
    events = [(Event(), Event()) for _ in range(reps)]
    try:
        # The source's contents do not matter to the copy engine; zero it so the measurement
        # never reads uninitialized memory (compute-sanitizer's initcheck stays quiet).
        check(driver.cuMemsetD8Async(src.ptr, 0, copy_bytes, stream.handle), "cuMemsetD8Async")
        check(driver.cuMemcpyDtoDAsync(dst.ptr, src.ptr, copy_bytes, stream.handle), "cuMemcpyDtoDAsync")
        for e0, e1 in events:
            e0.record(stream)
            check(driver.cuMemcpyDtoDAsync(dst.ptr, src.ptr, copy_bytes, stream.handle), "cuMemcpyDtoDAsync")
            e1.record(stream)
        stream.synchronize()
        times = tuple(e0.elapsed_ms(e1) for e0, e1 in events)
    finally:
        stream.synchronize()
        for e0, e1 in events:
            e0.close()
            e1.close()
        stream.close()
        dst.free()
        src.free()
    return CopyBandwidth(copy_bytes, times)
