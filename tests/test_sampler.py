"""The reference sampler and its counter-based random numbers."""

import numpy as np
import pytest

from drvqwen.sampler import SamplingParams, philox4x32, sample, uniform


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
