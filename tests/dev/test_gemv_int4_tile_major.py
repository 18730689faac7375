"""kernels/dev/gemv_int4_tile_major.cu against float64 numpy and against the layout-1 kernels.

The tile-major weight layout is an experiment (the kernel file says what it is and what it
measured). This test keeps it correct and measurable: each shape runs the layout-1 kernel of
gemv_int4.cu and the tile-major one on the same weights in the same launch shape; both must match
the float64 reference, and for residual each other bit for bit (the same sums in the same
order, only the weights' addresses differ); for the 7B shapes both are timed side by side (GPU
µs per call, graph replay). drvqwen never launches the dev kernels, so their launcher lives here.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from drvqwen import reference as ref
from kernel_testing import (TOL_GEMV, assert_same_bits, dev, graph_time_us, matvec64,  # noqa: F401
                            random_int4, report)

DEV_FILE = "dev/gemv_int4_tile_major"  # kernels/dev/gemv_int4_tile_major.cu

# (label, N or F, K): the two 7B matrices the experiment is about, and small ones with several
# tiles per block and K-group counts the warps do not divide evenly.
SHAPES = [("7b.gate_up", 18944, 3584), ("7b.down_proj", 3584, 18944), ("odd.gate_up", 160, 256),
          ("odd.down_proj", 64, 384)]


def tile_major(qweight: np.ndarray) -> np.ndarray:
    """Layout id 1 [N, K/8] uint32 → tile-major [N/16, K/128, 16, 16] uint32 (N % 16 == 0)."""
    n, kw = qweight.shape
    assert n % 16 == 0 and kw % 16 == 0, qweight.shape
    return np.ascontiguousarray(qweight.reshape(n // 16, 16, kw // 16, 16).transpose(0, 2, 1, 3))


class TileMajorLaunch:
    """One launch of a tile-major kernel, in the launch shape (grid, block, dynamic smem) of
    `like`, the drvqwen launcher of the same problem in layout id 1: the engine is the same (its
    register count may differ a little: the shape must still fit on an SM)."""

    def __init__(self, kernel: str, params: list, like):
        from drvqwen.cuda import KernelLaunch, load_kernel_module

        shape = like.launches[0]
        fn = load_kernel_module(DEV_FILE).function(kernel)
        fn.ensure_dynamic_smem(shape.smem_bytes)
        assert fn.max_active_blocks_per_sm(shape.block[0], shape.smem_bytes) >= 1, (kernel, fn.num_registers)
        self.launches = [KernelLaunch(fn, shape.grid, shape.block, params, smem_bytes=shape.smem_bytes)]
        self.bytes_moved = like.bytes_moved

    def launch(self, stream=None) -> None:
        for ln in self.launches:
            ln.launch(stream)


def _time(label: str, variant: str, launcher) -> None:
    if not label.startswith("7b"):
        return
    us = graph_time_us(launcher)
    ln = launcher.launches[0]
    print(f"  {label} [{variant}: grid {ln.grid[0]} x {ln.block[0] // 32} warps]: {us:.2f} µs/call, "
          f"{launcher.bytes_moved / us / 1e3:.0f} GB/s")


def _x(rng, k):
    return rng.standard_normal(k).astype(np.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("label,n,k", [s for s in SHAPES if s[0].endswith("down_proj")],
                         ids=[s[0] for s in SHAPES if s[0].endswith("down_proj")])
def test_gemv_int4_residual_tile_major(dev, rng, label, n, k):
    from drvqwen.launchers import GemvInt4Residual

    qw, sc = random_int4(rng, n, k)
    x = _x(rng, k)
    want = matvec64(qw, sc, x)
    x_d, sc_d = dev.upload("x", x), dev.upload("sc", sc)
    res1 = dev.upload("residual.layout1", np.zeros(n, np.float32))
    layout1 = GemvInt4Residual(res1, x_d, dev.upload("qw", qw), sc_d, n=n, k=k)
    res2 = dev.upload("residual.tile_major", np.zeros(n, np.float32))
    qw_tm = dev.upload("qw.tile_major", tile_major(qw))
    tiled = TileMajorLaunch("gemv_int4_residual_tile_major",
                            [res2, x_d, qw_tm, sc_d, ctypes.c_int32(n), ctypes.c_int32(k)], like=layout1)
    layout1.launch()
    tiled.launch()
    got1, got2 = res1.download(), res2.download()
    report(f"{label}[layout 1]", got1, want, TOL_GEMV)
    report(f"{label}[tile-major]", got2, want, TOL_GEMV)
    assert_same_bits(label, got1, got2)
    _time(label, "layout 1", layout1)
    _time(label, "tile-major", tiled)


@pytest.mark.gpu
@pytest.mark.parametrize("label,f,k", [s for s in SHAPES if s[0].endswith("gate_up")],
                         ids=[s[0] for s in SHAPES if s[0].endswith("gate_up")])
def test_gemv_int4_gate_up_swiglu_tile_major(dev, rng, label, f, k):
    from drvqwen.launchers import GemvInt4GateUpSwiglu

    (gq, gs), (uq, us) = random_int4(rng, f, k), random_int4(rng, f, k)
    x = _x(rng, k)
    want = ref.swiglu(matvec64(gq, gs, x), matvec64(uq, us, x))
    x_d, gs_d, us_d = dev.upload("x", x), dev.upload("gs", gs), dev.upload("us", us)
    # drvqwen's gate/up GEMV normalises the residual itself; the tile-major experiment takes x.
    # The layout-1 launcher gives the launch shape and the timing beside it (its norm prologue
    # costs one read of the residual); correctness is checked against the reference.
    layout1 = GemvInt4GateUpSwiglu(dev.poisoned("h.layout1", (f,), np.float16),
                                   dev.upload("residual", rng.standard_normal(k).astype(np.float32)),
                                   dev.upload("norm_w", np.ones(k, np.float16)), dev.upload("gq", gq), gs_d,
                                   dev.upload("uq", uq), us_d, f=f, k=k, eps=1e-6)
    h2 = dev.poisoned("h.tile_major", (f,), np.float16)
    gq_tm, uq_tm = dev.upload("gq.tile_major", tile_major(gq)), dev.upload("uq.tile_major", tile_major(uq))
    tiled = TileMajorLaunch("gemv_int4_gate_up_swiglu_tile_major",
                            [h2, x_d, gq_tm, gs_d, uq_tm, us_d, ctypes.c_int32(f), ctypes.c_int32(k)],
                            like=layout1)
    tiled.launch()
    got2 = h2.download()
    report(f"{label}[tile-major]", got2, want, TOL_GEMV)
    h2.fill_bytes(0xFF)
    tiled.launch()
    assert_same_bits(label, got2, h2.download())
    _time(label, "layout 1 (+ norm)", layout1)
    _time(label, "tile-major", tiled)


def test_tile_major_packing():
    """The packing the kernel reads: row r of tile T, words 16·gi … 16·gi + 15 (group gi) land at
    [T, gi, r, 0:16]."""
    n, k = 32, 384
    qw = np.arange(n * k // 8, dtype=np.uint32).reshape(n, k // 8)
    tm = tile_major(qw)
    assert tm.shape == (n // 16, k // 128, 16, 16)
    for tile, gi, r in [(0, 0, 0), (1, 2, 15), (0, 1, 7), (1, 0, 3)]:
        np.testing.assert_array_equal(tm[tile, gi, r], qw[16 * tile + r, 16 * gi: 16 * gi + 16])
