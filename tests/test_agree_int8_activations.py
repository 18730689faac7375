"""tools/agree_int8_activations.py on the CPU: its int8 block encoding (llama.cpp's Q8_1 rule)
and the reference's projection_inputs hook it runs through, which must reach the input of every
matrix product and nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from drvqwen import reference as ref

from helpers import TINY, random_dense

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import agree_int8_activations as tool  # noqa: E402


def test_int8_blocks_follow_the_q8_1_rule(rng):
    B = 32
    # Row scales keep every block's FP16 scale normal (≥ 2^-14), where its rounding is relative.
    x = rng.standard_normal((3, 4 * B)).astype(np.float32) * np.array([0.05, 1.0, 3e4])[:, None]
    x[1, B:2 * B] = 0.0                              # an all-zero block stays zero
    x[2, 5] = -1.5 * np.abs(x[2]).max()              # a block whose largest value is negative
    got = tool.int8_blocks(B)(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    blocks, want_blocks = got.reshape(3, 4, B), x.reshape(3, 4, B)
    assert not blocks[1, 1].any()
    for r in range(3):
        for b in range(4):
            xb, gb = want_blocks[r, b], blocks[r, b]
            if not xb.any():
                continue
            d = np.float32(np.float16(np.abs(xb).max() / 127.0))   # the block's FP16 scale
            q = gb / d                                 # integers, up to the product's rounding
            assert np.abs(q - np.rint(q)).max() <= 1e-4 and np.abs(np.rint(q)).max() <= 127
            assert np.abs(gb - xb).max() <= 0.5 * d * (1 + 1e-6) + np.abs(xb).max() * 2 ** -10
    # The negative maximum is the block's -127 (up to the scale's FP16 rounding).
    d = np.float32(np.float16(-x[2, 5] / 127.0))
    assert abs(blocks[2, 0, 5] / d + 127) < 1e-4
    with pytest.raises(ValueError, match="not a multiple of the block"):
        tool.int8_blocks(B)(np.zeros((1, B + 1), np.float32))


def test_projection_inputs_reach_every_matrix_product(rng):
    cfg = TINY
    w = ref.Weights.from_dense(cfg, random_dense(cfg, rng, std=0.05).__getitem__)
    ids = rng.integers(0, cfg.vocab_size, size=9).tolist()
    plain = ref.Model(w, max_tokens=16).forward(ids)

    seen = []

    def record(a):
        seen.append(a.shape)
        return a
    same = ref.Model(w, max_tokens=16, projection_inputs=record).forward(ids)
    assert np.array_equal(same, plain)                 # the identity hook changes no bit
    T, D, F, A = len(ids), cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    # Per layer: q/k/v's normed input, o_proj's attention output, gate/up's normed input,
    # down_proj's SwiGLU output; then the lm_head's normed input.
    assert seen == [(T, D), (T, A), (T, D), (T, F)] * cfg.num_layers + [(T, D)]

    zero_last = {"n": 0}

    def zero_lm_head_input(a):
        zero_last["n"] += 1
        return np.zeros_like(a) if zero_last["n"] == len(seen) else a
    logits = ref.Model(w, max_tokens=16, projection_inputs=zero_lm_head_input).forward(ids)
    assert not logits.any()                            # what the hook returns is what is multiplied

    coarse = ref.Model(w, max_tokens=16, projection_inputs=tool.int8_blocks(32)).forward(ids)
    assert not np.array_equal(coarse, plain)
    cos = (coarse * plain).sum(-1) / (np.linalg.norm(coarse, axis=-1) * np.linalg.norm(plain, axis=-1))
    assert cos.min() > 0.99                            # a perturbation, not another model


def test_only_at_encodes_one_products_inputs(rng):
    cfg = TINY
    w = ref.Weights.from_dense(cfg, random_dense(cfg, rng, std=0.05).__getitem__)
    ids = rng.integers(0, cfg.vocab_size, size=5).tolist()
    every = []                                         # every product's input, in call order

    def keep(a):
        every.append(a.copy())
        return a
    ref.Model(w, max_tokens=16, chunk=16, projection_inputs=keep).forward(ids)
    L = cfg.num_layers
    assert len(every) == 4 * L + 1
    for name in (*tool.LAYER_INPUTS, "lm_head"):
        got = []

        def mark(a, got=got):
            got.append(a.copy())
            return a
        m = ref.Model(w, max_tokens=16, chunk=16, projection_inputs=tool.only_at(name, L, mark))
        m.forward(ids)
        m.reset()
        m.forward(ids)                                 # a second pass: the count carries on
        at = [4 * L] if name == "lm_head" else [4 * i + tool.LAYER_INPUTS.index(name) for i in range(L)]
        want = [every[i] for i in at] * 2
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), name


def test_bad_block_sizes_are_one_line_errors(tmp_path, rng, monkeypatch, capsys):
    from helpers import byte_tokenizer_json, write_model

    path = tmp_path / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng), tokenizer_json=byte_tokenizer_json())
    for blocks, want in ((["32", "0"], "--blocks 0: a block must hold at least 1 input"),
                         (["32", "7"], f"--blocks 7: does not divide the model's input width {TINY.hidden_size}")):
        monkeypatch.setattr(sys, "argv", ["agree_int8_activations.py", "--model", str(path), "--blocks", *blocks])
        assert tool.main() == 2
        err = capsys.readouterr().err
        assert err == f"error: {want}\n"
