"""kernels/gemm_int4.cu: the prefill GEMMs against a float64 matmul on the dequantized weights.

Token counts M ∈ {1, 15, 16, 17, 100, 512} (one, partial and exact 8-token MMA columns, a
partial 128-token block, a full prompt chunk), an odd N (the last weight rows of a block past
N), K from one 128-input group to the 7B width. The activation rows past M are NaN: the kernel
may read them (each token is its own column of the MMA) but they must not reach any output row
< M; the output is poisoned (every element < M must be written, every element past M left alone).
Every test runs each build of the file — tiles of 64, 128 and 256 tokens (GEMM_BM), forced
with tile_tokens — beside the launchers' own choice where it differs. The weights go to the GPU in
the device layout (kernel_testing.upload_int4: q, k and v RoPE-paired by the head dim), the
reference works on the same words in layout id 1. (Speed: tools/bench_gemm.py.)
"""

import numpy as np
import pytest

from drvqwen import launchers
from drvqwen.prefill import ROW_BUCKET
from drvqwen import reference as ref

from kernel_testing import (TOL_GEMV, assert_same_bits, check_long_k_one_wave, dequant64, dev,  # noqa: F401
                            graph_time_us, random_int4, report, upload_int4)

pytestmark = pytest.mark.gpu


def _capacity(m: int) -> int:
    return -(-m // ROW_BUCKET) * ROW_BUCKET


def _x(rng, m, k):
    """FP16 activations [capacity, K], rows ≥ m NaN."""
    x = np.full((_capacity(m), k), np.nan, np.float16)
    x[:m] = rng.standard_normal((m, k)).astype(np.float16)
    return x


TILES = [64, 128, 256]


def _state(dev, m, start=0):
    return dev.upload("prefill_state", np.array([start, m], np.int32))


def _qkv_weights(dev, ws, hd: int) -> list:
    """[q qweight, q scales, k …, v …] on the device: the qweights in the device layout, their
    rows RoPE-paired by the head dim hd (as the QKV kernels read q, k and v)."""
    return [a for i, (qw, sc) in enumerate(ws) for a in (upload_int4(dev, f"w{i}.qw", qw, hd),
                                                        dev.upload(f"w{i}.sc", sc))]


@pytest.mark.parametrize("m,n,k", [(1, 333, 384), (15, 333, 128), (16, 200, 896), (17, 333, 384),
                                   (100, 1000, 1024), (512, 333, 3584)])
@pytest.mark.parametrize("max_blocks", [None, 0, 3])
@pytest.mark.parametrize("tile", TILES)
def test_gemm_f32(dev, rng, m, n, k, max_blocks, tile):
    qw, sc = random_int4(rng, n, k)
    x = _x(rng, m, k)
    rows = _capacity(m)
    out = dev.poisoned("out", (rows, n), np.float32)
    g = launchers.GemmInt4(out, dev.upload("x", x), upload_int4(dev, "qw", qw), dev.upload("sc", sc), _state(dev, m),
                   n=n, k=k, rows=rows, max_blocks=max_blocks, tile_tokens=tile)
    g.launch()
    got = out.download()
    want = x[:m].astype(np.float64) @ dequant64(qw, sc).T
    report(f"gemm_int4_f32 M={m} N={n} K={k} tile={tile}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all(), "rows past M were written"
    g.launch()
    assert_same_bits("gemm_int4_f32", got, out.download())


@pytest.mark.parametrize("m", [17, 100, 300])
@pytest.mark.parametrize("tile", TILES)
def test_gemm_qkv(dev, rng, m, tile):
    nq, nkv, k = 224, 32, 256           # 288 stacked rows: 3 blocks of 128, the last partial; a
                                        # block holds rows of all three matrices
    hd = 32                             # 7 q heads, 1 k/v head
    ws = [random_int4(rng, n, k) for n in (nq, nkv, nkv)]
    x = _x(rng, m, k)
    rows = _capacity(m)
    out = dev.poisoned("qkv", (rows, nq + 2 * nkv), np.float32)
    launchers.GemmInt4QkvRows(out, dev.upload("x", x), *_qkv_weights(dev, ws, hd), _state(dev, m), n_q=nq, n_kv=nkv,
                              k=k, rows=rows, head_dim=hd, tile_tokens=tile).launch()
    want = np.concatenate([x[:m].astype(np.float64) @ dequant64(*w).T for w in ws], axis=1)
    got = out.download()
    report(f"gemm_int4_qkv M={m}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all()


@pytest.mark.parametrize("m", [1, 100, 300])
@pytest.mark.parametrize("max_blocks", [None, 0, 3])
@pytest.mark.parametrize("tile", TILES)
def test_gemm_residual(dev, rng, m, max_blocks, tile):
    n, k = 333, 384
    qw, sc = random_int4(rng, n, k)
    x = _x(rng, m, k)
    rows = _capacity(m)
    r0 = np.full((rows, n), np.nan, np.float32)
    r0[:m] = (rng.standard_normal((m, n)) * 100).astype(np.float32)  # large residual values
    res = dev.upload("residual", r0)
    launchers.GemmInt4ResidualRows(res, dev.upload("x", x), upload_int4(dev, "qw", qw), dev.upload("sc", sc),
                                   _state(dev, m), n=n, k=k, rows=rows, max_blocks=max_blocks,
                                   tile_tokens=tile).launch()
    got = res.download()
    want = r0[:m].astype(np.float64) + x[:m].astype(np.float64) @ dequant64(qw, sc).T
    report(f"gemm_int4_residual M={m}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all()


@pytest.mark.parametrize("m", [16, 100, 300])
@pytest.mark.parametrize("tile", TILES)
def test_gemm_gate_up_swiglu(dev, rng, m, tile):
    f, k = 200, 256                     # 4 blocks of 64 features, the last partial
    (gq, gs), (uq, us) = random_int4(rng, f, k), random_int4(rng, f, k)
    x = _x(rng, m, k)
    rows = _capacity(m)
    h = dev.poisoned("h", (rows, f), np.float16)
    launchers.GemmInt4GateUpSwigluRows(h, dev.upload("x", x), upload_int4(dev, "gq", gq), dev.upload("gs", gs),
                                       upload_int4(dev, "uq", uq), dev.upload("us", us), _state(dev, m), f=f, k=k,
                                       rows=rows, tile_tokens=tile).launch()
    x64 = x[:m].astype(np.float64)
    want = ref.swiglu(x64 @ dequant64(gq, gs).T, x64 @ dequant64(uq, us).T)
    got = h.download()
    report(f"gemm_int4_gate_up_swiglu M={m}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:].astype(np.float32)).all()


# Stream-K ranges (kernels/gemm_split_k.cuh): each block takes a contiguous range of the (tile,
# group) work, a tile cut by ranges finished by the block holding its first group, which adds
# the other blocks' partials in block order. K = 3456 is 27 groups a tile, 3 row blocks: at M = 1
# 3 tiles (81 groups) — 2 blocks cut the middle tile, 5 give every tile two or three parts, the
# launcher's own P (None: up to the SMs) ranges of one or two groups and owners adding dozens of
# tails; M = 100 and 300 more tiles (two to six token blocks). The scratch's partials are
# poisoned (NaN): a block that read a slot no block of this launch wrote would show. Every launch
# must leave the counters at zero (the next one starts from them), give the same bits launched
# again (the sum's order does not depend on which block finishes first), and add a residual once
# (only the owner runs the epilogue).
SPLIT_CASES = [(m, blocks, tile) for m in (1, 100, 300) for blocks in (2, 5, None) for tile in TILES]


def _scratch(dev):
    """A scratch for any plan on up to 132 blocks (two 128 × 128 slots a block at 256 tokens)."""
    sk = launchers.gemm_int4.SplitKScratch(dev.array, 264, 132)
    sk.partials.fill_bytes(0xFF)
    return sk


def _split_checks(name, sk, launch, read, first):
    assert not sk.counters.download().any(), f"{name}: counters left non-zero"
    launch()
    assert_same_bits(f"{name} launched again", first, read())
    assert not sk.counters.download().any()


def _plan(g, blocks):
    """The launcher's plan: P as forced, ranges cutting tiles whenever P does not divide them."""
    t = g.tiling
    assert blocks is None or t.blocks == blocks
    return f"P={t.blocks}{' cut' if t.split else ''}"


@pytest.mark.parametrize("m,blocks,tile", SPLIT_CASES)
def test_gemm_split_k(dev, rng, m, blocks, tile):
    n, k = 333, 3456                    # 3 row blocks, the last partial
    qw, sc = random_int4(rng, n, k)
    x = _x(rng, m, k)
    rows = _capacity(m)
    x64 = x[:m].astype(np.float64)
    want = x64 @ dequant64(qw, sc).T
    xd, qd, sd, ps = dev.upload("x", x), upload_int4(dev, "qw", qw), dev.upload("sc", sc), _state(dev, m)
    sk = _scratch(dev)

    out = dev.poisoned("out", (rows, n), np.float32)
    g = launchers.GemmInt4(out, xd, qd, sd, ps, n=n, k=k, rows=rows, split_k=sk, blocks=blocks, tile_tokens=tile)
    tag = f"M={m} {_plan(g, blocks)} tile={tile}"
    g.launch()
    got = out.download()
    report(f"gemm_int4_f32 split {tag}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all(), "rows past M were written"
    _split_checks("gemm_int4_f32", sk, g.launch, out.download, got)
    # The same GEMM in whole tiles: equal up to the order of the FP32 sums (partial sums of
    # cancelling terms added, instead of one chain: ~3e-6 measured at M = 1).
    whole = dev.poisoned("whole", (rows, n), np.float32)
    launchers.GemmInt4(whole, xd, qd, sd, ps, n=n, k=k, rows=rows, tile_tokens=tile).launch()
    report(f"gemm_int4_f32 split vs whole {tag}", got[:m], whole.download()[:m].astype(np.float64), 2e-5)

    r0 = np.full((rows, n), np.nan, np.float32)
    r0[:m] = (rng.standard_normal((m, n)) * 100).astype(np.float32)
    res = dev.upload("residual", r0)
    launchers.GemmInt4ResidualRows(res, xd, qd, sd, ps, n=n, k=k, rows=rows, split_k=sk, blocks=blocks,
                                   tile_tokens=tile).launch()
    got = res.download()
    report(f"gemm_int4_residual split {tag}", got[:m], r0[:m].astype(np.float64) + want, TOL_GEMV)
    assert np.isnan(got[m:]).all()
    assert not sk.counters.download().any()


@pytest.mark.parametrize("m,blocks", [(17, 3), (300, None)])
@pytest.mark.parametrize("tile", TILES)
def test_gemm_qkv_and_gate_up_split_k(dev, rng, m, blocks, tile):
    nq, nkv, hd, f, k = 224, 32, 32, 200, 3456
    x = _x(rng, m, k)
    rows = _capacity(m)
    x64 = x[:m].astype(np.float64)
    xd, ps = dev.upload("x", x), _state(dev, m)

    ws = [random_int4(rng, n, k) for n in (nq, nkv, nkv)]
    sk = _scratch(dev)
    out = dev.poisoned("qkv", (rows, nq + 2 * nkv), np.float32)
    g = launchers.GemmInt4QkvRows(out, xd, *_qkv_weights(dev, ws, hd), ps, n_q=nq, n_kv=nkv, k=k, rows=rows,
                                  head_dim=hd, split_k=sk, blocks=blocks, tile_tokens=tile)
    tag = f"M={m} {_plan(g, blocks)} tile={tile}"
    g.launch()
    got = out.download()
    report(f"gemm_int4_qkv split {tag}", got[:m], np.concatenate([x64 @ dequant64(*w).T for w in ws], axis=1),
           TOL_GEMV)
    assert np.isnan(got[m:]).all()
    _split_checks("gemm_int4_qkv", sk, g.launch, out.download, got)

    (gq, gs), (uq, us) = random_int4(rng, f, k), random_int4(rng, f, k)
    h = dev.poisoned("h", (rows, f), np.float16)
    g = launchers.GemmInt4GateUpSwigluRows(h, xd, upload_int4(dev, "gq", gq), dev.upload("gs", gs),
                                           upload_int4(dev, "uq", uq), dev.upload("us", us), ps, f=f, k=k, rows=rows,
                                           split_k=sk, blocks=blocks, tile_tokens=tile)
    tag = f"M={m} {_plan(g, blocks)} tile={tile}"
    g.launch()
    got = h.download()
    report(f"gemm_int4_gate_up_swiglu split {tag}", got[:m],
           ref.swiglu(x64 @ dequant64(gq, gs).T, x64 @ dequant64(uq, us).T), TOL_GEMV)
    assert np.isnan(got[m:].astype(np.float32)).all()
    _split_checks("gemm_int4_gate_up_swiglu", sk, g.launch, h.download, got)


def test_gemm_split_k_chosen_where_tiles_are_few(dev, rng):
    """With a scratch the launcher spreads the 0.5B's down_proj shape at 512 tokens (28 tiles of
    38 groups at 128 tokens) over a grid of 132 (an H200's SMs) in stream-K ranges; without one,
    whole tiles on as many blocks as there are."""
    rows, n, k = 512, 896, 4864
    sk = _scratch(dev)
    x = dev.array("x", (rows, k), np.float16)
    res = dev.array("residual", (rows, n), np.float32)
    qw, sc = dev.array("qw", (n // 16, k // 128, 16, 16), np.uint32), dev.array("sc", (n, k // 128), np.float16)
    ps = _state(dev, rows)
    kw = dict(rows=rows, max_blocks=132)
    t = launchers.GemmInt4ResidualRows(res, x, qw, sc, ps, n=n, k=k, split_k=sk, **kw).tiling
    assert (t.tile_tokens, t.blocks, t.split) == (64, 132, True)
    t = launchers.GemmInt4ResidualRows(res, x, qw, sc, ps, n=n, k=k, **kw).tiling   # no scratch: whole tiles
    assert (t.tile_tokens, t.blocks, t.split) == (64, 56, False)


def test_gemm_residual_long_k_one_wave_of_whole_tiles(dev, rng):
    """The 7B's down_proj at a 1024-row chunk in INT4: one wave of 112 whole 256-token tiles under
    the launcher's plan, against the reference and the ranges' plan (check_long_k_one_wave)."""
    m, n, k = 1024, 3584, 18944
    qw, sc = random_int4(rng, n, k)
    x = _x(rng, m, k)
    xd, qd, sd, ps = dev.upload("x", x), upload_int4(dev, "qw", qw), dev.upload("sc", sc), _state(dev, m)
    check_long_k_one_wave(dev, "gemm_int4_residual", lambda res, **kw: launchers.GemmInt4ResidualRows(
        res, xd, qd, sd, ps, n=n, k=k, rows=m, max_blocks=132, **kw), x,
        (rng.standard_normal((m, n)) * 100).astype(np.float32), dequant64(qw, sc))


# (M, start, scratch, blocks, head_dim, Hq, Hkv): 576 pairs in 9 row blocks; 80 pairs in 2, the
# last partial (pairs past the end read and never written); positions near 30000; three token
# blocks; stream-K ranges cutting tiles (the launcher's P, or 3 blocks each running several units).
QKV_ROPE_CASES = [(100, 5, False, None, 64, 14, 2), (100, 5, True, None, 32, 3, 1), (1, 0, False, None, 128, 7, 1),
                  (300, 30000, False, None, 128, 7, 1), (17, 40, True, 3, 64, 14, 2)]


@pytest.mark.parametrize("m,start,split,blocks,hd,hq,hkv", QKV_ROPE_CASES,
                         ids=[f"m{c[0]}-start{c[1]}-" + ("split" if c[2] else "whole")
                              + ("" if c[3] is None else f"-blocks{c[3]}") + f"-hd{c[4]}-{c[5]}q{c[6]}kv"
                              for c in QKV_ROPE_CASES])
@pytest.mark.parametrize("tile", TILES)
def test_gemm_qkv_rope(dev, rng, m, start, split, blocks, hd, hq, hkv, tile):
    """gemm_int4_qkv_rope (rotating by rope_table_rows' cos and sin): q and the chunk's K/V cache
    slots against the float64 reference (x Wᵀ + bias, rotated), and bit for bit what
    gemm_int4_qkv + rope_kv_rows write from the same inputs (the path it replaces). The cache
    starts NaN, pages come from a shuffled table: only the chunk's slots may change; q's rows past
    M stay poisoned, and so do the table's."""
    from drvqwen.kv_cache import PAGE_TOKENS

    k = 384
    nq, nkv = hq * hd, hkv * hd
    rows = _capacity(m)
    x = _x(rng, m, k)
    ws = [random_int4(rng, n, k) for n in (nq, nkv, nkv)]
    biases = [(rng.standard_normal(n) * 0.1).astype(np.float16) for n in (nq, nkv, nkv)]
    inv_freq = ref.rope_inv_freq(hd, 1e6)
    n_pages = -(-(start + m) // PAGE_TOKENS) + 2
    block_table = rng.permutation(n_pages).astype(np.int32)
    xd, ps, bt = dev.upload("x", x), _state(dev, m, start), dev.upload("bt", block_table)
    wd = _qkv_weights(dev, ws, hd)
    bd = [dev.upload(f"b{i}", b) for i, b in enumerate(biases)]
    fd = dev.upload("inv_freq", inv_freq)
    rope_cs = dev.poisoned("rope_cs", (rows, hd // 2, 2), np.float32)
    launchers.RopeTableRows(rope_cs, fd, ps, rows=rows, head_dim=hd).launch()
    sk = _scratch(dev) if split else None
    heads = dict(n_heads=hq, n_kv_heads=hkv, head_dim=hd)

    def outputs(tag):
        return (dev.poisoned(f"q_{tag}", (rows, hq, hd), np.float16),
                dev.poisoned(f"k_{tag}", (n_pages, hkv, PAGE_TOKENS, hd), np.float16),
                dev.poisoned(f"v_{tag}", (n_pages, hkv, PAGE_TOKENS, hd), np.float16))

    fused = outputs("fused")
    g = launchers.GemmInt4QkvRopeRows(*fused, xd, *wd, *bd, rope_cs, ps, bt, k=k, rows=rows, split_k=sk,
                                      blocks=blocks, tile_tokens=tile, **heads)
    g.launch()
    got_q, got_k, got_v = (a.download() for a in fused)

    # The float64 reference.
    x64 = x[:m].astype(np.float64)
    pos = start + np.arange(m)
    cos, sin = (a.astype(np.float64) for a in ref.rope_cos_sin(pos, hd, 1e6))
    q, kk, v = ((x64 @ dequant64(*w).T + b.astype(np.float64)).reshape(m, -1, hd) for w, b in zip(ws, biases))
    tag = f"gemm_int4_qkv_rope M={m} start={start} {_plan(g, blocks)} hd={hd} tile={tile}"
    report(f"{tag} q", got_q[:m], ref.apply_rope(q, cos, sin), TOL_GEMV)
    assert np.isnan(got_q[m:].astype(np.float32)).all(), "q rows past M were written"
    table = rope_cs.download()
    assert np.isnan(table[m:]).all(), "rope_table_rows wrote rows past M"
    np.testing.assert_allclose(table[:m], np.stack([cos[:, :hd // 2], sin[:, :hd // 2]], axis=-1), atol=2e-6)
    report(f"{tag} k", ref.gather_pages(got_k, block_table, start + m)[start:], ref.apply_rope(kk, cos, sin), TOL_GEMV)
    report(f"{tag} v", ref.gather_pages(got_v, block_table, start + m)[start:], v, TOL_GEMV)
    written = np.zeros((n_pages, PAGE_TOKENS), bool)
    written[block_table[pos // PAGE_TOKENS], pos % PAGE_TOKENS] = True
    for c in (got_k, got_v):
        assert np.isnan(c.transpose(0, 2, 1, 3)[~written].astype(np.float32)).all(), "a slot outside the chunk changed"

    # The two-launch path on the same inputs: the same bits everywhere (written slots and poison).
    apart = outputs("apart")
    qkv = dev.poisoned("qkv", (rows, nq + 2 * nkv), np.float32)
    launchers.GemmInt4QkvRows(qkv, xd, *wd, ps, n_q=nq, n_kv=nkv, k=k, rows=rows, head_dim=hd, split_k=sk,
                              blocks=blocks, tile_tokens=tile).launch()
    launchers.RopeKvRows(*apart, qkv, *bd, fd, ps, bt, rows=rows, **heads).launch()
    for name, a, b in zip("qkv", (got_q, got_k, got_v), apart):
        assert_same_bits(f"{tag} {name} against gemm_int4_qkv + rope_kv_rows", a, b.download())
    if sk is not None:
        assert not sk.counters.download().any(), "split-K counters left non-zero"
    g.launch()
    assert_same_bits(f"{tag} launched again", got_k, fused[1].download())
