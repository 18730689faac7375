"""CUDA-graph decode: two graph execs, switched at each KV page boundary.

Why graphs: one decode step is 173 kernel launches at 7B (6 per layer; 149 at 0.5B). Launched
eagerly from Python each costs ~5.6 µs of host time, ~1 ms per token; replayed from a graph they
cost ~0.7 µs of GPU-side scheduling each (docs/graphs.md#why-graphs). Measured on the H200
(`drvqwen bench`, one lease): synthetic 7B eager 2.325 ms per token, graph 2.212 ms — the
kernels take about that long, so most of the eager launch time hides behind them; the real
0.5B eager 0.917 ms, graph 0.639 ms, where launching is a large part of the step.
The step is captured once (`cuStreamBeginCapture` … `cuStreamEndCapture`, `cuGraphInstantiate`)
and every later token is one `cuGraphLaunch`.

Why one graph serves every step: nothing that changes per step is a launch parameter. The
position, the input token and the sequence length live in the device array `state`, which the
kernels read and the graph's last node (`advance_state`) advances, turning this step's argmax
into the next step's input; the block table lives in device memory too. So the graph is never
edited (no cuGraphExec*SetParams) and the host's only per-token work is the launch.

Why two graphs: every 16 tokens the step's position opens a new KV page, and the QKV kernel
must find that page in the block table before it writes K/V there. The page comes from the host-owned
free list (`PageAllocator`), so the host has to hand it over, and a graph that wrote a page
*every* step would need the host's input every step. Hence:

    "step"        the decode step, as `DecodeStep.launches` list it             (15 of 16 steps)
    "opens_page"  set_block_table_entry, then the same decode step              (pos % 16 == 0)

How the page-opening graph gets its page — a device scalar `new_page`, filled by an async copy
queued on the stream just before the graph is launched (`cuda.graph.GraphInput`):

    host:  page = free list pop;  h_pages[pos // 16] = page                (pinned host memory)
           cuMemcpyHtoDAsync(new_page ← h_pages[pos // 16], 4 B, stream);  cuGraphLaunch(opens_page)
    GPU:   set_block_table_entry: block_table[state.pos // 16] = new_page; then the step

Stream order puts the copy before the graph's first node, so the graph needs no parameter update. The
source is one pinned slot per *logical page* rather than one shared scalar: an async copy reads
its source when the stream reaches it, so if the host queues steps ahead of the GPU (it never
has to wait for a token it does not print), a shared slot could be overwritten before the copy
of the previous page had read it. Per-page slots are written once per sequence, and a new
sequence reuses them only after the stream has drained: `start()` synchronizes, and so does
the prefill's synchronous block-table upload (`DecodeStep.reserve`). The alternative, a device ring of pages popped
ahead of time, moves the same copy earlier and takes pages off the free list before they are
needed; here the cost is one 4-byte copy every 16 tokens.

The host picks one of the two graphs from the position each step, with the same bookkeeping
as eager mode (`PageAllocator.page_for`: "opens_page" exactly when the step's position needs a
page the block table does not have yet). Eager `DecodeStep.step()` and `GraphDecoder.step()` share the device state,
the KV cache and the page allocator, so a prompt can be fed eagerly and decoded by graphs, or a
run switched between modes, and both give the same bits: the graph replays the same kernels
with the same grids and parameters, in the same order.

Graphs are captured once per `DecodeStep` (per engine) from its launch list as it is at
capture time, and reused for every prompt. If capture or instantiation fails, `GraphDecoder`
warns and falls back to eager steps (or raises `GraphCaptureError` with fallback=False).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from . import launchers as K
from .cuda import CudaError
from .cuda.graph import GraphExec, GraphInput, capture
from .decode import DecodeStep
from .errors import DrvqwenError
from .kv_cache import PAGE_TOKENS, PageAllocator

GRAPH_STEP = "step"              # an ordinary decode step
GRAPH_OPENS_PAGE = "opens_page"  # a decode step whose position opens a new KV page


class GraphCaptureError(RuntimeError):
    """Capturing or instantiating a decode graph failed.

    Attributes:
        graph: "step" or "opens_page".
        launch: the name of the launch being recorded when it failed ("" if it failed at the
            end of capture or at instantiation).
        cause: the underlying CudaError.
    """

    def __init__(self, graph: str, launch: str, cause: Exception) -> None:
        self.graph, self.launch, self.cause = graph, launch, cause
        where = f" while recording '{launch}'" if launch else ""
        super().__init__(f"CUDA graph capture of decode graph {graph} failed{where}: {cause}")


@dataclass(frozen=True)
class StepPlan:
    """What one decode step needs from the host.

    Attributes:
        graph: GRAPH_STEP, or GRAPH_OPENS_PAGE when the step opens a new page.
        page: for GRAPH_OPENS_PAGE, the physical page just taken from the free list; else None.
        logical_page: pos // PAGE_TOKENS, the block-table index (and GraphInput slot) of `page`.
    """

    graph: str
    page: int | None
    logical_page: int


def plan_step(pages: PageAllocator, pos: int, max_context: int) -> StepPlan:
    """Choose the graph for the step at position `pos`, allocating the page it opens, if any.

    "opens_page" is chosen exactly when `pos` needs a page the block table does not hold yet: on an
    ordinary run that is pos % PAGE_TOKENS == 0, and never for a page an earlier (eager) step or
    a prefill already allocated.

    Args:
        pages: the host free list and block table (mutated: a new page is popped from it).
        pos: the position the step decodes (its K/V is written there).
        max_context: the KV cache's capacity in tokens.

    Raises:
        DrvqwenError: pos >= max_context, or no free page is left.
    """
    if pos >= max_context:
        raise DrvqwenError(f"context full: position {pos} >= max_context {max_context}")
    page, new = pages.page_for(pos)
    logical = pos // PAGE_TOKENS
    return StepPlan(GRAPH_OPENS_PAGE, page, logical) if new else StepPlan(GRAPH_STEP, None, logical)


class GraphDecoder:
    """Decode steps replayed from two CUDA graphs over a `DecodeStep` (see the module doc).

    Same interface and semantics as `DecodeStep` for running a sequence: `start`, `feed`,
    `step`, `sync`, `logits`, `next_token`; `pos` is the DecodeStep's. The DecodeStep stays
    owned by the caller: `close()` here destroys the graphs, not the weights or the cache.

    Attributes:
        dec: the DecodeStep whose launches were captured.
        mode: "graph", or "eager" after a capture failure with fallback=True.
        fallback_reason: the GraphCaptureError's message when mode is "eager", else None.
        num_nodes: {"step": nodes, "opens_page": nodes} of the captured graphs (empty when eager).
        steps_by_graph: {"step": steps, "opens_page": steps} replayed so far (also counted when eager).
    """

    def __init__(self, dec: DecodeStep, *, fallback: bool = True) -> None:
        """Capture both graphs from `dec.launches` and instantiate them.

        Args:
            dec: the eager decode step; its launch list is captured as it is now.
            fallback: on a capture failure, warn (RuntimeWarning) and run eager steps instead
                of raising.

        Raises:
            GraphCaptureError: capture or instantiation failed and fallback is False.
        """
        self.dec = dec
        self.mode = "graph"
        self.fallback_reason: str | None = None
        self.num_nodes: dict[str, int] = {}
        self.steps_by_graph = {GRAPH_STEP: 0, GRAPH_OPENS_PAGE: 0}
        self._execs: dict[str, GraphExec] = {}
        n_pages = dec.pages.n_pages
        # Allocated before capture: allocation is an unsafe call while a stream captures.
        self._new_page: GraphInput | None = GraphInput(n_pages, np.int32, name="new_page")
        try:
            self._set_entry = K.SetBlockTableEntry(dec.buf["block_table"], self._new_page.array,
                                                   dec.buf["state"], n_pages=n_pages, stream=dec.stream)
            self._capture_all()
        except GraphCaptureError as e:
            self._destroy_execs()
            if not fallback:
                self.close()
                raise
            self.mode = "eager"
            self.fallback_reason = str(e)
            warnings.warn(f"{e}; decoding eagerly instead (slower, same results)", RuntimeWarning, stacklevel=2)
        except BaseException:
            self.close()
            raise

    def _capture_all(self) -> None:
        step_launches = [(nl.name, nl.launch) for nl in self.dec.launches]
        page_launches = [("set_block_table_entry", self._set_entry.launches[0]), *step_launches]
        for name, launches in ((GRAPH_STEP, step_launches), (GRAPH_OPENS_PAGE, page_launches)):
            self._capture(name, launches)

    def _capture(self, graph_name: str, launches) -> GraphExec:
        """Record `launches` on the step's stream into one graph, instantiate and upload it.

        Raises:
            GraphCaptureError: a launch was refused during capture, the capture was
                invalidated, or the graph could not be instantiated.
        """
        stream = self.dec.stream
        recording = ""
        try:
            with capture(stream) as cap:
                for name, ln in launches:
                    recording = name
                    # The stream is given explicitly: a launch built for another stream would
                    # otherwise run outside the capture and be silently missing from the graph.
                    ln.launch(stream)
                recording = ""
            graph = cap.graph
            try:
                self.num_nodes[graph_name] = graph.num_nodes()
                exe = graph.instantiate()
            finally:
                graph.destroy()  # the exec keeps what it needs; the template is not reused
            self._execs[graph_name] = exe
            exe.upload(stream)
            return exe
        except CudaError as e:
            raise GraphCaptureError(graph_name, recording, e) from e

    # ---- running a sequence -------------------------------------------------------------------
    @property
    def pos(self) -> int:
        """The next position to decode (the DecodeStep's host mirror of state[0])."""
        return self.dec.pos

    def start(self, token: int, pos: int = 0) -> None:
        """Begin decoding `token` at position `pos`, as `DecodeStep.start` (pos 0 releases the
        previous sequence's pages). Waits for queued work first: the page slots of the previous
        sequence may still be read by queued copies until then."""
        self.dec.sync()
        self.dec.start(token, pos)

    def feed(self, token: int) -> None:
        """Make the next step consume `token` (a prompt token) instead of the last argmax."""
        self.dec.feed(token)

    def step(self) -> str:
        """Queue one decode step: "opens_page" if its position opens a new page, else "step".

        Same semantics as `DecodeStep.step()`: consumes state.token at state.pos, leaves
        logits and next_token, advances the state on the GPU. Asynchronous; `sync()` waits.

        Returns:
            "step" or "opens_page", the graph chosen (also when running eagerly after a fallback).

        Raises:
            DrvqwenError: the context is full or no free page is left.
        """
        dec = self.dec
        if self.mode != "graph":
            if self.mode == "closed":
                raise RuntimeError("GraphDecoder.step() after close()")
            # Eager fallback: DecodeStep.step() allocates its own page (and uploads it); only
            # label the step.
            label = GRAPH_OPENS_PAGE if dec.pages.opens_page(dec.pos) else GRAPH_STEP
            dec.step()
            self.steps_by_graph[label] += 1
            return label
        plan = plan_step(dec.pages, dec.pos, dec.max_context)
        if plan.graph == GRAPH_OPENS_PAGE:
            self._new_page.set(plan.logical_page, plan.page, dec.stream)
        self._execs[plan.graph].launch(dec.stream)
        dec.pos += 1
        self.steps_by_graph[plan.graph] += 1
        return plan.graph

    def sync(self) -> None:
        """Wait for every queued step."""
        self.dec.sync()

    def logits(self) -> np.ndarray:
        """fp32 [V] logits of the last step (waits for the stream)."""
        return self.dec.logits()

    def next_token(self) -> int:
        """The last step's argmax (waits for the stream)."""
        return self.dec.next_token()

    # ---- teardown -----------------------------------------------------------------------------
    def _destroy_execs(self) -> None:
        for exe in self._execs.values():
            exe.destroy()
        self._execs.clear()

    def close(self) -> None:
        """Destroy both graph execs and free the page hand-over buffers; idempotent. The
        DecodeStep is left open (its owner closes it, after this)."""
        if self._new_page is None:
            return
        self.dec.sync()  # a queued launch or copy may still use what is freed here
        self._destroy_execs()
        self._new_page.close()
        self._new_page = None
        self.mode = "closed"

    def __enter__(self) -> GraphDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
