"""kernels/gemv_f16.cu: the lm_head GEMV with the fused first pass of the argmax.

lm_head against float64 numpy (within TOL_LM_HEAD: FP32 sums of exact products) at the real 7B
and 0.5B shapes and awkward ones: V not a multiple of the 32 rows of a block, D a multiple of 8
but not of the 32 inputs of a k step (the last step's chunks past D are zero), D = 8 (one k step:
three of the four K-split warps have none). The greedy token (argmax_final over the fused
partials) must be exactly np.argmax of the kernel's own logits (first occurrence on ties), also
for exact ties produced by identical lm_head rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_testing import TOL_LM_HEAD, assert_same_bits, dev, graph_time_us, report  # noqa: F401

pytestmark = pytest.mark.gpu

LM_CASES = [("7b", 152064, 3584), ("0.5b", 151936, 896), ("odd", 100, 128), ("odd_d", 4099, 200), ("d8", 77, 8)]


def _matvec64(w16: np.ndarray, x16: np.ndarray, rows: int = 8192) -> np.ndarray:
    x64 = x16.astype(np.float64)
    return np.concatenate([w16[r:r + rows].astype(np.float64) @ x64 for r in range(0, w16.shape[0], rows)])


def _lm_head(dev, w16, x16):
    from drvqwen.launchers import ArgmaxFinal, LmHead, lm_head_partials

    v, d = w16.shape
    n_part = lm_head_partials(v)
    logits = dev.poisoned("logits", (v,), np.float32)
    pv, pi = dev.poisoned("part_val", (n_part,), np.float32), dev.poisoned("part_idx", (n_part,), np.int32)
    token = dev.poisoned("next_token", (1,), np.int32)
    head = LmHead(logits, pv, pi, dev.upload("x", x16), dev.upload("lm_head", w16), vocab_size=v, dim=d)
    final = ArgmaxFinal(token, pv, pi, n_partials=n_part)
    head.launch()
    final.launch()
    return head, final, logits, token


@pytest.mark.parametrize("label,v,d", LM_CASES, ids=[c[0] for c in LM_CASES])
def test_lm_head_and_argmax(dev, rng, label, v, d):
    w16 = (0.02 * rng.standard_normal((v, d), dtype=np.float32)).astype(np.float16)
    x16 = rng.standard_normal(d, dtype=np.float32).astype(np.float16)
    head, final, logits, token = _lm_head(dev, w16, x16)
    got = logits.download()
    want = _matvec64(w16, x16)
    report(label, got, want, TOL_LM_HEAD)
    tok = int(token.download()[0])
    assert tok == int(np.argmax(got)), f"argmax {tok} != np.argmax of the kernel's logits {np.argmax(got)}"
    top2 = np.sort(want)[-2:]
    if top2[1] - top2[0] > 1e-4 * max(1.0, abs(top2[1])):
        assert tok == int(np.argmax(want))
    logits.fill_bytes(0xFF)
    head.launch()
    assert_same_bits(label, got, logits.download())
    if label == "7b":
        us = graph_time_us(head, reps=5)
        print(f"  lm_head 7b: {us:.1f} µs/call, {head.bytes_moved / us / 1e3:.0f} GB/s "
              f"({head.bytes_moved / 1e9:.3f} GB)")
        us = graph_time_us(final)
        print(f"  argmax_final over {head.n_partials} partials: {us:.2f} µs/call")


def test_lm_head_exact_ties(dev, rng):
    v, d = 4099, 256
    w16 = (0.02 * rng.standard_normal((v, d), dtype=np.float32)).astype(np.float16)
    x16 = rng.standard_normal(d, dtype=np.float32).astype(np.float16)
    winner = (np.sign(x16.astype(np.float32)) * 0.5).astype(np.float16)
    for rows in ([5, 77, 4000], [33, 34], [4098], [0, 4098]):
        w = w16.copy()
        w[rows] = winner  # identical rows → bit-identical logits in the kernel
        _, _, logits, token = _lm_head(dev, w, x16)
        got = logits.download()
        assert len(set(got[rows].tolist())) == 1, "identical rows must give identical logits"
        assert int(token.download()[0]) == min(rows), (rows, int(token.download()[0]))
        dev.close()


def test_lm_head_padded_rows_are_minus_inf(dev, rng):
    """Rows from text_vocab on (the padding past the tokenizer) come out −inf and never win the
    argmax, even when their dot products are the largest."""
    from drvqwen.launchers import ArgmaxFinal, LmHead, lm_head_partials
    from drvqwen.sampler import argmax as sampler_argmax

    v, d, text_vocab = 4099, 256, 4099 - 37
    w16 = (0.02 * rng.standard_normal((v, d), dtype=np.float32)).astype(np.float16)
    x16 = rng.standard_normal(d, dtype=np.float32).astype(np.float16)
    w16[text_vocab:] = (np.sign(x16.astype(np.float32)) * 0.5).astype(np.float16)   # the largest logits
    n_part = lm_head_partials(v)
    logits = dev.poisoned("logits", (v,), np.float32)
    pv, pi = dev.poisoned("part_val", (n_part,), np.float32), dev.poisoned("part_idx", (n_part,), np.int32)
    token = dev.poisoned("next_token", (1,), np.int32)
    LmHead(logits, pv, pi, dev.upload("x", x16), dev.upload("lm_head", w16), vocab_size=v, dim=d,
           text_vocab=text_vocab).launch()
    ArgmaxFinal(token, pv, pi, n_partials=n_part).launch()
    got = logits.download()
    assert np.isneginf(got[text_vocab:]).all()
    report("masked", got[:text_vocab], _matvec64(w16[:text_vocab], x16), TOL_LM_HEAD)
    tok = int(token.download()[0])
    assert tok == sampler_argmax(got) and tok < text_vocab
