"""Shared pieces of the GPU kernel tests (tests/test_kernel_*.py).

- `dev` fixture: device scratch arrays, each its own cuMemAlloc, freed after the test.
  `dev.upload(name, host)` copies a host array; `dev.poisoned(name, shape, dtype)` gives a
  buffer filled with 0xFF bytes — NaN in fp16 and fp32 — so a test can check that the kernel
  wrote every element (docs/numerics.md#how-the-tests-catch-what-they-catch).
- `report(...)`: relative L2 and max abs error against a float64 reference, printed, with the
  first mismatches on failure.
- `graph_time_us(...)`: GPU time per launch of a launcher, replayed from a captured graph (drvqwen.cuda.graph)
  (no Python launch overhead in the figure).
- `upload_int4(dev, name, qweight, pair_dim)`: a layout-id-1 INT4 qweight uploaded in the device
  layout the INT4 kernels read (format/int4_tiles.py); `int4_specs(...)` the same weight's
  BufferSpecs for the CPU tests' launchers.

The references are drvqwen.reference's dtype-generic functions evaluated in float64 on the
kernel's exact inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.cuda.graph import graph_time_us  # noqa: F401  (the kernel tests import it from here)

# Relative-L2 thresholds (docs/numerics.md#kernel-tests-against-the-reference): FP32-accumulated
# GEMV/norm kernels, fused attention. Defined once with the stepwise reference, which judges the
# launches of `drvqwen step` by the same bounds.
from drvqwen.reference_steps import TOL_ATTENTION, TOL_GEMV  # noqa: E402,F401

# The FP16 lm_head (kernels/gemv_f16.cu) has no FP16 output to round: its logits are FP32 sums
# of exact FP16 products, so its bound is far tighter than TOL_GEMV. A numpy model of the MMA's
# FP32 accumulation with truncation (every term cut to the largest one's 24 bits, each MMA's sum
# truncated to FP32) gives ~1e-6 at the 7B and 0.5B shapes, the sequential FP32 FMA chain the
# same; an FP16 rounding anywhere on the way (a partial, x) would cost ~1e-4 and fail.
TOL_LM_HEAD = 1e-5


class DeviceScratch:
    """Device arrays for one test; every buffer is freed by `close()`."""

    def __init__(self) -> None:
        self._buffers = []

    def array(self, name: str, shape, dtype):
        from drvqwen.cuda import DeviceArray, DeviceBuffer

        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in np.atleast_1d(np.asarray(shape, dtype=np.int64)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buf = DeviceBuffer(max(nbytes, 16), name)
        self._buffers.append(buf)
        return DeviceArray(name, buf.ptr, shape, dtype)

    def upload(self, name: str, host: np.ndarray):
        host = np.ascontiguousarray(host)
        arr = self.array(name, host.shape, host.dtype)
        arr.upload(host)
        return arr

    def poisoned(self, name: str, shape, dtype):
        arr = self.array(name, shape, dtype)
        arr.fill_bytes(0xFF)
        return arr

    def close(self) -> None:
        for b in self._buffers:
            b.free()
        self._buffers.clear()


@pytest.fixture
def dev():
    from drvqwen.cuda import get_device

    get_device()
    scratch = DeviceScratch()
    yield scratch
    get_device().synchronize()
    scratch.close()


def report(label: str, got: np.ndarray, want: np.ndarray, tol: float, *, atol: float | None = None) -> float:
    """Print rel-L2 / max-abs of `got` vs the float64 reference `want`; assert rel-L2 ≤ tol.

    Also asserts that `got` holds no NaN (every element written, nothing poisoned left).
    Returns the relative L2 error.
    """
    g = np.asarray(got, dtype=np.float64).reshape(-1)
    w = np.asarray(want, dtype=np.float64).reshape(-1)
    assert g.shape == w.shape, (g.shape, w.shape)
    nan = np.isnan(g)
    assert not nan.any(), f"{label}: {nan.sum()} of {g.size} outputs are NaN (unwritten?) " \
                          f"first at {np.flatnonzero(nan)[:8].tolist()}"
    diff = np.abs(g - w)
    rel = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300))
    max_abs = float(diff.max()) if diff.size else 0.0
    print(f"  {label}: rel_l2={rel:.3e} max_abs={max_abs:.3e} (n={g.size}, ref rms="
          f"{np.sqrt(np.mean(w * w)) if w.size else 0:.3e})")
    bad = rel > tol or (atol is not None and max_abs > atol)
    if bad:
        worst = np.argsort(-diff)[:8]
        lines = [f"    [{i}] got {g[i]!r} want {w[i]!r}" for i in worst]
        pytest.fail(f"{label}: rel_l2 {rel:.3e} (tol {tol:g}), max_abs {max_abs:.3e}"
                    f"{'' if atol is None else f' (atol {atol:g})'}; worst:\n" + "\n".join(lines))
    return rel


def assert_same_bits(label: str, a: np.ndarray, b: np.ndarray) -> None:
    """Two runs of the same launch must agree bit for bit (no atomics, fixed reduction order)."""
    assert a.tobytes() == b.tobytes(), f"{label}: two launches gave different bits"


def assert_bits_as_single_token(label: str, got: np.ndarray, want: np.ndarray) -> None:
    """A T-token kernel's output for one token (`got`) has the bits of the single-token kernel's
    (`want`), element for element; the message names the first that differs."""
    def bits(a):
        a = np.ascontiguousarray(a)
        return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]).reshape(-1)

    g, w = bits(got), bits(want)
    assert g.shape == w.shape, (label, g.shape, w.shape)
    diff = np.flatnonzero(g != w)
    assert diff.size == 0, (f"{label}: {diff.size} of {g.size} values differ from the single-token kernel's, first "
                            f"[{diff[0]}] {got.reshape(-1)[diff[0]]!r} vs {want.reshape(-1)[diff[0]]!r}")




def random_int4(rng: np.random.Generator, n: int, k: int, scale_lo=0.002, scale_hi=0.01):
    """Random layout-id-1 weights: every nibble uniform in 0..15 (codes -8..7), FP16 scales.

    Returns (qweight uint32 [n, k/8], scales fp16 [n, k/128]). Random words are already a
    valid packing (any 32 bits are 8 nibbles), which is much faster than quantize+pack.
    """
    qweight = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = rng.uniform(scale_lo, scale_hi, size=(n, k // 128)).astype(np.float16)
    return qweight, scales


def upload_int4(dev, name: str, qweight: np.ndarray, pair_dim: int = 0):
    """A layout-id-1 qweight uint32 [N, K/8] on the device as the INT4 kernels (gemv_int4.cu,
    gemm_int4.cu) read it: uint32 [ceil(N/16), K/128, 16, 16] in the device layout
    (format/int4_tiles.py), pair_dim the head dim for q_proj, k_proj and v_proj and 0 for every
    other weight. The references stay on the layout-id-1 array."""
    from drvqwen.format.int4_tiles import to_tile_major

    return dev.upload(name, to_tile_major(qweight, pair_dim))


def int4_specs(name: str, n: int, k: int):
    """(qweight, scales) BufferSpecs of an INT4 [n, k] weight as the INT4 kernels' launchers take
    it (no GPU): qweight uint32 [ceil(n/16), K/128, 16, 16] (the device layout), scales fp16
    [n, K/128]."""
    from drvqwen.launchers.base import BufferSpec

    return (BufferSpec(f"{name}.qweight", (-(-n // 16), k // 128, 16, 16), np.uint32),
            BufferSpec(f"{name}.scales", (n, k // 128), np.float16))


def dequant64(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The reference weights in float64 through format.quant.dequantize (layout id 1)."""
    from drvqwen.format import quant

    return quant.dequantize(qweight, scales, np.float32).astype(np.float64)


