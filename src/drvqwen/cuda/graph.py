"""CUDA graphs: capture a stream's launches once, replay them with one call.

Why: an eager launch from Python costs ~5.6 µs even pre-packed, a graph ~0.7 µs per kernel
node (DESIGN.md §7); at ~300 launches per decode step that is ~2 ms against ~0.2 ms. The
decode step is captured once (graph A, and graph B for a step that opens a new KV page) and
replayed every token; all per-step state lives in device memory, so the same graph serves
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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cuda.bindings import driver

from .errors import check
from .launch import Stream

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
        """Replay the whole graph on `stream` (one cuGraphLaunch)."""
        check(driver.cuGraphLaunch(self.handle, stream.handle), "cuGraphLaunch")

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
