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
    """The sum's order is a 1024-thread block's whatever the block (rmsnorm.cuh), so the prefill's
    row_threads(D) blocks, and any multiple of 32, give the bits of the 1024-thread one."""
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
