"""kernels/gemv_int4.cu against float64 numpy on the dequantized weights (format.quant).

Shapes: the real 7B and 0.5B projections, plus awkward ones — N not a multiple of the 16-row
tile, N = 1, K = 128 (one group), K with a group count no warp split divides evenly.
Every output is poisoned with NaN before the launch and must be fully written; the same launch
twice must give the same bits. Each shape runs in the launch shape the launcher picks and in a
second one: for the 7B shapes the first version's (one 16-row tile per block), timed side by
side (GPU µs per call and GB/s); for the others 3 blocks, so that blocks own several tiles
(and, for q/k/v, tiles of different matrices).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref
from kernel_testing import (TOL_GEMV, assert_same_bits, dev, graph_time_us, matvec64,  # noqa: F401
                            random_int4, report)

pytestmark = pytest.mark.gpu

# (label, N, K)
PLAIN = [("7b.o_proj", 3584, 3584), ("0.5b.o_proj", 896, 896), ("odd.n160.k128", 160, 128),
         ("odd.n200.k384", 200, 384), ("odd.n1.k128", 1, 128), ("odd.n136.k1152", 136, 1152)]
QKV = [("7b", 3584, 512, 3584), ("0.5b", 896, 128, 896), ("odd", 200, 24, 256)]
RESIDUAL = [("7b.o_proj", 3584, 3584), ("7b.down_proj", 3584, 18944), ("0.5b.o_proj", 896, 896),
            ("0.5b.down_proj", 896, 4864), ("odd.n72.k640", 72, 640)]
GATE_UP = [("7b", 18944, 3584), ("0.5b", 4864, 896), ("odd", 200, 128)]


def _v1_warps(k: int) -> int:
    """The first version's warps per block: 8, unless 7, 6 or 5 split the K groups exactly."""
    groups = k // 128
    return next((w for w in (8, 7, 6, 5) if groups % w == 0), min(8, groups))


def _variants(label: str, n_tiles: int, k: int):
    """(name, launcher kwargs): the launcher's own shape, then a second one (see the docstring)."""
    if label.startswith("7b"):
        return [("auto", {}), ("one_tile_per_block", {"blocks": n_tiles, "warps": _v1_warps(k)})]
    return [("auto", {}), ("3_blocks", {"blocks": 3})]


def _time(label, variant, launcher):
    if not label.startswith("7b"):
        return
    us = graph_time_us(launcher)
    ln = launcher.launches[0]
    print(f"  {label} [{variant}: grid {ln.grid[0]} x {ln.block[0] // 32} warps]: {us:.2f} µs/call, "
          f"{launcher.bytes_moved / us / 1e3:.0f} GB/s ({launcher.bytes_moved / 1e6:.2f} MB; "
          f"L2-resident if < ~50 MB)")


def _x(rng, k):
    return rng.standard_normal(k).astype(np.float16)


@pytest.mark.parametrize("label,n,k", PLAIN, ids=[p[0] for p in PLAIN])
def test_gemv_int4_f16(dev, rng, label, n, k):
    from drvqwen.kernels import GemvInt4

    qw, sc = random_int4(rng, n, k)
    x = _x(rng, k)
    want = matvec64(qw, sc, x)
    bufs = dev.upload("x", x), dev.upload("qw", qw), dev.upload("sc", sc)
    for variant, kw in _variants(label, -(-n // 16), k):
        y = dev.poisoned("y", (n,), np.float16)
        ln = GemvInt4(y, *bufs, n=n, k=k, **kw)
        ln.launch()
        got = y.download()
        report(f"{label}[{variant}]", got, want, TOL_GEMV)
        y.fill_bytes(0xFF)
        ln.launch()
        assert_same_bits(label, got, y.download())
        _time(label, variant, ln)


@pytest.mark.parametrize("label,nq,nkv,k", QKV, ids=[p[0] for p in QKV])
def test_gemv_int4_qkv(dev, rng, label, nq, nkv, k):
    from drvqwen.kernels import GemvInt4Qkv

    ws = [random_int4(rng, n, k) for n in (nq, nkv, nkv)]
    x = _x(rng, k)
    args = []
    for name, (qw, sc) in zip("qkv", ws):
        args += [dev.upload(f"{name}.qw", qw), dev.upload(f"{name}.sc", sc)]
    x_d = dev.upload("x", x)
    want = np.concatenate([matvec64(qw, sc, x) for qw, sc in ws])
    for variant, kw in _variants(label, -(-nq // 16) + 2 * -(-nkv // 16), k):
        out = dev.poisoned("qkv", (nq + 2 * nkv,), np.float32)
        ln = GemvInt4Qkv(out, x_d, *args, n_q=nq, n_kv=nkv, k=k, **kw)
        ln.launch()
        got = out.download()
        for name, sl in (("q", slice(0, nq)), ("k", slice(nq, nq + nkv)), ("v", slice(nq + nkv, None))):
            report(f"{label}[{variant}].{name}", got[sl], want[sl], TOL_GEMV)
        out.fill_bytes(0xFF)
        ln.launch()
        assert_same_bits(label, got, out.download())
        _time(f"{label}.qkv", variant, ln)


@pytest.mark.parametrize("label,n,k", RESIDUAL, ids=[p[0] for p in RESIDUAL])
def test_gemv_int4_residual(dev, rng, label, n, k):
    from drvqwen.kernels import GemvInt4Residual

    qw, sc = random_int4(rng, n, k)
    x = _x(rng, k)
    res_in = rng.standard_normal(n).astype(np.float32)
    big = rng.choice(n, size=min(4, n), replace=False)  # Qwen2's massive residual channels
    res_in[big] = rng.choice([-1, 1], size=big.size) * rng.uniform(1e3, 3e4, size=big.size)
    bufs = dev.upload("x", x), dev.upload("qw", qw), dev.upload("sc", sc)
    dot = matvec64(qw, sc, x)
    for variant, kw in _variants(label, -(-n // 16), k):
        res = dev.upload("residual", res_in)
        ln = GemvInt4Residual(res, *bufs, n=n, k=k, **kw)
        ln.launch()
        got = res.download()
        # The added part (what the GEMV computed) and the whole new residual.
        report(f"{label}[{variant}].delta", got.astype(np.float64) - res_in, dot, TOL_GEMV)
        report(f"{label}[{variant}].residual", got, res_in.astype(np.float64) + dot, TOL_GEMV)
        res.upload(res_in)
        ln.launch()
        assert_same_bits(label, got, res.download())
        _time(label, variant, ln)


@pytest.mark.parametrize("label,f,k", GATE_UP, ids=[p[0] for p in GATE_UP])
def test_gemv_int4_gate_up_swiglu(dev, rng, label, f, k):
    from drvqwen.kernels import GemvInt4GateUpSwiglu

    (gq, gs), (uq, us) = random_int4(rng, f, k), random_int4(rng, f, k)
    x = _x(rng, k)
    bufs = (dev.upload("x", x), dev.upload("gq", gq), dev.upload("gs", gs), dev.upload("uq", uq),
            dev.upload("us", us))
    want = ref.swiglu(matvec64(gq, gs, x), matvec64(uq, us, x))
    for variant, kw in _variants(label, -(-f // 16), k):
        h = dev.poisoned("h", (f,), np.float16)
        ln = GemvInt4GateUpSwiglu(h, *bufs, f=f, k=k, **kw)
        ln.launch()
        got = h.download()
        report(f"{label}[{variant}]", got, want, TOL_GEMV)
        h.fill_bytes(0xFF)
        ln.launch()
        assert_same_bits(label, got, h.download())
        _time(f"{label}.gate_up", variant, ln)
