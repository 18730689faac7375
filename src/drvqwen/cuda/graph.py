"""CUDA graphs: capture a stream's launches once, replay them with one call.

Why: an eager launch from Python costs ~5.6 µs even pre-packed, a graph ~0.7 µs per kernel
node (docs/graphs.md#why-graphs); at ~300 launches per decode step that is ~2 ms against ~0.2 ms. The
decode step is captured once (twice: the ordinary step, and a step that opens a new KV page)
and replayed every token; all per-step state lives in device memory, so the same graph serves
every step.

    with capture(stream) as cap:
        for step in launches:
            step.launch(stream)
    exe = cap.graph.instantiate()
    exe.launch(stream)

Capture records, it does not run: the launches inside the `with` do no work until replay.
While a blocking stream (launch.Stream) captures, the legacy default stream is unusable, so
the synchronous copies of memory.py must not be called inside the `with` (CUDA runtime API
reference, cudaStreamIsCapturing).

A value the host must hand a graph at launch time (the decode step's newly allocated KV page)
goes through a `GraphInput`: a device scalar the captured kernels read, filled by an async copy
queued on the stream just before the launch. The graph itself is never edited.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from cuda.bindings import driver

from .errors import check
from .launch import Event, Stream
from .memory import DeviceArray, DeviceBuffer, PinnedHostBuffer

# GLOBAL mode: while any thread captures, a "potentially unsafe" call (cuMemAlloc, a
# synchronous cuMemcpy …) from *any* thread fails instead of silently running outside the
# graph. drvqwen is single-threaded, so the strictest mode costs nothing and catches a stray
# synchronous call in the captured code (CUDA driver API reference, cuStreamBeginCapture).
_CAPTURE_MODE = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL


class GraphExec:
    """An instantiated, launchable graph (`CUgraphExec`)."""

    def __init__(self, handle: driver.CUgraphExec) -> None:
        self.handle = handle

    def launch(self, stream: Stream) -> None:
        """Replay the whole graph on `stream` (one cuGraphLaunch).

        Raises:
            CudaError: the launch was refused (or an earlier kernel faulted: errors are sticky).
        """
        check(driver.cuGraphLaunch(self.handle, stream.handle), "cuGraphLaunch")

    def upload(self, stream: Stream) -> None:
        """cuGraphUpload: move the exec's work descriptors to the device now, queued on `stream`.

        Without it the first `launch()` does this upload itself and is slower than every later
        one, which would show up as an outlier in a latency measurement.
        """
        check(driver.cuGraphUpload(self.handle, stream.handle), "cuGraphUpload")

    def destroy(self) -> None:
        """cuGraphExecDestroy; idempotent."""
        if self.handle is not None:
            check(driver.cuGraphExecDestroy(self.handle), "cuGraphExecDestroy")
            self.handle = None


class Graph:
    """A captured graph (`CUgraph`): a template to instantiate, not yet launchable."""

    def __init__(self, handle: driver.CUgraph) -> None:
        self.handle = handle

    def num_nodes(self) -> int:
        """How many nodes (kernels, memsets, copies) the graph holds."""
        _nodes, count = check(driver.cuGraphGetNodes(self.handle, 0), "cuGraphGetNodes")
        return int(count)

    def instantiate(self) -> GraphExec:
        """cuGraphInstantiate with no flags: the graph's work, fixed, ready to launch.

        Raises:
            CudaError: the graph cannot be instantiated.
        """
        return GraphExec(check(driver.cuGraphInstantiate(self.handle, 0), "cuGraphInstantiate"))

    def destroy(self) -> None:
        """cuGraphDestroy (instantiated execs stay valid); idempotent."""
        if self.handle is not None:
            check(driver.cuGraphDestroy(self.handle), "cuGraphDestroy")
            self.handle = None


def begin_capture(stream: Stream) -> None:
    """Start recording `stream`'s work into a graph (cuStreamBeginCapture, GLOBAL mode)."""
    check(driver.cuStreamBeginCapture(stream.handle, _CAPTURE_MODE), "cuStreamBeginCapture")


def end_capture(stream: Stream) -> Graph:
    """Stop recording and return the captured `Graph`.

    Raises:
        CudaError: the capture was invalidated (e.g. an unsafe call was made during it).
    """
    return Graph(check(driver.cuStreamEndCapture(stream.handle), "cuStreamEndCapture"))


