"""kernels/rmsnorm.cu against reference.rmsnorm in float64 on the kernel's exact inputs.

The FP32 residual carries a few channels of magnitude 1e3–3e4 (as real Qwen2 models do), which
would overflow an FP16 sum of squares; rows > 1 is the prefill form.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref
from kernel_testing import TOL_GEMV, assert_same_bits, dev, report  # noqa: F401

pytestmark = pytest.mark.gpu

EPS = 1e-6
CASES = [("7b", 3584, 1), ("0.5b", 896, 1), ("prefill.7b", 3584, 5), ("d128", 128, 1), ("d8192", 8192, 2)]


@pytest.mark.parametrize("label,d,rows", CASES, ids=[c[0] for c in CASES])
def test_rmsnorm(dev, rng, label, d, rows):
    from drvqwen.launchers import RmsNorm

    x = rng.standard_normal((rows, d)).astype(np.float32)
    for r in range(rows):
        big = rng.choice(d, size=3, replace=False)
        x[r, big] = rng.choice([-1, 1], size=3) * rng.uniform(1e3, 3e4, size=3)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float16)
    out = dev.poisoned("out", (rows, d), np.float16)
    ln = RmsNorm(out, dev.upload("x", x), dev.upload("w", w), dim=d, eps=EPS, rows=rows)
    ln.launch()
    got = out.download()
    assert np.isfinite(got).all(), "FP16 output overflowed or was not written"
    want = ref.rmsnorm(x.astype(np.float64), w.astype(np.float64), EPS)
    report(label, got, want, TOL_GEMV)
    out.fill_bytes(0xFF)
    ln.launch()
    assert_same_bits(label, got, out.download())


@pytest.mark.parametrize("d", [896, 3584, 8192])
def test_rmsnorm_same_bits_at_any_block_size(dev, rng, d):
    """The sum's order is a 1024-thread block's whatever the block (rmsnorm.cuh), so blocks of any
    multiple of 32 threads (the GEMVs that normalise their own input use theirs) give the bits of
    the 1024-thread one."""
    from drvqwen.launchers import RmsNorm

    rows = 3
    x = (rng.standard_normal((rows, d)) * rng.uniform(0.5, 50.0, (rows, 1))).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float16)
    xs, ws = dev.upload("x", x), dev.upload("w", w)
    results = {}
    for threads in (1024, 256, 224, 96, 32):
        out = dev.poisoned(f"out{threads}", (rows, d), np.float16)
        RmsNorm(out, xs, ws, dim=d, eps=EPS, rows=rows, threads=threads).launch()
        results[threads] = out.download()
    report(f"d{d}", results[1024], ref.rmsnorm(x.astype(np.float64), w.astype(np.float64), EPS), TOL_GEMV)
    for threads, got in results.items():
        assert_same_bits(f"rmsnorm d{d} at {threads} threads", results[1024], got)


ROWS_CASES = [(3584, 512), (3584, 7), (896, 5), (5120, 3), (8192, 2), (128, 1), (16384, 4)]


@pytest.mark.parametrize("d,rows", ROWS_CASES, ids=[f"d{d}.rows{r}" for d, r in ROWS_CASES])
def test_rmsnorm_rows_are_rmsnorm_bit_for_bit(dev, rng, d, rows):
    """rmsnorm_rows (a warp a row, the prefill's) sums in rmsnorm's order (rmsnorm.cuh), so every row
    has the block kernel's bits — rows not a multiple of the block's 4, D past 4096 (chunks j ≥ 1)
    and below a warp's 128 elements — and nothing is written past the last row."""
    from drvqwen.cuda import DeviceArray
    from drvqwen.launchers import RmsNorm, RmsNormRows

    x = (rng.standard_normal((rows, d)) * rng.uniform(0.5, 50.0, (rows, 1))).astype(np.float32)
    for r in range(rows):
        big = rng.choice(d, size=3, replace=False)
        x[r, big] = rng.choice([-1, 1], size=3) * rng.uniform(1e3, 3e4, size=3)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float16)
    xs, ws = dev.upload("x", x), dev.upload("w", w)
    want_bits = dev.poisoned("out_block", (rows, d), np.float16)
    RmsNorm(want_bits, xs, ws, dim=d, eps=EPS, rows=rows).launch()
    padded = dev.poisoned("out_rows", (rows + 1, d), np.float16)  # one poisoned row past the end
    out = DeviceArray("out_rows[:rows]", padded.ptr, (rows, d), np.float16)
    RmsNormRows(out, xs, ws, dim=d, eps=EPS, rows=rows).launch()
    got = padded.download()
    assert (got[rows].view(np.uint16) == 0xFFFF).all(), "rmsnorm_rows wrote past its last row"
    report(f"d{d}.rows{rows}", got[:rows], ref.rmsnorm(x.astype(np.float64), w.astype(np.float64), EPS), TOL_GEMV)
    assert_same_bits(f"rmsnorm_rows d{d} rows{rows}", want_bits.download(), got[:rows])
