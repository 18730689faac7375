"""The acceptance rule of speculative sampling leaves the distribution unchanged: for random p
and q (and a one-hot q), the tokens it outputs are distributed as p — a chi-square test with a
fixed seed, enough draws and a threshold that a wrong rule fails (checked here too: resampling
from p instead of max(0, p − q) is caught). Plus the greedy rule and the random numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from drvqwen.sampler import SamplingParams, sample, uniform
from drvqwen.speculative_accept import LANE_ACCEPT, LANE_SAMPLE, accept_or_resample, choose, distribution, draws

V = 8
DRAWS = 30000
SEED = 20240607


def chi_square(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """(Pearson's statistic of `counts` against the expected N·p over the tokens with p > 0,
    degrees of freedom). A count where p = 0 makes it infinite."""
    n = counts.sum()
    if counts[p == 0].any():
        return math.inf, 1
    m = p > 0
    expected = n * p[m]
    return float(((counts[m] - expected) ** 2 / expected).sum()), int(m.sum()) - 1


def critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile of probability Φ(z) (z = 3.719: 1 − 1e-4) by the Wilson–Hilferty
    approximation: df · (1 − 2/(9 df) + z·sqrt(2/(9 df)))³."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def random_dist(rng: np.random.Generator, zeros: int = 0) -> np.ndarray:
    """A random distribution over V tokens, `zeros` of them at 0."""
    w = rng.gamma(0.7, size=V)
    w[rng.choice(V, zeros, replace=False)] = 0.0
    return w / w.sum()


def right_rule(p, q, x, u_a, u_r):
    return accept_or_resample(p, q, x, u_a, u_r)[0]


def wrong_rule(p, q, x, u_a, u_r):
    """A plausible mistake: on rejection, draw from p itself instead of max(0, p − q)."""
    if u_a * q[x] < p[x]:
        return x
    cum = np.cumsum(p)
    return int(np.searchsorted(cum, u_r * cum[-1], side="right"))


def output_counts(rule, p: np.ndarray, q: np.ndarray, seed: int) -> np.ndarray:
    """Counts of the tokens `rule` outputs over DRAWS proposals x ~ q, the random numbers
    those of `draws(seed, i)` (x drawn by inverse CDF with the fourth lane)."""
    counts = np.zeros(V, np.int64)
    cq = np.cumsum(q)
    for i in range(DRAWS):
        u = draws(seed, i)
        x = min(int(np.searchsorted(cq, u[3] * cq[-1], side="right")), V - 1)
        counts[rule(p, q, x, u[LANE_ACCEPT], u[LANE_SAMPLE])] += 1
    return counts


CASES = [("random q", 0, False), ("q with zeros", 3, False), ("p with zeros", 0, True), ("one-hot q", 0, None)]


@pytest.mark.parametrize("name,q_zeros,p_zeros", CASES, ids=[c[0] for c in CASES])
def test_output_is_distributed_as_p_and_a_wrong_rule_is_caught(name, q_zeros, p_zeros):
    rng = np.random.default_rng(SEED + q_zeros)
    p = random_dist(rng, 2 if p_zeros else 0)
    if p_zeros is None:
        q = np.zeros(V)
        q[int(rng.integers(V))] = 1.0
    else:
        q = random_dist(rng, q_zeros)
    stat, df = chi_square(output_counts(right_rule, p, q, SEED), p)
    assert stat < critical(df), f"{name}: chi-square {stat:.1f} over {df} degrees of freedom (p = {p}, q = {q})"
    # The test has the power to see a wrong rule on the same draws.
    bad, df = chi_square(output_counts(wrong_rule, p, q, SEED), p)
    assert bad > critical(df), f"{name}: the wrong rule passed with {bad:.1f}"


def test_deterministic_proposal_through_choose_samples_p():
    """`choose` with a deterministic proposal (prompt lookup): accepted with probability p(x), the
    output distributed as p, and the token the plain sampler draws with uniform(seed, i)."""
    rng = np.random.default_rng(SEED)
    logits = rng.standard_normal(V).astype(np.float32) * 1.5
    params = SamplingParams(temperature=0.9, seed=SEED)
    p = distribution(logits, params)
    x = int(np.argsort(p)[-2])
    counts, accepted = np.zeros(V, np.int64), 0
    for i in range(DRAWS):
        t, ok = choose(logits, params, i, x)
        assert t == sample(logits, params, uniform(params.seed, i)) and ok == (t == x)
        counts[t] += 1
        accepted += ok
    stat, df = chi_square(counts, p)
    assert stat < critical(df)
    sd = math.sqrt(DRAWS * p[x] * (1 - p[x]))
    assert abs(accepted - DRAWS * p[x]) < 4 * sd


def test_sampled_proposal_through_choose_samples_p():
    """`choose` with a draft model's distribution q (the target's p from its logits, top-k)."""
    rng = np.random.default_rng(SEED + 1)
    params = SamplingParams(temperature=0.8, top_k=6, seed=SEED)
    logits = rng.standard_normal(V).astype(np.float32) * 2
    p = distribution(logits, params)
    q = distribution(rng.standard_normal(V).astype(np.float32) * 2, params)
    cq = np.cumsum(q)
    counts = np.zeros(V, np.int64)
    for i in range(DRAWS):
        x = min(int(np.searchsorted(cq, draws(SEED, i)[2] * cq[-1], side="right")), V - 1)
        counts[choose(logits, params, i, x, q)[0]] += 1
    stat, df = chi_square(counts, p)
    assert stat < critical(df) and not counts[p == 0].any()


def test_a_larger_draft_vocabulary_is_handled():
    p = np.array([0.5, 0.5, 0.0, 0.0])
    q = np.array([0.0, 0.0, 0.0, 0.0, 1.0])        # all its mass on a token the target has no row for
    assert accept_or_resample(p, q, 4, 0.0, 0.3) == (0, False)
    assert accept_or_resample(p, q, 4, 0.0, 0.7) == (1, False)


def test_greedy_accepts_exactly_the_argmax():
    logits = np.array([0.1, 3.0, 3.0, -1.0], np.float32)      # a tie: the lowest id is the choice
    for proposal, want in ((1, (1, True)), (2, (1, False)), (0, (1, False)), (None, (1, False))):
        assert choose(logits, SamplingParams(), 7, proposal) == want
    assert distribution(logits, SamplingParams()).tolist() == [0, 1, 0, 0]


def test_draws_lane_zero_is_the_plain_sampler():
    for seed, i in ((0, 0), (SEED, 5), (2**64 - 1, 123456)):
        u = draws(seed, i)
        assert u[0] == uniform(seed, i) and len(set(u)) == 4 and all(0 <= x < 1 for x in u)
