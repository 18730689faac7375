"""The generation loop, independent of the backend that computes logits or chooses tokens.

Two kinds of backend:
- a logits backend has `prefill(ids) -> logits [V]` (last position), `decode(token) -> logits
  [V]`, `reset()`, `max_context` and a `name`; the loop chooses each token on the host with
  `sampler.sample` (the CPU backend here, running `reference.Model`);
- a token backend also has `token_stream(prompt_ids, max_new_tokens, params) -> Iterator[int]`
  and chooses the tokens itself (the GPU engine, engine.py: prefill and decode and the
  sampler all run on the GPU, the host only reads each token back to print it). Its tokens
  must be the ones `sampler.sample` would pick from its logits with
  `uniform(params.seed, i)` for token i.

Either way the loop stops on the stop ids unless told to ignore them — closing the token
stream, so a backend that runs ahead stops at once — and streams text through
`tokenizer.StreamDecoder` (in the caller's `on_token`) so that multi-byte characters split
across tokens print whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Callable, Protocol

import numpy as np

from .errors import DrvqwenError
from .format.nanoqwen import NanoqwenFile
from .reference import Model, Weights
from .sampler import SamplingParams, sample, uniform


class Backend(Protocol):
    name: str
    max_context: int

    def prefill(self, ids: list[int]) -> np.ndarray: ...
    def decode(self, token: int) -> np.ndarray: ...
    def reset(self) -> None: ...


class TokenBackend(Backend, Protocol):
    def token_stream(self, prompt_ids: list[int], max_new_tokens: int,
                     params: SamplingParams) -> Iterator[int]: ...


class CPUBackend:
    """The numpy reference as a backend: weights dequantized once to float32 and kept in memory
    (~4 bytes/parameter: 2 GB for the 0.5B), decode is one reference forward of one token."""

    def __init__(self, f: NanoqwenFile, max_context: int, progress: Callable[[int, int], None] | None = None):
        self.name = "cpu (numpy reference)"
        self.config = f.config
        self.max_context = min(max_context, f.config.max_position)
        self.weights = Weights.from_nanoqwen(f, np.float32, progress=progress)
        self.model = Model(self.weights, max_tokens=self.max_context)

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.model.reset()
        return self.model.forward(ids, last_only=True)[0]

    def decode(self, token: int) -> np.ndarray:
        return self.model.forward([token])[0]

    def reset(self) -> None:
        self.model.reset()


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    ttft_s: float = 0.0             # prompt submitted → first token chosen
    decode_s: float = 0.0           # first token → last token
    stopped_by: str = "max_new_tokens"

    @property
    def decode_tok_s(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def check_prompt_fits(n_prompt: int, max_context: int) -> None:
    """Raise DrvqwenError when the prompt leaves no room to generate within the context."""
    if n_prompt == 0:
        raise DrvqwenError("the prompt is empty (0 tokens)")
    if n_prompt >= max_context:
        raise DrvqwenError(f"prompt of {n_prompt} tokens does not fit the context of "
                           f"{max_context} tokens (--max-context)")


def host_sampled_tokens(backend: Backend, prompt_ids: list[int], max_new_tokens: int,
                        params: SamplingParams) -> Iterator[int]:
    """The token stream of a logits backend: token i = sample(logits, params, uniform(seed, i)).

    Lazy: the prefill runs at the first `next`, and token i is decoded (to get the logits of
    token i + 1) only when the consumer asks for token i + 1 — a stop token is never decoded.
    """
    logits = backend.prefill(list(prompt_ids))
    for i in range(max_new_tokens):
        tok = sample(logits, params, uniform(params.seed, i))
        yield tok
        if i + 1 < max_new_tokens:
            logits = backend.decode(tok)


def generate(backend: Backend, prompt_ids: list[int], max_new_tokens: int,
             params: SamplingParams = SamplingParams(), stop_ids: frozenset[int] = frozenset(),
             on_token: Callable[[int], None] | None = None, ignore_stop: bool = False) -> GenerationResult:
    """Prefill `prompt_ids`, then decode up to `max_new_tokens` tokens.

    Token i (0-based) is chosen with the uniform number `sampler.uniform(params.seed, i)`, by
    the backend itself when it has `token_stream` (the GPU engine), else here.
    Generation stops early at a stop id (not included in the result) unless ignore_stop; it is
    capped so that prompt + generated never exceeds backend.max_context.
    Raises DrvqwenError if the prompt does not fit.
    """
    check_prompt_fits(len(prompt_ids), backend.max_context)
    budget = min(max_new_tokens, backend.max_context - len(prompt_ids))
    res = GenerationResult(prompt_tokens=len(prompt_ids))
    if budget <= 0:
        return res
    t0 = time.perf_counter()
    if hasattr(backend, "token_stream"):
        tokens = backend.token_stream(list(prompt_ids), budget, params)
    else:
        tokens = host_sampled_tokens(backend, prompt_ids, budget, params)
    t_first = None
    try:
        for tok in tokens:
            if t_first is None:
                t_first = time.perf_counter()
                res.ttft_s = t_first - t0
            if tok in stop_ids and not ignore_stop:
                res.stopped_by = "stop token"
                break
            res.tokens.append(tok)
            if on_token:
                on_token(tok)
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()  # a backend running ahead of the host stops here
    res.decode_s = time.perf_counter() - (t_first or t0)
    return res
