"""The acceptance rule of speculative decoding: which of the proposed tokens the target keeps,
and the token it puts after them.

At each verified position the target has logits; p is the distribution the plain sampler
draws from there (`distribution`: temperature, top-k, top-p, min-p — after the repeat penalty,
which the caller applies over the window that position sees). A proposal x comes with the
proposer's distribution q (a draft model sampling), or with none (a deterministic proposer:
prompt lookup, or a draft model choosing greedily — q is one-hot at x).

- Greedy (`params.greedy`): x is accepted when it is the target's own choice there (the
  sampler's greedy path: `sampler.argmax`, the repeat penalty applied); at the first position
  where it is not, the target's choice is taken instead and the rest of the proposal dropped.
  When every proposal was accepted, the target's choice after the last is appended. The output
  is plain decoding's, token for token.
- Sampling: the speculative-sampling rule of Leviathan, Kalman & Matias, "Fast Inference from
  Transformers via Speculative Decoding" (ICML 2023, Algorithm 1) and Chen et al., "Accelerating
  Large Language Model Decoding with Speculative Sampling" (2023): accept x with probability
  min(1, p(x) / q(x)); else draw the token from normalize(max(0, p − q)). Whatever q is, the
  token that comes out is distributed as p.
  For a deterministic proposer (q one-hot at x) the rule is: accept with probability p(x),
  else draw from p without x. Drawing t from p with the plain sampler and accepting x exactly
  when t == x is that rule (P(accept) = p(x); a rejection's t is distributed as p without x,
  normalized), so `choose` does it that way: with the same seed the text is plain decoding's
  own. A draft model that samples draws with other numbers, and its text differs from plain
  decoding's (the distribution does not).

Random numbers, all from `sampler.philox4x32` with the run's seed and counter (i, 0, 0, 0) for
token i, one 32-bit output per use (`draws`):

    lane 0   the plain sampler's draw (= sampler.uniform(seed, i)); also the draw from
             max(0, p − q) after a rejection
    lane 1   the acceptance test of a sampled proposal
    lane 2   the draft model's own sample at token i

so a seeded run is reproducible, on any backend, whatever the proposals were.
"""

from __future__ import annotations

import numpy as np

from .sampler import SamplingParams, argmax_total_order, kept_tokens, philox4x32, sample

LANE_SAMPLE, LANE_ACCEPT, LANE_DRAFT = 0, 1, 2


def draws(seed: int, index: int) -> tuple[float, float, float, float]:
    """The four uniform numbers in [0, 1) of token `index` in a run seeded `seed`: Philox4x32-10
    of counter (index, 0, 0, 0) under key (seed lo, seed hi), each output / 2^32. Lane 0 is
    `sampler.uniform(seed, index)`."""
    seed &= 2**64 - 1
    out = philox4x32((index, 0, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))
    return tuple(x / 2.0**32 for x in out)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution `sampler.sample(logits, params, u)` draws from, for u uniform: float64
    [V], summing to 1.

    Greedy parameters, or a largest logit that is not finite: one-hot at `sampler.argmax`.
    Else the kept tokens' integer weights over their sum (sampler module doc, steps 1–3); the
    sampler's own draw matches it to within 2^-32 per token.
    """
    l = np.asarray(logits, dtype=np.float32).reshape(-1)
    p = np.zeros(l.size, np.float64)
    best = argmax_total_order(l)
    if params.greedy or not np.isfinite(l[best]):
        p[best] = 1.0
        return p
    kept, w = kept_tokens(l, params)
    p[kept] = w.astype(np.float64) / float(w.sum(dtype=np.uint64))
    return p


def accept_or_resample(p: np.ndarray, q: np.ndarray, x: int, u_accept: float, u_resample: float) -> tuple[int, bool]:
    """One position of the speculative-sampling rule (module doc).

    Args:
        p: the target's distribution, float64 [V].
        q: the proposer's distribution that x was drawn from, float64 [V'] (a draft model's
            vocabulary may have more or fewer rows than the target's: a token without a row in
            p has p = 0, and a row without one in q has q = 0).
        x: the proposed token.
        u_accept, u_resample: independent uniform numbers in [0, 1).
    Returns:
        (x, True) when x is accepted (u_accept · q(x) < p(x), i.e. with probability
        min(1, p(x)/q(x))); else (t, False) with t drawn from normalize(max(0, p − q)) by
        inverse CDF in id order.
    """
    px, qx = (float(p[x]) if x < p.size else 0.0), float(q[x])
    if u_accept * qx < px:
        return int(x), True
    q = q[:p.size] if q.size >= p.size else np.pad(q, (0, p.size - q.size))
    r = np.maximum(p - q, 0.0)
    cum = np.cumsum(r)
    if not cum[-1] > 0:             # p == q up to rounding: any draw from p is right
        cum = np.cumsum(p)
    t = int(np.searchsorted(cum, u_resample * cum[-1], side="right"))
    return min(t, cum.size - 1), False


def choose(logits: np.ndarray, params: SamplingParams, index: int, proposal: int | None = None,
           q: np.ndarray | None = None) -> tuple[int, bool]:
    """The token at one verified position, and whether it accepts the proposal there.

    Args:
        logits: the target's logits fp32 [V] at this position, repeat penalty already applied.
        params: the run's sampling parameters.
        index: the token's index in the generation (its random numbers: `draws`).
        proposal: the proposed token at this position; None after the last proposal (the
            target's own token is appended).
        q: float64 [V], the distribution the proposal was sampled from (a sampling draft
            model); None for a deterministic proposal.
    Returns:
        (token, accepted): token is the proposal when accepted, else the target's token.
    """
    if proposal is None or q is None:
        # Plain decoding's token (module doc): greedy, or the one-hot q of a deterministic proposal.
        t = sample(logits, params, draws(params.seed, index)[LANE_SAMPLE])
        return t, proposal is not None and t == proposal
    u = draws(params.seed, index)
    return accept_or_resample(distribution(logits, params), q, proposal, u[LANE_ACCEPT], u[LANE_SAMPLE])
