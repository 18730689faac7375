"""Token sampling: greedy, temperature, top-k, top-p — driven by a counter-based RNG.

The uniform number for step `step` of a run with seed `seed` is the first 32-bit output of
Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) with key
(seed lo, seed hi) and counter (step, 0, 0, 0), divided by 2^32. Being a pure function of
(seed, step), it is the same on the CPU and on the GPU, so a GPU sampler fed the same uniform
picks the same token as `sample` here, and a run is reproducible whatever backend runs it.

`sample` is the reference sampler: the GPU one (a later issue) must match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Philox4x32 round constants (Random123: PHILOX_M4x32_0/1, PHILOX_W32_0/1).
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF

# Temperatures below this behave as greedy: dividing logits by ~0 would overflow to inf/NaN.
GREEDY_TEMPERATURE = 1e-5


def philox4x32(counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int = 10) -> tuple[int, int, int, int]:
    """Philox4x32-`rounds` of one 128-bit counter under a 64-bit key. Returns four uint32."""
    c0, c1, c2, c3 = (x & _MASK for x in counter)
    k0, k1 = key[0] & _MASK, key[1] & _MASK
    for _ in range(rounds):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK, p1 & _MASK, ((p0 >> 32) ^ c3 ^ k1) & _MASK, p0 & _MASK
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def uniform(seed: int, step: int) -> float:
    """The uniform number in [0, 1) used at generation step `step` of a run seeded `seed`."""
    x = philox4x32((step, 0, 0, 0), (seed & _MASK, (seed >> 32) & _MASK))[0]
    return x / 2.0**32


@dataclass(frozen=True)
class SamplingParams:
    """temperature: 0 (or < 1e-5) = greedy. top_k: 0 = off. top_p: 1.0 = off; 0 = greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0) or self.temperature == float("inf"):
            raise ValueError(f"temperature={self.temperature}: must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0")
        if not (0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p}: must be in [0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1 or self.top_p <= 0.0


def argmax(logits: np.ndarray) -> int:
    """Greedy choice; the lowest index wins a tie (np.argmax's rule, and the GPU kernel's)."""
    return int(np.argmax(logits))


def sample(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """Pick a token from logits [V] given the uniform number u in [0, 1).

    Steps (in float64): greedy if params.greedy; else p = softmax(logits / T); sort by p
    descending (ties: lower id first); keep the top_k; keep the shortest prefix whose mass
    reaches top_p (at least one token); renormalize; return the first token whose cumulative
    mass exceeds u.
    """
    if params.greedy:
        return argmax(logits)
    z = np.asarray(logits, dtype=np.float64) / params.temperature
    z = z - np.max(z)
    p = np.exp(z)
    order = np.argsort(-p, kind="stable")
    ps = p[order] / p.sum()
    if params.top_k > 0:
        ps = ps[: params.top_k]
    if params.top_p < 1.0:
        c = np.cumsum(ps)
        keep = int(np.searchsorted(c, params.top_p * c[-1], side="left")) + 1
        ps = ps[: max(1, min(keep, len(ps)))]
    c = np.cumsum(ps)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(order[min(i, len(ps) - 1)])
