"""kernels/sampling.cu: the GPU sampler picks exactly the token `sampler.sample` picks.

Random logits of many sizes (up to the full 152064 vocabulary) under several temperature /
top-k / top-p settings, logits with many exact ties, NaN and −inf entries, tiny temperatures;
the GPU draws its uniform number itself from (seed, token_index) in device memory, and must
land on the reference's token with u = uniform(seed, token_index), with the same Philox bits
and the same kept-set size. Then publish_token: the host ring and the step counter; min-p; and the repeat penalty of
PenalizedSampleToken (penalize_logits → sample_token → record_token) over a device token
history, against sampler.penalize, with the ring short, full and wrapped.
"""

import numpy as np
import pytest

from drvqwen import launchers as K
from drvqwen.launchers import sampling
from drvqwen.engine import pack_sampler_params
from drvqwen.sampler import PENALTY_WINDOW, SamplingParams, kept_tokens, penalize, philox4x32, sample, uniform

from kernel_testing import dev  # noqa: F401

pytestmark = pytest.mark.gpu

COMBOS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=100, top_p=0.5),
    SamplingParams(temperature=0.2, top_k=3),
    SamplingParams(temperature=2.0, top_p=0.999),
    SamplingParams(temperature=1e-5),                       # the smallest non-greedy temperature
    SamplingParams(temperature=1.0, top_k=5000, top_p=0.01),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.1),
    SamplingParams(temperature=1.5, min_p=0.5),
]


class GpuSampler:
    """One sample_token launch over scratch buffers sized for vocab `v`."""

    def __init__(self, dev, v):
        self.v = v
        self.logits = dev.array("logits", (v,), np.float32)
        self.next = dev.poisoned("next", (1,), np.int32)
        self.info = dev.poisoned("info", (sampling.INFO_INTS,), np.int32)
        self.params = dev.array("params", (sampling.PARAMS_BYTES,), np.uint8)
        self.launcher = K.SampleToken(self.next, self.info, self.params, self.logits, vocab_size=v)

    def __call__(self, logits, params, step):
        self.logits.upload(np.ascontiguousarray(logits, np.float32))
        self.params.upload(pack_sampler_params(params, token_index=step))
        self.launcher.launch()
        info = self.info.download()
        # info[0] is the kernel's own pick (-1 if its scan chose nothing, which is a bug: the
        # kernel then falls back to the argmax for next_token so the run goes on); the token
        # handed to the next step must be that pick, and a real id, on every call.
        assert 0 <= info[0] < self.v, f"sample_token picked no token (info[0] = {info[0]}, V = {self.v})"
        assert self.next.download()[0] == info[0]
        return info


def _check(gpu, logits, params, step, label):
    info = gpu(logits, params, step)
    u = uniform(params.seed, step)
    want = sample(logits, params, u)
    x = philox4x32((step, 0, 0, 0), (params.seed & 0xFFFFFFFF, (params.seed >> 32) & 0xFFFFFFFF))[0]
    assert np.uint32(info[1]) == x, f"{label}: Philox bits {np.uint32(info[1]):#x} != {x:#x}"
    assert info[0] == want, f"{label}: GPU token {info[0]}, reference {want} ({params}, step {step})"
    if not params.greedy and np.isfinite(np.nanmax(np.where(np.isnan(logits), -np.inf, logits))):
        assert info[2] == len(kept_tokens(logits, params)[0]), f"{label}: kept-set size"
    assert info[3] == step


@pytest.mark.parametrize("params", COMBOS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}")
def test_sampler_matches_reference_random_logits(dev, rng, params):
    for trial in range(40):
        v = int(rng.integers(2, 6000))
        gpu = GpuSampler(dev, v)
        logits = (rng.standard_normal(v) * rng.uniform(0.5, 8)).astype(np.float32)
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=int(rng.integers(0, 2**63)),
                           min_p=params.min_p)
        _check(gpu, logits, p, int(rng.integers(0, 2**31)), f"trial {trial} V={v}")


