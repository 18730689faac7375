"""kernels/attention_decode.cu (split-KV decode attention + combine) against
reference.attention_decode in float64 on the kernel's exact FP16 q, K and V.

KV lengths 1, 15, 16, 17, 255, 256, 257, 2048 and 3000; pages handed out from a shuffled free list;
every unwritten slot, page tail and spare page filled with NaN, and block-table entries past
the sequence pointing at an all-NaN page — so any read past seq_len shows as NaN. The grid is
sized three ways: for a 2048-token context (one page per warp at 2048), for a 32k context
(warps with no pages write neutral partials), and one block per KV head (many pages per warp).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref
from kernel_testing import TOL_ATTENTION, assert_same_bits, dev, graph_time_us, report  # noqa: F401

pytestmark = pytest.mark.gpu

MODELS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}
LENGTHS = [1, 15, 16, 17, 255, 256, 257, 2048, 3000]  # 3000: > 32 pages per warp in one_block
GRIDS = ["ctx2048", "ctx32k", "one_block"]
MAX_PAGES = 32768 // 16


def _blocks(grid: str, hkv: int, dh: int) -> int:
    from drvqwen.launchers.attention_decode import blocks_per_kv_head

    if grid == "ctx2048":
        return blocks_per_kv_head(hkv, 2048, dh)
    if grid == "ctx32k":
        return blocks_per_kv_head(hkv, 32768, dh)
    if grid == "ctx32k_1_per_sm":  # the previous choice, one block per SM: for the timing table
        from drvqwen.cuda import get_device

        return -(-get_device().info.sm_count // hkv)
    return 1


def _case(rng, hq, hkv, dh, seq_len):
    """q, caches [P, Hkv, 16, Dh] (NaN where unwritten), block table int32 [MAX_PAGES]."""
    n_pages = -(-seq_len // 16)
    n_phys = n_pages + 3
    free = rng.permutation(n_phys)                    # shuffled free list
    bt = np.full(MAX_PAGES, free[n_pages], dtype=np.int32)  # past the end: an all-NaN page
    bt[:n_pages] = free[:n_pages]
    k_cache = np.full((n_phys, hkv, 16, dh), np.nan, dtype=np.float16)
    v_cache = np.full_like(k_cache, np.nan)
    k = rng.standard_normal((seq_len, hkv, dh)).astype(np.float16)
    v = rng.standard_normal((seq_len, hkv, dh)).astype(np.float16)
    ref.write_pages(k_cache, bt, np.arange(seq_len), k)
    ref.write_pages(v_cache, bt, np.arange(seq_len), v)
    q = (2 * rng.standard_normal((hq, dh))).astype(np.float16)  # sharper than N(0,1) softmax
    return q, k_cache, v_cache, bt


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_attention_decode(dev, rng, model, grid):
    from drvqwen.launchers import AttentionDecode
    from drvqwen.launchers.attention_decode import partial_shapes

    hq, hkv, dh = MODELS[model]
    blocks = _blocks(grid, hkv, dh)
    shapes = partial_shapes(hq, dh, blocks)
    print(f"\n  {model} grid={grid}: {blocks} blocks per KV head, {blocks * 4} splits")
    for seq_len in LENGTHS:
        q, k_cache, v_cache, bt = _case(rng, hq, hkv, dh, seq_len)
        out = dev.poisoned(f"out{seq_len}", (hq, dh), np.float16)
        parts = {name: dev.poisoned(f"{name}{seq_len}", shape, np.float32) for name, shape in shapes.items()}
        state = dev.upload(f"state{seq_len}", np.array([seq_len - 1, 0, seq_len], dtype=np.int32))
        ln = AttentionDecode(out, dev.upload(f"q{seq_len}", q), dev.upload(f"k{seq_len}", k_cache),
                             dev.upload(f"v{seq_len}", v_cache), dev.upload(f"bt{seq_len}", bt), state,
                             tuple(parts.values()),
                             n_heads=hq, n_kv_heads=hkv, head_dim=dh, blocks_per_kv_head=blocks)
        ln.launch()
        got = out.download()
        want = ref.attention_decode(q.astype(np.float64), k_cache.astype(np.float64),
                                    v_cache.astype(np.float64), bt, seq_len)
        report(f"{model}.{grid}.len{seq_len}", got, want, TOL_ATTENTION)
        out.fill_bytes(0xFF)
        ln.launch()
        assert_same_bits(f"{model}.len{seq_len}", got, out.download())
        if seq_len == 2048:
            _time(f"{model}.{grid}", ln, seq_len)


def _time(label, ln, seq_len):
    us = graph_time_us(ln)
    kv = ln.bytes_for(seq_len)
    print(f"  {label} len {seq_len}: {us:.2f} µs/call (decode + combine), KV {kv / 1e6:.2f} MB, "
          f"{kv / us / 1e3:.0f} GB/s{' (L2-resident)' if kv < 40e6 else ''}")


def test_attention_decode_long_context(dev, rng):
    """7B at 32768 tokens (64 MiB of K/V per layer, more than L2): correctness and GB/s."""
    from drvqwen.launchers import AttentionDecode
    from drvqwen.launchers.attention_decode import partial_shapes

    hq, hkv, dh = MODELS["7b"]
    seq_len = 32768
    q, k_cache, v_cache, bt = _case(rng, hq, hkv, dh, seq_len)
    want = ref.attention_decode(q.astype(np.float64), k_cache.astype(np.float64),
                                v_cache.astype(np.float64), bt, seq_len)
    bufs = (dev.upload("q", q), dev.upload("k", k_cache), dev.upload("v", v_cache), dev.upload("bt", bt),
            dev.upload("state", np.array([seq_len - 1, 0, seq_len], np.int32)))
    for grid in ("ctx32k", "ctx32k_1_per_sm"):
        blocks = _blocks(grid, hkv, dh)
        out = dev.poisoned("out", (hq, dh), np.float16)
        parts = {n: dev.poisoned(n, sh, np.float32) for n, sh in partial_shapes(hq, dh, blocks).items()}
        ln = AttentionDecode(out, *bufs[:4], bufs[4], tuple(parts.values()),
                             n_heads=hq, n_kv_heads=hkv, head_dim=dh, blocks_per_kv_head=blocks)
        ln.launch()
        report(f"7b.{grid}.len32768", out.download(), want, TOL_ATTENTION)
        _time(f"7b.{grid} ({blocks} blocks/KV head)", ln, seq_len)


@pytest.mark.parametrize("model", list(MODELS))
def test_combine_bits_do_not_depend_on_its_dim_split(dev, rng, model):
    """attention_combine with a head's dims over 4, 8, 16 or 32 blocks (every output element written: the
    output poisoned first) gives, on the same partials, the bits of the combine as one 1024-thread
    block a head (attention_combine_tokens at T = 1) — the order of every sum is the same
    (attention_decode.cu, attention_combine_dims) — at lengths whose splits each thread adds in
    groups of 16, 8, 4, 2 and 1 (ctx32k grid: up to 264 active splits)."""
    from drvqwen.launchers import AttentionDecode, Launcher
    from drvqwen.launchers.attention_decode import COMBINE_SPLIT, combine_launch, partial_shapes

    hq, hkv, dh = MODELS[model]
    blocks = _blocks("ctx32k", hkv, dh)
    shapes = partial_shapes(hq, dh, blocks)
    for seq_len in (17, 700, 4100, 16000):
        q, k_cache, v_cache, bt = _case(rng, hq, hkv, dh, seq_len)
        parts = tuple(dev.poisoned(f"{n}{seq_len}", sh, np.float32) for n, sh in shapes.items())
        state = dev.upload(f"state{seq_len}", np.array([seq_len - 1, 0, seq_len], dtype=np.int32))
        out = dev.poisoned(f"out{seq_len}", (hq, dh), np.float16)
        AttentionDecode(out, dev.upload(f"q{seq_len}", q), dev.upload(f"k{seq_len}", k_cache),
                        dev.upload(f"v{seq_len}", v_cache), dev.upload(f"bt{seq_len}", bt), state, parts,
                        n_heads=hq, n_kv_heads=hkv, head_dim=dh, blocks_per_kv_head=blocks).launch()
        whole = Launcher()
        want = dev.poisoned(f"want{seq_len}", (hq, dh), np.float16)
        combine_launch(whole, want, parts, state, n_splits=blocks * 4, n_heads=hq, head_dim=dh, n_tokens=1)
        whole.launch()
        want_bits = want.download()
        assert not np.isnan(want_bits.astype(np.float32)).any()
        assert_same_bits(f"{model}.len{seq_len}.split{COMBINE_SPLIT}", want_bits, out.download())
        for split in (4, 8, 16, 32):
            ln = Launcher()
            got = dev.poisoned(f"got{seq_len}_{split}", (hq, dh), np.float16)
            combine_launch(ln, got, parts, state, n_splits=blocks * 4, n_heads=hq, head_dim=dh, dim_split=split)
            assert ln.specs[0].grid == (hq, split) and ln.specs[0].block == (1024 // split,)
            ln.launch()
            assert_same_bits(f"{model}.len{seq_len}.split{split}", want_bits, got.download())
