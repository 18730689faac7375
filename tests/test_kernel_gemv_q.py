"""kernels/gemv_q.cu (one decode GEMV per weight format, format/weight_formats.py) against
float64 numpy on the format's dequantized weights.

Every format at the real 0.5B and 7B projection shapes and at awkward ones (N = 1, N not a
multiple of the 8 rows of a block, K = 32 and K with fewer chunks than a warp has lanes), for
both outputs (fp16 y, fp32 residual +=). Codes are uniform over the format's range, scales of
both signs and offsets random in the format's dtype. Outputs are NaN-poisoned before the
launch and must be fully written; the same launch twice gives the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.format import weight_formats as wf
from kernel_testing import TOL_GEMV, assert_same_bits, dev, graph_time_us, report  # noqa: F401

pytestmark = pytest.mark.gpu

# (label, N, K)
SHAPES = [("0.5b.q_proj", 896, 896), ("0.5b.gate_proj", 4864, 896), ("0.5b.down_proj", 896, 4864),
          ("7b.o_proj", 3584, 3584), ("7b.down_proj", 3584, 18944),
          ("odd.n1.k128", 1, 128), ("odd.n37.k160", 37, 160), ("odd.n9.k32", 9, 32), ("odd.n200.k1152", 200, 1152)]
# The flat formats (the K-quants' two-level scales are not gemv_q.cu's).
FORMATS = [f for f in wf.FORMATS.values() if not f.superblock]
# Only the pairs that can exist: a format whose group does not divide K stores no such weight
# (the converter refuses it), so there is nothing to test, and nothing to skip.
CASES = [(fmt, label, n, k) for fmt in FORMATS for label, n, k in SHAPES if fmt.fits(k)]
# Checked when the module is collected (on any machine): what is left out is only ever an
# awkward shape, never a real model's projection.
assert {(f.name, label) for f in FORMATS for label, _, _ in SHAPES if not label.startswith("odd")} <= \
    {(f.name, label) for f, label, _, _ in CASES}, "a format no longer fits a real projection shape"


def random_parts(fmt: wf.WeightFormat, rng, n: int, k: int) -> tuple[dict, np.ndarray]:
    """Random stored parts of a [n, k] weight in `fmt` and its float64 dequantization."""
    codes = rng.integers(0, 1 << fmt.bits, (n, k)).astype(np.uint8)
    parts = wf.pack_codes(fmt, codes)
    g = k // fmt.group
    parts["scales"] = (rng.uniform(0.002, 0.01, (n, g)) * rng.choice([-1, 1], (n, g))).astype(fmt.scale_dtype)
    if fmt.offset_dtype is not None:
        parts["offsets"] = (rng.standard_normal((n, g)) * 0.02).astype(fmt.offset_dtype)
    w = wf.dequantize_parts(fmt, codes, parts["scales"], parts.get("offsets")).astype(np.float64)
    return parts, w


@pytest.mark.parametrize("fmt,label,n,k", CASES, ids=[f"{c[0].name}-{c[1]}" for c in CASES])
def test_gemv_q(dev, rng, fmt, label, n, k):
    from drvqwen.launchers import GemvQ

    parts, w = random_parts(fmt, rng, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    want = w @ x.astype(np.float64)
    bufs = {p: dev.upload(f"W.{p}", a) for p, a in parts.items()}
    xd = dev.upload("x", x)
    y = dev.poisoned("y", (n,), np.float16)
    ln = GemvQ(fmt, bufs, xd, n=n, k=k, out=y)
    ln.launch()
    got = y.download()
    report(f"{fmt.name}.{label}.f16", got, want, TOL_GEMV)
    y.fill_bytes(0xFF)
    ln.launch()
    assert_same_bits(label, got, y.download())

    r0 = rng.standard_normal(n).astype(np.float32)
    res = dev.upload("residual", r0)
    GemvQ(fmt, bufs, xd, n=n, k=k, residual=res).launch()
    report(f"{fmt.name}.{label}.residual", res.download(), r0.astype(np.float64) + want, TOL_GEMV)
    if label.startswith("7b"):
        us = graph_time_us(ln)
        print(f"  {fmt.name} {label}: {us:.2f} µs/call, {ln.bytes_moved / us / 1e3:.0f} GB/s "
              f"({ln.bytes_moved / 1e6:.2f} MB)")
