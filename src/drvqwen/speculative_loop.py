"""The speculative token stream: propose, verify, accept, roll back — on any backend.

    prefill(prompt)                       logits of the last prompt position → token 0
    per verify pass, with tokens 0 … n-1 out (token n-1 not yet run):
      propose   k ≤ min(max_tokens, budget − n − 1) tokens d_1 … d_k   (speculative.py)
      verify    [token n-1, d_1 … d_k] at positions P+n-1 … P+n-1+k: k + 1 rows of logits,
                row i what a decode step would give there               (Backend.verify)
      accept    row by row, the repeat penalty over the window that position sees
                (prompt + tokens so far + the accepted proposals), the acceptance rule
                (speculative_accept.choose): the accepted proposals, then the target's own
                token — at the first rejection, or after the last proposal
      rollback  the cache keeps the positions of the tokens that were kept, except the last
                one out (not run yet, exactly as in plain decoding)   (Backend.rollback)

Greedy without a repeat penalty (each row's argmax is all that matters), a pass with nothing
proposed is one decode step, and the stream keeps one step queued ahead as plain decoding does
(Backend.queue_greedy / take_greedy): the step that consumes the token just out is queued
before the host waits for that token, so the proposer's and the stream's host work overlap the
GPU's. Without that, each such pass would wait for the GPU and then the GPU for the host: on
the real 0.5B's plain completions, where most passes propose nothing, that cost 10 % of the
tokens per second. A proposal that comes while a step is queued is checked at its first token
by that step's own choice: a miss costs no pass at all, a hit goes on with a verify pass from
there (`_greedy_step`).

Every token is yielded one at a time, so generate() stops on stop ids, on stop strings and at
max_new_tokens exactly as with plain decoding; the budget (max_new_tokens capped by the
context) bounds k, so no verify pass runs a position plain decoding would not. When the
consumer closes the stream, the positions after the last token it took are rolled back (a step
queued ahead and a pass's rejected positions alike): the cache then holds every token out but
the last (`cached_ids()`, which `reuse` compares with the next prompt) — what the CPU's plain
decoding leaves; the GPU's plain stream holds the last one too, consumed by the step it had
queued ahead.

With a verify pass made of plain decode steps (generate.DecodeVerify: the CPU, per-tensor
formats) this is as slow as plain decoding plus the proposer; the gain comes from a backend whose
verify runs the k + 1 tokens in one pass (the GPU's INT4 model: verify_pass.py;
docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .sampler import PENALTY_WINDOW, SamplingParams, penalize
from .speculative_accept import choose
from .stats import phase


@dataclass
class SpeculationStats:
    """What speculation did in one generation.

    Attributes:
        proposer: the proposer's name.
        proposed: tokens proposed, over every verify pass.
        accepted: proposed tokens the acceptance rule kept (greedy: the target chose them),
            a first proposal checked by a queued decode step's own choice included.
        verify_passes: target passes after the prefill (a pass with nothing proposed is one
            decode step, and counts).
        pass_tokens: tokens those passes produced: each pass's accepted proposals and its own
            token, where a queued decode step's choice that matched the first proposal counts
            once (so pass_tokens ≤ accepted + verify_passes).
    """

    proposer: str
    proposed: int = 0
    accepted: int = 0
    verify_passes: int = 0
    pass_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed; NaN when nothing was proposed."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """Tokens per verify pass (1 for plain decoding); NaN before the first pass."""
        return self.pass_tokens / self.verify_passes if self.verify_passes else float("nan")

    def summary(self) -> str:
        """`<proposer>: P proposed, A accepted (R %), T tokens per verify pass` (the rates only
        when measured)."""
        s = f"{self.proposer}: {self.proposed} proposed, {self.accepted} accepted"
        if self.proposed:
            s += f" ({100 * self.acceptance_rate:.1f} %)"
        if self.verify_passes:
            s += f", {self.tokens_per_pass:.2f} tokens per verify pass"
        return s

    def to_dict(self) -> dict:
        """The `speculation` object of `--json-stats` (rates null when unmeasured)."""
        def num(x):
            return None if x != x else round(float(x), 6)

        return {"proposer": self.proposer, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": num(self.acceptance_rate), "verify_passes": self.verify_passes,
                "pass_tokens": self.pass_tokens, "tokens_per_pass": num(self.tokens_per_pass)}


def _penalized(logits: np.ndarray, seq: list[int], params: SamplingParams) -> np.ndarray:
    """The logits the sampler sees after `seq`: the repeat penalty over its last PENALTY_WINDOW
    ids (on a copy), as plain decoding applies it."""
    if not params.penalized:
        return logits
    return penalize(np.array(logits, np.float32), seq[-PENALTY_WINDOW:], params.repeat_penalty)


def _accept(rows: np.ndarray, drafts: list[int], q, seq: list[int], params: SamplingParams,
            n: int) -> list[int]:
    """The tokens a verify pass gives (speculative_accept.choose per row, in order): the accepted
    proposals, then the target's own token at the first rejection or after the last proposal."""
    out: list[int] = []
    for i, row in enumerate(rows):
        proposal = drafts[i] if i < len(drafts) else None
        t, ok = choose(_penalized(row, seq + out, params), params, n + i, proposal,
                       None if q is None or proposal is None else q[i])
        out.append(t)
        if not ok:
            break
    return out


