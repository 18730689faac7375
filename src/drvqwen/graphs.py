"""CUDA-graph decode: two graph execs, switched at each KV page boundary (two more for each
short-context twin of the step: LaunchList.short, its attention for short contexts, and that
twin's own twin for shorter ones still: LaunchList.chain).

Why graphs: one decode step is 173 kernel launches at 7B (6 per layer; 149 at 0.5B). Launched
eagerly from Python each costs ~5.6 µs of host time, ~1 ms per token; replayed from a graph they
cost ~0.7 µs of GPU-side scheduling each (docs/graphs.md#why-graphs). Measured on the H200
(`drvqwen bench`, one run): synthetic 7B eager 2.325 ms per token, graph 2.212 ms — the
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

    "decode"      the decode step, as its launch list (launch_list.LaunchList) lists it   (15 of 16 steps)
    "opens_page"  set_block_table_entry, then the same decode step                   (pos % 16 == 0)

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
sequence reuses them only after the stream has drained: `Sequence.start()` and
`Sequence.rollback()` synchronize, and so does the prefill's synchronous block-table upload
(`Sequence.reserve`). The alternative, a device ring of pages popped ahead of time, moves the
same copy earlier and takes pages off the free list before they are needed; here the cost is
one 4-byte copy every 16 tokens.

The host picks one of the two graphs from the position each step, with the same bookkeeping
as eager mode (`Sequence.open_page`: "opens_page" exactly when the step's position needs a
page the block table does not have yet). Eager `DecodeStep.decode_token()` and
`GraphDecoder.decode_token()` share the sequence (sequence.py: device state, block table, page
allocator) and the KV cache, so a prompt can be fed eagerly and decoded by graphs, or a run
switched between modes, and both give the same bits: the graph replays the same kernels with
the same grids and parameters, in the same order.

A GraphDecoder captures one launch list (the plan's greedy step, or a sampler variant: each its
own list, launch_list.LaunchList) once, and is reused for every prompt. If capture or instantiation
fails, `GraphDecoder` warns and falls back to eager steps (or raises `GraphCaptureError` with
fallback=False).
"""

from __future__ import annotations

import warnings

import numpy as np

from .cuda import CudaError
from .cuda.graph import GraphExec, GraphInput, capture
from .decode import DecodeStep
from .launch_list import LaunchList
from .kv_cache import PAGE_TOKENS
from .launchers import SetBlockTableEntry
from .sequence import Sequence

GRAPH_DECODE = "decode"          # an ordinary decode step
GRAPH_OPENS_PAGE = "opens_page"  # a decode step whose position opens a new KV page
SHORT = "_short"                 # suffix of the two graphs of a list's short-context twin (LaunchList.short)


class GraphCaptureError(RuntimeError):
    """Capturing or instantiating a graph of launches failed.

    Attributes:
        graph: the graph's name ("decode", "opens_page"; the verify pass's "verify<T>").
        launch: the name of the launch being recorded when it failed ("" if it failed at the
            end of capture or at instantiation).
        cause: the underlying CudaError.
    """

    def __init__(self, graph: str, launch: str, cause: Exception, what: str = "the decode step") -> None:
        self.graph, self.launch, self.cause = graph, launch, cause
        where = f" while recording '{launch}'" if launch else ""
        super().__init__(f"capturing the CUDA graph {graph!r} of {what} failed{where}: {cause}")


def capture_launches(stream, graph_name: str, launches, what: str = "the decode step") -> tuple[GraphExec, int]:
    """Record `launches` ((name, launch) pairs) on `stream` into one graph, instantiate it and
    upload it: the decode graphs here, the verify pass's per T (verify_pass.py).

    Returns:
        The exec and the graph's node count.
    Raises:
        GraphCaptureError: a launch was refused during capture, the capture was invalidated,
            or the graph could not be instantiated (`what` names the owner in its message).
    """
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
            num_nodes = graph.num_nodes()
            exe = graph.instantiate()
        finally:
            graph.destroy()  # the exec keeps what it needs; the template is not reused
        try:
            exe.upload(stream)
        except BaseException:
            exe.destroy()
            raise
        return exe, num_nodes
    except CudaError as e:
        raise GraphCaptureError(graph_name, recording, e, what) from e


