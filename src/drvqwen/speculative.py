"""The proposers of speculative decoding: where the tokens the target model verifies come from.

A proposer looks at the sequence so far (prompt + generated tokens) and guesses up to k next
tokens; the target checks them all in one verify pass (`Backend.verify`) and keeps the longest
run the acceptance rule accepts (speculative_accept.py), so a proposer can only cost time,
never change the distribution of the output. The loop is speculative_loop.py; docs/speculative.md
says when it pays.

    PromptLookup   copies what followed the last time the most recent tokens occurred: free
                   to run, right when the answer repeats its input (code edits, refactors)
    DraftModel     a smaller model of the same tokenizer, with its own KV cache, generating k
                   tokens ahead
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import DrvqwenError
from .sampler import PENALTY_WINDOW, SamplingParams, penalize, sample
from .speculative_accept import LANE_DRAFT, distribution, draws

# The most tokens one verify pass checks after the last accepted one: the verify pass runs at
# most 16 positions (one KV page's worth).
MAX_PROPOSAL = 15
# Tokens a draft model proposes per verify pass unless told (`--draft-max`).
DEFAULT_DRAFT_MAX = 8


class Proposer(Protocol):
    """What the speculative loop asks of a proposer.

    Attributes:
        name: for the statistics ("prompt lookup", "draft model qwen-0.5b.nanoqwen").
        max_tokens: proposals per verify pass at most (1 … MAX_PROPOSAL).
    """

    name: str
    max_tokens: int

    def propose(self, context: list[int], k: int, params: SamplingParams,
                index: int) -> tuple[list[int], np.ndarray | None]:
        """Up to k tokens to follow `context` (prompt + tokens so far; the first proposal is
        token `index` of the generation), and the distributions they were drawn from: float64
        [len, V], or None when the proposal is deterministic (a function of the context)."""

    def close(self) -> None:
        """Release what the proposer holds (a draft model's weights and cache)."""


def check_max_tokens(n: int, option: str) -> int:
    """`n` when it is a proposal length in [1, MAX_PROPOSAL]; else DrvqwenError naming `option`."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_PROPOSAL:
        raise DrvqwenError(f"{option}={n}: must be an integer in [1, {MAX_PROPOSAL}] (tokens proposed per "
                           f"verify pass)")
    return int(n)


def lookup(context: list[int], k: int, ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the tokens after an earlier occurrence of the context's last n tokens, n
    tried from `ngram` down to `min_ngram` (the longest match wins). Of its occurrences, the
    most recent one with k tokens after it, else the one with the most after it (the earliest):
    in a run of repeats the most recent occurrence overlaps the suffix and would propose one
    token.

    Args:
        context: the ids so far (prompt + generated).
        k: tokens to return at most.
        ngram, min_ngram: the longest and shortest suffix searched for.
    Returns:
        Up to k ids (fewer when no occurrence has k after it); [] when no suffix of length ≥
        min_ngram occurs earlier.
    """
    a = np.asarray(context, np.int64)
    size = a.size
    for n in range(min(ngram, size - 1), min_ngram - 1, -1):
        tail = a[size - n:]
        # Starts s = 0 … size-n-1: the match a[s:s+n] has at least one token after it and is
        # not the suffix itself.
        hit = np.ones(size - n, bool)
        for j in range(n):
            hit &= a[j:size - n + j] == tail[j]
        found = np.flatnonzero(hit)
        if found.size:
            full = found[found + n + k <= size]
            s = int(full[-1] if full.size else found[0]) + n
            return a[s:s + k].tolist()
    return []


@dataclass
class PromptLookup:
    """Prompt lookup decoding (vLLM's `ngram` proposer, llama.cpp's lookup decoding): propose
    the tokens that followed the most recent earlier occurrence of the last `ngram` tokens of
    prompt + output, else of the last ngram − 1, … down to `min_ngram` (`lookup`).

    Choices: the longest suffix that matches wins (a longer match predicts better); among its
    occurrences the most recent one with max_tokens after it (in code that repeats, the nearest
    copy is the one being followed), else the earliest; the proposal is cut at max_tokens,
    never padded. Deterministic, so a rejected proposal costs only the verify pass's extra
    positions — which are not free (docs/speculative.md: a pass of 9 costs two decode steps of
    the 0.5B).

    Only a match of all `ngram` = 3 tokens proposes (min_ngram = 3 by default). On the real
    Qwen2.5-Coder-0.5B's plain HumanEval completions (82 problems, `--lookup 8`), matches of 1 or
    2 tokens proposed 11575 of the 12958 tokens and 7 % of them were accepted, 3-token matches
    48 %: the short matches filled passes of up to 9 positions for a fraction of a token each,
    while an edit's copied text matches 3 tokens anyway. (Counted on its greedy outputs from the
    CPU reference — acceptance depends on nothing else — whose totals, 12958 proposed and 1508
    accepted, are within 10 % of the GPU run's in docs/speculative.md.)

    Args:
        max_tokens: tokens proposed per verify pass at most (`--lookup N`), 1 … MAX_PROPOSAL.
        ngram, min_ngram: the suffix lengths searched, 1 ≤ min_ngram ≤ ngram.
    Raises:
        DrvqwenError: a value out of range.
    """

    max_tokens: int = 8
    ngram: int = 3
    min_ngram: int = 3
    name: str = "prompt lookup"

    def __post_init__(self):
        check_max_tokens(self.max_tokens, "--lookup")
        if not 1 <= self.min_ngram <= self.ngram:
            raise DrvqwenError(f"prompt lookup n-grams {self.min_ngram} … {self.ngram}: need 1 <= min <= max")

    def propose(self, context: list[int], k: int, params: SamplingParams,
                index: int) -> tuple[list[int], None]:
        """`lookup` of up to min(k, max_tokens) tokens; deterministic (no distribution)."""
        return lookup(context, min(k, self.max_tokens), self.ngram, self.min_ngram), None

    def close(self) -> None:
        """Nothing to release."""


class DraftModel:
    """A smaller model of the same tokenizer proposing what it would generate itself.

    Each call brings the draft's KV cache in step with the context through its own prefill with
    reuse (`Backend.prefill(…, reuse=True)`): the positions the context shares are kept, the
    draft's rejected proposals are rolled back, only the new tokens run. Then it generates k
    tokens with the run's sampling parameters, the repeat penalty over the same window as the
    target's: greedy (a deterministic proposal) or sampled with the LANE_DRAFT numbers of
    `draws` (and then its distributions go with the proposal, for the acceptance rule).

    Args:
        backend: the draft model (a generate.Backend with its own KV cache, at least as long as
            the target's).
        max_tokens: tokens proposed per verify pass at most (`--draft-max`), 1 … MAX_PROPOSAL.
        name: for the statistics.
    """

    def __init__(self, backend, max_tokens: int = DEFAULT_DRAFT_MAX, name: str = "draft model"):
        self.backend = backend
        self.max_tokens = check_max_tokens(max_tokens, "--draft-max")
        self.name = name

    def propose(self, context: list[int], k: int, params: SamplingParams,
                index: int) -> tuple[list[int], np.ndarray | None]:
        """Up to min(k, max_tokens) tokens the draft generates after `context` (fewer where its
        context ends), and their distributions when sampling (None when greedy)."""
        k = min(k, self.max_tokens, self.backend.max_context - len(context) + 1)
        if k <= 0:
            return [], None
        logits = self.backend.prefill(list(context), reuse=True)
        window = list(context[-PENALTY_WINDOW:])
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(k):
            if params.penalized:
                logits = penalize(np.array(logits, np.float32), window[-PENALTY_WINDOW:], params.repeat_penalty)
            if params.greedy:
                t = sample(logits, params, 0.0)
            else:
                qs.append(distribution(logits, params))
                t = sample(logits, params, draws(params.seed, index + i)[LANE_DRAFT])
            tokens.append(t)
            window.append(t)
            if i + 1 < k:
                logits = self.backend.decode(t)
        return tokens, (np.stack(qs) if qs else None)

    def close(self) -> None:
        """Release the draft model."""
        self.backend.close()