class _Capture:
    graph: Graph | None = None


@contextmanager
def capture(stream: Stream) -> Iterator[_Capture]:
    """Capture the work queued on `stream` inside the `with` block; the result is `.graph`.

    If the block raises, the capture is still ended (a stream left capturing refuses all
    later work) and the partial graph is destroyed before the exception propagates.
    """
    cap = _Capture()
    begin_capture(stream)
    try:
        yield cap
    except BaseException:
        err, partial = driver.cuStreamEndCapture(stream.handle)
        if not err and int(partial):
            driver.cuGraphDestroy(partial)
        raise
    cap.graph = end_capture(stream)


def graph_time_us(launcher, reps: int = 20) -> float:
    """GPU microseconds per call of `launcher` (anything with `.launch(stream)`), timed as one
    captured graph of `reps` calls after a warm-up replay: no host launch gaps in the figure.

    Raises:
        CudaError: capture, instantiation or launch failed.
    """
    with Stream() as stream:
        with capture(stream) as cap:
            for _ in range(reps):
                launcher.launch(stream)
        exe = cap.graph.instantiate()
        cap.graph.destroy()
        exe.launch(stream)  # warm-up (and first-touch of the weights' TLB entries)
        start, end = Event(), Event()
        start.record(stream)
        exe.launch(stream)
        end.record(stream)
        ms = start.elapsed_ms(end)
        exe.destroy()
        start.close()
        end.close()
    return ms * 1e3 / reps


class GraphInput:
    """A device value a captured graph reads, handed over by the host before each launch.

    Why not edit the graph: cuGraphExecKernelNodeSetParams per step would cost a driver call
    per changed node and make the replayed graph differ from step to step. Instead a captured
    kernel reads `array` (one element of `dtype` in device memory), and `set()` queues a copy
    into it on the launch stream, so stream order puts the new value in place before the
    graph's first node runs.

    The copy source is page-locked host memory with `n_slots` slots. An async copy from pinned
    memory reads its source when the stream *reaches* the copy, which can be many launches
    after `set()` returned if the host runs ahead of the GPU; so a slot may only be rewritten
    once the copy queued from it has run. Callers use a fresh slot per value (graphs.py: one
    per logical KV page) and synchronize the stream before cycling through the slots again.
    (Pageable memory would be staged by the driver during the call instead, a hidden host
    copy and a possible stall per launch.)

    Attributes:
        array: the device scalar, a `DeviceArray` of shape (1,), to pass to kernels.
        n_slots: the number of host slots.
    """

    def __init__(self, n_slots: int, dtype=np.int32, name: str = "graph_input") -> None:
        """Allocate the device scalar and the pinned slots (before any capture: allocation is
        an unsafe call while a stream captures).

        Raises:
            DeviceMemoryError: the allocation does not fit.
            ValueError: n_slots < 1.
        """
        if n_slots < 1:
            raise ValueError(f"{name}: n_slots={n_slots} must be >= 1")
        self.dtype = np.dtype(dtype)
        self.n_slots = int(n_slots)
        self._buf = DeviceBuffer(self.dtype.itemsize, name)
        self.array = DeviceArray(name, self._buf.ptr, (1,), self.dtype)
        self._host = PinnedHostBuffer(self.n_slots * self.dtype.itemsize)
        self.slots = self._host.view(self.dtype)  # [n_slots] host view of the pinned slots

    def set(self, slot: int, value, stream: Stream) -> None:
        """Write `value` into host slot `slot` and queue its copy into `array` on `stream`.

        Raises:
            IndexError: `slot` outside [0, n_slots).
            CudaError: the copy could not be queued.
        """
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"{self.array.name}: slot {slot} outside [0, {self.n_slots})")
        self.slots[slot] = value
        n = self.dtype.itemsize
        check(driver.cuMemcpyHtoDAsync(self._buf.ptr, self._host.ptr + slot * n, n, stream.handle),
              "cuMemcpyHtoDAsync")

    def close(self) -> None:
        """Free the device scalar and the pinned slots; idempotent. Synchronize the stream first:
        a queued copy may still read a slot."""
        self._buf.free()
        self._host.free()
        self.slots = None  # the view pointed into the freed pinned memory
