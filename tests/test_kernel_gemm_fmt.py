"""kernels/gemm_fmt.cu and kernels/gemm_fmt_wgmma.cu (the prefill GEMMs over per-tensor weight
formats: mma.sync, and wgmma with a producer warpgroup dequantizing into shared memory) against
float64 numpy on the weights as format/weight_formats.py dequantizes them.

Every format, at a real 0.5B shape and at awkward ones (N not a multiple of the 64-row block, a
live row count M below the launch's capacity, a single token), for the three launchers: columns
of a wider output (q, k, v into qkv), the residual add, gate/up with SwiGLU. Outputs are
poisoned first; rows past M and columns outside [col0, col0 + N) must stay untouched (the wgmma
file takes K in multiples of 128 only: it runs the shapes that have it, and refuses the rest). The
tolerance is the decode GEMVs' (TOL_GEMV): the GEMM rounds each dequantized weight to FP16 once
(≤ 2^-11 of it), far below it over K ≥ 256 inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref
from drvqwen.format import weight_formats as wf
from drvqwen.launchers.gemv_fmt import DENSE_F16, codes_tile_major
from kernel_testing import TOL_GEMV, assert_same_bits, dev, random_fmt_weight, report  # noqa: F401

pytestmark = pytest.mark.gpu

# Every format of weight_formats.py, and a dense FP16 matrix (a GGUF's F16 projection kept as it
# is: the same kernels, WF_DENSE).
FORMATS = list(wf.FORMATS.values()) + [DENSE_F16]
# (label, rows capacity, live M, N, K)
SHAPES = [("0.5b.q_proj", 128, 100, 896, 896), ("odd.m1", 64, 1, 40, 256), ("odd.n200", 192, 130, 200, 1280),
          ("odd.k96", 64, 20, 40, 96)]  # K not a multiple of 64: the last step holds one chunk
IMPLS = ("mma", "wgmma")
# K = 96 for the mma kernel only, and only in the formats whose codes the GPU keeps row-major
# (8-bit, dense): 4–6-bit codes are tile-major in 128-input quads (codes_tile_major).
CASES = [(impl, fmt, *shape) for impl in IMPLS for fmt in FORMATS for shape in SHAPES
         if fmt.fits(shape[4]) and (shape[4] % 128 == 0 or (impl == "mma" and not codes_tile_major(fmt)))]


def launchers(impl: str):
    """(rows, residual, gate/up) launcher classes of one implementation."""
    if impl == "mma":
        from drvqwen.launchers.gemm_fmt import GemmFmtGateUpSwigluRows, GemmFmtResidualRows, GemmFmtRows
        return GemmFmtRows, GemmFmtResidualRows, GemmFmtGateUpSwigluRows
    from drvqwen.launchers.gemm_fmt_wgmma import GemmFmtwGateUpSwigluRows, GemmFmtwResidualRows, GemmFmtwRows
    return GemmFmtwRows, GemmFmtwResidualRows, GemmFmtwGateUpSwigluRows


@pytest.mark.parametrize("impl,fmt,label,rows,m,n,k", CASES, ids=[f"{c[0]}-{c[1].name}-{c[2]}" for c in CASES])
def test_gemm_fmt_rows_and_residual(dev, rng, impl, fmt, label, rows, m, n, k):
    GemmFmtRows, GemmFmtResidualRows, _ = launchers(impl)

    w, w64 = random_fmt_weight(dev, rng, fmt, n, k)
    x = rng.standard_normal((rows, k)).astype(np.float16)
    want = x[:m].astype(np.float64) @ w64.T                    # [m, n]
    xd, ps = dev.upload("x", x), dev.upload("prefill_state", np.array([7, m], np.int32))
    ldo, col0 = n + 24, 16                                     # a column window of a wider buffer
    out = dev.poisoned("out", (rows, ldo), np.float32)
    ln = GemmFmtRows(out, xd, w, ps, n=n, k=k, rows=rows, ldo=ldo, col0=col0)
    ln.launch()
    got = out.download()
    report(f"{fmt.name}.{label}.rows", got[:m, col0:col0 + n], want, TOL_GEMV)
    untouched = np.ones(got.shape, dtype=bool)
    untouched[:m, col0:col0 + n] = False
    assert np.isnan(got[untouched]).all(), "the GEMM wrote outside its rows < M and its columns"
    out.fill_bytes(0xFF)
    ln.launch()
    assert_same_bits(label, got[:m, col0:col0 + n], out.download()[:m, col0:col0 + n])

    r0 = rng.standard_normal((rows, n)).astype(np.float32)
    res = dev.upload("residual", r0)
    GemmFmtResidualRows(res, xd, w, ps, n=n, k=k, rows=rows).launch()
    got = res.download()
    report(f"{fmt.name}.{label}.delta", got[:m].astype(np.float64) - r0[:m], want, TOL_GEMV)
    assert got[m:].tobytes() == r0[m:].tobytes(), "rows past M changed"


GATE_UP = [(impl, *g) for impl in IMPLS for g in (
    ("0.5b.q5_g32", 128, 77, 4864, 896, "q5_g32"), ("odd.q4_k", 64, 3, 200, 512, "q4_k"),
    ("odd.q6_k", 64, 64, 72, 256, "q6_k"), ("odd.m300.int4_g128", 384, 300, 136, 384, "int4_g128"))]


@pytest.mark.parametrize("impl,label,rows,m,f,k,fname", GATE_UP, ids=[f"{g[0]}-{g[1]}" for g in GATE_UP])
def test_gemm_fmt_gate_up_swiglu(dev, rng, impl, label, rows, m, f, k, fname):
    GemmFmtGateUpSwigluRows = launchers(impl)[2]

    fmt = {x.name: x for x in FORMATS}[fname]
    (g, g64), (u, u64) = (random_fmt_weight(dev, rng, fmt, f, k, name) for name in ("gate", "up"))
    x = rng.standard_normal((rows, k)).astype(np.float16)
    x64 = x[:m].astype(np.float64)
    want = ref.swiglu(x64 @ g64.T, x64 @ u64.T)
    h = dev.poisoned("h", (rows, f), np.float16)
    GemmFmtGateUpSwigluRows(h, dev.upload("x", x), g, u, dev.upload("ps", np.array([0, m], np.int32)), f=f, k=k,
                            rows=rows).launch()
    got = h.download()
    report(label, got[:m], want, TOL_GEMV)
    assert (got[m:].view(np.uint16) == 0xFFFF).all(), "rows past M were written"


def test_gemm_fmt_wgmma_refuses_k_off_its_stage(dev, rng):
    """K = 96 (gemm_fmt.cu takes it) is not a multiple of the wgmma file's 128-input stage."""
    from drvqwen.launchers.base import LaunchError
    from drvqwen.launchers.gemm_fmt_wgmma import GemmFmtwResidualRows

    w, _ = random_fmt_weight(dev, rng, wf.Q8_G32, 40, 96)
    x = dev.upload("x", rng.standard_normal((64, 96)).astype(np.float16))
    res = dev.upload("residual", np.zeros((64, 40), np.float32))
    with pytest.raises(LaunchError, match="K=96"):
        GemmFmtwResidualRows(res, x, w, dev.upload("ps", np.array([0, 64], np.int32)), n=40, k=96, rows=64)


