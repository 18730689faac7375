"""The engine worker: one thread owns the model and runs one sequence at a time, in FIFO order.

The runtime is single-stream (one KV-cache sequence, one CUDA stream), and the CUDA driver API
binds a context to a thread, so the backend is built, used and closed on this thread alone.
Requests reach it through a bounded `queue.Queue`: `submit` refuses a job when the queue is
full (the server answers 503 with Retry-After) and the worker takes jobs in arrival order.

A job reports back through its `emit` callback (thread-safe, into the event loop):

    ("text", str)        text that is final (stop strings and n_indent already applied;
                         see answer_text.py)
    ("done", Outcome)    finish reason, token counts, timings
    ("error", APIError)  the generation failed (the server stays up), or the server is
                         shutting down (503)

The KV cache outlives the job (llama.cpp's `cache_prompt`): the backend keeps the last
sequence — prompt and the answer's tokens that were run — and the next job's prompt reuses its
longest common prefix (`generate(…, reuse=True)`): only the rest is prefilled, the positions
after the common prefix are rolled back and their pages given back first. A request sending
`cache_prompt: false` is prefilled whole (its sequence is then the one kept). An /infill with
`n_predict: 0` (llama.vim's warm-up) prefills its prompt into the cache and generates nothing.

Cancellation: `Job.cancel()` (the client went away) sets a flag that the token callback reads
before every step, so the generation stops within one decode step: `generate` closes the token
stream (the GPU engine syncs its stream), and the cache keeps what was run — `cached_ids()`
is what the K/V hold, so the next request may reuse it. A job that fails (an error in the
backend) resets the cache: nothing of an unknown state is reused. `EngineWorker.shutdown()`
(Ctrl-C) cancels the running job and every waiting one the same way, each answered with a 503
error, so that the HTTP side can finish every response at once.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import DrvqwenError
from ..generate import generate
from ..sampler import SamplingParams
from ..tokenizer import Tokenizer
from .answer_text import AnswerText
from .api_errors import APIError
from .metrics import ServerMetrics
from .settings import RETRY_AFTER_S
from .validate import GenerationRequest


@dataclass
class Outcome:
    """How a job ended: finish_reason "stop" (end-of-generation token or stop string), "length"
    (max_tokens, the context, n_indent or t_max_predict_ms) or "cancelled"; token counts for
    `usage`; llama.cpp's stop_type ("eos", "word", "limit") and stopping_word; reused_tokens
    (prompt positions taken from the KV cache, not prefilled: llama.cpp's timings.cache_n);
    cached_tokens (positions the KV cache holds afterwards — the prompt and the answer's tokens
    that were run: llama.cpp's tokens_cached, its n_past); prompt_s (submitted → first token,
    or → the prompt in the cache when nothing is generated) and predicted_s (first token →
    last); context_full: generation stopped at the end of the context
    (`GenerationRequest.context_capped` and all of it used)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_type: str = "limit"
    stopping_word: str = ""
    reused_tokens: int = 0
    cached_tokens: int = 0
    prompt_s: float = 0.0
    predicted_s: float = 0.0
    context_full: bool = False
    # Speculative decoding (llama.cpp's timings.draft_n, draft_n_accepted): tokens proposed and
    # accepted; None when the request did not speculate.
    draft_n: int | None = None
    draft_n_accepted: int | None = None


@dataclass
class Job:
    """One request's generation, as the worker sees it."""

    request: GenerationRequest
    emit: Callable[[tuple], None]
    enqueued_at: float = field(default_factory=time.perf_counter)
    seq: int = 0                    # arrival number (set by submit)
    started_seq: int | None = None  # order in which the worker took it (FIFO: equals seq)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    shutdown: bool = False          # cancelled because the server is stopping (answered 503)

    def cancel(self, shutdown: bool = False) -> None:
        """Stop this job: skipped if still queued, stopped within a step if running."""
        self.shutdown = self.shutdown or shutdown
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


SHUTTING_DOWN = "the server is shutting down"


def shutting_down_error() -> APIError:
    return APIError(503, SHUTTING_DOWN, code="shutting_down")


class _Cancelled(Exception):
    pass


@dataclass
class LoadedModel:
    """What the worker's loader returns: the backend, its tokenizer and end-of-generation ids."""

    backend: object
    tokenizer: Tokenizer
    eog_ids: frozenset[int]
    device: str               # "cuda" or "cpu"
    draft: object | None = None   # the draft model's backend (serve --draft), its own KV cache
    draft_name: str = "draft model"


class EngineWorker:
    """The thread that owns the model.

    Args:
        load: builds the model on the worker thread (so a CUDA context is current there).
        queue_size: jobs that may wait (≥ 1).
        warmup: run two short generations (greedy and sampled) before serving, so the first
            request does not pay for CUDA-graph capture.
    """

    def __init__(self, load: Callable[[], LoadedModel], queue_size: int, warmup: bool = True):
        self._load, self._warmup = load, warmup
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._arrivals = itertools.count(1)
        self._starts = itertools.count(1)
        self._submit_lock = threading.Lock()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="drvqwen-engine", daemon=True)
        self.model: LoadedModel | None = None
        self.busy = False
        self.tokens_cached = 0      # positions the backend's KV cache holds (/health)
        self._running: Job | None = None
        self._stopping = False
        self.metrics = ServerMetrics(self.queue_length, lambda: self.kv_pages()[0])

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> LoadedModel:
        """Start the thread and wait until the model is loaded.

        Raises:
            whatever the loader raised (DrvqwenError for a bad model or device).
        """
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error
        return self.model

    def shutdown(self) -> None:
        """The server is stopping: refuse new jobs, cancel the running one and every waiting
        one; each is answered with a 503 error as the worker reaches it (within a step)."""
        with self._submit_lock:     # no job between the queue and `_running` is missed
            self._stopping = True
            with self._queue.mutex:
                jobs = [j for j in self._queue.queue if j is not None]
            if self._running is not None:
                jobs.append(self._running)
        for job in jobs:
            job.cancel(shutdown=True)

    def stop(self) -> None:
        """`shutdown`, finish the running job's step, close the backend, join."""
        self.shutdown()
        self._queue.put(None)
        self._thread.join()

    def queue_length(self) -> int:
        return self._queue.qsize()

    def kv_pages(self) -> tuple[int, int]:
        """(free, total) KV pages; (0, 0) before the model is loaded."""
        return self.model.backend.kv_pages() if self.model is not None else (0, 0)

    def submit(self, job: Job) -> None:
        """Queue `job` (FIFO).

        Raises:
            APIError 503 (Retry-After): the queue is full.
        """
        with self._submit_lock:     # arrival numbers in queue order
            if self._stopping:
                raise shutting_down_error()
            try:
                job.seq = next(self._arrivals)
                self._queue.put_nowait(job)
            except queue.Full:
                raise APIError(503, f"the server is busy: {self._queue.maxsize} requests are waiting; "
                                    f"retry later", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    # ---- the thread -------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.model = self._load()
            if self._warmup:
                self._warm_up()
        except BaseException as e:  # handed to start(), which re-raises it on the caller's thread
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while (job := self._queue.get()) is not None:
                with self._submit_lock:
                    if self._stopping:
                        job.cancel(shutdown=True)
                    self._running = job
                try:
                    if job.cancelled:   # its client left while it waited, or the server is stopping
                        self.metrics.cancelled.inc()
                        self._cancelled(job)
                        continue
                    job.started_seq = next(self._starts)
                    self.busy = True
                    self._run(job)
                finally:
                    self.busy, self._running = False, None
        finally:
            self.model.backend.close()
            if self.model.draft is not None:
                self.model.draft.close()

    def _warm_up(self) -> None:
        m = self.model
        ids = m.tokenizer.encode("def")[:1] or [0]
        if m.backend.max_context <= len(ids) + 2:
            return
        for params in (SamplingParams(), SamplingParams(temperature=0.7, seed=1)):
            generate(m.backend, ids, 2, params, ignore_stop=True)
            m.backend.reset()           # the first request finds the cache empty

    def _proposer(self, req: GenerationRequest):
        """The request's speculative proposer: prompt lookup, the draft model, or None."""
        from ..speculative import DraftModel, PromptLookup

        if req.lookup:
            return PromptLookup(req.lookup)
        if req.draft and self.model.draft is not None:
            return DraftModel(self.model.draft, req.draft, name=self.model.draft_name)
        return None

    @staticmethod
    def _cancelled(job: Job, completion_tokens: int = 0) -> None:
        if job.shutdown:
            job.emit(("error", shutting_down_error()))
        else:
            job.emit(("done", Outcome("cancelled", len(job.request.prompt_ids), completion_tokens)))

    def _run(self, job: Job) -> None:
        m, req, met = self.model, job.request, self.metrics
        t_start = time.perf_counter()
        met.queue_wait.observe(t_start - job.enqueued_at)
        met.prompt_tokens.inc(len(req.prompt_ids))
        text = AnswerText(m.tokenizer, req.stops, req.n_indent)
        t_max_s = req.t_max_predict_ms / 1e3
        state = {"n": 0, "first": None, "last": None, "time_up": False}

        def on_token(tok: int) -> bool:
            now = time.perf_counter()
            if state["last"] is None:
                met.ttft.observe(now - job.enqueued_at)
                state["first"] = now
            else:
                met.itl.observe(now - state["last"])
            state["last"] = now
            state["n"] += 1
            piece, ended = text.push(tok)
            if piece:
                job.emit(("text", piece))
            # True ends generation there, its result kept ("limit", or "word" by the text's
            # stop string): the answer's text ended it (a stop string, a line under n_indent),
            # or llama.cpp's t_max_predict_ms — past the time, the answer ends at a newline.
            if ended:
                return True
            if t_max_s > 0 and text.newline and now - state["first"] > t_max_s:
                state["time_up"] = True
                return True
            if job.cancelled:       # checked before the next step is asked for
                raise _Cancelled
            return False

        stop_type = None
        failed = False
        res = None
        try:
            if req.max_tokens == 0:     # /infill's n_predict 0 (llama.vim's warm-up): the prompt
                m.backend.prefill(req.prompt_ids, reuse=req.cache_prompt)   # into the cache only
                stop_type = "limit"
            else:
                res = generate(m.backend, req.prompt_ids, req.max_tokens, req.params, m.eog_ids, on_token,
                               ignore_stop=req.ignore_eos, reuse=req.cache_prompt, speculation=self._proposer(req))
                stop_type = "eos" if res.stopped_by == "stop token" else "limit"
        except _Cancelled:
            met.cancelled.inc()
            self._cancelled(job, state["n"])
        except DrvqwenError as e:
            failed = True
            job.emit(("error", APIError(400, str(e), code="generation_refused")))
        except Exception as e:      # a bug must not take the server down with it
            failed = True
            traceback.print_exc()
            job.emit(("error", APIError(500, f"internal error during generation: {type(e).__name__}: {e}",
                                        code="internal_error")))
        finally:
            if failed:              # what the cache holds is not known: reuse none of it
                m.backend.reset()
                if m.draft is not None:
                    m.draft.reset()
            self.tokens_cached = len(m.backend.cached_ids())
            met.generated_tokens.inc(state["n"])
        if stop_type is None:
            return
        reused = m.backend.last_reused
        met.prompt_tokens_reused.inc(reused)
        tail = text.finish()
        if tail:
            job.emit(("text", tail))
        if text.ended_by == "stop string":
            stop_type = "word"
        first, last = state["first"], state["last"]
        n = state["n"]
        spec = res.speculation if res is not None else None
        job.emit(("done", Outcome(
            "stop" if stop_type in ("eos", "word") else "length", len(req.prompt_ids), n, stop_type,
            text.stopping_word, reused_tokens=reused, cached_tokens=self.tokens_cached,
            prompt_s=(first if first is not None else time.perf_counter()) - t_start,
            predicted_s=(last - first) if first is not None else 0.0,
            context_full=(req.context_capped and stop_type == "limit" and text.ended_by is None
                          and not state["time_up"] and n == req.max_tokens),
            draft_n=spec.proposed if spec else None, draft_n_accepted=spec.accepted if spec else None)))