def _accept_greedy(ids: list[int], drafts: list[int]) -> list[int]:
    """`_accept` under greedy sampling without a penalty, from each row's argmax: the proposals
    up to the first that differs from the target's choice, then the target's choice there (or
    after the last proposal)."""
    out: list[int] = []
    for i, t in enumerate(ids):
        out.append(int(t))
        if i >= len(drafts) or int(t) != drafts[i]:
            break
    return out


def speculative_tokens(backend, prompt_ids: list[int], budget: int, params: SamplingParams, proposer,
                       stats: SpeculationStats, reuse: bool = False) -> Iterator[int]:
    """The token stream of generate() with a proposer (module doc).

    Args:
        backend: a generate.Backend (prefill, verify, rollback).
        prompt_ids: the prompt; it fits the context with room for `budget` tokens.
        budget: tokens to generate at most (max_new_tokens capped by the context), ≥ 1.
        params: sampling parameters; token i uses the random numbers of
            speculative_accept.draws(seed, i).
        proposer: a speculative.Proposer.
        stats: counts proposals, acceptances and verify passes as they happen.
        reuse: continue the backend's cached sequence (generate.py module doc).
    Yields:
        The tokens, one at a time, lazily: nothing is verified before the consumer asks for
        the next token.
    """
    seq = list(prompt_ids)
    # Greedy without a repeat penalty, each position's token is its row's argmax and nothing
    # else of the row matters: the backend returns T ids instead of T rows of logits (on the
    # GPU the pass's own argmax: 4 bytes a position to the host instead of 4·V).
    ids_only = params.greedy and not params.penalized
    with phase("prefill"):
        logits = backend.prefill(seq, reuse=True) if reuse else backend.prefill(seq)
    with phase("first token"):
        tok, _ = choose(_penalized(logits, seq, params), params, 0)
    seq.append(tok)
    held = len(seq) - 1                 # positions the cache holds: every token but the last
    queued = 0                          # greedy steps queued, their choice not taken (0 or 1 here)
    try:
        yield tok
        while len(seq) - len(prompt_ids) < budget:
            n = len(seq) - len(prompt_ids)
            k = min(proposer.max_tokens, budget - n - 1)
            with phase("propose"):
                drafts, q = proposer.propose(seq, k, params, n) if k > 0 else ([], None)
                drafts = [int(d) for d in drafts[:k]]
            with phase("decode"):
                if not ids_only:
                    out = _accept(backend.verify([seq[-1], *drafts]), drafts, q, seq, params, n)
                    passes, accepted = 1, len(out) - 1
                    held += 1 + len(drafts)
                elif drafts and not queued:
                    out = _accept_greedy(backend.verify_greedy([seq[-1], *drafts]), drafts)
                    passes, accepted = 1, len(out) - 1
                    held += 1 + len(drafts)
                else:
                    out, passes, accepted, held, queued = _greedy_step(backend, seq, drafts, n + 1 < budget,
                                                                       held, queued)
                # Every token out but the last has its position; the last too when a queued
                # step consumes it.
                keep = len(seq) + len(out) - 1 + queued
                if keep < held:
                    backend.rollback(keep)
                    held = keep
            stats.verify_passes += passes
            stats.proposed += len(drafts)
            stats.accepted += accepted
            stats.pass_tokens += len(out)
            for t in out:
                seq.append(t)
                yield t
    except GeneratorExit:
        # Closed: every token out but the last keeps its position (module doc).
        for _ in range(queued):
            backend.take_greedy()
        if held > len(seq) - 1:
            backend.rollback(len(seq) - 1)
        raise


def _greedy_step(backend, seq: list[int], drafts: list[int], more: bool, held: int,
                 queued: int) -> tuple[list[int], int, int, int, int]:
    """Greedy speculation's decode steps with one step of lookahead (Backend.queue_greedy).

    While nothing is proposed the stream decodes as plain decoding does: the step that consumes
    the next token is queued before the host waits for it (`more`: the budget has room for
    one), so the proposer's work on the token just out overlaps the GPU's on the next. When
    `drafts` come while a step is queued (`queued`: it consumes seq[-1]), that step's choice is
    the check of drafts[0]: on a miss the proposal cost nothing; on a hit, one verify pass of
    [drafts[0], drafts[1:]] goes on from there. Either way nothing stays queued afterwards, and
    the next pass starts from the host's token.

    Returns:
        (tokens out, passes run, proposals accepted, positions the cache holds, steps queued).
    """
    if not queued:
        backend.queue_greedy(seq[-1])
        held, queued = held + 1, 1
    if not drafts:
        if more:
            backend.queue_greedy(None)            # consumes the choice taken below
            held, queued = held + 1, queued + 1
        t = backend.take_greedy()
        return [t], 1, 0, held, queued - 1
    t = backend.take_greedy()
    if t != drafts[0] or len(drafts) == 1:
        return [t], 1, int(t == drafts[0]), held, 0
    rest = _accept_greedy(backend.verify_greedy([t, *drafts[1:]]), drafts[1:])
    return [t, *rest], 2, len(rest), held + len(drafts), 0
