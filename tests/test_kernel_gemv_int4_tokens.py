"""kernels/gemv_int4.cu's T-token GEMVs (the verify pass of speculative decoding) against the
single-token kernels, bit for bit, and against float64 numpy on the dequantized weights.

For T in {1, 2, 5, 8, 16} (16: the GEMV_TOKENS=16 build) each T-token kernel runs once on T
tokens' inputs, and the single-token kernel once per token on the same inputs, in the same
launch shape; every output of token j must have the single-token run's bits (viewed as
uint16 / uint32). Outputs are poisoned with NaN before every launch (the residual, read and
written, starts from the same values in both). gemv_int4_qkv_rope_tokens runs at positions
that cross a page (13 + j) and at the context's last 16 (32752 + j), its K/V must land in the slots of
positions pos + j through a shuffled block table, every other slot untouched. Each token's
outputs are also checked against the float64 reference (rel L2 within TOL_GEMV, as
tests/test_kernel_gemv_int4.py). Shapes: tests/test_kernel_gemv_int4.py's, real and awkward
(N not a multiple of 16, K of one group, group counts no warp split divides evenly).

The CPU tests plan the launches without a GPU: a T-token launch has the single-token launch's
grid and block (its W warps split K alike: the same sums), whatever the T-token kernel's own
occupancy; T and the shared memory of a block are checked.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref
from drvqwen.config import PRESETS
from drvqwen.launchers import (BufferSpec, FixedOccupancy, GemvInt4GateUpSwiglu, GemvInt4QkvRope, GemvInt4Residual,
                               LaunchError, RmsNorm)
from drvqwen.launchers.gemv_int4 import MAX_TOKENS, QKV_ROPE_DEFINES, gemv_tokens_smem_bytes
from kernel_testing import (TOL_GEMV, dequant64, dev, int4_specs, massive_residual, normed_fp16,  # noqa: F401
                            random_int4, report, upload_int4)

TOKEN_COUNTS = [1, 2, 5, 8, 16]
EPS = 1e-6
N_PAGES = 9
MAX_PAGES = 32768 // 16
# (label, N, K), (label, Hq, Hkv, Dh, D), (label, F, K): tests/test_kernel_gemv_int4.py's shapes.
RESIDUAL = [("7b.o_proj", 3584, 3584), ("7b.down_proj", 3584, 18944), ("0.5b.o_proj", 896, 896),
            ("0.5b.down_proj", 896, 4864), ("odd.n72.k640", 72, 640), ("odd.n200.k384", 200, 384),
            ("odd.n1.k128", 1, 128), ("odd.n136.k1152", 136, 1152)]
QKV = [("7b", 28, 4, 128, 3584), ("0.5b", 14, 2, 64, 896), ("odd", 3, 1, 32, 256)]
# First positions: a chunk that opens a page (13 + j crosses 16) and one whose 16 tokens end at the
# context's last position.
FIRST_POSITIONS = [13, 32768 - MAX_TOKENS]
GATE_UP = [("7b", 18944, 3584), ("0.5b", 4864, 896), ("odd", 200, 128)]


def _variants(label: str, n_tiles: int) -> list[tuple[str, dict]]:
    """(name, launcher kwargs), the same for both kernels: the launcher's own shape, and for the
    small shapes 3 blocks (blocks own several tiles; for q/k/v, tiles of different matrices).
    Small: at most 72 16-row tiles, so a block's 24 tiles of partials for 16 tokens fit its shared
    memory (0.5B gate_up's 304 tiles in 3 blocks would need 466 KB at T = 5)."""
    small = not label.startswith("7b") and n_tiles <= 72
    return [("auto", {}), ("3_blocks", {"blocks": 3})] if small else [("auto", {})]


def matmat64(qweight: np.ndarray, scales: np.ndarray, x: np.ndarray, rows_per_chunk: int = 4096) -> np.ndarray:
    """float64 x Wᵀ for INT4 W [N, K] and x [T, K]: [T, N], W dequantized chunk by chunk."""
    x64 = np.asarray(x, dtype=np.float64)
    out = np.empty((x64.shape[0], qweight.shape[0]), dtype=np.float64)
    for r in range(0, qweight.shape[0], rows_per_chunk):
        out[:, r:r + rows_per_chunk] = x64 @ dequant64(qweight[r:r + rows_per_chunk], scales[r:r + rows_per_chunk]).T
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


def _assert_bitwise(label: str, got: np.ndarray, want: np.ndarray) -> None:
    """got and want (one token's outputs) hold the same bits; names the first differing element."""
    g, w = _bits(np.ascontiguousarray(got)).reshape(-1), _bits(np.ascontiguousarray(want)).reshape(-1)
    assert g.shape == w.shape, (label, g.shape, w.shape)
    diff = np.flatnonzero(g != w)
    assert diff.size == 0, (f"{label}: {diff.size} of {g.size} outputs differ from the single-token kernel's, first "
                            f"[{diff[0]}] {got.reshape(-1)[diff[0]]!r} vs {want.reshape(-1)[diff[0]]!r}")


def _launch_and_check(where: str, ln, one, out, single: list[np.ndarray], want: np.ndarray) -> None:
    """Launch the T-token launcher `ln`, planned in the single-token launcher `one`'s grid and
    block; token j of `out` [T, …] must have the bits of single[j] (the single-token kernel's
    output for token j) and be within TOL_GEMV of the float64 reference want[j]."""
    assert (ln.specs[0].grid, ln.specs[0].block) == (one.specs[0].grid, one.specs[0].block), where
    ln.launch()
    got = out.download()
    for j in range(got.shape[0]):
        _assert_bitwise(f"{where} token {j}", got[j], single[j])
        report(f"{where} token {j}", got[j], want[j], TOL_GEMV)


def _residual_in(rng, t: int, n: int) -> np.ndarray:
    r = rng.standard_normal((t, n)).astype(np.float32)
    big = rng.choice(n, size=min(4, n), replace=False)  # Qwen2's massive residual channels
    r[:, big] = rng.choice([-1, 1], size=big.size) * rng.uniform(1e3, 3e4, size=big.size)
    return r


# ---- GPU: bit for bit against the single-token kernels ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("label,n,k", RESIDUAL, ids=[p[0] for p in RESIDUAL])
def test_gemv_int4_residual_tokens(dev, rng, label, n, k):
    qw, sc = random_int4(rng, n, k)
    x = rng.standard_normal((MAX_TOKENS, k)).astype(np.float16)
    res_in = _residual_in(rng, MAX_TOKENS, n)
    w = upload_int4(dev, "qw", qw), dev.upload("sc", sc)
    want = res_in.astype(np.float64) + matmat64(qw, sc, x)
    x1, res1 = dev.array("x1", (k,), np.float16), dev.array("res1", (n,), np.float32)
    xt, rest = dev.upload("x", x), dev.array("residual", (MAX_TOKENS, n), np.float32)
    for variant, kw in _variants(label, -(-n // 16)):
        single = []
        one = GemvInt4Residual(res1, x1, *w, n=n, k=k, **kw)
        for j in range(MAX_TOKENS):
            x1.upload(x[j])
            res1.upload(res_in[j])
            one.launch()
            single.append(res1.download())
        for t in TOKEN_COUNTS:
            res_t = dev.array("residual_t", (t, n), np.float32) if t < MAX_TOKENS else rest
            x_t = dev.upload("x_t", x[:t]) if t < MAX_TOKENS else xt
            res_t.upload(res_in[:t])
            ln = GemvInt4Residual(res_t, x_t, *w, n=n, k=k, n_tokens=t, **kw)
            _launch_and_check(f"{label}[{variant}] T={t}", ln, one, res_t, single, want)


@pytest.mark.gpu
@pytest.mark.parametrize("label,hq,hkv,dh,k", QKV, ids=[p[0] for p in QKV])
def test_gemv_int4_qkv_rope_tokens(dev, rng, label, hq, hkv, dh, k):
    nq, nkv = hq * dh, hkv * dh
    ws = [random_int4(rng, n, k) for n in (nq, nkv, nkv)]
    residual = np.stack([massive_residual(rng, k) for _ in range(MAX_TOKENS)])
    norm_w = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
    biases = [(rng.standard_normal(n) * 0.5).astype(np.float16) for n in (nq, nkv, nkv)]
    inv_freq = ref.rope_inv_freq(dh, 1e6)
    block_table = rng.integers(0, N_PAGES, size=MAX_PAGES).astype(np.int32)  # shuffled pages
    x = np.stack([normed_fp16(r, norm_w, EPS) for r in residual])
    q64, k64, v64 = (matmat64(qw, sc, x) + b.astype(np.float64) for (qw, sc), b in zip(ws, biases))
    weights = []
    for name, (qw, sc) in zip("qkv", ws):
        weights += [upload_int4(dev, f"{name}.qw", qw, dh), dev.upload(f"{name}.sc", sc)]
    tail = [*(dev.upload(f"b{i}", b) for i, b in enumerate(biases)), dev.upload("inv_freq", inv_freq),
            dev.upload("state", np.zeros(3, np.int32)), dev.upload("block_table", block_table)]
    state = tail[4]
    norm = dev.upload("norm_w", norm_w)
    cache_shape = (N_PAGES, hkv, 16, dh)
    dims = dict(n_heads=hq, n_kv_heads=hkv, head_dim=dh, dim=k, eps=EPS)
    res1, q1 = dev.array("res1", (k,), np.float32), dev.array("q1", (hq, dh), np.float16)
    k1, v1 = dev.array("k1", cache_shape, np.float16), dev.array("v1", cache_shape, np.float16)
    kt, vt = dev.array("k_t", cache_shape, np.float16), dev.array("v_t", cache_shape, np.float16)
    for variant, kw in _variants(label, (hq + 2 * hkv) * dh // 16):
        one = GemvInt4QkvRope(q1, k1, v1, res1, norm, *weights, *tail, **dims, **kw)
        for pos0 in FIRST_POSITIONS:
            # The single-token kernel, token j at position pos0 + j: its q and its K/V slot.
            single = []
            for j in range(MAX_TOKENS):
                pos = pos0 + j
                page, slot = block_table[pos // 16], pos % 16
                res1.upload(residual[j])
                state.upload(np.array([pos, 0, pos + 1], np.int32))
                for buf in (q1, k1, v1):
                    buf.fill_bytes(0xFF)
                one.launch()
                single.append((q1.download(), k1.download()[page, :, slot], v1.download()[page, :, slot]))
            for t, prenorm in [(t, False) for t in TOKEN_COUNTS] + [(5, True), (16, True)]:
                res_t, q_t = dev.upload("res_t", residual[:t]), dev.poisoned("q_t", (t, hq, dh), np.float16)
                for buf in (kt, vt):
                    buf.fill_bytes(0xFF)
                state.upload(np.array([pos0, 0, pos0 + 1], np.int32))
                # prenorm: the rows normalised by the rmsnorm kernel first, then the …_x_tokens kernel.
                xn = _prenormed(dev, res_t, norm, t, k) if prenorm else None
                ln = GemvInt4QkvRope(q_t, kt, vt, res_t, norm, *weights, *tail, **dims, n_tokens=t, x_normed=xn, **kw)
                assert (ln.specs[0].grid, ln.specs[0].block) == (one.specs[0].grid, one.specs[0].block)
                ln.launch()
                got_q, got_k, got_v = q_t.download(), kt.download(), vt.download()
                written = np.zeros(cache_shape[:3], dtype=bool)
                for j in range(t):
                    pos = pos0 + j
                    page, slot = block_table[pos // 16], pos % 16
                    written[page, :, slot] = True
                    where = f"{label}[{variant}{' prenorm' if prenorm else ''}] pos {pos0} T={t} token {j}"
                    _assert_bitwise(f"{where} q", got_q[j], single[j][0])
                    _assert_bitwise(f"{where} k", got_k[page, :, slot], single[j][1])
                    _assert_bitwise(f"{where} v", got_v[page, :, slot], single[j][2])
                    cos, sin = (c.astype(np.float64) for c in ref.rope_cos_sin(np.array([pos]), dh, 1e6))
                    report(f"{where} q", got_q[j], ref.apply_rope(q64[j].reshape(1, hq, dh), cos, sin)[0], TOL_GEMV)
                    report(f"{where} k", got_k[page, :, slot],
                           ref.apply_rope(k64[j].reshape(1, hkv, dh), cos, sin)[0], TOL_GEMV)
                    report(f"{where} v", got_v[page, :, slot], v64[j].reshape(hkv, dh), TOL_GEMV)
                for name, got in (("k", got_k), ("v", got_v)):
                    assert (got.view(np.uint16)[~written] == 0xFFFF).all(), \
                        f"{label} pos {pos0} T={t}: {name}_cache: a slot outside positions pos .. pos + T - 1 written"


@pytest.mark.gpu
@pytest.mark.parametrize("label,f,k", GATE_UP, ids=[p[0] for p in GATE_UP])
def test_gemv_int4_gate_up_swiglu_tokens(dev, rng, label, f, k):
    (gq, gs), (uq, us) = random_int4(rng, f, k), random_int4(rng, f, k)
    residual = np.stack([massive_residual(rng, k) for _ in range(MAX_TOKENS)])
    norm_w = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
    x = np.stack([normed_fp16(r, norm_w, EPS) for r in residual])
    want = ref.swiglu(matmat64(gq, gs, x), matmat64(uq, us, x))
    w = (dev.upload("norm_w", norm_w), upload_int4(dev, "gq", gq), dev.upload("gs", gs), upload_int4(dev, "uq", uq),
         dev.upload("us", us))
    res1, h1 = dev.array("res1", (k,), np.float32), dev.array("h1", (f,), np.float16)
    for variant, kw in _variants(label, -(-f // 16)):
        one = GemvInt4GateUpSwiglu(h1, res1, *w, f=f, k=k, eps=EPS, **kw)
        single = []
        for j in range(MAX_TOKENS):
            res1.upload(residual[j])
            h1.fill_bytes(0xFF)
            one.launch()
            single.append(h1.download())
        for t, prenorm in [(t, False) for t in TOKEN_COUNTS] + [(5, True), (16, True)]:
            res_t, h_t = dev.upload("res_t", residual[:t]), dev.poisoned("h_t", (t, f), np.float16)
            xn = _prenormed(dev, res_t, w[0], t, k) if prenorm else None
            ln = GemvInt4GateUpSwiglu(h_t, res_t, *w, f=f, k=k, eps=EPS, n_tokens=t, x_normed=xn, **kw)
            _launch_and_check(f"{label}[{variant}{' prenorm' if prenorm else ''}] T={t}", ln, one, h_t, single, want)


def _prenormed(dev, res_t, norm_w, t: int, k: int):
    """xn fp16 [t, k] = the rmsnorm kernel over the t rows of res_t (what the verify pass's
    prenorm plan launches before the …_x_tokens GEMVs)."""
    xn = dev.poisoned("xn_t", (t, k), np.float16)
    RmsNorm(xn, res_t, norm_w, dim=k, eps=EPS, rows=t).launch()
    return xn


# ---- CPU: launch shapes and argument checks ----------------------------------------------------------

# Two blocks per SM for the single-token kernels, one for the T-token ones: a launcher that sized
# the T-token grid from its own kernel's occupancy would get another grid.
# As on an H100 or H200: two blocks an SM of a single-token GEMV's default build (128 registers),
# three of qkv_rope's two-group build (QKV_ROPE_DEFINES: 80), one of a T-token kernel.
OCCUPANCY = FixedOccupancy(132, lambda kernel, _t, _s: 1 if kernel.kernel.endswith("_tokens")
                           else 3 if kernel.defines == QKV_ROPE_DEFINES else 2)


def _buf(name: str, *shape, dtype=np.float16) -> BufferSpec:
    return BufferSpec(name, shape, dtype)


_int4 = int4_specs  # (qweight, scales) of an INT4 weight, qweight in the device layout


def _plans(cfg, t: int | None) -> dict[str, object]:
    """The four GEMV launchers of one layer of `cfg` for t tokens (None: the single-token kernels)."""
    D, F, Hq, Hkv, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    nq, nkv, tt = Hq * Dh, Hkv * Dh, t or 1
    lead = () if t is None else (t,)
    cache = [_buf(c, 8, Hkv, 16, Dh) for c in ("k_cache", "v_cache")]
    common = dict(occupancy=OCCUPANCY, n_tokens=t)
    return {
        "qkv": GemvInt4QkvRope(_buf("q", *lead, nq), *cache, _buf("residual", tt * D, dtype=np.float32),
                               _buf("norm_w", D), *_int4("q", nq, D), *_int4("k", nkv, D), *_int4("v", nkv, D),
                               _buf("q_bias", nq), _buf("k_bias", nkv), _buf("v_bias", nkv),
                               _buf("inv_freq", Dh // 2, dtype=np.float32), _buf("state", 3, dtype=np.int32),
                               _buf("block_table", 64, dtype=np.int32), n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh,
                               dim=D, eps=EPS, **common),
        "o_proj": GemvInt4Residual(_buf("residual", tt, D, dtype=np.float32), _buf("attn", tt, nq), *_int4("o", D, nq),
                                   n=D, k=nq, **common),
        "gate_up": GemvInt4GateUpSwiglu(_buf("h", tt, F), _buf("residual", tt, D, dtype=np.float32), _buf("norm_w", D),
                                        *_int4("g", F, D), *_int4("u", F, D), f=F, k=D, eps=EPS, **common),
        "down": GemvInt4Residual(_buf("residual", tt, D, dtype=np.float32), _buf("h", tt, F), *_int4("d", D, F), n=D,
                                 k=F, **common),
    }


@pytest.mark.parametrize("preset", ["7b", "0.5b"])
def test_tokens_launch_is_the_single_token_launch(preset):
    """Same grid and block as the single-token launch for every T (so the same W: the same sums),
    the `…_tokens` kernel in the single-token launch's build plus the build for T, the same
    arguments plus n_tokens, and the shared memory of T tokens' x (where staged) and partials."""
    cfg = PRESETS[preset]
    single = _plans(cfg, None)
    for t in range(1, MAX_TOKENS + 1):
        for name, ln in _plans(cfg, t).items():
            one, spec = single[name].specs[0], ln.specs[0]
            where = f"{preset} {name} T={t}"
            assert (spec.grid, spec.block) == (one.grid, one.block), where
            assert spec.kernel.kernel == one.kernel.kernel + "_tokens", where
            # The single-token launch's build plus the build for T. qkv_rope takes its two-group
            # build where three blocks an SM give each block fewer tiles: the 7B's 288 tiles (two a
            # block at two blocks an SM, one at three), not the 0.5B's 72 (one either way).
            assert dict(one.kernel.defines) == (dict(QKV_ROPE_DEFINES) if (name, preset) == ("qkv", "7b") else {}), where
            assert dict(spec.kernel.defines) == {**dict(one.kernel.defines), **({} if t <= 8 else {"GEMV_TOKENS": 16})}, where
            assert list(spec.args) == [*one.args, "n_tokens"] and spec.args["n_tokens"].value == t, where
            n_tiles = {"qkv": (cfg.q_dim + 15) // 16 + 2 * ((cfg.kv_dim + 15) // 16),
                       "gate_up": (cfg.intermediate_size + 15) // 16}.get(name, (cfg.hidden_size + 15) // 16)
            k = {"o_proj": cfg.q_dim, "down": cfg.intermediate_size}.get(name, cfg.hidden_size)
            per_block, warps = -(-n_tiles // spec.grid[0]), spec.block[0] // 32
            mt, staged = (2 if name == "gate_up" else 1), name in ("qkv", "gate_up")
            assert spec.smem_bytes == gemv_tokens_smem_bytes(k, per_block, warps, mt, t, staged), where
            # Independently: the partials, and x only where the kernel stages it.
            assert spec.smem_bytes == (t * (2 * k + 64) if staged else 0) + per_block * mt * warps * t * 16 * 4, where


def test_tokens_out_of_range_and_too_much_shared_memory_are_refused():
    cfg = PRESETS["7b"]
    for t in (0, MAX_TOKENS + 1):
        with pytest.raises(LaunchError, match=f"n_tokens={t}"):
            _plans(cfg, t)
    # A 32B-wide gate/up (K = 5120, F = 27648) at 16 tokens: x and the partials of 7 tiles per
    # block pass the 227 KiB a block may have.
    with pytest.raises(LaunchError, match="gemv_int4_gate_up_swiglu_tokens: 16 tokens at K=5120"):
        GemvInt4GateUpSwiglu(_buf("h", 16, 27648), _buf("residual", 16, 5120, dtype=np.float32), _buf("norm_w", 5120),
                             *_int4("g", 27648, 5120), *_int4("u", 27648, 5120), f=27648, k=5120, eps=EPS,
                             occupancy=OCCUPANCY, n_tokens=16)


def test_tokens_buffers_are_checked_for_t_tokens():
    cfg = PRESETS["0.5b"]
    D = cfg.hidden_size
    with pytest.raises(LaunchError, match="residual: expected 2688 elements"):
        GemvInt4Residual(_buf("residual", D, dtype=np.float32), _buf("x", 3, D), *_int4("o", D, D), n=D, k=D,
                         occupancy=OCCUPANCY, n_tokens=3)
    with pytest.raises(LaunchError, match="x: expected 2688 elements"):
        GemvInt4Residual(_buf("residual", 3, D, dtype=np.float32), _buf("x", D), *_int4("o", D, D), n=D, k=D,
                         occupancy=OCCUPANCY, n_tokens=3)
