"""kernels/attention_decode.cu's T-token decode attention (the verify pass of speculative
decoding) against the single-token kernels, bit for bit, and against float64 numpy.

A chunk of T tokens at positions seq_len − 1 … seq_len + T − 2 has all its K/V in the paged cache
(as gemv_int4_qkv_rope_tokens leaves it); token j must see exactly the first seq_len + j keys.
For T in {1, 3, 8, 16} and first lengths that put the chunk at the context's start (1), across a
page boundary (14: lengths 14 … 29) and at a page start (17: token 0 at position 16), and a long
one across page 128 (2041), the T-token kernels run once and the single-token kernels once per
token with state[2] = seq_len + j, in the same grid, on the same cache (pages from a shuffled free
list, every unwritten slot and spare page NaN, block-table entries past the chunk at an all-NaN
page). Token j's output and its partials (partial_out, max_logits, exp_sums) must have the
single-token run's bits; every output and partial buffer is poisoned with NaN before each launch
(the splits past the last page leave the same poison in both). Each token's output is also
checked against reference.attention (causal, float64 on the kernel's FP16 inputs) within
TOL_ATTENTION, as tests/test_kernel_attention_decode.py. Grids: the launcher's for a 2048-token
context and one block per KV head (many pages per split).

The CPU tests plan the launches without a GPU: a T-token launch has the single-token launch's
grid per token, block and shared memory (the same NS, so the same split rule).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref
from drvqwen.launchers import AttentionDecode, BufferSpec, LaunchError
from drvqwen.launchers.attention_decode import (COMBINE_SPLIT, COMBINE_THREADS, WARPS, pages_per_split,
                                              partial_shapes)
from kernel_testing import TOL_ATTENTION, assert_bits_as_single_token, dev, report  # noqa: F401

MODELS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}
TOKEN_COUNTS = [1, 3, 8, 16]
FIRST_LENGTHS = [1, 14, 17, 2041]
GRIDS = ["ctx2048", "one_block"]
MAX_PAGES = 32768 // 16


def _case(rng, hq, hkv, dh, n_positions, n_tokens):
    """q [T, Hq, Dh], caches [P, Hkv, 16, Dh] holding positions 0 … n_positions − 1 (NaN
    elsewhere), block table int32 [MAX_PAGES] over shuffled pages."""
    n_pages = -(-n_positions // 16)
    n_phys = n_pages + 3
    free = rng.permutation(n_phys)
    bt = np.full(MAX_PAGES, free[n_pages], dtype=np.int32)  # past the chunk: an all-NaN page
    bt[:n_pages] = free[:n_pages]
    k_cache = np.full((n_phys, hkv, 16, dh), np.nan, dtype=np.float16)
    v_cache = np.full_like(k_cache, np.nan)
    for cache in (k_cache, v_cache):
        ref.write_pages(cache, bt, np.arange(n_positions), rng.standard_normal((n_positions, hkv, dh)).astype(np.float16))
    q = (2 * rng.standard_normal((n_tokens, hq, dh))).astype(np.float16)  # sharper than N(0,1) softmax
    return q, k_cache, v_cache, bt


def _check(dev, rng, model: str, blocks: int, n_tokens: int, seq_len: int) -> None:
    """T-token kernels vs the single-token ones per token (bits) and vs the reference."""
    hq, hkv, dh = MODELS[model]
    n_positions = seq_len + n_tokens - 1
    q, k_cache, v_cache, bt = _case(rng, hq, hkv, dh, n_positions, n_tokens)
    cache = dict(k_cache=dev.upload("k", k_cache), v_cache=dev.upload("v", v_cache), block_table=dev.upload("bt", bt))
    shape = dict(n_heads=hq, n_kv_heads=hkv, head_dim=dh, blocks_per_kv_head=blocks)
    where = f"{model} blocks={blocks} T={n_tokens} seq_len={seq_len}"

    # The single-token kernels, token j at position seq_len − 1 + j over seq_len + j keys.
    out1 = dev.array("out1", (hq, dh), np.float16)
    parts1 = tuple(dev.array(f"{n}1", sh, np.float32) for n, sh in partial_shapes(hq, dh, blocks).items())
    q1, state1 = dev.array("q1", (hq, dh), np.float16), dev.array("state1", (3,), np.int32)
    one = AttentionDecode(out1, q1, state=state1, partials=parts1, **cache, **shape)
    single = []
    for j in range(n_tokens):
        q1.upload(q[j])
        state1.upload(np.array([seq_len - 1 + j, 0, seq_len + j], np.int32))
        for b in (out1, *parts1):
            b.fill_bytes(0xFF)
        one.launch()
        single.append([b.download() for b in (out1, *parts1)])

    # The T-token kernels over the same cache.
    out = dev.poisoned("out", (n_tokens, hq, dh), np.float16)
    parts = tuple(dev.poisoned(n, sh, np.float32)
                  for n, sh in partial_shapes(hq, dh, blocks, n_tokens=n_tokens).items())
    state = dev.upload("state", np.array([seq_len - 1, 0, seq_len], np.int32))
    ln = AttentionDecode(out, dev.upload("q", q), state=state, partials=parts, n_tokens=n_tokens, **cache, **shape)
    # The splits on the single-token grid (its warps share out the (token, split) pairs); the
    # combine as one block of COMBINE_THREADS a (head, token), where the single-token combine
    # spreads a head's dims over dim_split blocks (the same sums in the same order: the same bits,
    # checked below).
    (split_t, comb_t), (split_1, comb_1) = ln.specs, one.specs
    assert (split_t.grid, split_t.block) == (split_1.grid, split_1.block), where
    assert (comb_t.grid, comb_t.block) == ((hq, n_tokens), (COMBINE_THREADS,)), where
    assert (comb_1.grid, comb_1.block) == ((hq, COMBINE_SPLIT), (COMBINE_THREADS // COMBINE_SPLIT,)), where
    ln.launch()
    got = [b.download() for b in (out, *parts)]

    k64 = ref.gather_pages(k_cache, bt, n_positions).astype(np.float64)
    v64 = ref.gather_pages(v_cache, bt, n_positions).astype(np.float64)
    want = ref.attention(q.astype(np.float64), k64, v64, seq_len - 1 + np.arange(n_tokens))
    ns = blocks * WARPS                           # splits per KV head
    for j in range(n_tokens):
        # The splits that hold pages of token j (the combine's count): the single-token kernel's
        # bits. The others are not run for T tokens (no partial of theirs is read), so they keep
        # the poison; the single-token kernel writes its neutral partial there.
        n_pages = -(-(seq_len + j) // 16)
        pps = pages_per_split(n_pages, ns)
        active = -(-n_pages // pps)
        assert_bits_as_single_token(f"{where} token {j} out", got[0][j], single[j][0])
        for name, g, s in zip(("partial_out", "max_logits", "exp_sums"), got[1:], single[j][1:]):
            assert_bits_as_single_token(f"{where} token {j} {name}", g[j][:active], s[:active])
            idle = g[j][active:].view(np.uint32)
            assert (idle == 0xFFFFFFFF).all(), f"{where} token {j} {name}: a split without pages written"
        report(f"{where} token {j}", got[0][j], want[j], TOL_ATTENTION)


@pytest.mark.gpu
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_attention_decode_tokens(dev, rng, model, grid):
    from drvqwen.launchers.attention_decode import blocks_per_kv_head

    hq, hkv, dh = MODELS[model]
    blocks = blocks_per_kv_head(hkv, 2048, dh) if grid == "ctx2048" else 1
    for n_tokens in TOKEN_COUNTS:
        for seq_len in FIRST_LENGTHS:
            _check(dev, rng, model, blocks, n_tokens, seq_len)


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
def test_attention_decode_tokens_small(dev, rng, model):
    """A chunk of 5 across a page boundary (lengths 45 … 49: 3 pages, then 4) on one block per
    KV head: 4 warps share out 16 (token, split) pairs, several each and across tokens
    (tools/sanitize_nodes.txt)."""
    _check(dev, rng, model, 1, 5, 45)


# ---- CPU: the launch plan -----------------------------------------------------------------------


def _plan(model: str, n_tokens: int | None, blocks: int = 66, q_tokens: int | None = None) -> AttentionDecode:
    hq, hkv, dh = MODELS[model]
    t = n_tokens or 1
    qt = t if q_tokens is None else q_tokens
    parts = tuple(BufferSpec(n, sh, np.float32)
                  for n, sh in partial_shapes(hq, dh, blocks, n_tokens=n_tokens).items())
    return AttentionDecode(BufferSpec("out", (t * hq * dh,), np.float16), BufferSpec("q", (qt * hq * dh,), np.float16),
                           BufferSpec("k", (8, hkv, 16, dh), np.float16), BufferSpec("v", (8, hkv, 16, dh), np.float16),
                           BufferSpec("bt", (8,), np.int32), BufferSpec("state", (3,), np.int32), parts,
                           n_heads=hq, n_kv_heads=hkv, head_dim=dh, blocks_per_kv_head=blocks, n_tokens=n_tokens)


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("model", list(MODELS))
def test_tokens_launch_is_the_single_token_launch_per_token(model, n_tokens):
    one, ln = _plan(model, None), _plan(model, n_tokens)
    dh = MODELS[model][2]
    assert [s.kernel.kernel for s in one.specs] == [f"attention_decode_hd{dh}", "attention_combine"]
    assert [s.kernel.kernel for s in ln.specs] == [f"attention_decode_tokens_hd{dh}", "attention_combine_tokens"]
    # The splits: the single-token grid (its warps share out the (token, split) pairs), plus the
    # token count; the combine: one whole head a block per token, where the single-token one
    # splits a head's dims over COMBINE_SPLIT blocks — each (dim, j) adds the same splits in the
    # same order either way (attention_decode.cu), so each token's output has the same bits.
    (split_t, comb_t), (split_1, comb_1) = ln.specs, one.specs
    assert split_t.grid == split_1.grid and (split_t.block, split_t.smem_bytes) == (split_1.block, split_1.smem_bytes)
    assert comb_1.grid == (MODELS[model][0], COMBINE_SPLIT) and comb_t.grid == (MODELS[model][0], n_tokens)
    assert comb_1.block == (COMBINE_THREADS // COMBINE_SPLIT,) and comb_t.block == (COMBINE_THREADS,)
    assert comb_t.smem_bytes == comb_1.smem_bytes
    assert list(split_t.args) == [*split_1.args, "n_tokens"] and split_t.args["n_tokens"].value == n_tokens
    assert list(comb_t.args) == list(comb_1.args)
    assert ln.n_splits == one.n_splits
    assert ln.bytes_for(100) == sum(one.bytes_for(100 + j) for j in range(n_tokens))


@pytest.mark.parametrize("n_tokens", [0, 17])
def test_tokens_out_of_range_refused(n_tokens):
    with pytest.raises(LaunchError, match=f"n_tokens={n_tokens}"):
        _plan("0.5b", n_tokens)


def test_tokens_buffers_sized_for_t():
    with pytest.raises(LaunchError, match=r"^q: expected"):
        _plan("7b", 3, q_tokens=1)
