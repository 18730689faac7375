"""The GPU engine (engine.py) on the synthetic 0.5B: tokens chosen on the GPU, read back by the host.

- greedy: every streamed token is the argmax of the logits the same GPU computes for that
  prefix (teacher-forced through the backend's logits path: the same kernels, so the same bits);
- sampling: every token is `sampler.sample(logits, params, uniform(seed, i))` of those logits,
  and the same seed gives the same tokens;
- generate(): a stop token ends the stream (and the GPU loop); max_new_tokens and the context
  cap hold.
"""

import numpy as np
import pytest

from drvqwen.config import QWEN25_CODER_05B
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.synthetic import write_synthetic
from drvqwen.generate import generate
from drvqwen.sampler import PENALTY_WINDOW, SamplingParams, penalize, sample, uniform

from helpers import minimal_tokenizer_json

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from drvqwen.engine import GPUBackend

    path = tmp_path_factory.mktemp("syn") / "0.5b.nanoqwen"
    write_synthetic(path, QWEN25_CODER_05B, seed=99, tokenizer_json=minimal_tokenizer_json())
    f = NanoqwenFile(path)
    b = GPUBackend(f, max_context=256, rng=np.random.default_rng(5), chunk_rows=64)
    yield b
    b.close()
    f.close()


def _teacher_forced_logits(backend, prompt, tokens):
    """The backend's logits for each of `tokens`' positions, fed the tokens themselves."""
    out = [backend.prefill(prompt)]
    for t in tokens[:-1]:
        out.append(backend.decode(t))
    return np.stack(out)


def _assert_equal_but_at_a_near_tie(backend, prompt, got, scratch):
    """Greedy tokens `got` (the cache reused) against `scratch` (prefilled from position 0):
    the same, or parted at a token where the from-scratch logits have a near-tie (reused K/V may
    differ from a fresh prefill's in the last bits)."""
    logits = _teacher_forced_logits(backend, prompt, scratch)
    for i, (a, b) in enumerate(zip(got, scratch)):
        if a != b:
            top2 = np.sort(logits[i])[-2:]
            assert top2[1] - top2[0] < 0.05 and logits[i][a] >= top2[0], f"token {i}: {a} vs {b}"
            break


def test_greedy_stream_is_argmax_of_its_logits(backend, rng):
    prompt = rng.integers(0, backend.config.vocab_size, 70).tolist()   # two prefill chunks of 64
    toks = list(backend.token_stream(prompt, 24, SamplingParams()))
    assert len(toks) == 24
    logits = _teacher_forced_logits(backend, prompt, toks)
    assert toks == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7),
                                    SamplingParams(temperature=1.5, seed=2**40 + 3)],
                         ids=["T0.8-k50-p0.9", "T1.5"])
def test_sampled_stream_matches_reference_sampler(backend, rng, params):
    prompt = rng.integers(0, backend.config.vocab_size, 20).tolist()
    toks = list(backend.token_stream(prompt, 20, params))
    assert toks == list(backend.token_stream(prompt, 20, params)), "same seed, different tokens"
    logits = _teacher_forced_logits(backend, prompt, toks)
    want = [sample(logits[i], params, uniform(params.seed, i)) for i in range(len(toks))]
    assert toks == want
    other = SamplingParams(params.temperature, params.top_k, params.top_p, seed=params.seed + 1)
    assert toks != list(backend.token_stream(prompt, 20, other))


def test_generate_with_gpu_backend_stops_and_caps(backend, rng):
    prompt = rng.integers(0, backend.config.vocab_size, 30).tolist()
    free = list(backend.token_stream(prompt, 16, SamplingParams()))
    stop = free[5]
    first = free.index(stop)
    res = generate(backend, prompt, 16, SamplingParams(), stop_ids=frozenset({stop}))
    assert res.tokens == free[:first] and res.stopped_by == "stop token"
    res = generate(backend, prompt, 16, SamplingParams(), stop_ids=frozenset({stop}), ignore_stop=True)
    assert res.tokens == free and res.ttft_s > 0
    res = generate(backend, list(range(250)), 100, SamplingParams())
    assert len(res.tokens) == backend.max_context - 250


def test_padded_vocabulary_rows_are_never_chosen(tmp_path, rng):
    """A model whose tokenizer covers fewer ids than its lm_head has rows (text_vocab 265 of
    512, like Qwen2.5's 151665 of 151936): the GPU's logits for the padded rows are −inf —
    what the CPU backend's are — so neither greedy nor sampled tokens land there, even when
    those rows would win."""
    import dataclasses

    from drvqwen.engine import GPUBackend
    from drvqwen.generate import CPUBackend

    from helpers import TINY, byte_tokenizer_json, random_dense, write_model

    cfg = dataclasses.replace(TINY, max_position=512)
    dense = random_dense(cfg, rng)
    f_path = tmp_path / "padded.nanoqwen"
    text_vocab = 265
    dense["lm_head.weight"][text_vocab:] = dense["lm_head.weight"][:text_vocab].mean(0) * 50
    write_model(f_path, cfg, dense, tokenizer_json=byte_tokenizer_json())
    f = NanoqwenFile(f_path)
    assert f.text_vocab == text_vocab
    gpu = GPUBackend(f, max_context=256)
    cpu = CPUBackend(f, 256)
    try:
        prompt = rng.integers(0, text_vocab, 20).tolist()
        g, c = gpu.prefill(prompt), cpu.prefill(prompt)
        assert np.isneginf(g[text_vocab:]).all() and np.isfinite(g[:text_vocab]).all()
        assert np.isneginf(c[text_vocab:]).all()
        for params in (SamplingParams(), SamplingParams(temperature=3.0, seed=int(rng.integers(1 << 30)))):
            toks = list(gpu.token_stream(prompt, 40, params))
            assert max(toks) < text_vocab, toks
    finally:
        gpu.close()
        cpu.close()
        f.close()


