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
from drvqwen.sampler import SamplingParams, sample, uniform

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
