"""kernels/gemv_f16.cu's T-token lm_head and argmax.cu's argmax_final_tokens (the verify pass of
speculative decoding) against the single-token kernels, bit for bit, and against float64 numpy.

For T in {1, 3, 8, 9, 16} (9: the second MMA of a k step with one live column) the T-token lm_head runs once on x [T, D] and argmax_final_tokens once on
its partials [T, P]; the single-token lm_head and argmax_final run once per token on x[j]. Token
j's logits, part_val, part_idx and next token must have the single-token run's bits; every output
is poisoned with NaN (0xFF bytes) before each launch. The padded rows past text_vocab must be
−inf in both. Each token's logits are also checked against float64 numpy within TOL_LM_HEAD, and
its token must be np.argmax of its own logits. Shapes: the 0.5B's lm_head and odd ones (V not
a multiple of the 32 rows of a block, a text_vocab below V; D not a multiple of the 32 inputs of a
k step).

The CPU tests plan the launches without a GPU: the T-token launches have the single-token
launches' grid and block (lm_head) or one block per token (argmax_final).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.launchers import ArgmaxFinal, BufferSpec, LaunchError, LmHead, lm_head_partials
from kernel_testing import TOL_LM_HEAD, assert_bits_as_single_token, dev, report  # noqa: F401

TOKEN_COUNTS = [1, 3, 8, 9, 16]
# (label, V, D, text_vocab)
CASES = [("0.5b", 151936, 896, 151665), ("odd", 1000, 256, 990), ("odd_d", 4099, 200, 4090)]


@pytest.mark.gpu
@pytest.mark.parametrize("label,v,d,text_vocab", CASES, ids=[c[0] for c in CASES])
def test_lm_head_tokens(dev, rng, label, v, d, text_vocab):
    n_part = lm_head_partials(v)
    w16 = (0.02 * rng.standard_normal((v, d), dtype=np.float32)).astype(np.float16)
    x16 = rng.standard_normal((max(TOKEN_COUNTS), d), dtype=np.float32).astype(np.float16)
    weight = dev.upload("lm_head", w16)
    shape = dict(vocab_size=v, dim=d, text_vocab=text_vocab)

    # The single-token kernels, token by token.
    logits1, x1 = dev.array("logits1", (v,), np.float32), dev.array("x1", (d,), np.float16)
    pv1, pi1 = dev.array("part_val1", (n_part,), np.float32), dev.array("part_idx1", (n_part,), np.int32)
    tok1 = dev.array("next_token1", (1,), np.int32)
    head1, final1 = LmHead(logits1, pv1, pi1, x1, weight, **shape), ArgmaxFinal(tok1, pv1, pi1, n_partials=n_part)
    single = []
    for j in range(max(TOKEN_COUNTS)):
        x1.upload(x16[j])
        for b in (logits1, pv1, pi1, tok1):
            b.fill_bytes(0xFF)
        head1.launch()
        final1.launch()
        single.append([b.download() for b in (logits1, pv1, pi1, tok1)])

    w64 = w16.astype(np.float64)
    for t in TOKEN_COUNTS:
        logits = dev.poisoned("logits", (t, v), np.float32)
        pv, pi = dev.poisoned("part_val", (t, n_part), np.float32), dev.poisoned("part_idx", (t, n_part), np.int32)
        tok = dev.poisoned("next_token", (t,), np.int32)
        head = LmHead(logits, pv, pi, dev.upload("x", x16[:t]), weight, n_tokens=t, **shape)
        final = ArgmaxFinal(tok, pv, pi, n_partials=n_part, n_tokens=t)
        assert (head.specs[0].grid, head.specs[0].block) == (head1.specs[0].grid, head1.specs[0].block)
        head.launch()
        final.launch()
        got = [b.download() for b in (logits, pv, pi)] + [tok.download().reshape(t, 1)]
        for j in range(t):
            where = f"{label} T={t} token {j}"
            for name, g, s in zip(("logits", "part_val", "part_idx", "next_token"), got, single[j]):
                assert_bits_as_single_token(f"{where} {name}", g[j], s)
            lj = got[0][j]
            assert np.all(lj[text_vocab:] == -np.inf), where
            want = w64[:text_vocab] @ x16[j].astype(np.float64)
            report(where, lj[:text_vocab], want, TOL_LM_HEAD)
            assert int(got[3][j, 0]) == int(np.argmax(lj)), where


# ---- CPU: the launch plan -----------------------------------------------------------------------


def _plan(n_tokens: int | None, v: int = 1000, d: int = 256, x_tokens: int | None = None):
    t = n_tokens or 1
    n_part = lm_head_partials(v)
    pv, pi = BufferSpec("part_val", (t * n_part,), np.float32), BufferSpec("part_idx", (t * n_part,), np.int32)
    head = LmHead(BufferSpec("logits", (t * v,), np.float32), pv, pi,
                  BufferSpec("x", ((x_tokens or t) * d,), np.float16), BufferSpec("w", (v * d,), np.float16),
                  vocab_size=v, dim=d, n_tokens=n_tokens)
    final = ArgmaxFinal(BufferSpec("next_token", (t,), np.int32), pv, pi, n_partials=n_part, n_tokens=n_tokens)
    return head, final


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
def test_tokens_launch_is_the_single_token_launch(n_tokens):
    (head1, final1), (head, final) = _plan(None), _plan(n_tokens)
    a, b = head.specs[0], head1.specs[0]
    assert (a.kernel.kernel, b.kernel.kernel) == ("gemv_f16_lm_head_tokens", "gemv_f16_lm_head")
    assert (a.grid, a.block, a.smem_bytes) == (b.grid, b.block, b.smem_bytes)
    assert list(a.args) == [*b.args, "n_tokens"] and a.args["n_tokens"].value == n_tokens
    a, b = final.specs[0], final1.specs[0]
    assert (a.kernel.kernel, b.kernel.kernel) == ("argmax_final_tokens", "argmax_final")
    assert (a.grid, b.grid, a.block, list(a.args)) == ((n_tokens,), (1,), b.block, list(b.args))


@pytest.mark.parametrize("n_tokens", [0, 17])
def test_tokens_out_of_range_refused(n_tokens):
    with pytest.raises(LaunchError, match=f"n_tokens={n_tokens}"):
        _plan(n_tokens)


def test_tokens_buffers_sized_for_t():
    with pytest.raises(LaunchError, match=r"^x: expected"):
        _plan(3, x_tokens=1)


@pytest.mark.parametrize("v", [100, 4099, 151936, 152064])
def test_one_block_and_one_partial_per_32_rows(v):
    """The kernel's block is 32 rows (two 16-row MMA tiles): the grid and the partials the argmax
    reads are ceil(V/32), whatever D (here one that is not a multiple of a k step's 32 inputs)."""
    for t in (None, 9):
        head, final = _plan(t, v=v, d=200)
        assert lm_head_partials(v) == -(-v // 32) == head.n_partials
        assert head.specs[0].grid == (lm_head_partials(v),) and head.specs[0].block == (256,)
        assert final.specs[0].args["P"].value == lm_head_partials(v)


@pytest.mark.parametrize("d", [0, 12, 900])
def test_d_not_a_multiple_of_8_refused_in_one_line(d):
    with pytest.raises(LaunchError, match=rf"^lm_head: D={d} must be a positive multiple of 8$"):
        _plan(3, d=d)


def test_both_kernels_fit_two_blocks_per_sm():
    """One build serves every T ≤ 16 because the 16-token kernel, like the single-token one, stays
    within 128 registers: two blocks of 256 threads per SM (gemv_f16.cu, "Registers")."""
    from drvqwen.cuda.nvrtc import compile_kernel
    from drvqwen.launchers.gemv_f16 import THREADS

    ck = compile_kernel("gemv_f16")
    regs = {r.function: r.registers for r in ck.resources.values() if r.is_entry}
    assert set(regs) == {"gemv_f16_lm_head", "gemv_f16_lm_head_tokens"}, regs
    assert all(2 * THREADS * r <= 65536 for r in regs.values()), regs
