"""The verify pass of speculative decoding on the GPU: T = 1 … 16 tokens through the INT4 model in
one pass over the weights, sharing a `DecodeStep`'s weights, KV cache, sequence and stream (as
prefill.py's `Prefill` does).

    VerifyPass.run(tokens)    p = the sequence's position, T = len(tokens)
      pages                   positions p … p+T-1 get pages through the sequence owner
                              (Sequence.reserve: a chunk that crosses a page boundary opens a page)
      ids                     int32 [T] ← tokens
      the launch list         verify_plan.plan_verify(T), built on first use: every position's
                              logits and argmax, then advance_state (state += T)
      logits                  fp32 [T, V] back to the host; the sequence at p + T

so the state and the sequence are what T decode steps fed `tokens` leave: the device state
(p + T, argmax after the last token, p + T + 1), the K/V of all T positions in the cache, and
`Sequence.pos` = p + T. Speculative decoding then keeps the accepted positions with
`Sequence.rollback` (engine.GPUBackend.rollback), exactly as after T decode steps.

Row j of the logits is bit for bit what the decode step computes for tokens[j] at position p + j
— the decode step with attention="plain" (verify_plan.py says why): a backend that speculates
decodes with that kernel (engine.GPUBackend(speculative=True)); `matches_decode` says whether a
decode plan is one this pass matches.

Buffers: one activation pool, sized for T = 16 and shared by every T. Each of its buffers is
token-major ([T, …]: ids, next_token, residual, xn, q, attn, h, logits, the argmax and split-KV
partials), so the list for T reads and writes the first T rows of the 16-row buffers
(prefill.rows_view). The lists never run at the same time — one stream, one pass after the
other — so separate pools per T would only hold ~8.5× the memory (Σ T / 16 over T = 1 … 16). The
state, the block table and the RoPE frequencies are the decode step's own (`DecodeStep.resolve`),
as are the weights and the KV cache.

Launches: about 6 per layer (~170 for the 7B), ~5.6 µs each from Python when eager. With
graphs=True (GPUBackend's default, as for decode) each T's list is captured into a CUDA graph on
the first pass of that T (graphs.capture_launches, as graphs.py captures the decode step) and every
later pass of that T is one replay. One graph serves every pass of its T because the list takes no
per-pass argument: the position is read from the state (which advance_state_tokens moves on), the
tokens from ids (uploaded on the stream ahead of the replay). The page-opening stays on the host,
before the replay: `Sequence.reserve` writes any new page into the device block table with a
synchronous copy, so — unlike a decode step, whose "opens_page" graph takes its page through a
GraphInput — no pass needs a graph of its own for a page boundary. If a capture fails the pass
warns and runs eagerly from then on (same results), or raises with fallback=False.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from .cuda import DEFAULT_ALIGN_BYTES, Pool
from .decode import DecodePlan, DecodeStep
from .errors import DrvqwenError
from .graphs import GraphCaptureError, capture_launches
from .launch_list import LaunchList, time_launches
from .launchers.base import BufferSpec, Occupancy, check_resolved
from .launchers.gemv_int4 import MAX_TOKENS
from .prefill import rows_view
from .verify_plan import VERIFY_ATTENTION, VerifyPlan, plan_verify

# Buffers of the verify plan that are the decode step's own (one [3], [P] and [Dh/2] each, shared).
SHARED = ("state", "block_table", "inv_freq")


def matches_decode(plan: DecodePlan) -> bool:
    """Whether the verify pass computes `plan`'s logits bit for bit: a decode step of the INT4
    model (not per-tensor formats) with the attention kernel the pass has T-token kernels of
    (verify_plan.VERIFY_ATTENTION: "plain"), launch by launch (not the persistent kernel)."""
    return plan.attention in VERIFY_ATTENTION and not plan.per_tensor and plan.persistent is None


def check_chunk(tokens: Sequence[int], vocab_size: int, pos: int, max_context: int) -> np.ndarray:
    """The ids of a verify pass of `tokens` at positions pos … pos + T − 1, checked.

    Returns:
        int32 [T].
    Raises:
        DrvqwenError: T outside 1..16, an id outside 0 … vocab_size − 1, or a position past the
            KV cache (pos + T > max_context); nothing has run or changed then.
    """
    T = len(tokens)
    if not 1 <= T <= MAX_TOKENS:
        raise DrvqwenError(f"verify pass of {T} tokens: it runs 1..{MAX_TOKENS}")
    ids = np.asarray(tokens, dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise DrvqwenError(f"verify pass: token id {int(bad[0])} outside the vocabulary (0..{vocab_size - 1})")
    if pos + T > max_context:
        raise DrvqwenError(f"verify pass of {T} tokens at position {pos}: past the KV cache of {max_context} "
                           f"(--max-context)")
    return ids.astype(np.int32)


class VerifyPass:
    """The verify pass of one model, sharing a `DecodeStep`'s weights, KV cache, sequence and
    stream (module doc).

    Args:
        decode_step: the step whose logits the pass reproduces (`matches_decode(decode_step.plan)`).
        occupancy: the grids' occupancy: the decode step's (default: the driver's, as DecodeStep
            plans), so that every launch has its decode counterpart's grid.
        graphs: replay each T's list from a CUDA graph captured on its first pass (module doc);
            False launches it eagerly.
        fallback: on a capture failure, warn (RuntimeWarning) and run eagerly from then on,
            instead of raising GraphCaptureError.
        prenorm: the layers' RMSNorms as launches of their own (plan_verify's prenorm; the
            default), or False: inside the T-token GEMVs, as the decode step's. The same rows
            either way. On the H200 a pass of 8 tokens cost 1.25 decode steps of the 7B with
            prenorm against 1.56 without (0.5B: 1.29 against 1.96; tools/bench_verify.py
            --fused, docs/bench): fused, every block of a GEMV normalises all T rows itself.
    Attributes:
        buf: name → DeviceArray [16, …] of the pass's own buffers (each T uses the first T rows).
        mode: "graph" or "eager" (graphs=False, or after a capture failure).
        fallback_reason: why a capture failed, or None.
        num_nodes: T → the node count of T's graph, for the Ts captured so far.
    Raises:
        DrvqwenError: a decode step the pass does not match (per-tensor formats, the TMA
            attention kernel, the persistent step), or the buffers do not fit in GPU memory.
    """

    def __init__(self, decode_step: DecodeStep, occupancy: Occupancy | None = None, *, graphs: bool = False,
                 fallback: bool = True, prenorm: bool = True):
        if not matches_decode(decode_step.plan):
            raise DrvqwenError(f"the verify pass runs the INT4 model with attention={VERIFY_ATTENTION[0]!r} "
                               f"launch by launch; this decode step has attention={decode_step.plan.attention!r}"
                               f"{', per-tensor formats' if decode_step.plan.per_tensor else ''}"
                               f"{', the persistent kernel' if decode_step.plan.persistent else ''}")
        self.decode_step = decode_step
        self.occupancy = occupancy
        self.prenorm = prenorm
        self._plans: dict[int, VerifyPlan] = {}
        self._lists: dict[int, LaunchList] = {}
        self.mode = "graph" if graphs else "eager"
        self.fallback = fallback
        self.fallback_reason: str | None = None
        self.num_nodes: dict[int, int] = {}
        self._execs: dict = {}    # T → GraphExec
        full = self.plan(MAX_TOKENS)
        own = {n: b for n, b in full.buffers.items() if n not in SHARED}
        # activation_bytes counts the shared buffers too: a few KiB more than needed.
        self.pool = Pool(full.activation_bytes + DEFAULT_ALIGN_BYTES, name="verify")
        self.buf = {n: self.pool.alloc(n, b.shape, b.dtype) for n, b in own.items()}

    def plan(self, n_tokens: int) -> VerifyPlan:
        """plan_verify of the decode step's model, context and text vocabulary for n_tokens
        tokens (made once per T). Raises as plan_verify."""
        if n_tokens not in self._plans:
            step = self.decode_step
            self._plans[n_tokens] = plan_verify(step.config, step.max_context, n_tokens, occupancy=self.occupancy,
                                                text_vocab=step.text_vocab, prenorm=self.prenorm)
        return self._plans[n_tokens]

    def resolve(self, spec):
        """The device object behind a planned buffer of the T-token list: the first T rows of
        the pass's own buffer, or the decode step's (shared buffers, weights, KV cache, tensor
        maps: DecodeStep.resolve).

        Raises:
            LaunchError: the view's shape or dtype differs from the plan's.
        """
        if isinstance(spec, BufferSpec) and spec.name in self.buf:
            return check_resolved(spec, rows_view(self.buf[spec.name], spec.shape[0]))
        return self.decode_step.resolve(spec)

    def launch_list(self, n_tokens: int) -> LaunchList:
        """The built launch list of a pass of n_tokens tokens ("verify<T>"), built on first use
        on the decode step's stream, with its choice of programmatic dependent launch."""
        if n_tokens not in self._lists:
            step = self.decode_step
            steps = list(self.plan(n_tokens).steps)
            for _name, launcher in steps:
                launcher.build(self.resolve, step.stream, pdl=step.pdl)
            self._lists[n_tokens] = LaunchList(f"verify{n_tokens}", steps)
        return self._lists[n_tokens]

    def run(self, tokens: Sequence[int], events=None, ids_only: bool = False) -> np.ndarray:
        """Run `tokens` at the sequence's next positions p … p + T − 1 (module doc) and wait.

        Args:
            events: (start, end) cuda Events to record on the stream right before and after the
                pass's kernels (the replay), or None: a benchmark's GPU time of the pass alone,
                without the ids' copy or the logits' download (tools/bench_verify.py).
            ids_only: bring back only next_token [T] (each row's argmax), not the logits.
        Returns:
            fp32 [T, V]: row j the logits after tokens[j] (the decode step's bit for bit), −inf
            at the ids from the model's text vocabulary on; with ids_only, int32 [T]: row j's
            greedy choice (argmax_final_tokens, the decode step's).
        Raises:
            DrvqwenError: as `check_chunk`, or no free page is left (nothing has run then).
        """
        step = self.decode_step
        seq = step.seq
        ids = check_chunk(tokens, step.config.vocab_size, seq.pos, step.max_context)
        T, p = len(ids), seq.pos
        lst = self.launch_list(T)
        # Captured before reserve and the ids' copy: while the stream captures, a synchronous
        # copy (reserve's block-table upload) would invalidate the capture.
        exe = self.graph(T)
        seq.reserve(p + T)
        self._launch(ids, lst, exe, events)
        seq.resume(p + T)
        if ids_only:
            return rows_view(self.buf["next_token"], T).download(step.stream)
        return self._logits(T)

    def time_kernels(self, tokens: Sequence[int], n_reps: int = 10, hold_ms: float = 20.0) -> dict[str, float]:
        """Median GPU time in µs of each launch of the pass of `tokens` over n_reps eager passes
        at the sequence's next positions, rolled back after each (launch_list.time_launches: the
        pass queued behind gpu_sleep, an event pair around each launch). The sequence ends where
        it started, its next token unchanged.

        Raises:
            DrvqwenError: as `run`.
        """
        step = self.decode_step
        seq = step.seq
        ids = check_chunk(tokens, step.config.vocab_size, seq.pos, step.max_context)
        T, p = len(ids), seq.pos
        lst = self.launch_list(T)
        step.sync()
        token = int(seq.state.download()[1])      # state = (pos, token, seq_len): what decodes next

        def before() -> None:
            seq.reserve(p + T)
            self.buf["ids"].upload_at(0, ids, step.stream)

        return time_launches(lst.launches, step.stream, n_reps, before=before,
                             after=lambda: seq.rollback(p, token), hold_ms=hold_ms)

    def graph(self, n_tokens: int):
        """The GraphExec of a pass of n_tokens tokens, captured on first use of that T (and
        reused after), or None when the pass runs eagerly (mode "eager", or this capture failed
        and fallback is True: then it warns and the pass stays eager from then on).

        Raises:
            GraphCaptureError: the capture failed and fallback is False.
        """
        if self.mode != "graph":
            return None
        if n_tokens not in self._execs:
            lst = self.launch_list(n_tokens)
            try:
                exe, nodes = capture_launches(self.decode_step.stream, lst.name,
                                              [(nl.name, nl.launch) for nl in lst.launches], what="the verify pass")
            except GraphCaptureError as e:
                if not self.fallback:
                    raise
                self.mode, self.fallback_reason = "eager", str(e)
                warnings.warn(f"{e}; verifying eagerly instead (slower, same results)", RuntimeWarning, stacklevel=2)
                return None
            self._execs[n_tokens], self.num_nodes[n_tokens] = exe, nodes
        return self._execs[n_tokens]

    def _launch(self, ids: np.ndarray, lst: LaunchList, exe=None, events=None) -> None:
        """Queue the pass: the ids (a copy the stream orders before the kernels), then the list,
        replayed from `exe` (T's graph) when given, else launch by launch; `events` (start, end)
        recorded around the kernels when given."""
        stream = self.decode_step.stream
        self.buf["ids"].upload_at(0, ids, stream)
        if events is not None:
            events[0].record(stream)
        if exe is not None:
            exe.launch(stream)
        else:
            for nl in lst.launches:
                nl.launch.launch()
        if events is not None:
            events[1].record(stream)

    def _logits(self, n_tokens: int) -> np.ndarray:
        """fp32 [T, V] of the last pass (waits for the stream)."""
        return rows_view(self.buf["logits"], n_tokens).download(self.decode_step.stream)

    def close(self) -> None:
        """Destroy the graphs and release the pass's buffers (the DecodeStep owns everything
        else); waits for the stream first when graphs exist (a queued replay may still run)."""
        if self._execs:
            self.decode_step.sync()
            for exe in self._execs.values():
                exe.destroy()
            self._execs.clear()
        self.pool.close()
