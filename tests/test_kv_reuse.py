"""Reusing the KV cache of the previous sequence (generate.py's `reuse=True`), on the CPU backend
with a tiny synthetic model, end to end: for a prompt that extends, shortens, diverges in the
middle from, or repeats the cached one, exactly the longest common prefix is kept (never a
position whose token differs), the rest is given back (pages included), and the tokens and
logits are those of a cold backend that prefills the whole prompt. A prefill interrupted half
way leaves the cache holding exactly the ids it says it holds. The same on the GPU engine:
tests/test_engine_gpu.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.generate import CPUBackend, generate
from drvqwen.kv_cache import n_pages_for
from drvqwen.reference import gather_pages
from drvqwen.sampler import SamplingParams

from helpers import TINY, byte_tokenizer_json, common_prefix, random_dense, write_model

CTX = 512
CFG = dataclasses.replace(TINY, max_position=CTX)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("reuse") / "tiny.nanoqwen"
    write_model(path, CFG, random_dense(CFG, np.random.default_rng(11)), tokenizer_json=byte_tokenizer_json())
    f = NanoqwenFile(path)
    yield f
    f.close()


def assert_cache_holds_its_ids(backend: CPUBackend, cold: CPUBackend) -> None:
    """cached_ids() is what the K/V hold: as many positions as the reference cache says, pages
    for those and no more, and K/V equal to a cold prefill's of those ids."""
    ids = backend.cached_ids()
    cache = backend.model.cache
    assert cache.seq_len == len(ids)
    free, total = backend.kv_pages()
    assert total - free == len(cache.block_table) == n_pages_for(len(ids))
    if not ids:
        return
    cold.prefill(ids)
    ref = cold.model.cache
    for layer in range(CFG.num_layers):
        for name in ("k", "v"):
            got = gather_pages(getattr(cache, name)[layer], np.asarray(cache.block_table), len(ids))
            want = gather_pages(getattr(ref, name)[layer], np.asarray(ref.block_table), len(ids))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{name} of layer {layer}")


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=5)],
                         ids=["greedy", "sampled"])
def test_reuse_keeps_exactly_the_common_prefix_and_changes_nothing(tiny, params):
    rng = np.random.default_rng(3)
    warm, cold = CPUBackend(tiny, CTX), CPUBackend(tiny, CTX)
    text = tiny.text_vocab

    def new_ids(n: int) -> list[int]:
        return rng.integers(0, 256, n).tolist()

    # Each prompt is made from the previous sequence (prompt + answer); the count it must reuse.
    steps = [("cold start", lambda seq: new_ids(70), lambda seq, cached: 0),
             ("extends past the answer", lambda seq: seq + new_ids(9), lambda seq, cached: len(cached)),
             ("shortens", lambda seq: seq[:40], lambda seq, cached: 39),
             ("diverges in the middle", lambda seq: seq[:17] + [(seq[17] + 1) % 256] + seq[18:] + new_ids(25),
              lambda seq, cached: 17),
             ("diverges inside the first page", lambda seq: seq[:3] + new_ids(30), lambda seq, cached: 3),
             ("repeats", lambda seq: list(seq), lambda seq, cached: len(seq) - 1),
             ("shares nothing", lambda seq: [(seq[0] + 1) % 256] + new_ids(20), lambda seq, cached: 0)]
    seq: list[int] = []
    for what, make, expect in steps:
        ids = make(seq)
        cached = warm.cached_ids()
        want_n = common_prefix(cached, ids)
        assert want_n == expect(ids if what == "repeats" else seq, cached), what
        # The first token's logits: a prefill with reuse against a cold prefill of the whole prompt.
        got_logits = warm.prefill(ids, reuse=True)
        assert warm.last_reused == want_n, what
        want_logits = cold.prefill(ids)
        assert np.array_equal(np.isneginf(got_logits), np.isneginf(want_logits))
        np.testing.assert_allclose(got_logits[:text], want_logits[:text], rtol=1e-5, atol=1e-5, err_msg=what)
        assert_cache_holds_its_ids(warm, cold)
        # The tokens of a generation that reuses the cache are a cold one's, seed for seed.
        got = generate(warm, ids, 12, params, reuse=True)
        want = generate(cold, ids, 12, params)
        assert got.tokens == want.tokens, what
        assert got.reused_tokens == warm.last_reused == len(ids) - 1, what   # prefilled just above
        assert warm.cached_ids()[:len(ids)] == ids
        assert_cache_holds_its_ids(warm, cold)
        seq = ids + got.tokens


def test_an_interrupted_prefill_leaves_the_cache_holding_what_it_says(tiny, monkeypatch):
    """A prefill that fails half way (here its third chunk of 16 positions) keeps the common
    prefix it reused and nothing else: cached_ids(), the positions and the pages agree, and the
    next prompt reuses that prefix and gets a cold backend's logits."""
    rng = np.random.default_rng(4)
    warm, cold = CPUBackend(tiny, CTX), CPUBackend(tiny, CTX)
    first = rng.integers(0, 256, 50).tolist()
    warm.prefill(first)
    second = first[:20] + rng.integers(0, 256, 60).tolist()
    warm.model.chunk = 16
    forward_chunk = warm.model._forward_chunk
    calls = []

    def failing(ids, last_only):
        calls.append(len(ids))
        if len(calls) == 3:
            raise MemoryError("out of memory in the third chunk")
        return forward_chunk(ids, last_only)

    monkeypatch.setattr(warm.model, "_forward_chunk", failing)
    with pytest.raises(MemoryError):
        warm.prefill(second, reuse=True)
    assert calls == [16, 16, 16]
    assert warm.cached_ids() == first[:20]
    assert_cache_holds_its_ids(warm, cold)
    monkeypatch.setattr(warm.model, "_forward_chunk", forward_chunk)
    got = warm.prefill(second, reuse=True)
    assert warm.last_reused == 20
    text = tiny.text_vocab
    np.testing.assert_allclose(got[:text], cold.prefill(second)[:text], rtol=1e-5, atol=1e-5)
    assert_cache_holds_its_ids(warm, cold)
