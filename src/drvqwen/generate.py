"""The generation loop, independent of the backend that computes logits or chooses tokens.

`Backend` names what the front doors and this loop use of a backend; both backends implement
it, and generate() asks only for its `token_stream`. Two ways to make the tokens:
- on the host (`HostSampling`, the CPU backend here, running `reference.Model`): `prefill(ids)`
  and `decode(token)` give logits [V], and `host_sampled_tokens` chooses each token with
  `sampler.sample`;
- on the device (the GPU engine, engine.py: prefill and decode and the sampler all run on the
  GPU, the host only reads each token back to print it). Its tokens must be the ones
  `sampler.sample` would pick from its logits with `uniform(params.seed, i)` for token i.

A backend that keeps its KV cache between calls (both do) can continue a cached sequence:
with `reuse=True`, `prefill(ids, reuse=True)` / `token_stream(…, reuse=True)` compare `ids`
with the ids whose K/V the cache holds (`cached_ids()`), keep exactly the longest common
prefix — the positions after it are rolled back, their pages given back, so no K/V of a
position whose token differs is ever read — prefill only the rest (at least one token: its
logits choose the next token), and report how many positions they reused in `last_reused`
(`drvqwen chat`, chat.py; the server, server/worker.py). The prompt extends, shortens or
parts from the cached ids anywhere. `cached_ids()` is always what the K/V hold: the prompt and
every token that was run, also when the consumer closes the stream early or a step fails.
Sampling does not depend on it: token i is drawn with uniform(seed, i) either way. The reused
K/V were computed by an earlier prefill or decode step rather than by this prompt's prefill,
so logits can differ from a cold run's in the last bits (the CPU's BLAS and the GPU's decode
GEMV sum in another order than a prefill of many rows), which changes a token only where two
logits nearly tie.

The repeat penalty (sampler.penalize) looks at the last PENALTY_WINDOW ids of the whole
sequence, prompt included: here for a logits backend, in device memory for the GPU engine.

Either way the loop stops on the stop ids unless told to ignore them — closing the token
stream, so a backend that runs ahead stops at once — and streams text through
`stream_decoder.StreamDecoder` (in the caller's `on_token`) so that multi-byte characters split
across tokens print whole.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from .config import QwenConfig
from .errors import DrvqwenError
from .format.nanoqwen import NanoqwenFile
from .reference import Model, Weights
from .sampler import PENALTY_WINDOW, SamplingParams, argmax, penalize, sample, uniform
from .stats import phase

if TYPE_CHECKING:
    from .speculative import Proposer
    from .speculative_loop import SpeculationStats


class Backend(Protocol):
    """A model ready to generate: `CPUBackend` below, `engine.GPUBackend`.

    Attributes:
        name: for people ("cpu (numpy reference)", "cuda (NVIDIA H200)").
        max_context: positions the KV cache holds; prompt + generated never pass it.
        last_reused: positions the last `token_stream(…, reuse=True)` kept from the cache.
        decode_mode: "graph" or "eager" on the GPU (how decode steps were launched), None on
            the CPU; read it before `close`.
    """

    name: str
    max_context: int
    last_reused: int

    @property
    def decode_mode(self) -> str | None: ...

    def token_stream(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams = ...,
                     reuse: bool = False) -> Iterator[int]:
        """Prefill `prompt_ids`, then yield up to max_new_tokens tokens (fewer if the consumer
        closes the iterator); token i is `sampler.sample(logits, params, uniform(seed, i))`.
        reuse: keep the cached positions the prompt starts with (module doc)."""

    def prefill(self, ids: list[int], reuse: bool = False) -> np.ndarray:
        """Greedy prefill of `ids`: the last position's logits fp32 [V]. From position 0, or
        with `reuse` after the cached positions `ids` starts with (module doc)."""

    def decode(self, token: int) -> np.ndarray:
        """`token` at the next position: its logits fp32 [V] (teacher forcing)."""

    def verify(self, tokens: list[int]) -> np.ndarray:
        """`tokens` at the next positions (the first is the last accepted token, the rest a
        speculative proposal): logits fp32 [len(tokens), V], row i what `decode(tokens[i])`
        would return at that position. Every token's K/V stays in the cache (`rollback` drops
        the rejected ones). `DecodeVerify` is the default."""

    def verify_greedy(self, tokens: list[int]) -> list[int]:
        """`verify` reduced to each row's greedy choice (`sampler.argmax`): what speculation
        needs under greedy sampling without a repeat penalty. The GPU backend returns the pass's
        own argmax, T ids instead of T rows of logits. `DecodeVerify` is the default."""

    def queue_greedy(self, token: int | None = None) -> None:
        """Queue a greedy decode step at the next position: it consumes `token` — or, with None,
        the token the step queued just before it chose, which the host need not know yet — and
        chooses `sampler.argmax` of its logits. The consumed token's K/V stay in the cache.
        Greedy speculation without a repeat penalty decodes through it while nothing is
        proposed: with the next step queued before the host waits for this one's token, the
        host's work (the proposer, the stream) overlaps the GPU's, as in plain decoding.
        `DecodeVerify` is the default (runs at once)."""

    def take_greedy(self) -> int:
        """The choice of the oldest step `queue_greedy` queued and no call has taken (waits for
        it). Every queued step is taken before `verify`, `verify_greedy` or `rollback`."""

    def rollback(self, n_positions: int) -> None:
        """Keep the first n_positions cached positions and drop the rest (their pages back to
        the free list): the next `decode` runs at position n_positions.
        Raises DrvqwenError when n_positions is outside [0, len(cached_ids())]."""

    def cached_ids(self) -> list[int]:
        """The ids whose K/V the cache holds, positions 0 … len-1."""

    def kv_pages(self) -> tuple[int, int]:
        """(free, total) pages of the KV cache (the server's metrics)."""

    def reset(self) -> None:
        """Forget the sequence (the next prefill starts at position 0)."""

    def close(self) -> None:
        """Release the weights and the KV cache; the backend is unusable afterwards."""


class HostSampling:
    """The token stream of a backend whose `prefill`/`decode` return logits: each token chosen
    on the host by `host_sampled_tokens` (CPUBackend; a test's scripted backend)."""

    last_reused = 0
    decode_mode = None

    def token_stream(self, prompt_ids: list[int], max_new_tokens: int,
                     params: SamplingParams = SamplingParams(), reuse: bool = False) -> Iterator[int]:
        """`Backend.token_stream` through `host_sampled_tokens`."""
        return host_sampled_tokens(self, prompt_ids, max_new_tokens, params, reuse)


class DecodeVerify:
    """`Backend.verify` as one `decode` per token: exact by construction (each row is the decode
    step's own logits), and as slow as plain decoding. The CPU backend uses it; the GPU backend
    overrides `verify` with a pass that runs the tokens together (weights read once for all of
    them) with the same logits bit for bit (verify_pass.py), and falls back to this where it has
    none.

    Attributes:
        verify_implementation: what `verify` runs, for the benchmarks' records.
    """

    verify_implementation = "DecodeVerify.verify"

    def verify(self, tokens: list[int]) -> np.ndarray:
        """Logits fp32 [len(tokens), V]: row i = decode(tokens[i]) (`Backend.verify`)."""
        if not tokens:
            raise ValueError("verify() needs at least one token (the last accepted one)")
        return np.stack([np.asarray(self.decode(int(t)), np.float32) for t in tokens])

    def verify_greedy(self, tokens: list[int]) -> list[int]:
        """`Backend.verify_greedy`: `sampler.argmax` of each row of `verify`."""
        return [argmax(row) for row in self.verify(tokens)]

    def queue_greedy(self, token: int | None = None) -> None:
        """`Backend.queue_greedy`, run at once: `verify_greedy([token])`, its choice kept for
        `take_greedy` (and for a following queue_greedy(None) to consume).

        Raises:
            RuntimeError: token None with no step queued before it.
            DrvqwenError: as `verify`.
        """
        queued = self.__dict__.setdefault("_greedy_queue", deque())
        if token is None:
            if not queued:
                raise RuntimeError("queue_greedy(None) consumes the choice of a step queued before it; none is")
            token = queued[-1]
        queued.append(self.verify_greedy([int(token)])[0])

    def take_greedy(self) -> int:
        """`Backend.take_greedy`: the oldest queued step's choice.

        Raises:
            RuntimeError: no step queued.
        """
        queued = self.__dict__.get("_greedy_queue")
        if not queued:
            raise RuntimeError("take_greedy() with no step queued")
        return queued.popleft()

    def drop_greedy_queue(self) -> None:
        """Forget choices queued and never taken — a stream that ended by an exception (Ctrl-C)
        leaves them — so that the next generation's first take_greedy is its own step's. The
        steps themselves ran at once: their K/V are in the cache like any decode's. Prefill and
        reset call it."""
        self.__dict__.pop("_greedy_queue", None)


def check_rollback(n_positions: int, cached: int) -> None:
    """Raise DrvqwenError unless 0 <= n_positions <= cached (`Backend.rollback`)."""
    if not 0 <= n_positions <= cached:
        raise DrvqwenError(f"rollback to {n_positions} positions: the cache holds {cached}")


def resolve_max_context(requested: int | None, max_position: int, default: int | None = None) -> int:
    """The context length of a run, by one rule for the CPU and the GPU backends.

    Args:
        requested: --max-context; None or 0 means `default`.
        max_position: the model's context length (QwenConfig.max_position).
        default: the context of 0 (None: max_position; chat: 8192 or max_position if smaller).
    Returns:
        The context in tokens, in [1, max_position].
    Raises:
        DrvqwenError: `requested` is negative or larger than the model's max_position — the
            positions past it were never trained, so a larger context is refused, never capped
            in silence.
    """
    zero = max_position if default is None else default
    n = zero if not requested else int(requested)
    if not 1 <= n <= max_position:
        what = "all of it" if zero == max_position else f"{zero}"
        raise DrvqwenError(f"--max-context={requested}: must be 0 or in [1, {max_position}] "
                           f"(the model's max_position; 0 = {what})")
    return n


def cpu_memory_needed(cfg: QwenConfig, cache_tokens: int) -> dict[str, int]:
    """Bytes the CPU backend needs for `cfg` and a KV cache of `cache_tokens` positions.

    Returns {"weights", "kv_cache", "activations", "total"}: the weights dequantized to
    float32, K and V in float32 pages, and the working set of one prefill chunk (activations of
    PREFILL_CHUNK rows, one block of attention scores a few times over, the logits).
    """
    from .kv_cache import PAGE_TOKENS
    from .format.tensor_set import expected_tensors
    from .reference import ATTENTION_BLOCK_BYTES, PREFILL_CHUNK

    elems = 0
    for name, (_, shape) in expected_tensors(cfg).items():
        if name.endswith(".scales"):
            continue
        n = int(np.prod(shape, dtype=np.int64))
        elems += n * 8 if name.endswith(".qweight") else n      # 8 weights per packed word
    weights = 4 * elems
    positions = -(-cache_tokens // PAGE_TOKENS) * PAGE_TOKENS
    kv = 2 * cfg.num_layers * positions * cfg.num_kv_heads * cfg.head_dim * 4
    rows = min(PREFILL_CHUNK, max(cache_tokens, 1))
    per_row = 4 * (4 * cfg.hidden_size + cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.intermediate_size)
    acts = 2 * rows * per_row + 4 * ATTENTION_BLOCK_BYTES + 8 * cfg.vocab_size
    return {"weights": weights, "kv_cache": kv, "activations": acts, "total": weights + kv + acts}


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_cpu_memory(f: NanoqwenFile, cache_tokens: int, available: int | None = None) -> None:
    """Refuse, before anything is allocated, a CPU run that cannot fit in memory.

    Raises:
        DrvqwenError: the estimate of `cpu_memory_needed` exceeds the available memory; the
            message gives both and what takes the memory.
    """
    available = available_memory() if available is None else available
    if available is None:
        return
    need = cpu_memory_needed(f.config, cache_tokens)
    if need["total"] > available:
        gib = 2.0**30
        raise DrvqwenError(
            f"{f.path}: the CPU backend needs ~{need['total'] / gib:.1f} GiB for a context of "
            f"{cache_tokens} tokens (weights {need['weights'] / gib:.1f} GiB as float32, KV cache "
            f"{need['kv_cache'] / gib:.2f} GiB, working set {need['activations'] / gib:.2f} GiB), "
            f"{available / gib:.1f} GiB available: use a GPU, a smaller model or a shorter prompt")


class CPUBackend(HostSampling, DecodeVerify):
    """The numpy reference as a backend: weights dequantized once to float32 and kept in memory
    (~4 bytes/parameter: 2 GB for the 0.5B), decode is one reference forward of one token.

    Args:
        f: the validated model file.
        max_context: the run's context in tokens (checked by `resolve_max_context`: the same
            rule as the GPU backend).
        progress: called as progress(layers_done, layers) while dequantizing.
        cache_tokens: KV-cache positions to allocate (default max_context). A run that knows it
            needs fewer (prompt + max_new_tokens) allocates only those; `max_context` still
            says where the context ends.
    Raises:
        DrvqwenError: max_context outside [1, max_position]; or the weights, the cache and
            the working set would not fit in the available memory (`check_cpu_memory`,
            checked before anything is allocated).
    """

    def __init__(self, f: NanoqwenFile, max_context: int, progress: Callable[[int, int], None] | None = None,
                 cache_tokens: int | None = None):
        self.name = "cpu (numpy reference)"
        self.config = f.config
        self.max_context = resolve_max_context(max_context, f.config.max_position)
        cache = min(cache_tokens or self.max_context, self.max_context)
        check_cpu_memory(f, cache)
        self.text_vocab = f.text_vocab
        self.weights = Weights.from_nanoqwen(f, np.float32, progress=progress)
        self.model = Model(self.weights, max_tokens=cache)
        self._cached: list[int] = []
        self.last_reused = 0

    def _mask(self, logits: np.ndarray) -> np.ndarray:
        # The lm_head's padded rows (ids >= text_vocab) stand for no text: -inf takes them out
        # of greedy and sampled choices alike (the sampler gives -inf a weight of 0).
        logits[self.text_vocab:] = -np.inf
        return logits

    def prefill(self, ids: list[int], reuse: bool = False) -> np.ndarray:
        """Logits fp32 [V] of the last prompt position; ids >= text_vocab are −inf.

        reuse: keep the cached positions that `ids` starts with (`reused_prefix`) and run only
            the rest; `last_reused` says how many were kept. False: start from position 0.
        """
        ids = list(ids)
        self.drop_greedy_queue()
        n = reused_prefix(self._cached, ids) if reuse else 0
        self.model.cache.truncate(n)     # the rest rolled back, its pages to the free list
        self.last_reused = n
        self._cached = ids[:n]
        logits = self._forward(ids[n:])
        self._cached = ids
        return self._mask(logits)

    def decode(self, token: int) -> np.ndarray:
        """Logits fp32 [V] after `token`; ids >= text_vocab are −inf."""
        logits = self._forward([token])
        self._cached.append(int(token))
        return self._mask(logits)

    def _forward(self, ids: list[int]) -> np.ndarray:
        """Run `ids` after the cached ones: the last position's logits fp32 [V]. A forward that
        fails half way (a chunk written, the next one not) is rolled back to the cached ids, so
        that `cached_ids()` is always what the K/V hold."""
        try:
            return self.model.forward(ids, last_only=True)[0]
        except BaseException:
            self.model.cache.truncate(len(self._cached))
            raise

    def rollback(self, n_positions: int) -> None:
        """Keep positions < n_positions, drop the rest (`Backend.rollback`): the cache's
        truncate gives their pages back and makes their slots NaN again."""
        check_rollback(n_positions, len(self._cached))
        self.model.cache.truncate(n_positions)
        del self._cached[n_positions:]

    def cached_ids(self) -> list[int]:
        """The ids whose K/V the cache holds, positions 0 … len-1."""
        return list(self._cached)

    def kv_pages(self) -> tuple[int, int]:
        """(free, total) pages of the reference's PagedKVCache."""
        cache = self.model.cache
        free = len(cache.free)
        return free, free + len(cache.block_table)

    def reset(self) -> None:
        self.model.reset()
        self._cached = []
        self.drop_greedy_queue()

    def close(self) -> None:
        """Drop the dequantized weights and the KV cache (the memory goes back at once)."""
        self.weights = self.model = None


def reused_prefix(cached: list[int], ids: list[int]) -> int:
    """Cached positions a prefill of `ids` can keep: the longest common prefix of the cached
    ids and `ids`, but at most len(ids) - 1 (the last prompt token must run to give logits)."""
    n, limit = 0, min(len(cached), len(ids) - 1)
    while n < limit and cached[n] == ids[n]:
        n += 1
    return n


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    ttft_s: float = 0.0             # prompt submitted → first token chosen
    decode_s: float = 0.0           # first token → last token
    # Why generation ended: "max_new_tokens", "stop token", "stop string" (the caller's
    # on_token said so), or "context full" (the context ended before max_new_tokens).
    stopped_by: str = "max_new_tokens"
    reused_tokens: int = 0          # prompt positions taken from the KV cache, not prefilled
    # Proposals, acceptance and verify passes of a speculative run (None: plain decoding).
    speculation: "SpeculationStats | None" = None

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens that ran through the model (not taken from the cache)."""
        return self.prompt_tokens - self.reused_tokens

    @property
    def prompt_tok_s(self) -> float:
        """Prompt-eval speed: prefilled tokens / TTFT (TTFT covers the prefill and the first
        token's choice); NaN when no token was chosen."""
        return self.prefill_tokens / self.ttft_s if self.ttft_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first; NaN when fewer than two tokens were generated
        (there is no decode interval to measure: `summary` leaves it out)."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")

    def summary(self) -> str:
        """One line: prompt tokens (reused from the cache, prompt-eval speed), generated tokens,
        why it stopped, TTFT and the decode rate — each timing only when it was measured (TTFT
        and the prompt-eval speed need a token, the decode rate two)."""
        timed = bool(self.tokens) or self.stopped_by == "stop token"
        prompt = f"prompt {self.prompt_tokens} tokens"
        if self.reused_tokens:
            prompt += f" ({self.reused_tokens} reused from the KV cache)"
        if timed and self.ttft_s > 0:
            prompt += f" at {self.prompt_tok_s:.1f} tok/s"
        parts = [prompt, f"generated {len(self.tokens)} ({self.stopped_by})"]
        if timed:
            parts.append(f"TTFT {self.ttft_s * 1e3:.1f} ms")
        if len(self.tokens) >= 2 and self.decode_s > 0:
            parts.append(f"decode {self.decode_tok_s:.2f} tok/s")
        if self.speculation is not None:
            parts.append(self.speculation.summary())
        return ", ".join(parts)


def check_prompt_fits(n_prompt: int, max_context: int, model: str | None = None,
                      max_position: int | None = None) -> None:
    """Raise DrvqwenError when the prompt leaves no room to generate within the context.

    model, max_position: the model file and its context, named in the message (the context
    may be short because the file says so, not because of --max-context).
    """
    if n_prompt == 0:
        raise DrvqwenError("the prompt is empty (0 tokens)")
    if n_prompt >= max_context:
        where = f"; {model} allows {max_position}" if model and max_position else ""
        raise DrvqwenError(f"prompt of {n_prompt} tokens does not fit the context of "
                           f"{max_context} tokens (--max-context{where})")


def check_prompt_ids(ids: list[int], vocab_size: int, model: str) -> None:
    """Raise DrvqwenError when a prompt id has no row in the model (a tokenizer with more ids
    than the embedding has rows: the file's tokenizer and weights disagree)."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise DrvqwenError(f"{model}: the prompt's token id {bad[0]} has no embedding row (the model "
                           f"has {vocab_size}): the embedded tokenizer does not belong to these weights")


def host_sampled_tokens(backend: Backend, prompt_ids: list[int], max_new_tokens: int,
                        params: SamplingParams, reuse: bool = False) -> Iterator[int]:
    """The token stream of a logits backend: token i = sample(penalize(logits, last
    PENALTY_WINDOW ids of prompt + tokens so far), params, uniform(seed, i)).

    Lazy: the prefill runs at the first `next`, and token i is decoded (to get the logits of
    token i + 1) only when the consumer asks for token i + 1 — a stop token is never decoded.
    reuse: continue the backend's cached sequence (module doc).
    """
    seq = list(prompt_ids)
    with phase("prefill"):
        logits = backend.prefill(list(prompt_ids), reuse=True) if reuse else backend.prefill(list(prompt_ids))
    for i in range(max_new_tokens):
        with phase("decode" if i else "first token"):
            if params.penalized:
                logits = penalize(np.array(logits, np.float32), seq[-PENALTY_WINDOW:], params.repeat_penalty)
            tok = sample(logits, params, uniform(params.seed, i))
        seq.append(tok)
        yield tok
        if i + 1 < max_new_tokens:
            with phase("decode"):
                logits = backend.decode(tok)


def generate(backend: Backend, prompt_ids: list[int], max_new_tokens: int,
             params: SamplingParams = SamplingParams(), stop_ids: frozenset[int] = frozenset(),
             on_token: Callable[[int], bool | None] | None = None, ignore_stop: bool = False,
             reuse: bool = False, speculation: "Proposer | None" = None) -> GenerationResult:
    """Prefill `prompt_ids`, then decode up to `max_new_tokens` tokens.

    on_token(token) is called for every generated token; a true return value ends generation
    there (stopped_by "stop string": the caller found a stop string in the text).
    reuse: continue the backend's cached sequence, prefilling only what follows the common
    prefix (module doc); `reused_tokens` says how many positions were kept.

    Token i (0-based) is chosen with the uniform number `sampler.uniform(params.seed, i)`, by
    the backend's `token_stream` (on the GPU, or on the host: `HostSampling`).
    speculation: a proposer (speculative.py: PromptLookup, DraftModel); its tokens are
    verified by the backend's `verify` and accepted by speculative_accept.py's rule
    (speculative_loop.py): greedy output identical to plain decoding, sampled output of the
    same distribution. `speculation` in the result counts proposals and verify passes.
    Generation stops early at a stop id (not included in the result) unless ignore_stop; it is
    capped so that prompt + generated never exceeds backend.max_context, and when that cap
    ends it before max_new_tokens, `stopped_by` says "context full".
    Raises DrvqwenError if the prompt does not fit.
    """
    check_prompt_fits(len(prompt_ids), backend.max_context)
    budget = min(max_new_tokens, backend.max_context - len(prompt_ids))
    res = GenerationResult(prompt_tokens=len(prompt_ids))
    if budget <= 0:
        return res
    t0 = time.perf_counter()
    if speculation is None:
        tokens = backend.token_stream(list(prompt_ids), budget, params, reuse=reuse)
    else:
        from .speculative_loop import SpeculationStats, speculative_tokens

        res.speculation = SpeculationStats(speculation.name)
        tokens = speculative_tokens(backend, list(prompt_ids), budget, params, speculation, res.speculation,
                                    reuse=reuse)
    t_first = None
    try:
        for tok in tokens:
            if t_first is None:
                t_first = time.perf_counter()
                res.ttft_s = t_first - t0
                res.reused_tokens = backend.last_reused if reuse else 0
            if tok in stop_ids and not ignore_stop:
                res.stopped_by = "stop token"
                break
            res.tokens.append(tok)
            if on_token and on_token(tok):
                res.stopped_by = "stop string"
                break
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()  # a backend running ahead of the host stops here
    res.decode_s = time.perf_counter() - (t_first or t0)
    if res.stopped_by == "max_new_tokens" and len(res.tokens) == budget < max_new_tokens:
        res.stopped_by = "context full"
    return res
