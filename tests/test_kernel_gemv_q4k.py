"""kernels/gemv_int4.cu's Q4_K GEMVs (gemv_q4k_residual, gemv_q4k_gate_up_swiglu: the INT4 engine
with GemvQ4kWeights) against float64 numpy on the weights as format/weight_formats.py
dequantizes them.

The 7B's o_proj, down_proj and gate/up shapes, the 0.5B's, and awkward ones (N = 1, N not a
multiple of 16, few groups per warp, K = 256: one super-block). Their weights reach the MMAs
exact (c·sc in FP16, d and dmin·m in FP32), so y = W x added to a zero residual must match the
reference to FP32 summation error (TOL_LM_HEAD), far inside what one FP16 rounding of the
weights would cost; with Qwen2's massive residual channels, and for h (FP16 out), TOL_GEMV.
Outputs are NaN-poisoned where the kernel writes them whole; the same launch twice gives the
same bits; the launchers refuse what the kernels do not take.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.format import weight_formats as wf
from kernel_testing import (TOL_GEMV, TOL_LM_HEAD, assert_same_bits, dev, graph_time_us, massive_residual,  # noqa: F401
                            normed_fp16, random_fmt_weight, report)

Q4K = next(f for f in wf.FORMATS.values() if f.name == "q4_k")
EPS = 1e-6

# (label, N, K)
RESIDUAL = [("7b.o_proj", 3584, 3584), ("7b.down_proj", 3584, 18944), ("0.5b.down_proj", 896, 4864),
            ("odd.n1.k256", 1, 256), ("odd.n37.k512", 37, 512), ("odd.n200.k1280", 200, 1280)]
# (label, F, D)
GATE_UP = [("7b", 18944, 3584), ("1.5b", 8960, 1536), ("odd.f40.k512", 40, 512), ("odd.f200.k256", 200, 256)]


def test_launchers_refuse_other_formats_and_widths():
    """CPU: a weight in another format, or K not a multiple of 256, is refused by name."""
    from drvqwen.launchers import BufferSpec, LaunchError
    from drvqwen.launchers.gemv_fmt import fmt_weight
    from drvqwen.launchers.gemv_q4k import GemvQ4kGateUpSwiglu, GemvQ4kResidual

    def weight(fmt, n, k, name):
        return fmt_weight(lambda t: BufferSpec(t, fmt.tensors(name, n, k)[t][1], fmt.tensors(name, n, k)[t][0]),
                          name, fmt)

    q6k = next(f for f in wf.FORMATS.values() if f.name == "q6_k")
    res, x = BufferSpec("r", (64,), np.float32), BufferSpec("x", (512,), np.float16)
    with pytest.raises(LaunchError, match="down_proj is q6_k"):
        GemvQ4kResidual(res, x, weight(q6k, 64, 512, "down_proj"), n=64, k=512)
    x384 = BufferSpec("x", (384,), np.float16)
    with pytest.raises(LaunchError, match="K=384"):
        GemvQ4kResidual(res, x384, weight(Q4K, 64, 384, "o_proj"), n=64, k=384)
    g, u = weight(Q4K, 64, 512, "gate"), weight(q6k, 64, 512, "up")
    with pytest.raises(LaunchError, match="up is q6_k"):
        GemvQ4kGateUpSwiglu(BufferSpec("h", (64,), np.float16), BufferSpec("r", (512,), np.float32),
                            BufferSpec("w", (512,), np.float16), g, u, f=64, k=512, eps=EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("label,n,k", RESIDUAL, ids=[r[0] for r in RESIDUAL])
def test_gemv_q4k_residual(dev, rng, label, n, k):
    from drvqwen.launchers.gemv_q4k import GemvQ4kResidual

    w, w64 = random_fmt_weight(dev, rng, Q4K, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    want = w64 @ x.astype(np.float64)
    xd = dev.upload("x", x)

    # y = W x alone: a zero residual, nothing to hide the sum's error behind.
    res = dev.upload("residual", np.zeros(n, np.float32))
    ln = GemvQ4kResidual(res, xd, w, n=n, k=k)
    ln.launch()
    got = res.download()
    report(f"{label}.exact", got, want, TOL_LM_HEAD)
    res.upload(np.zeros(n, np.float32))
    ln.launch()
    assert_same_bits(label, got, res.download())

    # Qwen2's huge channels need rows to hide among (as in test_kernel_gemv_fmt.py).
    r0 = massive_residual(rng, n) if n >= 64 else rng.standard_normal(n).astype(np.float32)
    res.upload(r0)
    ln.launch()
    report(f"{label}.delta", res.download().astype(np.float64) - r0, want, TOL_GEMV)
    if n * k >= 3584 * 3584:
        us = graph_time_us(ln)
        print(f"  {label}: {us:.2f} µs/call, {ln.bytes_moved / us / 1e3:.0f} GB/s")


@pytest.mark.gpu
@pytest.mark.parametrize("label,f,d", GATE_UP, ids=[g[0] for g in GATE_UP])
def test_gemv_q4k_gate_up_swiglu(dev, rng, label, f, d):
    from drvqwen import reference as ref
    from drvqwen.launchers.gemv_q4k import GemvQ4kGateUpSwiglu

    (g, g64), (u, u64) = (random_fmt_weight(dev, rng, Q4K, f, d, name) for name in ("gate", "up"))
    residual, norm_w = massive_residual(rng, d), (1 + 0.1 * rng.standard_normal(d)).astype(np.float16)
    x = normed_fp16(residual, norm_w, EPS).astype(np.float64)
    want = ref.swiglu(g64 @ x, u64 @ x)
    h = dev.poisoned("h", (f,), np.float16)
    ln = GemvQ4kGateUpSwiglu(h, dev.upload("residual", residual), dev.upload("norm_w", norm_w), g, u, f=f, k=d,
                             eps=EPS)
    ln.launch()
    got = h.download()
    report(label, got, want, TOL_GEMV)
    h.fill_bytes(0xFF)
    ln.launch()
    assert_same_bits(label, got, h.download())
    if f * d >= 3584 * 3584:
        us = graph_time_us(ln)
        print(f"  {label}: {us:.2f} µs/call, {ln.bytes_moved / us / 1e3:.0f} GB/s")