# gemm_fmt_wgmma.cu's persistent path: fewer blocks than tiles, so a block runs several tiles
# with its stage ring and barrier parities carried across tile boundaries (K/128 = 10 or 7
# groups: not a multiple of the 3 stages, a tile starts mid-ring) and the producer's loads run
# one stage ahead into the next tile; 4 blocks over 6 tiles give blocks different tile counts;
# max_blocks=0 is one block per tile. The cases above have fewer tiles than SMs (one tile each).
PERSISTENT = [(fname, k, blocks) for fname, k in (("q5_k", 1280), ("q8_g32", 896)) for blocks in (1, 4, 0)]


def _multi_tile_case(dev, rng, fname: str, k: int):
    """The persistent and split-K cases: 300 rows of which m = 260 live × n = 200 outputs over
    K = k — 3 token blocks × 2 row blocks (gate/up: × 4 of 64 features) — with W and U in format
    `fname`: (rows, m, n, w, u on the device, x and prefill_state on the device, x64 of the live
    rows, want = x64 Wᵀ, U in float64)."""
    fmt = {x.name: x for x in FORMATS}[fname]
    rows, m, n = 300, 260, 200
    (w, w64), (u, u64) = (random_fmt_weight(dev, rng, fmt, n, k, name) for name in ("W", "U"))
    x = rng.standard_normal((rows, k)).astype(np.float16)
    x64 = x[:m].astype(np.float64)
    xd, ps = dev.upload("x", x), dev.upload("prefill_state", np.array([0, m], np.int32))
    return rows, m, n, w, u, xd, ps, x64, x64 @ w64.T, u64


