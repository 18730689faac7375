"""kernels/gemm_int4.cu: the prefill GEMMs against a float64 matmul on the dequantized weights.

Token counts M ∈ {1, 15, 16, 17, 100, 512} (one, partial and exact 8-token MMA columns, a
partial 128-token block, a full prompt chunk), an odd N (the last weight rows of a block past
N), K from one 128-input group to the 7B width. The activation rows past M are NaN: the kernel
may read them (each token is its own column of the MMA) but they must not reach any output row
< M; the output is poisoned (every element < M must be written, every element past M left alone).
(Speed: tools/bench_gemm.py.)
"""

import numpy as np
import pytest

from drvqwen import launchers
from drvqwen.prefill import ROW_BUCKET
from drvqwen import reference as ref

from kernel_testing import TOL_GEMV, assert_same_bits, dequant64, dev, graph_time_us, random_int4, report  # noqa: F401

pytestmark = pytest.mark.gpu


def _capacity(m: int) -> int:
    return -(-m // ROW_BUCKET) * ROW_BUCKET


def _x(rng, m, k):
    """FP16 activations [capacity, K], rows ≥ m NaN."""
    x = np.full((_capacity(m), k), np.nan, np.float16)
    x[:m] = rng.standard_normal((m, k)).astype(np.float16)
    return x


def _state(dev, m, start=0):
    return dev.upload("prefill_state", np.array([start, m], np.int32))


@pytest.mark.parametrize("m,n,k", [(1, 333, 384), (15, 333, 128), (16, 200, 896), (17, 333, 384),
                                   (100, 1000, 1024), (512, 333, 3584)])
@pytest.mark.parametrize("max_blocks", [None, 0, 3])
def test_gemm_f32(dev, rng, m, n, k, max_blocks):
    qw, sc = random_int4(rng, n, k)
    x = _x(rng, m, k)
    rows = _capacity(m)
    out = dev.poisoned("out", (rows, n), np.float32)
    g = launchers.GemmInt4(out, dev.upload("x", x), dev.upload("qw", qw), dev.upload("sc", sc), _state(dev, m),
                   n=n, k=k, rows=rows, max_blocks=max_blocks)
    g.launch()
    got = out.download()
    want = x[:m].astype(np.float64) @ dequant64(qw, sc).T
    report(f"gemm_int4_f32 M={m} N={n} K={k}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all(), "rows past M were written"
    g.launch()
    assert_same_bits("gemm_int4_f32", got, out.download())


@pytest.mark.parametrize("m", [17, 100, 300])
def test_gemm_qkv(dev, rng, m):
    nq, nkv, k = 224, 32, 256           # 288 stacked rows: 3 blocks of 128, the last partial; a
                                        # block holds rows of all three matrices
    ws = [random_int4(rng, n, k) for n in (nq, nkv, nkv)]
    x = _x(rng, m, k)
    rows = _capacity(m)
    out = dev.poisoned("qkv", (rows, nq + 2 * nkv), np.float32)
    launchers.GemmInt4QkvRows(out, dev.upload("x", x), *[dev.upload(f"w{i}{j}", a) for i, w in enumerate(ws) for j, a in enumerate(w)],
                      _state(dev, m), n_q=nq, n_kv=nkv, k=k, rows=rows).launch()
    want = np.concatenate([x[:m].astype(np.float64) @ dequant64(*w).T for w in ws], axis=1)
    got = out.download()
    report(f"gemm_int4_qkv M={m}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all()


@pytest.mark.parametrize("m", [1, 100, 300])
@pytest.mark.parametrize("max_blocks", [None, 0, 3])
def test_gemm_residual(dev, rng, m, max_blocks):
    n, k = 333, 384
    qw, sc = random_int4(rng, n, k)
    x = _x(rng, m, k)
    rows = _capacity(m)
    r0 = np.full((rows, n), np.nan, np.float32)
    r0[:m] = (rng.standard_normal((m, n)) * 100).astype(np.float32)  # large residual values
    res = dev.upload("residual", r0)
    launchers.GemmInt4ResidualRows(res, dev.upload("x", x), dev.upload("qw", qw), dev.upload("sc", sc), _state(dev, m),
                           n=n, k=k, rows=rows, max_blocks=max_blocks).launch()
    got = res.download()
    want = r0[:m].astype(np.float64) + x[:m].astype(np.float64) @ dequant64(qw, sc).T
    report(f"gemm_int4_residual M={m}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all()


@pytest.mark.parametrize("m", [16, 100, 300])
def test_gemm_gate_up_swiglu(dev, rng, m):
    f, k = 200, 256                     # 4 blocks of 64 features, the last partial
    (gq, gs), (uq, us) = random_int4(rng, f, k), random_int4(rng, f, k)
    x = _x(rng, m, k)
    rows = _capacity(m)
    h = dev.poisoned("h", (rows, f), np.float16)
    launchers.GemmInt4GateUpSwigluRows(h, dev.upload("x", x), dev.upload("gq", gq), dev.upload("gs", gs),
                               dev.upload("uq", uq), dev.upload("us", us), _state(dev, m), f=f, k=k,
                               rows=rows).launch()
    x64 = x[:m].astype(np.float64)
    want = ref.swiglu(x64 @ dequant64(gq, gs).T, x64 @ dequant64(uq, us).T)
    got = h.download()
    report(f"gemm_int4_gate_up_swiglu M={m}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:].astype(np.float32)).all()