@pytest.mark.parametrize("params", [SamplingParams(repeat_penalty=1.3),
                                    SamplingParams(temperature=0.9, top_k=40, min_p=0.05, repeat_penalty=1.15, seed=11),
                                    SamplingParams(temperature=1.2, min_p=0.2, seed=12)],
                         ids=["greedy-rp1.3", "T0.9-k40-minp0.05-rp1.15", "T1.2-minp0.2"])
def test_penalty_and_min_p_stream_matches_the_cpu_sampler(backend, rng, params):
    """The GPU's tokens are the host loop's (generate.host_sampled_tokens: sampler.penalize over
    the last 64 ids of prompt + tokens, then sampler.sample) on the GPU's own logits."""
    prompt = rng.integers(0, 300, 90).tolist()            # few distinct ids: the penalty bites
    toks = list(backend.token_stream(prompt, 40, params))
    logits = _teacher_forced_logits(backend, prompt, toks)
    seq = list(prompt)
    for i, t in enumerate(toks):
        l = penalize(logits[i].copy(), seq[-PENALTY_WINDOW:], params.repeat_penalty)
        assert t == sample(l, params, uniform(params.seed, i)), f"token {i}"
        seq.append(t)


def test_continued_sequence_reuses_the_cache(backend, rng):
    """token_stream(reuse=True): only the new part is prefilled, and the result is what a
    from-scratch prefill of the whole sequence gives (same first-token logits, same tokens)."""
    first = rng.integers(0, backend.config.vocab_size, 40).tolist()
    toks = list(backend.token_stream(first, 10, SamplingParams()))
    cached = backend.cached_ids()
    assert cached == first + toks[:-1]                      # the last token was never decoded
    second = first + toks + rng.integers(0, backend.config.vocab_size, 30).tolist()
    cont = list(backend.token_stream(second, 12, SamplingParams(), reuse=True))
    assert backend.last_reused == len(first) + len(toks) - 1
    scratch = list(backend.token_stream(second, 12, SamplingParams()))
    assert backend.last_reused == 0
    # The reused positions' K/V came from decode steps (GEMV), the from-scratch ones from the
    # prefill (GEMM): the bits may differ in the last place.
    _assert_equal_but_at_a_near_tie(backend, second, cont, scratch)


@pytest.mark.parametrize("change", ["extends", "shortens", "diverges"])
def test_reuse_keeps_exactly_the_common_prefix_and_rolls_back_the_rest(backend, rng, change):
    """A prompt that extends the cached sequence, is shorter than it, or parts from it in the
    middle: prefill(…, reuse=True) and token_stream(…, reuse=True) keep exactly the common
    prefix, roll back the positions after it (their pages back to the free list: Prefill.run →
    Sequence.keep), and give a cold prefill's logits and tokens (within the last bits: module
    doc of generate.py)."""
    from drvqwen.kv_cache import n_pages_for

    V = backend.config.vocab_size
    first = rng.integers(0, V, 80).tolist()
    toks = list(backend.token_stream(first, 10, SamplingParams()))
    cached = backend.cached_ids()
    seq = first + toks
    if change == "extends":
        ids, want_n = seq + rng.integers(0, V, 20).tolist(), len(cached)
    elif change == "shortens":
        ids, want_n = seq[:37], 36
    else:
        ids, want_n = seq[:21] + [(seq[21] + 1) % V] + seq[22:] + rng.integers(0, V, 10).tolist(), 21
    got = backend.prefill(ids, reuse=True)
    assert backend.last_reused == want_n
    assert backend.cached_ids() == ids
    free, total = backend.kv_pages()
    assert total - free == n_pages_for(len(ids)) == len(backend.decode_step.seq.pages.block_table)
    assert backend.decode_step.seq.pos == len(ids)
    want = backend.prefill(ids)                             # cold: from position 0
    assert backend.last_reused == 0
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got))
    err = np.abs(got[finite] - want[finite]).max()
    print(f"\n{change}: reused {want_n} positions, max |logit - cold| = {err:.3g}"
          f"{' (bit for bit)' if np.array_equal(got, want) else ''}")
    assert err <= 1e-2 * np.abs(want[finite]).max(), err
    # The token stream: the same rollback from the cold sequence just prefilled (ids) back to a
    # prompt that parts from it, then the same tokens as from scratch but at a near-tie.
    other = ids[:want_n] + [(ids[want_n] + 1) % V] + rng.integers(0, V, 14).tolist()
    cont = list(backend.token_stream(other, 12, SamplingParams(), reuse=True))
    assert backend.last_reused == want_n
    free, total = backend.kv_pages()
    assert total - free == n_pages_for(len(backend.cached_ids()))
    scratch = list(backend.token_stream(other, 12, SamplingParams()))
    _assert_equal_but_at_a_near_tie(backend, other, cont, scratch)