@pytest.mark.parametrize("fname,k,max_blocks", PERSISTENT, ids=[f"{p[0]}-k{p[1]}-blocks{p[2]}" for p in PERSISTENT])
def test_gemm_fmt_wgmma_persistent(dev, rng, fname, k, max_blocks):
    GemmFmtRows, GemmFmtResidualRows, GemmFmtGateUpSwigluRows = launchers("wgmma")
    rows, m, n, w, u, xd, ps, x64, want, u64 = _multi_tile_case(dev, rng, fname, k)
    tag = f"{fname}.k{k}.blocks{max_blocks}"

    out = dev.poisoned("out", (rows, n), np.float32)
    GemmFmtRows(out, xd, w, ps, n=n, k=k, rows=rows, ldo=n, max_blocks=max_blocks).launch()
    got = out.download()
    report(f"{tag}.rows", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all(), "rows past M were written"

    r0 = rng.standard_normal((rows, n)).astype(np.float32)
    res = dev.upload("residual", r0)
    GemmFmtResidualRows(res, xd, w, ps, n=n, k=k, rows=rows, max_blocks=max_blocks).launch()
    got = res.download()
    report(f"{tag}.delta", got[:m].astype(np.float64) - r0[:m], want, TOL_GEMV)
    assert got[m:].tobytes() == r0[m:].tobytes(), "rows past M changed"

    h = dev.poisoned("h", (rows, n), np.float16)
    GemmFmtGateUpSwigluRows(h, xd, w, u, ps, f=n, k=k, rows=rows, max_blocks=max_blocks).launch()
    got = h.download()
    report(f"{tag}.gate_up", got[:m], ref.swiglu(want, x64 @ u64.T), TOL_GEMV)
    assert (got[m:].view(np.uint16) == 0xFFFF).all(), "rows past M were written"


# Stream-K ranges on the format GEMMs (kernels/gemm_split_k.cuh, as gemm_int4.cu): 6 tiles (12
# for gate/up) of 10 groups (K = 1280) or 7 (K = 896) on P blocks: P = 1 runs every tile whole
# in one block; P = 4 and 7 cut tiles between two blocks (a range shorter than a tile: a block
# holding only the middle of one); the launcher's own P (None: up to the SMs) gives each tile's
# owner several tails to add. The producer walks the block's units with their uneven group
# counts, one stage ahead across units. The partials are poisoned; the counters must be zero
# after each launch; a second launch gives the same bits; the residual is added once.
SPLIT = [(fname, k, blocks) for fname, k in (("q5_k", 1280), ("q8_g32", 896)) for blocks in (1, 4, 7, None)]


@pytest.mark.parametrize("fname,k,blocks", SPLIT, ids=[f"{p[0]}-k{p[1]}-blocks{p[2]}" for p in SPLIT])
def test_gemm_fmt_wgmma_split_k(dev, rng, fname, k, blocks):
    from drvqwen.launchers.gemm_int4 import SplitKScratch

    GemmFmtRows, GemmFmtResidualRows, GemmFmtGateUpSwigluRows = launchers("wgmma")
    rows, m, n, w, u, xd, ps, x64, want, u64 = _multi_tile_case(dev, rng, fname, k)
    sk = SplitKScratch(dev.array, 132, 132)
    sk.partials.fill_bytes(0xFF)
    kw = dict(rows=rows, split_k=sk, blocks=blocks)
    tag = f"{fname}.k{k}.blocks{blocks}"

    def twice(launcher, read):
        assert blocks is None or launcher.tiling.blocks == blocks
        launcher.launch()
        first = read()
        assert not sk.counters.download().any(), "counters left non-zero"
        launcher.launch()
        assert_same_bits(f"{tag} launched again", first, read())
        return first

    out = dev.poisoned("out", (rows, n), np.float32)
    got = twice(GemmFmtRows(out, xd, w, ps, n=n, k=k, ldo=n, **kw), out.download)
    report(f"{tag}.rows", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all(), "rows past M were written"

    r0 = rng.standard_normal((rows, n)).astype(np.float32)
    res = dev.upload("residual", r0)
    GemmFmtResidualRows(res, xd, w, ps, n=n, k=k, **kw).launch()
    got = res.download()
    report(f"{tag}.delta", got[:m].astype(np.float64) - r0[:m], want, TOL_GEMV)
    assert got[m:].tobytes() == r0[m:].tobytes(), "rows past M changed"
    assert not sk.counters.download().any()

    h = dev.poisoned("h", (rows, n), np.float16)
    got = twice(GemmFmtGateUpSwigluRows(h, xd, w, u, ps, f=n, k=k, **kw), h.download)
    report(f"{tag}.gate_up", got[:m], ref.swiglu(want, x64 @ u64.T), TOL_GEMV)
    assert (got[m:].view(np.uint16) == 0xFFFF).all(), "rows past M were written"