class GraphDecoder:
    """Decode steps of one launch list replayed from two CUDA graphs (see the module doc).

    `decode_token`, `sync`, `logits` and `next_token` as on the DecodeStep; the sequence is the
    DecodeStep's (`seq`). The DecodeStep stays owned by the caller: `close()` here destroys the
    graphs, not the weights or the cache.

    Attributes:
        dec: the DecodeStep whose launches were captured.
        launch_list: the list captured (default: the DecodeStep's greedy step).
        mode: "graph", or "eager" after a capture failure with fallback=True.
        fallback_reason: the GraphCaptureError's message when mode is "eager", else None.
        num_nodes: {"decode": nodes, "opens_page": nodes} of the captured graphs (empty when eager);
            with a short-context twin (LaunchList.short) also "decode_short" and "opens_page_short",
            its pair of graphs, replayed for the steps whose attention covers at most
            launch_list.short_below positions, and for a twin's twin the same names with the
            suffix SHORT twice (once for each step down LaunchList.chain).
        steps_by_graph: steps replayed so far by graph name (also counted when eager).
    """

    def __init__(self, dec: DecodeStep, launch_list: LaunchList | None = None, *, fallback: bool = True) -> None:
        """Capture both graphs from `launch_list.launches` and instantiate them.

        Args:
            dec: the eager decode step.
            launch_list: the step to capture (DecodeStep.launch_list or a sampler variant).
            fallback: on a capture failure, warn (RuntimeWarning) and run eager steps instead
                of raising.

        Raises:
            GraphCaptureError: capture or instantiation failed and fallback is False.
        """
        self.dec = dec
        self.launch_list = launch_list or dec.launch_list
        self.mode = "graph"
        self.fallback_reason: str | None = None
        self.num_nodes: dict[str, int] = {}
        # The step's lists by band, outermost first (depth d: graph names with SHORT d times), once:
        # decode_token picks one every step.
        self._chain = self.launch_list.chain()
        self.steps_by_graph = {graph + SHORT * depth: 0 for depth in range(len(self._chain))
                               for graph in (GRAPH_DECODE, GRAPH_OPENS_PAGE)}
        self._execs: dict[str, GraphExec] = {}
        n_pages = dec.seq.pages.n_pages
        # Allocated before capture: allocation is an unsafe call while a stream captures.
        self._new_page: GraphInput | None = GraphInput(n_pages, np.int32, name="new_page")
        try:
            self._set_entry = SetBlockTableEntry(dec.buf["block_table"], self._new_page.array,
                                                 dec.buf["state"], n_pages=n_pages, stream=dec.stream)
            self._capture_all()
        except GraphCaptureError as e:
            self._destroy_execs()
            self.num_nodes.clear()  # eager from here: no graph holds any node
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
        for depth, lst in enumerate(self._chain):
            suffix = SHORT * depth
            step_launches = [(nl.name, nl.launch) for nl in lst.launches]
            page_launches = [("set_block_table_entry", self._set_entry.launches[0]), *step_launches]
            for name, launches in ((GRAPH_DECODE, step_launches), (GRAPH_OPENS_PAGE, page_launches)):
                self._capture(name + suffix, launches)

    def _capture(self, graph_name: str, launches) -> GraphExec:
        """Capture `launches` into the graph `graph_name` (capture_launches) and keep its exec.

        Raises:
            GraphCaptureError: as capture_launches.
        """
        exe, self.num_nodes[graph_name] = capture_launches(self.dec.stream, graph_name, launches)
        self._execs[graph_name] = exe
        return exe

    # ---- running a sequence -------------------------------------------------------------------
    @property
    def seq(self) -> Sequence:
        """The sequence the steps decode (the DecodeStep's)."""
        return self.dec.seq

    def decode_token(self) -> str:
        """Queue one decode step: "opens_page" if its position opens a new page, else "decode".

        Same semantics as `DecodeStep.decode_token()`: consumes state.token at state.pos, leaves
        logits and next_token, advances the state on the GPU. Asynchronous; `sync()` waits.

        Returns:
            "decode" or "opens_page", the graph chosen (also when running eagerly after a fallback),
            with "_short" for the short-context twin's (twice for its twin's: LaunchList.chain).

        Raises:
            DrvqwenError: the context is full or no free page is left.
        """
        dec, seq = self.dec, self.dec.seq
        suffix = SHORT * self._chain.index(self.launch_list.for_length(seq.pos + 1))
        if self.mode != "graph":
            if self.mode == "closed":
                raise RuntimeError("GraphDecoder.decode_token() after close()")
            # Eager fallback: the eager step records its own page (an upload); only label it.
            label = (GRAPH_OPENS_PAGE if seq.pages.opens_page(seq.pos) else GRAPH_DECODE) + suffix
            dec.decode_token(self.launch_list)
            self.steps_by_graph[label] += 1
            return label
        page = seq.open_page()
        graph = (GRAPH_DECODE if page is None else GRAPH_OPENS_PAGE) + suffix
        if page is not None:
            self._new_page.set(seq.pos // PAGE_TOKENS, page, dec.stream)
        self._execs[graph].launch(dec.stream)
        seq.advance()
        self.steps_by_graph[graph] += 1
        return graph

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