def test_sampler_full_vocab(dev, rng):
    v = 152064
    gpu = GpuSampler(dev, v)
    for i, params in enumerate(COMBOS):
        logits = (rng.standard_normal(v) * 3).astype(np.float32)
        logits[rng.integers(0, v, 20)] += 12                    # a few strong candidates
        _check(gpu, logits, SamplingParams(params.temperature, params.top_k, params.top_p, seed=1234 + i,
                                           min_p=params.min_p), i, f"full vocab {i}")


def test_sampler_ties(dev, rng):
    """Integer logits: thousands of exact ties at every threshold (lower id first)."""
    v = 4000
    gpu = GpuSampler(dev, v)
    for trial in range(60):
        logits = rng.integers(-6, 3, v).astype(np.float32)
        params = SamplingParams(temperature=float(rng.choice([0.5, 1.0, 3.0])), top_k=int(rng.choice([0, 7, 500])),
                                top_p=float(rng.choice([1.0, 0.3, 0.77])), seed=trial)
        _check(gpu, logits, params, trial, f"ties {trial}")
    flat = np.zeros(v, np.float32)                               # all equal: uniform over all ids
    picks = {int(gpu(flat, SamplingParams(temperature=1.0, seed=3), s)[0]) for s in range(200)}
    assert len(picks) > 150


def test_sampler_edge_cases(dev, rng):
    v = 1000
    gpu = GpuSampler(dev, v)
    logits = (rng.standard_normal(v) * 4).astype(np.float32)
    best = int(np.argmax(logits))
    for params in (SamplingParams(), SamplingParams(temperature=1e-9), SamplingParams(temperature=0.9, top_p=0.0),
                   SamplingParams(temperature=0.9, top_k=1)):
        assert params.greedy
        assert gpu(logits, params, 5)[0] == best
    with_nan = logits.copy()
    with_nan[rng.integers(0, v, 50)] = np.nan
    with_nan[rng.integers(0, v, 50)] = -np.inf
    for step in range(20):
        _check(gpu, with_nan, SamplingParams(temperature=1.0, top_p=0.9, seed=9), step, "NaN/-inf logits")
    for bad in (np.full(v, -np.inf, np.float32), np.full(v, np.nan, np.float32)):
        _check(gpu, bad, SamplingParams(temperature=1.0, seed=1), 0, "no finite logit")
    big = (logits * 1e4).astype(np.float32)                      # huge logit gaps at T = 1e-5: no NaN
    _check(gpu, big, SamplingParams(temperature=1e-5, seed=2), 0, "tiny temperature")
    # Same seed and step → the same token; the GPU's Philox matches uniform() for many steps.
    p = SamplingParams(temperature=1.0, seed=77)
    flat = np.zeros(v, np.float32)
    a = [int(gpu(flat, p, s)[0]) for s in range(50)]
    assert a == [int(gpu(flat, p, s)[0]) for s in range(50)]
    assert a == [sample(flat, p, uniform(77, s)) for s in range(50)]


def test_sampler_nan_order_and_huge_top_k(dev, rng):
    """One NaN order for both backends (the greedy answer skips NaN: 5, not 3), and a top_k
    past int32 (normalized once by SamplingParams) samples exactly as the CPU does."""
    gpu = GpuSampler(dev, 6)
    nan_logits = np.array([0, 1, 2, np.nan, 4, 5], np.float32)
    assert gpu(nan_logits, SamplingParams(), 0)[0] == sample(nan_logits, SamplingParams(), 0.0) == 5
    v = 3000
    gpu = GpuSampler(dev, v)
    logits = (rng.standard_normal(v) * 3).astype(np.float32)
    logits[rng.integers(0, v, 40)] = np.nan
    for step, top_k in enumerate((2**31, 10**12, v, v + 1)):
        _check(gpu, logits, SamplingParams(temperature=0.9, top_k=top_k, top_p=0.95, seed=step), step,
               f"top_k={top_k}")


