"""Token sampling: repeat penalty, greedy, temperature, top-k, top-p, min-p — driven by a
counter-based RNG.

The uniform number for step `step` of a run with seed `seed` is the first 32-bit output of
Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) with key
(seed lo, seed hi) and counter (step, 0, 0, 0), divided by 2^32. Being a pure function of
(seed, step), it is the same on the CPU and on the GPU, so a run is reproducible whatever
backend runs it.

`sample` is the reference sampler, and the GPU one (kernels/sampling.cu) picks the same token
for the same logits and the same uniform number. "The same" is only possible if every value
that decides the token is computed exactly alike on both sides, so the sampler is defined on
quantities that are:

1. Weights. With l_max the largest logit and s = float32(log2(e) / temperature),
   y_i = fl32(fl32(l_i − l_max) · s) ≤ 0 and e_i = exp2_det(y_i): 2^n · p(f) with
   n = floor(y), f = y − n and p a fixed degree-6 polynomial (EXP2_COEFFS) evaluated by
   Horner in float32 with separately rounded multiplies and adds (no FMA) — every step an
   IEEE-754 basic operation, so numpy and the GPU (__fmul_rn / __fadd_rn) agree bit for bit
   (a library exp would differ in the last ulp). e = 0 for y < −64 (or NaN), e = 1 exactly
   at the maximum. The integer weight is W_i = floor(e_i · 2^32) (≤ 2^32 + small): sums of
   weights are exact in uint64 whatever the order of addition, which is what lets a parallel
   GPU reduction agree with numpy.
2. Order. Tokens are ranked by e_i descending (compared as float bits), ties by lower id first.
3. Kept set. top_k: the first min(top_k, V) tokens of that order (top_k = 0: all). top_p: of
   those, the shortest prefix whose cumulative weight reaches R = ceil(C1 · top_p), C1 being
   the weight of the top-k set (float64 multiply of two exact values). At least one token, the
   maximum, is always kept.
4. Pick. The kept tokens are scanned in *id* order (not probability order: the GPU needs no
   sort): with x the 32-bit Philox output (u = x / 2^32) and C the kept weight, the token is
   the first whose cumulative weight exceeds floor(x · C / 2^32) (exact in integers).

min_p (after top_k and top_p, as in Hugging Face's MinPLogitsWarper): of the kept prefix,
only the tokens with e_i ≥ float32(min_p) stay — e_i is the token's probability relative to
the most likely one at this temperature, compared exactly (float32 on both sides). The most
likely token (e = 1) always stays.

Repeat penalty (llama.cpp's `penalty_repeat`, window `penalty_last_n` = 64 by default): before
anything else, the logit of every distinct token among the last PENALTY_WINDOW tokens of the
sequence (prompt included) is divided by the penalty if it is positive, multiplied by it if not
— one correctly rounded float32 operation each, so the GPU (__fdiv_rn / __fmul_rn) gets the
same bits. It applies to greedy choices too.

Greedy (temperature < 1e-5, top_k = 1 or top_p = 0) is the argmax in the GPU argmax's order
(ptx/warp.cuh argmax_better): the largest logit, lowest id on ties, a NaN never chosen over a
number (id 0 if every logit is NaN). numpy's np.argmax would return the first NaN instead; a
single order is what makes the CPU and the GPU pick the same token from the same logits. If
the largest logit is not finite (+inf, or all NaN), the argmax is returned too: there is no
distribution to sample.

Parameters are checked once, here (`SamplingParams`), for both backends: top_k is clamped to
TOP_K_MAX (2^31 − 1, the GPU's int field; any top_k ≥ V keeps every token anyway), and the
seed is taken modulo 2^64 (the Philox key's two words) on both sides.

Tokens whose probability relative to the maximum is below 2^-32 get weight 0 and are never
sampled — at most ~4e-5 of the mass for a 152k vocabulary, in exchange for exactness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Philox4x32 round constants (Random123: PHILOX_M4x32_0/1, PHILOX_W32_0/1).
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF

# Temperatures below this behave as greedy: dividing logits by ~0 would overflow to inf/NaN.
GREEDY_TEMPERATURE = 1e-5
# The largest top_k kept as given: the GPU sampler's parameter is an int32 (sampling.cu
# SamplerParams.top_k). Larger values mean "every token", as any top_k >= V does.
TOP_K_MAX = 2**31 - 1
# Tokens of the sequence the repeat penalty looks back over: llama.cpp's default
# `penalty_last_n` (common/common.h). kernels/sampling.cu PENALTY_WINDOW mirrors it.
PENALTY_WINDOW = 64


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
    """Sampling parameters, validated and normalized once for both backends.

    Attributes:
        temperature: 0 (or < 1e-5) = greedy; a finite float >= 0.
        top_k: 0 = off; an int >= 0, clamped to TOP_K_MAX (every top_k >= V keeps all tokens).
        top_p: 1.0 = off; 0 = greedy; a float in [0, 1].
        seed: the Philox key, an int taken modulo 2^64 (negative seeds wrap, as on the GPU).
        min_p: 0 = off; a float in [0, 1]: keep tokens at least this likely relative to the top one.
        repeat_penalty: 1 = off; a finite float > 0 (llama.cpp's repeat_penalty, over the last
            PENALTY_WINDOW tokens).

    Raises:
        ValueError: a value outside its range (the message names the field and the value).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0) or self.temperature == float("inf"):
            raise ValueError(f"temperature={self.temperature}: must be a finite number >= 0")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0")
        if not (0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p}: must be in [0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p={self.min_p}: must be in [0, 1]")
        # Both backends divide or multiply logits by it in float32: a value float32 cannot hold
        # as a normal number would become inf or 0 there (an overflow, a division by zero).
        f32 = np.finfo(np.float32)
        if not (float(f32.tiny) <= self.repeat_penalty <= float(f32.max)):
            raise ValueError(f"repeat_penalty={self.repeat_penalty}: must be a finite number > 0 that float32 "
                             f"holds ({float(f32.tiny):.3g} to {float(f32.max):.3g})")
        # float32 here: both backends use these bits (the GPU's parameters are float32).
        object.__setattr__(self, "min_p", float(np.float32(self.min_p)))
        object.__setattr__(self, "repeat_penalty", float(np.float32(self.repeat_penalty)))
        # Normalized here so that the CPU sampler and the GPU's packed parameters (int32 top_k,
        # u64 seed) can only ever see the same values.
        object.__setattr__(self, "top_k", min(int(self.top_k), TOP_K_MAX))
        object.__setattr__(self, "seed", int(self.seed) % 2**64)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1 or self.top_p <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether the repeat penalty changes any logit (repeat_penalty != 1)."""
        return self.repeat_penalty != 1.0


def penalize(logits: np.ndarray, recent, penalty: float) -> np.ndarray:
    """The repeat penalty (module doc), in place: logits fp32 [V] of each distinct id in
    `recent` (the last PENALTY_WINDOW ids of the sequence; ids outside [0, V) are skipped)
    become l / penalty if l > 0, else l · penalty. Returns `logits`.

    Source: llama.cpp src/llama-sampling.cpp, llama_sampler_penalties_apply.
    """
    if penalty == 1.0:
        return logits
    p = np.float32(penalty)
    ids = np.unique(np.asarray(list(recent), np.int64))
    ids = ids[(ids >= 0) & (ids < logits.size)]
    l = logits[ids].astype(np.float32)
    logits[ids] = np.where(l > 0, l / p, l * p).astype(np.float32)
    return logits


def argmax(logits: np.ndarray) -> int:
    """Greedy choice: the largest non-NaN logit, the lowest index on ties, 0 if all are NaN —
    the GPU argmax's order (`argmax_total_order`), not np.argmax's (which picks a NaN)."""
    return argmax_total_order(logits)


# 2^f ≈ 1 + f·(c1 + f·(c2 + … + f·c6)) on [0, 1): a least-squares fit of the relative error,
# max 8.4e-8 in float32. Written as hex floats so that numpy and kernels/sampling.cu
# (SAMPLE_EXP2_C1 …) use the same float32 bits.
EXP2_COEFFS = tuple(np.float32(float.fromhex(h)) for h in (
    "0x1.62e42cp-1", "0x1.ebfd5ap-3", "0x1.c688f0p-5", "0x1.3d0c48p-7", "0x1.46d2e8p-10", "0x1.c546fap-13"))
# Below this exponent a weight is 0 (2^-64 ≪ 2^-32, the weight resolution).
EXP2_MIN = np.float32(-64.0)
# Integer weights W = floor(e · 2^WEIGHT_BITS): the resolution of the sampler's probabilities.
WEIGHT_BITS = 32
LOG2E = 1.4426950408889634


def scale_log2(temperature: float) -> np.float32:
    """float32(log2(e) / temperature): the factor that turns logit differences into log2 weights."""
    return np.float32(LOG2E / temperature)


def exp2_det(y: np.ndarray) -> np.ndarray:
    """2^y for float32 y ≤ 0, reproducible bit for bit on the GPU (see the module doc).

    y: float32 array. Returns float32: 0 where y < EXP2_MIN or y is NaN, else 2^n · p(y − n).
    """
    y = np.asarray(y, dtype=np.float32)
    valid = y >= EXP2_MIN                                  # False for NaN
    yv = np.where(valid, y, np.float32(0))
    n = np.floor(yv)
    f = yv - n                                             # float32, rounded like __fsub_rn
    p = EXP2_COEFFS[5]
    for c in EXP2_COEFFS[4::-1]:
        p = p * f + c                                      # two roundings: no FMA
    p = p * f + np.float32(1.0)
    e = p * np.ldexp(np.float32(1.0), n.astype(np.int32)).astype(np.float32)
    return np.where(valid, e, np.float32(0)).astype(np.float32)


def weights(logits: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """(e float32 [V], W uint64 [V]) of the logits at a temperature (module doc, step 1).

    Assumes the largest non-NaN logit is finite (callers check).
    """
    l = np.asarray(logits, dtype=np.float32).reshape(-1)
    l_max = l[argmax_total_order(l)]
    e = exp2_det((l - l_max) * scale_log2(temperature))
    w = np.floor(np.ldexp(e.astype(np.float64), WEIGHT_BITS)).astype(np.uint64)
    return e, w


def argmax_total_order(logits: np.ndarray) -> int:
    """The GPU argmax's order (ptx/warp.cuh argmax_better): the largest non-NaN value, lowest
    index on ties; 0 if every value is NaN."""
    l = np.asarray(logits).reshape(-1)
    nan = np.isnan(l)
    if not nan.any():
        return int(np.argmax(l))       # the usual case: np.argmax's order is this order
    ok = np.flatnonzero(~nan)
    if ok.size == 0:
        return 0
    return int(ok[np.argmax(l[ok])])


def kept_tokens(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(kept token ids in id order, their uint64 weights) for a non-greedy `params` (module doc,
    steps 1–3). The largest logit must be finite."""
    e, w = weights(logits, params.temperature)
    v = e.size
    order = np.argsort(-(e.view(np.uint32).astype(np.int64)), kind="stable")   # e desc, id asc
    cum = np.cumsum(w[order], dtype=np.uint64)
    n = v if params.top_k == 0 else min(params.top_k, v)
    if params.top_p < 1.0:
        c1 = int(cum[n - 1])
        goal = math.ceil(float(c1) * params.top_p)          # exact operands, one float64 rounding
        n = int(np.searchsorted(cum, goal, side="left")) + 1  # first prefix with weight ≥ goal
    if params.min_p > 0.0:
        n = min(n, int(np.count_nonzero(e >= np.float32(params.min_p))))  # a prefix of the order
    kept = np.sort(order[:n])
    return kept, w[kept]


def sample(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """Pick a token from logits [V] given the uniform number u in [0, 1).

    u is taken as the 32-bit integer x = floor(u · 2^32) (exactly the Philox output when
    u = uniform(seed, step)). Greedy if params.greedy or the largest logit is not finite;
    else the kept set of `kept_tokens` scanned in id order: the first token whose cumulative
    weight exceeds floor(x · C / 2^32), C the kept weight (module doc, step 4).
    """
    if params.greedy:
        return argmax(logits)
    l = np.asarray(logits, dtype=np.float32).reshape(-1)
    best = argmax_total_order(l)
    if not np.isfinite(l[best]):
        return best
    kept, w = kept_tokens(l, params)
    cum = np.cumsum(w, dtype=np.uint64)
    x = int(u * 2.0**32)
    target = (x * int(cum[-1])) >> 32                        # < C: some kept token exceeds it
    return int(kept[int(np.searchsorted(cum, target, side="right"))])
