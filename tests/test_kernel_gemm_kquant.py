"""kernels/gemm_int4.cu's K-quant kernels (launchers/gemm_kquant.py: Q4_K, Q5_K and Q6_K codes unpacked
in the consumers' A registers with each sub-block's scale, and the offset of Q4_K and Q5_K) against
float64 numpy on the weights as format/weight_formats.py dequantizes them.

Shapes: N not a multiple of the 128-row block (rows past it read, never stored), a live row
count M below the launch's capacity, a single token, K of one super-block and of several; all
three tile builds (64, 128, 256 tokens: Q6_K's 256 with its two-stage ring), whole tiles and
stream-K ranges that cut tiles. Outputs poisoned first; rows past M and columns outside
[col0, col0 + N) must stay untouched; a second launch gives the same bits. The tolerance is the GEMMs' (TOL_GEMV): S = d·sc and O = dmin·m are rounded to
FP16 before the fma (Q6_K: S before the product), where gemm_fmt_wgmma.cu rounds the FP32 weight
once. Q6_K's weights have negative scales too (random_fmt_weight: int8 sc in [−64, 63]) and codes
over all 6 bits; Q5_K's codes run over all 5 (the high-bit plane uniform).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.format import weight_formats as wf
from drvqwen.launchers.gemm_int4 import SplitKScratch, split_k_need
from drvqwen.launchers.gemm_int4 import SPLIT_UNIT_FLOATS, unit_floats
from drvqwen.launchers.gemm_kquant import (GemmQ4kGateUpSwigluRows, GemmQ4kQkvRopeRows, GemmQ4kResidualRows,
                                           GemmQ4kStackedRows, GemmQ5kGateUpSwigluRows, GemmQ5kQkvRopeRows,
                                           GemmQ5kResidualRows, GemmQ5kStackedRows, GemmQ6kResidualRows, GemmQ6kRows)
from kernel_testing import (TOL_GEMV, assert_same_bits, check_long_k_one_wave, check_qkv_rope_gemm, dev,  # noqa: F401
                            random_fmt_weight, report)

pytestmark = pytest.mark.gpu

Q4K = next(f for f in wf.FORMATS.values() if f.name == "q4_k")
Q5K = next(f for f in wf.FORMATS.values() if f.name == "q5_k")
Q6K = next(f for f in wf.FORMATS.values() if f.name == "q6_k")
# (label, rows capacity, live M, N0, N1, K, tile, split): N1 > 0 stacks a second matrix (q | k)
CASES = [("qk.straddle", 128, 100, 200, 72, 1280, 128, False), ("one.m1", 64, 1, 40, 0, 256, 64, False),
         ("qk.split", 192, 130, 384, 128, 1024, 128, True), ("one.tile64.split", 128, 77, 300, 0, 2048, 64, True),
         ("qk.tile256", 256, 230, 256, 64, 1024, 256, False), ("one.tile256.split", 512, 300, 200, 0, 2048, 256, True)]


def _scratch(dev, rows: int, n: int, k: int, tile: int, grid: int | None = None) -> SplitKScratch:
    units, tiles = split_k_need(rows, -(-n // 128), k, grid, tile_tokens=tile)
    return SplitKScratch(dev.array, max(units, 1), max(tiles, 1))


@pytest.mark.parametrize("label,rows,m,n0,n1,k,tile,split", CASES, ids=[c[0] for c in CASES])
def test_gemm_q4k_stacked_and_residual(dev, rng, label, rows, m, n0, n1, k, tile, split):
    check_stacked_and_residual(dev, rng, Q4K, GemmQ4kStackedRows, GemmQ4kResidualRows, label, rows, m, n0, n1, k,
                               tile, split)


@pytest.mark.parametrize("label,rows,m,n0,n1,k,tile,split", CASES, ids=[c[0] for c in CASES])
def test_gemm_q5k_stacked_and_residual(dev, rng, label, rows, m, n0, n1, k, tile, split):
    check_stacked_and_residual(dev, rng, Q5K, GemmQ5kStackedRows, GemmQ5kResidualRows, label, rows, m, n0, n1, k,
                               tile, split)


def check_stacked_and_residual(dev, rng, fmt, Stacked, Residual, label, rows, m, n0, n1, k, tile, split):
    """One or two stacked matrices in `fmt` into their columns of out, then the first as a residual
    GEMM, against the float64 reference (the CASES)."""
    ns = [n0] + ([n1] if n1 else [])
    ws, w64s = zip(*(random_fmt_weight(dev, rng, fmt, n, k) for n in ns))
    x = rng.standard_normal((rows, k)).astype(np.float16)
    w64 = np.concatenate(w64s)
    want = x[:m].astype(np.float64) @ w64.T                              # [m, ΣN]
    xd, ps = dev.upload("x", x), dev.upload("prefill_state", np.array([5, m], np.int32))
    n, col0 = sum(ns), 16
    ldo = n + 24
    out = dev.poisoned("out", (rows, ldo), np.float32)
    sk = _scratch(dev, rows, n, k, tile) if split else None
    ln = Stacked(out, xd, list(ws), ps, ns=ns, k=k, rows=rows, ldo=ldo, col0=col0, tile_tokens=tile, split_k=sk)
    assert ln.tiling.tile_tokens == tile and ln.tiling.split == split, "the case should plan as its label says"
    ln.launch()
    got = out.download()
    report(f"{fmt.name}.{label}.stacked", got[:m, col0:col0 + n], want, TOL_GEMV)
    untouched = np.ones(got.shape, dtype=bool)
    untouched[:m, col0:col0 + n] = False
    assert np.isnan(got[untouched]).all(), "the GEMM wrote outside its rows < M and its columns"
    out.fill_bytes(0xFF)
    ln.launch()
    assert_same_bits(label, got[:m, col0:col0 + n], out.download()[:m, col0:col0 + n])
    if sk is not None:
        assert not sk.counters.download().any(), "a split-K counter was left non-zero"

    r0 = rng.standard_normal((rows, n0)).astype(np.float32)
    res = dev.upload("residual", r0)
    Residual(res, xd, ws[0], ps, n=n0, k=k, rows=rows, tile_tokens=tile, split_k=sk).launch()
    got = res.download()
    report(f"{fmt.name}.{label}.delta", got[:m].astype(np.float64) - r0[:m], want[:, :n0], TOL_GEMV)
    assert got[m:].tobytes() == r0[m:].tobytes(), "rows past M changed"


@pytest.mark.parametrize("tile", [64, 128, 256])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_gemm_q4k_gate_up_swiglu(dev, rng, tile, split):
    check_gate_up(dev, rng, Q4K, GemmQ4kGateUpSwigluRows, tile, split)


@pytest.mark.parametrize("tile", [64, 128, 256])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_gemm_q5k_gate_up_swiglu(dev, rng, tile, split):
    check_gate_up(dev, rng, Q5K, GemmQ5kGateUpSwigluRows, tile, split)


def check_gate_up(dev, rng, fmt, GateUp, tile, split):
    """h = silu(x Wgᵀ) ⊙ (x Wuᵀ) rounded to FP16, F = 200 (not a multiple of the 64-feature block)."""
    rows, m, f, k = max(128, tile), 90, 200, 1536
    (wg, g64), (wu, u64) = random_fmt_weight(dev, rng, fmt, f, k), random_fmt_weight(dev, rng, fmt, f, k)
    x = rng.standard_normal((rows, k)).astype(np.float16)
    gate, up = x[:m].astype(np.float64) @ g64.T, x[:m].astype(np.float64) @ u64.T
    want = gate / (1 + np.exp(-gate)) * up
    h = dev.poisoned("h", (rows, f), np.float16)
    sk = _scratch(dev, rows, 2 * f, k, tile) if split else None
    GateUp(h, dev.upload("x", x), wg, wu, dev.upload("ps", np.array([0, m], np.int32)), f=f, k=k, rows=rows,
           tile_tokens=tile, split_k=sk).launch()
    got = h.download()
    report(f"{fmt.name}.gate_up.tile{tile}", got[:m].astype(np.float64), want, TOL_GEMV)
    assert np.isnan(got[m:].astype(np.float32)).all(), "rows past M were written"


def test_gemm_q4k_refuses_other_formats_and_k(dev, rng):
    """A weight in another format, or K off the 256-input super-block, is refused naming it."""
    from drvqwen.launchers.base import LaunchError

    q6k = next(f for f in wf.FORMATS.values() if f.name == "q6_k")
    w6, _ = random_fmt_weight(dev, rng, q6k, 128, 256, name="model.layers.0.mlp.down_proj")
    xd, ps = dev.upload("x", np.zeros((64, 256), np.float16)), dev.upload("ps", np.array([0, 1], np.int32))
    res = dev.array("res", (64 * 128,), np.float32)
    with pytest.raises(LaunchError, match="down_proj: format q6_k"):
        GemmQ4kResidualRows(res, xd, w6, ps, n=128, k=256, rows=64, max_blocks=132)
    w4, _ = random_fmt_weight(dev, rng, Q4K, 128, 256)
    with pytest.raises(LaunchError, match="K=128"):
        GemmQ4kResidualRows(res, dev.upload("x2", np.zeros((64, 128), np.float16)), w4, ps, n=128, k=128, rows=64,
                            max_blocks=132)
    # Q4_K on the Q5_K kernels and Q5_K on the Q4_K ones: the same codes plane, not the same format.
    with pytest.raises(LaunchError, match="format q4_k, these kernels read q5_k only"):
        GemmQ5kResidualRows(res, xd, w4, ps, n=128, k=256, rows=64, max_blocks=132)
    w5, _ = random_fmt_weight(dev, rng, Q5K, 128, 256)
    with pytest.raises(LaunchError, match="format q5_k, these kernels read q4_k only"):
        GemmQ4kResidualRows(res, xd, w5, ps, n=128, k=256, rows=64, max_blocks=132)


# (label, rows capacity, live M, N, K, tile, split)
Q6K_CASES = [("straddle", 128, 100, 200, 1280, 128, False), ("m1", 64, 1, 40, 256, 64, False),
             ("split", 192, 130, 384, 1024, 128, True), ("tile64.split", 128, 77, 300, 2048, 64, True),
             ("tile256", 256, 230, 200, 1280, 256, False), ("tile256.split", 512, 300, 384, 2048, 256, True)]


@pytest.mark.parametrize("label,rows,m,n,k,tile,split", Q6K_CASES, ids=[c[0] for c in Q6K_CASES])
def test_gemm_q6k_rows_and_residual(dev, rng, label, rows, m, n, k, tile, split):
    w, w64 = random_fmt_weight(dev, rng, Q6K, n, k)
    x = rng.standard_normal((rows, k)).astype(np.float16)
    want = x[:m].astype(np.float64) @ w64.T                              # [m, N]
    xd, ps = dev.upload("x", x), dev.upload("prefill_state", np.array([5, m], np.int32))
    col0, ldo = 16, n + 24
    out = dev.poisoned("out", (rows, ldo), np.float32)
    sk = _scratch(dev, rows, n, k, tile) if split else None
    ln = GemmQ6kRows(out, xd, w, ps, n=n, k=k, rows=rows, ldo=ldo, col0=col0, tile_tokens=tile, split_k=sk)
    assert ln.tiling.tile_tokens == tile and ln.tiling.split == split, "the case should plan as its label says"
    ln.launch()
    got = out.download()
    report(f"q6k.{label}.rows", got[:m, col0:col0 + n], want, TOL_GEMV)
    untouched = np.ones(got.shape, dtype=bool)
    untouched[:m, col0:col0 + n] = False
    assert np.isnan(got[untouched]).all(), "the GEMM wrote outside its rows < M and its columns"
    out.fill_bytes(0xFF)
    ln.launch()
    assert_same_bits(label, got[:m, col0:col0 + n], out.download()[:m, col0:col0 + n])
    if sk is not None:
        assert not sk.counters.download().any(), "a split-K counter was left non-zero"

    r0 = rng.standard_normal((rows, n)).astype(np.float32)
    res = dev.upload("residual", r0)
    GemmQ6kResidualRows(res, xd, w, ps, n=n, k=k, rows=rows, tile_tokens=tile, split_k=sk).launch()
    got = res.download()
    report(f"q6k.{label}.delta", got[:m].astype(np.float64) - r0[:m], want, TOL_GEMV)
    assert got[m:].tobytes() == r0[m:].tobytes(), "rows past M changed"


def test_gemm_q6k_refuses_other_formats(dev, rng):
    """A q4_k weight on the Q6_K kernels is refused naming it."""
    from drvqwen.launchers.base import LaunchError

    w4, _ = random_fmt_weight(dev, rng, Q4K, 128, 256, name="model.layers.0.self_attn.v_proj")
    xd, ps = dev.upload("x", np.zeros((64, 256), np.float16)), dev.upload("ps", np.array([0, 1], np.int32))
    with pytest.raises(LaunchError, match="v_proj: format q4_k, these kernels read q6_k only"):
        GemmQ6kRows(dev.array("out", (64 * 128,), np.float32), xd, w4, ps, n=128, k=256, rows=64, ldo=128,
                    max_blocks=132)


# (M, start, split, head_dim, Hq, Hkv, tile): pairs past the last block's end (14q2kv at 64: 576
# pairs, 9 blocks); one token; positions near 30 000 with stream-K ranges (4 blocks for the 27
# tiles, each range cutting some); the 256-token build.
QKV_ROPE_CASES = [(100, 5, False, 64, 14, 2, 128), (1, 0, False, 128, 7, 1, 64), (300, 30000, True, 128, 7, 1, 128),
                  (230, 40, False, 64, 14, 2, 256)]


@pytest.mark.parametrize("m,start,split,hd,hq,hkv,tile", QKV_ROPE_CASES,
                         ids=[f"m{c[0]}-start{c[1]}-{'split' if c[2] else 'whole'}-hd{c[3]}-{c[4]}q{c[5]}kv-{c[6]}"
                              for c in QKV_ROPE_CASES])
def test_gemm_q4k_qkv_rope(dev, rng, m, start, split, hd, hq, hkv, tile):
    """gemm_q4k_qkv_rope against the float64 reference and, with whole tiles, bit for bit against
    the stacked Q4_K GEMMs + rope_kv_rows (kernel_testing.check_qkv_rope_gemm)."""
    check_kmin_qkv_rope(dev, rng, Q4K, GemmQ4kQkvRopeRows, GemmQ4kStackedRows, m, start, split, hd, hq, hkv, tile)


@pytest.mark.parametrize("m,start,split,hd,hq,hkv,tile", QKV_ROPE_CASES,
                         ids=[f"m{c[0]}-start{c[1]}-{'split' if c[2] else 'whole'}-hd{c[3]}-{c[4]}q{c[5]}kv-{c[6]}"
                              for c in QKV_ROPE_CASES])
def test_gemm_q5k_qkv_rope(dev, rng, m, start, split, hd, hq, hkv, tile):
    """gemm_q5k_qkv_rope, as test_gemm_q4k_qkv_rope."""
    check_kmin_qkv_rope(dev, rng, Q5K, GemmQ5kQkvRopeRows, GemmQ5kStackedRows, m, start, split, hd, hq, hkv, tile)


def check_kmin_qkv_rope(dev, rng, fmt, QkvRope, Stacked, m, start, split, hd, hq, hkv, tile):
    def apart(qkv, xd, ws, ns, ps, ld, tile):  # q | k, then v: the stacked kernel takes two at most
        rows = qkv.shape[0]
        Stacked(qkv, xd, ws[:2], ps, ns=ns[:2], k=512, rows=rows, ldo=ld, tile_tokens=tile).launch()
        Stacked(qkv, xd, ws[2:], ps, ns=ns[2:], k=512, rows=rows, ldo=ld, col0=sum(ns[:2]), tile_tokens=tile).launch()

    check_qkv_rope_gemm(dev, rng, fmt, QkvRope, apart, m, start, split, hd, hq, hkv, tile,
                        lambda rows, n, k, tile: _scratch(dev, rows, n, k, tile, grid=4))


# The mixed-format QKV (q, k in Q4_K or Q5_K, v in Q6_K) splits its grid in two parts by their
# tiles; its split case runs on 16 blocks, v's part 2 of them (launchers/gemm_kquant.py:
# v_part_blocks), so that both parts' ranges cut tiles (M = 300, 128-token tiles, K = 512: q and k
# 24 tiles of 4 groups on 14 blocks, v 3 tiles on 2). Its cases: QKV_ROPE_CASES, and whole tiles in
# three token blocks with v's pairs in a partial row block (Hq = 3, Hkv = 1, Dh = 64: q and k 128
# pairs, v 32).
MIXED_SPLIT_BLOCKS = 16
MIXED_CASES = QKV_ROPE_CASES + [(300, 5, False, 64, 3, 1, 128)]


@pytest.mark.parametrize("fmt,QkvRope,Stacked", [(Q4K, GemmQ4kQkvRopeRows, GemmQ4kStackedRows),
                                                 (Q5K, GemmQ5kQkvRopeRows, GemmQ5kStackedRows)],
                         ids=["q4_k", "q5_k"])
@pytest.mark.parametrize("m,start,split,hd,hq,hkv,tile", MIXED_CASES,
                         ids=[f"m{c[0]}-start{c[1]}-{'split' if c[2] else 'whole'}-hd{c[3]}-{c[4]}q{c[5]}kv-{c[6]}"
                              for c in MIXED_CASES])
def test_gemm_kquant_q6k_qkv_rope(dev, rng, fmt, QkvRope, Stacked, m, start, split, hd, hq, hkv, tile):
    """gemm_q4k_q6k_qkv_rope / gemm_q5k_q6k_qkv_rope (q and k in the K-quant, v in Q6_K, one launch
    in two parts) against the float64 reference and, with whole tiles, bit for bit against the
    stacked q | k GEMM + gemm_q6k_rows + rope_kv_rows; the split case's parts both cut tiles."""
    def apart(qkv, xd, ws, ns, ps, ld, tile):
        rows = qkv.shape[0]
        Stacked(qkv, xd, ws[:2], ps, ns=ns[:2], k=512, rows=rows, ldo=ld, tile_tokens=tile).launch()
        GemmQ6kRows(qkv, xd, ws[2], ps, n=ns[2], k=512, rows=rows, ldo=ld, col0=sum(ns[:2]), tile_tokens=tile).launch()

    def scratch(rows, n, k, tile):
        units = -(-MIXED_SPLIT_BLOCKS * unit_floats(tile) // SPLIT_UNIT_FLOATS)
        return SplitKScratch(dev.array, units, MIXED_SPLIT_BLOCKS)

    g = check_qkv_rope_gemm(dev, rng, fmt, QkvRope, apart, m, start, split, hd, hq, hkv, tile, scratch, fmt_v=Q6K,
                            split_blocks=MIXED_SPLIT_BLOCKS)
    if split:
        assert (g.tiling.blocks, g.v_blocks) == (MIXED_SPLIT_BLOCKS, 2), "the case should split as its comment says"


@pytest.mark.parametrize("fmt,Residual", [(Q4K, GemmQ4kResidualRows), (Q5K, GemmQ5kResidualRows),
                                          (Q6K, GemmQ6kResidualRows)], ids=["q4_k", "q5_k", "q6_k"])
def test_gemm_kquant_residual_long_k_one_wave_of_whole_tiles(dev, rng, fmt, Residual):
    """The 7B's down_proj at a 1024-row chunk as the prefill runs it in llama.cpp's K-quant
    layouts: one wave of 112 whole 256-token tiles under the launcher's plan (Q6_K's 256-token
    ring has two stages), against the reference and the ranges' plan (check_long_k_one_wave)."""
    m, n, k = 1024, 3584, 18944
    w, w64 = random_fmt_weight(dev, rng, fmt, n, k)
    x = rng.standard_normal((m, k)).astype(np.float16)
    xd, ps = dev.upload("x", x), dev.upload("prefill_state", np.array([0, m], np.int32))
    check_long_k_one_wave(dev, f"{fmt.name}.residual", lambda res, **kw: Residual(
        res, xd, w, ps, n=n, k=k, rows=m, max_blocks=132, **kw), x,
        (rng.standard_normal((m, n)) * 100).astype(np.float32), w64)