def test_publish_token_ring_and_counter(dev):
    from drvqwen.cuda import PinnedHostBuffer

    ring_size = 4
    with PinnedHostBuffer(4 * ring_size) as ring:
        view = ring.view(np.int32, ring_size)
        view[:] = -1
        params = dev.upload("params", pack_sampler_params(SamplingParams(temperature=1.0), token_index=2))
        nxt = dev.array("next", (1,), np.int32)
        pub = K.PublishToken(ring, params, nxt, ring_size=ring_size)
        for tok in (11, 12, 13):
            nxt.upload(np.array([tok], np.int32))
            pub.launch()
        params.download()                                        # waits for the launches
        assert view.tolist() == [13, -1, 11, 12]
        assert int(params.download()[24:28].view(np.uint32)[0]) == 5


def test_min_p_with_ties(dev, rng):
    """Integer logits: min_p's threshold falls on exact ties, or between them."""
    v = 3000
    gpu = GpuSampler(dev, v)
    for trial in range(60):
        logits = rng.integers(-6, 3, v).astype(np.float32)
        params = SamplingParams(temperature=float(rng.choice([0.5, 1.0, 3.0])), top_k=int(rng.choice([0, 7, 500])),
                                top_p=float(rng.choice([1.0, 0.6])), min_p=float(rng.choice([0.01, 0.135335, 0.5, 1.0])),
                                seed=trial)
        _check(gpu, logits, params, trial, f"min_p ties {trial}")


@pytest.mark.parametrize("count", [0, 1, 17, PENALTY_WINDOW, PENALTY_WINDOW + 5, 1000])
def test_penalized_sample_matches_reference(dev, rng, count):
    v = int(rng.integers(200, 5000))
    logits_d = dev.array("logits", (v,), np.float32)
    nxt = dev.poisoned("next", (1,), np.int32)
    info = dev.poisoned("info", (sampling.INFO_INTS,), np.int32)
    params_d = dev.array("params", (sampling.PARAMS_BYTES,), np.uint8)
    history = dev.array("history", (sampling.HISTORY_INTS,), np.int32)
    launcher = K.PenalizedSampleToken(nxt, info, params_d, logits_d, history, vocab_size=v)
    for trial, params in enumerate([SamplingParams(repeat_penalty=1.3),                     # greedy, penalized
                                    SamplingParams(temperature=0.8, top_k=50, repeat_penalty=1.1, seed=5),
                                    SamplingParams(temperature=1.0, min_p=0.05, repeat_penalty=0.9, seed=6),
                                    SamplingParams(temperature=1.0, seed=7)]):               # penalty off
        logits = (rng.standard_normal(v) * 3).astype(np.float32)
        seq = rng.integers(0, v, max(count, 1)).tolist()[:count]
        seq[: count // 2] = [seq[0]] * (count // 2) if count else []                          # duplicates
        hot = seq[-PENALTY_WINDOW:]
        logits[hot[: len(hot) // 2]] = np.abs(logits[hot[: len(hot) // 2]]) + 8               # positive and large
        ring = np.zeros(sampling.HISTORY_INTS, np.int32)
        ring[0] = count
        for i, t in enumerate(seq):                                                          # the ring as the GPU fills it
            ring[1 + i % PENALTY_WINDOW] = t
        history.upload(ring)
        logits_d.upload(logits)
        params_d.upload(pack_sampler_params(params, token_index=trial))
        launcher.launch()
        want_logits = penalize(logits.copy(), hot, params.repeat_penalty)
        got_logits = logits_d.download()
        np.testing.assert_array_equal(got_logits.view(np.uint32), want_logits.view(np.uint32))
        want = sample(want_logits, params, uniform(params.seed, trial))
        assert int(nxt.download()[0]) == want, f"count {count}, {params}"
        after = history.download()
        assert after[0] == count + 1 and after[1 + count % PENALTY_WINDOW] == want
