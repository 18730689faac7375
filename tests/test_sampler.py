"""The reference sampler and its counter-based random numbers."""

import math

import numpy as np
import pytest

from drvqwen.sampler import SamplingParams, exp2_det, kept_tokens, philox4x32, sample, uniform, weights


def test_philox_known_answers():
    # Known-answer vectors of Random123 (kat_vectors: philox4x32 10 rounds).
    assert philox4x32((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_uniform_is_a_pure_function_of_seed_and_step():
    a = [uniform(7, i) for i in range(100)]
    assert a == [uniform(7, i) for i in range(100)]
    assert a != [uniform(8, i) for i in range(100)]
    assert all(0 <= x < 1 for x in a)
    assert 0.35 < np.mean([uniform(1, i) for i in range(2000)]) < 0.65


def test_greedy_edge_cases(rng):
    logits = rng.standard_normal(1000).astype(np.float32)
    best = int(np.argmax(logits))
    for p in (SamplingParams(), SamplingParams(temperature=1e-9), SamplingParams(temperature=0.8, top_p=0.0),
              SamplingParams(temperature=0.8, top_k=1)):
        assert p.greedy
        assert sample(logits, p, 0.999) == best
    tied = np.zeros(10, np.float32)
    assert sample(tied, SamplingParams(), 0.5) == 0          # lowest index wins ties


def test_tiny_temperature_no_nan(rng):
    logits = (rng.standard_normal(500) * 50).astype(np.float32)
    t = sample(logits, SamplingParams(temperature=1e-4), 0.7)
    assert t == int(np.argmax(logits))


def test_top_k_top_p_support(rng):
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    # top_p 0.6 keeps {0, 1}; u splits 0.5 : 0.3 after renormalisation (0.625 : 0.375).
    p = SamplingParams(temperature=1.0, top_p=0.6)
    assert sample(logits, p, 0.6) == 0 and sample(logits, p, 0.63) == 1
    p = SamplingParams(temperature=1.0, top_k=3)
    assert {sample(logits, p, u) for u in np.linspace(0, 0.999, 200)} == {0, 1, 2}
    p = SamplingParams(temperature=1.0)
    counts = np.bincount([sample(logits, p, uniform(3, i)) for i in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_bad_params():
    for kw in ({"temperature": -1}, {"top_p": 1.5}, {"top_k": -2}, {"temperature": float("nan")}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


# --- the exact, GPU-reproducible definition (sampler.py module doc) -------------------------------


def test_exp2_det_accuracy_and_range():
    y = -np.linspace(0, 70, 100001, dtype=np.float32)
    e = exp2_det(y)
    assert e.dtype == np.float32 and e[0] == np.float32(1.0)
    ok = y >= -64
    rel = np.abs(e[ok].astype(np.float64) / np.exp2(y[ok].astype(np.float64)) - 1)
    assert rel.max() < 3e-7
    assert (e[~ok] == 0).all()
    assert exp2_det(np.array([np.nan, -np.inf], np.float32)).tolist() == [0.0, 0.0]


def _brute_kept(logits, params):
    """Kept set from the definition, by full sort and running sums in Python integers."""
    _e, w = weights(logits, params.temperature)
    e = _e.view(np.uint32).astype(np.int64)
    order = sorted(range(len(w)), key=lambda i: (-e[i], i))
    n = len(order) if params.top_k == 0 else min(params.top_k, len(order))
    if params.top_p < 1.0:
        c1 = sum(int(w[i]) for i in order[:n])
        goal = math.ceil(float(c1) * params.top_p)
        acc = 0
        for j, i in enumerate(order):
            acc += int(w[i])
            if acc >= goal:
                n = j + 1
                break
    return sorted(order[:n])


def test_kept_set_matches_the_definition(rng):
    for trial in range(200):
        v = int(rng.integers(1, 300))
        logits = rng.integers(-5, 3, v).astype(np.float32) if trial % 2 else rng.standard_normal(v).astype(np.float32)
        p = SamplingParams(temperature=float(rng.uniform(0.3, 3)), top_k=int(rng.choice([0, 1, 3, 50, 400])),
                           top_p=float(rng.choice([1.0, 0.9, 0.5, 0.05])))
        if p.greedy:
            continue
        kept, w = kept_tokens(logits, p)
        assert kept.tolist() == _brute_kept(logits, p)
        assert int(np.argmax(logits)) in kept.tolist()                    # the maximum is always kept
        if p.top_k:
            assert len(kept) <= p.top_k


def test_ties_are_ordered_by_lower_id():
    logits = np.zeros(10, np.float32)
    kept, _ = kept_tokens(logits, SamplingParams(temperature=1.0, top_k=3))
    assert kept.tolist() == [0, 1, 2]
    kept, _ = kept_tokens(logits, SamplingParams(temperature=1.0, top_p=0.35))   # 4 of 10 equal weights
    assert kept.tolist() == [0, 1, 2, 3]


def test_pick_scans_kept_tokens_in_id_order():
    logits = np.log(np.array([0.1, 0.6, 0.3], np.float64)).astype(np.float32)
    p = SamplingParams(temperature=1.0)
    # Weights ∝ (1/6, 1, 1/2): cumulative in id order 1/6, 7/6, 10/6 of 2^32 → thresholds 0.1, 0.7.
    assert [sample(logits, p, u) for u in (0.0, 0.09, 0.11, 0.69, 0.71, 0.999)] == [0, 0, 1, 1, 2, 2]


def test_non_finite_logits():
    p = SamplingParams(temperature=1.0, seed=1)
    assert sample(np.full(5, -np.inf, np.float32), p, 0.5) == 0
    assert sample(np.full(5, np.nan, np.float32), p, 0.5) == 0
    assert sample(np.array([0, np.inf, 1, np.inf], np.float32), p, 0.5) == 1
    with_nan = np.array([np.nan, 1.0, np.nan, 1.0, -np.inf], np.float32)
    assert {sample(with_nan, p, u) for u in np.linspace(0, 0.999, 50)} == {1, 3}


def test_nan_order_is_the_gpu_argmax_order():
    # The GPU argmax (ptx/warp.cuh argmax_better) never prefers a NaN to a number; the CPU's
    # greedy choice follows the same order (np.argmax would return the NaN's index, 3).
    logits = np.array([0, 1, 2, np.nan, 4, 5], np.float32)
    assert int(np.argmax(logits)) == 3                       # what the order must not be
    assert sample(logits, SamplingParams(), 0.5) == 5
    assert sample(np.array([np.nan, 2, 2, np.nan], np.float32), SamplingParams(), 0.5) == 1
    assert sample(np.full(4, np.nan, np.float32), SamplingParams(), 0.5) == 0


def test_generate_greedy_skips_nan_logits():
    # Through the generation loop of a logits backend (the CPU path of `drvqwen run`).
    from drvqwen.generate import HostSampling, generate

    class NaNBackend(HostSampling):
        name, max_context = "nan", 50

        def prefill(self, ids):
            return np.array([0, 1, 2, np.nan, 4, 5], np.float32)

        decode = prefill

        def reset(self):
            pass

    assert generate(NaNBackend(), [1], 3).tokens == [5, 5, 5]


def test_huge_top_k_is_clamped_once_for_both_backends(rng):
    from drvqwen.engine import pack_sampler_params
    from drvqwen.sampler import TOP_K_MAX
    import struct

    p = SamplingParams(temperature=0.8, top_k=2**31, seed=5)
    assert p.top_k == TOP_K_MAX
    assert SamplingParams(temperature=0.8, top_k=10**30).top_k == TOP_K_MAX
    logits = rng.standard_normal(300).astype(np.float32)
    off = SamplingParams(temperature=0.8, top_k=0, seed=5)
    assert [sample(logits, p, uniform(5, i)) for i in range(50)] == \
           [sample(logits, off, uniform(5, i)) for i in range(50)]
    packed = struct.unpack("<QdfiIiff8x", pack_sampler_params(p).tobytes())   # no struct.error
    assert packed[3] == TOP_K_MAX
    # Seeds are taken modulo 2^64 the same way on both sides.
    assert SamplingParams(seed=-1).seed == 2**64 - 1 == struct.unpack("<QdfiIiff8x", pack_sampler_params(SamplingParams(seed=-1)).tobytes())[0]
    assert uniform(SamplingParams(seed=2**64 + 7).seed, 3) == uniform(7, 3)