def matvec64(w_qweight: np.ndarray, w_scales: np.ndarray, x: np.ndarray, rows_per_chunk: int = 4096) -> np.ndarray:
    """float64 W x for INT4 W, dequantized chunk by chunk (the 7B gate/up is 136 M weights)."""
    x64 = np.asarray(x, dtype=np.float64)
    out = np.empty(w_qweight.shape[0], dtype=np.float64)
    for r in range(0, w_qweight.shape[0], rows_per_chunk):
        out[r:r + rows_per_chunk] = dequant64(w_qweight[r:r + rows_per_chunk], w_scales[r:r + rows_per_chunk]) @ x64
    return out


def massive_residual(rng: np.random.Generator, k: int) -> np.ndarray:
    """A residual stream with Qwen2's few channels of huge magnitude (fp32 [k])."""
    r = rng.standard_normal(k).astype(np.float32)
    big = rng.choice(k, size=min(4, k), replace=False)
    r[big] = rng.choice([-1, 1], size=big.size) * rng.uniform(1e3, 3e4, size=big.size)
    return r


def normed_fp16(residual: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm(residual) · weight as the fused GEMVs feed it to their MMAs: computed in float64,
    rounded to FP16 once."""
    from drvqwen import reference as ref

    return ref.rmsnorm(residual.astype(np.float64), weight, eps).astype(np.float16)


def random_fmt_weight(dev, rng: np.random.Generator, fmt, n: int, k: int, name: str = "W"):
    """(FmtWeight on the device, float64 [n, k] weight) of a random weight in `fmt`: a format of
    weight_formats.py (random_weight, dequantized as the reference does) or DENSE_F16, uploaded in
    the device layout (launchers.gemv_fmt.device_parts: 4–6-bit codes tile-major)."""
    from drvqwen.format import weight_formats as wf
    from drvqwen.launchers.gemv_fmt import DENSE_F16, FmtWeight, device_parts

    if fmt is DENSE_F16:
        parts = {"weight": (rng.standard_normal((n, k)) * 0.03).astype(np.float16)}
        w = parts["weight"].astype(np.float64)
    else:
        parts = wf.random_weight(fmt, n, k, rng)
        w = wf.dequantize_weight(fmt, lambda t: parts[t.rsplit(".", 1)[1]], name).astype(np.float64)
    return FmtWeight(fmt, {p: dev.upload(f"{name}.{p}", a) for p, a in device_parts(fmt, parts).items()}, name), w


def check_qkv_rope_gemm(dev, rng, fmt, Fused, apart, m: int, start: int, split: bool, hd: int, hq: int, hkv: int,
                        tile: int, scratch, *, fmt_v=None, split_blocks: int = 4):
    """A QKV GEMM with the bias, RoPE and K/V writes in its epilogue (launcher `Fused`, weights in
    `fmt`, K = 512): q and the chunk's K/V cache slots against the float64 reference (x Wᵀ + bias,
    rotated by rope_table_rows' cos and sin), only the chunk's slots changed, q's rows past M
    poisoned; and where the tiles are whole, bit for bit what the two-launch path writes —
    `apart(qkv, x, [wq, wk, wv], [Nq, Nkv, Nkv], prefill_state, ldo, tile)` filling FP32 qkv,
    then rope_kv_rows: the same sums in the same order. `scratch(rows, n, k, tile)` gives the
    split-K scratch of a `split` case (`split_blocks` blocks); `fmt_v`: v's format where it is not
    `fmt`. Returns the fused launcher."""
    from drvqwen import launchers
    from drvqwen import reference as ref
    from drvqwen.kv_cache import PAGE_TOKENS

    k = 512
    nq, nkv = hq * hd, hkv * hd
    rows = max(64, -(-m // 64) * 64, tile)
    x = rng.standard_normal((rows, k)).astype(np.float16)
    (wq, q64), (wk, k64), (wv, v64) = (random_fmt_weight(dev, rng, f, n, k, name=nm)
                                       for f, n, nm in ((fmt, nq, "wq"), (fmt, nkv, "wk"), (fmt_v or fmt, nkv, "wv")))
    biases = [(rng.standard_normal(n) * 0.1).astype(np.float16) for n in (nq, nkv, nkv)]
    inv_freq = ref.rope_inv_freq(hd, 1e6)
    n_pages = -(-(start + m) // PAGE_TOKENS) + 2
    block_table = rng.permutation(n_pages).astype(np.int32)
    xd, ps = dev.upload("x", x), dev.upload("ps", np.array([start, m], np.int32))
    bt, fd = dev.upload("bt", block_table), dev.upload("inv_freq", inv_freq)
    bd = [dev.upload(f"b{i}", b) for i, b in enumerate(biases)]
    rope_cs = dev.poisoned("rope_cs", (rows, hd // 2, 2), np.float32)
    launchers.RopeTableRows(rope_cs, fd, ps, rows=rows, head_dim=hd).launch()
    sk = scratch(rows, nq + 2 * nkv, k, tile) if split else None
    heads = dict(n_heads=hq, n_kv_heads=hkv, head_dim=hd)

    def outputs(tag):
        return (dev.poisoned(f"q_{tag}", (rows, hq, hd), np.float16),
                dev.poisoned(f"k_{tag}", (n_pages, hkv, PAGE_TOKENS, hd), np.float16),
                dev.poisoned(f"v_{tag}", (n_pages, hkv, PAGE_TOKENS, hd), np.float16))

    fused = outputs("fused")
    g = Fused(*fused, xd, wq, wk, wv, *bd, rope_cs, ps, bt, k=k, rows=rows, split_k=sk,
              blocks=split_blocks if split else None, tile_tokens=tile, **heads)
    assert g.tiling.tile_tokens == tile and g.tiling.split == split, "the case should plan as its id says"
    g.launch()
    got_q, got_k, got_v = (a.download() for a in fused)

    x64 = x[:m].astype(np.float64)
    pos = start + np.arange(m)
    cos, sin = (a.astype(np.float64) for a in ref.rope_cos_sin(pos, hd, 1e6))
    q, kk, v = ((x64 @ w.T + b.astype(np.float64)).reshape(m, -1, hd)
                for w, b in zip((q64, k64, v64), biases))
    tag = f"{fmt.name}{'/' + fmt_v.name if fmt_v else ''} qkv_rope M={m} start={start} tile={tile} {'split' if split else 'whole'}"
    report(f"{tag} q", got_q[:m], ref.apply_rope(q, cos, sin), TOL_GEMV)
    assert np.isnan(got_q[m:].astype(np.float32)).all(), "q rows past M were written"
    report(f"{tag} k", ref.gather_pages(got_k, block_table, start + m)[start:], ref.apply_rope(kk, cos, sin), TOL_GEMV)
    report(f"{tag} v", ref.gather_pages(got_v, block_table, start + m)[start:], v, TOL_GEMV)
    written = np.zeros((n_pages, PAGE_TOKENS), bool)
    written[block_table[pos // PAGE_TOKENS], pos % PAGE_TOKENS] = True
    for c in (got_k, got_v):
        assert np.isnan(c.transpose(0, 2, 1, 3)[~written].astype(np.float32)).all(), "a slot outside the chunk changed"
    if sk is not None:
        assert not sk.counters.download().any(), "split-K counters left non-zero"
        return g

    separate = outputs("apart")
    ld = nq + 2 * nkv
    qkv = dev.poisoned("qkv", (rows, ld), np.float32)
    apart(qkv, xd, [wq, wk, wv], [nq, nkv, nkv], ps, ld, tile)
    launchers.RopeKvRows(*separate, qkv, *bd, fd, ps, bt, rows=rows, **heads).launch()
    for name, a, b in zip("qkv", (got_q, got_k, got_v), separate):
        assert_same_bits(f"{tag} {name} against the stacked GEMMs + rope_kv_rows", a, b.download())
    return g


def check_long_k_one_wave(dev, label: str, make, x: np.ndarray, r0: np.ndarray, w64: np.ndarray) -> None:
    """A residual GEMM at the 7B's down_proj shape with a 1024-row chunk (N = 3584, K = 18944) on
    a grid of 132: `make(residual, split_k=…, **plan)` builds it (x, W and prefill_state bound,
    max_blocks=132). Under its own plan it must take one wave of 112 whole 256-token tiles
    (gemm_int4.lockstep_tiling); forced to stream-K ranges (tile 256, P 132) it runs on the same
    inputs. Each run leaves the scratch's counters at zero; the plan's output is checked against
    the float64 reference on the dequantized weights `w64` on a few rows (float64 over K = 18944
    is slow on the CPU) and against the ranges' output (another summation order: within the
    tolerance, not the same bits)."""
    from drvqwen.launchers.gemm_int4 import SplitKScratch

    sk = SplitKScratch(dev.array, 132 * 2, 132)  # a 256-token partial is two units, one counter a block
    sk.partials.fill_bytes(0xFF)
    outs = {}
    for name, kw in (("lockstep", {}), ("ranges", dict(tile_tokens=256, blocks=132))):
        res = dev.upload(f"residual_{name}", r0)
        g = make(res, split_k=sk, **kw)
        t = g.tiling
        assert (t.tile_tokens, t.blocks, t.split) == ((256, 112, False) if name == "lockstep" else (256, 132, True))
        g.launch()
        outs[name] = res.download()
        assert not sk.counters.download().any(), f"{label} {name}: counters left non-zero"
    rows = np.array([0, 1, 255, 256, 511, 777, 1022, 1023])
    want = r0[rows].astype(np.float64) + x[rows].astype(np.float64) @ w64.T
    report(f"{label} lockstep, 8 rows", outs["lockstep"][rows], want, TOL_GEMV)
    report(f"{label} lockstep against ranges", outs["lockstep"], outs["ranges"].astype(np.float64), TOL_GEMV)
