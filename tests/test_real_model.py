"""The real Qwen2.5-Coder-0.5B-Instruct (the official Q4_K_M GGUF, pulled into the cache):
the reference against `transformers` on the GGUF's dequantized weights, and greedy code
generation from our INT4 conversion on the CPU backend."""

import subprocess
import sys

import pytest

from drvqwen import reference as ref
from drvqwen.generate import CPUBackend, generate

from helpers import rel_l2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIB_PROMPT = 'def fib(n):\n    """Return the n-th Fibonacci number."""\n'
FIB_VALUES = [0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55]


@pytest.fixture(scope="module")
def tokenizer(real_nanoqwen):
    from drvqwen.tokenizer import Tokenizer

    return Tokenizer.from_json(real_nanoqwen.tokenizer_json)


def _hf_from_weights(w: ref.Weights):
    from test_reference import hf_model

    return hf_model(w.config, w.state_dict())


def _hf_greedy(model, ids, n):
    out = []
    with torch.no_grad():
        past = None
        x = torch.tensor([ids])
        for _ in range(n):
            o = model(x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            t = int(torch.argmax(o.logits[0, -1]))
            out.append(t)
            x = torch.tensor([[t]])
    return out


def test_reference_matches_transformers_on_gguf_weights(real_gguf, tokenizer):
    """Dense (not INT4) GGUF weights, float32 on both sides: last-position logits ≤ 1e-3."""
    from drvqwen.format.convert import GGUFSource

    src = GGUFSource(real_gguf)
    w = ref.Weights.from_dense(src.config, src.get)
    hf = _hf_from_weights(w)
    ids = tokenizer.encode(FIB_PROMPT)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1].double().numpy()
    got = ref.Model(w, max_tokens=64).forward(ids, last_only=True)[0]
    err = rel_l2(got, want)
    print(f"0.5B GGUF weights: last-position logits rel L2 {err:.2e}, argmax {got.argmax()} vs {want.argmax()}")
    assert err <= 1e-3


def _body_until_dedent(completion: str) -> str:
    """Cut a completion at its first non-indented, non-empty line."""
    keep = []
    for line in completion.split("\n"):
        if line.strip() and not line[0].isspace():
            break
        keep.append(line)
    return "\n".join(keep)


def test_int4_greedy_fib_is_correct_and_matches_transformers(real_nanoqwen, tokenizer):
    backend = CPUBackend(real_nanoqwen, max_context=512)
    ids = tokenizer.encode(FIB_PROMPT)
    res = generate(backend, ids, max_new_tokens=96, stop_ids=frozenset(tokenizer.stop_ids))
    completion = tokenizer.decode(res.tokens)
    print("completion:\n" + completion)
    code = FIB_PROMPT + _body_until_dedent(completion)
    prog = code + "\nprint([fib(i) for i in range(11)])\n"
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert eval(r.stdout.strip()) == FIB_VALUES, r.stdout

    # transformers on the same INT4-dequantized weights: the same first 16 greedy tokens.
    hf = _hf_from_weights(backend.weights)
    want = _hf_greedy(hf, ids, 16)
    print("ours:", res.tokens[:16], "\nhf:  ", want)
    assert res.tokens[:16] == want
