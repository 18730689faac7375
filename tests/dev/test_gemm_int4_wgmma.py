"""kernels/dev/gemm_int4_wgmma.cu against a float64 matmul on the dequantized weights, and timed
beside gemm_int4.cu's mma.sync GEMM on the same inputs.

The wgmma kernel multiplies FP16-rounded scaled weights (q · s rounded once to FP16, relative
2⁻¹¹), so its error budget is gemm_int4's plus that rounding: still well inside TOL_GEMV.
Shapes: token counts around the 128-token block (1, 15, 127, 128, 129, 512), N not a multiple of
the 128-row block, K from one 128-input group to the 7B widths. Outputs are NaN-poisoned (every
element < M must be written) and the buffer has rows past M that must stay NaN. At the 7B
shapes with M = 512 and 2048 both kernels are timed from a graph replay (µs, TFLOP/s).
drvqwen never launches the dev kernels, so their launcher lives here.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kernel_testing import TOL_GEMV, assert_same_bits, dequant64, dev, graph_time_us, random_int4, report  # noqa: F401

DEV_FILE = "dev/gemm_int4_wgmma"     # kernels/dev/gemm_int4_wgmma.cu
BLOCK_TOKENS, BLOCK_ROWS = 128, 128  # WGMMA_BN, WGMMA_BLOCK_ROWS
THREADS = 288                        # WGMMA_THREADS: 2 consumer warpgroups + 1 producer warp
SMEM_BYTES = 4 * 32768 + 1024 + 2 * 4 * 8  # WGMMA_SMEM_BYTES


class WgmmaGemm:
    """out fp32 [≥M, N] = x[:M] · dequant(qw, sc)ᵀ with the wgmma kernel.

    x: DeviceArray fp16 [≥M, K] (its first M rows are the tensor map's extent: rows past M read
    as zero by TMA, never from memory). qw [N, K/8] uint32, sc [N, K/128] fp16.
    """

    def __init__(self, out, x, qw, sc, m: int, n: int, k: int):
        from drvqwen.cuda import KernelLaunch, encode_tiled_2d, load_kernel_module
        from drvqwen.cuda.tensormap import Swizzle

        assert k % 128 == 0, k
        self.x_map = encode_tiled_2d(x.ptr, np.float16, (m, k), (BLOCK_TOKENS, 64),
                                     swizzle=Swizzle.CU_TENSOR_MAP_SWIZZLE_128B)
        fn = load_kernel_module(DEV_FILE).function("gemm_int4_wgmma_f32")
        fn.ensure_dynamic_smem(SMEM_BYTES)
        assert fn.max_active_blocks_per_sm(THREADS, SMEM_BYTES) >= 1, fn.num_registers
        grid = (-(-m // BLOCK_TOKENS), -(-n // BLOCK_ROWS), 1)
        self.launches = [KernelLaunch(fn, grid, (THREADS, 1, 1),
                                      [self.x_map, qw, sc, out, ctypes.c_int32(m), ctypes.c_int32(n),
                                       ctypes.c_int32(k)], smem_bytes=SMEM_BYTES)]

    def launch(self, stream=None) -> None:
        for ln in self.launches:
            ln.launch(stream)


def _run(dev, rng, m, n, k, extra_rows=3):
    qw, sc = random_int4(rng, n, k)
    x = np.full((m + extra_rows, k), np.nan, np.float16)   # rows past M: never read (TMA extent = M)
    x[:m] = rng.standard_normal((m, k)).astype(np.float16)
    out = dev.poisoned("out", (m + extra_rows, n), np.float32)
    x_d, qw_d, sc_d = dev.upload("x", x), dev.upload("qw", qw), dev.upload("sc", sc)
    g = WgmmaGemm(out, x_d, qw_d, sc_d, m, n, k)
    g.launch()
    got = out.download()
    want = x[:m].astype(np.float64) @ dequant64(qw, sc).T
    return g, out, got, want, (x_d, qw_d, sc_d, qw, sc, x)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 333, 384), (15, 200, 128), (127, 129, 896), (128, 256, 256),
                                   (129, 333, 384), (512, 1000, 3584)])
def test_gemm_int4_wgmma_f32(dev, rng, m, n, k):
    g, out, got, want, _ = _run(dev, rng, m, n, k)
    report(f"gemm_int4_wgmma_f32 M={m} N={n} K={k}", got[:m], want, TOL_GEMV)
    assert np.isnan(got[m:]).all(), "rows past M were written"
    g.launch()
    assert_same_bits("gemm_int4_wgmma_f32", got, out.download())


# The 7B prefill GEMM shapes (N, K): qkv, o_proj, gate (or up) — gate_up is two of these —, down.
SHAPES_7B = [("qkv", 4608, 3584), ("o_proj", 3584, 3584), ("gate", 18944, 3584), ("down", 3584, 18944)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [512, 2048])
@pytest.mark.parametrize("label,n,k", SHAPES_7B, ids=[s[0] for s in SHAPES_7B])
def test_gemm_int4_wgmma_7b_timed(dev, rng, label, n, k, m):
    from drvqwen import launchers as K
    from drvqwen.launchers.gemm_int4 import BM

    g, out, got, want, (x_d, qw_d, sc_d, qw, sc, x) = _run(dev, rng, m, n, k, extra_rows=0)
    report(f"wgmma {label} M={m}", got, want, TOL_GEMV)
    rows = -(-m // BM) * BM
    out2 = dev.poisoned("out.mma_sync", (rows, n), np.float32)
    x2 = dev.upload("x.mma_sync", np.concatenate([x, np.zeros((rows - m, k), np.float16)]))
    base = K.GemmInt4(out2, x2, qw_d, sc_d, dev.upload("prefill_state", np.array([0, m], np.int32)),
                      n=n, k=k, rows=rows)
    flop = 2.0 * m * n * k
    for name, launcher in (("mma.sync gemm_int4_f32", base), ("wgmma", g)):
        us = graph_time_us(launcher, reps=10)
        print(f"  {label} M={m} N={n} K={k} [{name}]: {us:.1f} µs, {flop / us / 1e6:.0f} TFLOP/s")
