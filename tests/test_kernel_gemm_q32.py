"""kernels/gemm_int4.cu's kernels for the GGUF's 32-input block formats (launchers/gemm_q32.py:
Q4_0's codes, Q5_0's with their high bits, Q8_0's bytes, unpacked in the consumers' A registers, each
32-input chunk times its FP16 scale) against float64 numpy on the weights as
format/weight_formats.py dequantizes them.

Shapes: N not a multiple of the 128-row block (rows past it read, never stored), stacks of one,
two and three matrices whose boundaries fall inside a warp's 16 rows, a live row count M below
the launch's capacity, a single token, K of one 128-input group and of the 0.5B's 896; all three
tile builds (64, 128 and 256 tokens: Q8_0's with its two-stage ring), whole tiles and stream-K
ranges that cut tiles. Outputs poisoned first; rows past M and columns outside [col0, col0 + N) must stay
untouched; a second launch gives the same bits. The tolerance is the GEMMs' (TOL_GEMV): each
weight is the reference's FP32 value rounded once to FP16 (mul.rn.f16x2 of the exact c − z and
the FP16 scale), the sums FP32 on the tensor cores.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.format import weight_formats as wf
from drvqwen.launchers.gemm_int4 import SplitKScratch, split_k_need
from drvqwen.launchers.gemm_q32 import (GemmQ32GateUpSwigluRows, GemmQ32QkvRopeRows, GemmQ32ResidualRows,
                                        GemmQ32StackedRows)
from kernel_testing import (TOL_GEMV, assert_same_bits, check_qkv_rope_gemm, dev, random_fmt_weight,  # noqa: F401
                            report)

pytestmark = pytest.mark.gpu

FMT = {name: next(f for f in wf.FORMATS.values() if f.name == name)
       for name in ("q4_g32", "q5_g32", "q8_g32", "q4_g32_min", "q5_g32_min")}
# (label, rows capacity, live M, row counts of the stacked matrices, K, tile, split)
CASES = [("qkv.straddle", 128, 100, (200, 40, 40), 896, 128, False), ("one.m1", 64, 1, (40,), 128, 64, False),
         ("qk.split", 192, 130, (384, 72), 1024, 128, True), ("one.tile64.split", 128, 77, (300,), 2048, 64, True),
         ("qkv.tile256", 256, 230, (256, 64, 64), 896, 256, False),
         ("qk.tile256.split", 512, 300, (200, 24), 1280, 256, True)]
FMT_CASES = [(f, *c) for f in FMT for c in CASES]


def _scratch(dev, rows: int, n: int, k: int, tile: int) -> SplitKScratch:
    units, tiles = split_k_need(rows, -(-n // 128), k, None, tile_tokens=tile)
    return SplitKScratch(dev.array, max(units, 1), max(tiles, 1))


@pytest.mark.parametrize("fmt,label,rows,m,ns,k,tile,split", FMT_CASES, ids=[f"{c[0]}-{c[1]}" for c in FMT_CASES])
def test_gemm_q32_stacked_and_residual(dev, rng, fmt, label, rows, m, ns, k, tile, split):
    ws, w64s = zip(*(random_fmt_weight(dev, rng, FMT[fmt], n, k, name=f"w{i}") for i, n in enumerate(ns)))
    x = rng.standard_normal((rows, k)).astype(np.float16)
    want = x[:m].astype(np.float64) @ np.concatenate(w64s).T            # [m, ΣN]
    xd, ps = dev.upload("x", x), dev.upload("prefill_state", np.array([5, m], np.int32))
    n, col0 = sum(ns), 16
    ldo = n + 24
    out = dev.poisoned("out", (rows, ldo), np.float32)
    sk = _scratch(dev, rows, n, k, tile) if split else None
    ln = GemmQ32StackedRows(out, xd, list(ws), ps, ns=list(ns), k=k, rows=rows, ldo=ldo, col0=col0,
                            tile_tokens=tile, split_k=sk)
    assert ln.tiling.tile_tokens == tile and ln.tiling.split == split, "the case should plan as its label says"
    ln.launch()
    got = out.download()
    report(f"{fmt}.{label}.stacked", got[:m, col0:col0 + n], want, TOL_GEMV)
    untouched = np.ones(got.shape, dtype=bool)
    untouched[:m, col0:col0 + n] = False
    assert np.isnan(got[untouched]).all(), "the GEMM wrote outside its rows < M and its columns"
    out.fill_bytes(0xFF)
    ln.launch()
    assert_same_bits(label, got[:m, col0:col0 + n], out.download()[:m, col0:col0 + n])
    if sk is not None:
        assert not sk.counters.download().any(), "a split-K counter was left non-zero"

    r0 = rng.standard_normal((rows, ns[0])).astype(np.float32)
    res = dev.upload("residual", r0)
    GemmQ32ResidualRows(res, xd, ws[0], ps, n=ns[0], k=k, rows=rows, tile_tokens=tile, split_k=sk).launch()
    got = res.download()
    report(f"{fmt}.{label}.delta", got[:m].astype(np.float64) - r0[:m], want[:, :ns[0]], TOL_GEMV)
    assert got[m:].tobytes() == r0[m:].tobytes(), "rows past M changed"


GATE_UP = [(f, tile, split) for f in FMT for tile in (64, 128, 256) for split in (False, True)]


@pytest.mark.parametrize("fmt,tile,split", GATE_UP,
                         ids=[f"{f}-{'split' if s else 'whole'}-{t}" for f, t, s in GATE_UP])
def test_gemm_q32_gate_up_swiglu(dev, rng, fmt, tile, split):
    """h = silu(x Wgᵀ) ⊙ (x Wuᵀ) rounded to FP16, F = 200 (not a multiple of the 64-feature block),
    K = 896 (the 0.5B's hidden size: 7 groups)."""
    rows, m, f, k = max(128, tile), 90, 200, 896
    (wg, g64), (wu, u64) = (random_fmt_weight(dev, rng, FMT[fmt], f, k, nm) for nm in ("g", "u"))
    x = rng.standard_normal((rows, k)).astype(np.float16)
    gate, up = x[:m].astype(np.float64) @ g64.T, x[:m].astype(np.float64) @ u64.T
    want = gate / (1 + np.exp(-gate)) * up
    h = dev.poisoned("h", (rows, f), np.float16)
    sk = _scratch(dev, rows, 2 * f, k, tile) if split else None
    GemmQ32GateUpSwigluRows(h, dev.upload("x", x), wg, wu, dev.upload("ps", np.array([0, m], np.int32)), f=f, k=k,
                            rows=rows, tile_tokens=tile, split_k=sk).launch()
    got = h.download()
    report(f"{fmt}.gate_up.tile{tile}", got[:m].astype(np.float64), want, TOL_GEMV)
    assert np.isnan(got[m:].astype(np.float32)).all(), "rows past M were written"


# (format, M, start, split, head_dim, Hq, Hkv, tile): pairs past the last block's end (14q2kv at 64);
# one token; positions near 30 000 with stream-K ranges; the 256-token build (Q8_0's on two stages).
QKV_ROPE = [("q4_g32", 100, 5, False, 64, 14, 2, 128), ("q5_g32", 1, 0, False, 128, 7, 1, 64),
            ("q8_g32", 300, 30000, True, 128, 7, 1, 128), ("q5_g32", 230, 40, False, 64, 14, 2, 256),
            ("q8_g32", 100, 5, False, 64, 14, 2, 256), ("q4_g32", 300, 30000, True, 128, 7, 1, 256),
            ("q4_g32_min", 100, 5, False, 64, 14, 2, 128), ("q5_g32_min", 300, 30000, True, 128, 7, 1, 256),
            ("q5_g32_min", 230, 40, False, 64, 14, 2, 64)]


@pytest.mark.parametrize("fmt,m,start,split,hd,hq,hkv,tile", QKV_ROPE,
                         ids=[f"{c[0]}-m{c[1]}-start{c[2]}-{'split' if c[3] else 'whole'}-hd{c[4]}-{c[7]}"
                              for c in QKV_ROPE])
def test_gemm_q32_qkv_rope(dev, rng, fmt, m, start, split, hd, hq, hkv, tile):
    """gemm_q4g32_qkv_rope, gemm_q5g32_qkv_rope, gemm_q8g32_qkv_rope and the Q4_1 / Q5_1 ones against the float64 reference
    and, with whole tiles, bit for bit against the stacked GEMM of the same format (q, k, v in one
    launch) + rope_kv_rows (kernel_testing.check_qkv_rope_gemm)."""
    def apart(qkv, xd, ws, ns, ps, ld, tile):
        GemmQ32StackedRows(qkv, xd, ws, ps, ns=ns, k=512, rows=qkv.shape[0], ldo=ld, tile_tokens=tile).launch()

    def scratch(rows, n, k, tile):
        units, tiles = split_k_need(rows, -(-n // 128), k, 4, tile_tokens=tile)
        return SplitKScratch(dev.array, max(units, 1), max(tiles, 1))

    check_qkv_rope_gemm(dev, rng, FMT[fmt], GemmQ32QkvRopeRows, apart, m, start, split, hd, hq, hkv, tile, scratch)
