"""kernels/gemv_int4.cu against float64 numpy on the dequantized weights (format.quant).

The fused kernels are checked against the reference of everything they fuse: gemv_int4_qkv_rope
against rmsnorm → matvec + bias → RoPE (q, and the K/V cache slot of the position in a
NaN-poisoned paged cache with a shuffled block table, every other slot untouched), and
gemv_int4_gate_up_swiglu against rmsnorm → two matvecs → SwiGLU. The normalised input is
rounded to FP16 in the reference as the kernel rounds it. The weights go to the GPU in the device
layout (kernel_testing.upload_int4: q, k and v RoPE-paired by the head dim), the reference works
on the same words in layout id 1.

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
from kernel_testing import (TOL_GEMV, assert_same_bits, dev, graph_time_us, massive_residual,  # noqa: F401
                            matvec64, normed_fp16, random_int4, report, upload_int4)

pytestmark = pytest.mark.gpu

# (label, N, K)
PLAIN = [("7b.o_proj", 3584, 3584), ("0.5b.o_proj", 896, 896), ("odd.n160.k128", 160, 128),
         ("odd.n200.k384", 200, 384), ("odd.n1.k128", 1, 128), ("odd.n136.k1152", 136, 1152)]
# (label, Hq, Hkv, Dh, D): the real shapes, and a small one whose q tiles span 2 heads per block.
QKV = [("7b", 28, 4, 128, 3584), ("0.5b", 14, 2, 64, 896), ("odd", 3, 1, 32, 256)]
POSITIONS = [0, 17, 1000, 32767]
N_PAGES = 9
MAX_PAGES = 32768 // 16
EPS = 1e-6
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


# rmsnorm.cuh's two prologues: the default reads the residual once and sums the squares from the
# registers it was loaded into; RMSNORM_ONE_PASS=0 sums, then reads the row again to normalise
# (the path of rows too long for one round, and of decode_persistent.cu). Both must give the same
# bits: the same sums in the same order. The fused kernels run the two-pass build as a third
# variant, compared bit for bit.
TWO_PASS = (("RMSNORM_ONE_PASS", 0),)


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
    from drvqwen.launchers import GemvInt4

    qw, sc = random_int4(rng, n, k)
    x = _x(rng, k)
    want = matvec64(qw, sc, x)
    bufs = dev.upload("x", x), upload_int4(dev, "qw", qw), dev.upload("sc", sc)
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


@pytest.mark.parametrize("label,hq,hkv,dh,k", QKV, ids=[p[0] for p in QKV])
def test_gemv_int4_qkv_rope(dev, rng, label, hq, hkv, dh, k):
    from drvqwen.launchers import GemvInt4QkvRope
    from drvqwen.launchers.gemv_int4 import qkv_rope_defines

    nq, nkv = hq * dh, hkv * dh
    ws = [random_int4(rng, n, k) for n in (nq, nkv, nkv)]
    residual, norm_w = massive_residual(rng, k), (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
    biases = [(rng.standard_normal(n) * 0.5).astype(np.float16) for n in (nq, nkv, nkv)]
    inv_freq = ref.rope_inv_freq(dh, 1e6)
    block_table = rng.integers(0, N_PAGES, size=MAX_PAGES).astype(np.int32)  # shuffled pages
    x = normed_fp16(residual, norm_w, EPS)
    q64, k64, v64 = (matvec64(qw, sc, x) + b.astype(np.float64) for (qw, sc), b in zip(ws, biases))
    args = []
    for name, (qw, sc) in zip("qkv", ws):
        args += [upload_int4(dev, f"{name}.qw", qw, dh), dev.upload(f"{name}.sc", sc)]
    bufs = dict(residual=dev.upload("residual", residual), norm_w=dev.upload("norm_w", norm_w),
                bias=[dev.upload(f"b{i}", b) for i, b in enumerate(biases)], inv_freq=dev.upload("inv_freq", inv_freq),
                bt=dev.upload("block_table", block_table), state=dev.upload("state", np.zeros(3, np.int32)))
    q_out = dev.poisoned("q", (hq, dh), np.float16)
    k_cache = dev.poisoned("k_cache", (N_PAGES, hkv, 16, dh), np.float16)
    v_cache = dev.poisoned("v_cache", (N_PAGES, hkv, 16, dh), np.float16)
    n_tiles = -(-nq // 16) + 2 * -(-nkv // 16)
    seen = {}
    two_pass = ("two_pass", {"defines": qkv_rope_defines(n_tiles, k) + TWO_PASS})
    for variant, kw in _variants(label, n_tiles, k) + [two_pass]:
        ln = GemvInt4QkvRope(q_out, k_cache, v_cache, bufs["residual"], bufs["norm_w"], *args, *bufs["bias"],
                             bufs["inv_freq"], bufs["state"], bufs["bt"], n_heads=hq, n_kv_heads=hkv, head_dim=dh,
                             dim=k, eps=EPS, **kw)
        for pos in POSITIONS:
            bufs["state"].upload(np.array([pos, 0, pos + 1], np.int32))
            for buf in (q_out, k_cache, v_cache):
                buf.fill_bytes(0xFF)
            ln.launch()
            cos, sin = (t.astype(np.float64) for t in ref.rope_cos_sin(np.array([pos]), dh, 1e6))
            got_q = q_out.download()
            report(f"{label}[{variant}].pos{pos}.q", got_q,
                   ref.apply_rope(q64.reshape(1, hq, dh), cos, sin)[0], TOL_GEMV)
            page, slot = block_table[pos // 16], pos % 16
            for name, cache, want in (("k", k_cache, ref.apply_rope(k64.reshape(1, hkv, dh), cos, sin)[0]),
                                      ("v", v_cache, v64.reshape(hkv, dh))):
                got = cache.download()
                report(f"{label}[{variant}].pos{pos}.{name}", got[page, :, slot, :], want, TOL_GEMV)
                untouched = np.ones(got.shape[:3], dtype=bool)
                untouched[page, :, slot] = False
                assert (got.view(np.uint16)[untouched] == 0xFFFF).all(), \
                    f"{name}_cache: a slot other than position {pos} was written"
            ln.launch()
            assert_same_bits(f"{label}.pos{pos}.q", got_q, q_out.download())
            outs = (got_q, k_cache.download()[page, :, slot], v_cache.download()[page, :, slot])
            if variant == "auto":
                seen[pos] = outs
            elif variant == "two_pass":
                for name, a, b in zip("qkv", seen[pos], outs):
                    assert_same_bits(f"{label}.pos{pos}.{name}: two passes against one", a, b)
        _time(f"{label}.qkv_rope", variant, ln)


@pytest.mark.parametrize("label,n,k", RESIDUAL, ids=[p[0] for p in RESIDUAL])
def test_gemv_int4_residual(dev, rng, label, n, k):
    from drvqwen.launchers import GemvInt4Residual

    qw, sc = random_int4(rng, n, k)
    x = _x(rng, k)
    res_in = rng.standard_normal(n).astype(np.float32)
    big = rng.choice(n, size=min(4, n), replace=False)  # Qwen2's massive residual channels
    res_in[big] = rng.choice([-1, 1], size=big.size) * rng.uniform(1e3, 3e4, size=big.size)
    bufs = dev.upload("x", x), upload_int4(dev, "qw", qw), dev.upload("sc", sc)
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
    from drvqwen.launchers import GemvInt4GateUpSwiglu

    (gq, gs), (uq, us) = random_int4(rng, f, k), random_int4(rng, f, k)
    residual, norm_w = massive_residual(rng, k), (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
    x = normed_fp16(residual, norm_w, EPS)
    bufs = (dev.upload("residual", residual), dev.upload("norm_w", norm_w), upload_int4(dev, "gq", gq),
            dev.upload("gs", gs), upload_int4(dev, "uq", uq), dev.upload("us", us))
    want = ref.swiglu(matvec64(gq, gs, x), matvec64(uq, us, x))
    seen = {}
    for variant, kw in _variants(label, -(-f // 16), k) + [("two_pass", {"defines": TWO_PASS})]:
        h = dev.poisoned("h", (f,), np.float16)
        ln = GemvInt4GateUpSwiglu(h, *bufs, f=f, k=k, eps=EPS, **kw)
        ln.launch()
        got = h.download()
        report(f"{label}[{variant}]", got, want, TOL_GEMV)
        h.fill_bytes(0xFF)
        ln.launch()
        assert_same_bits(label, got, h.download())
        seen[variant] = got
        _time(f"{label}.gate_up", variant, ln)
    assert_same_bits(f"{label}: two passes against one", seen["auto"], seen["two_pass"])
