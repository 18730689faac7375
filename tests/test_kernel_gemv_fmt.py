"""kernels/gemv_fmt.cu (the decode GEMVs and embedding rows over the per-tensor weight formats)
against float64 numpy on the weights as format/weight_formats.py dequantizes them.

Every format at the real 0.5B and 7B projection shapes and at awkward ones (N = 1, N not a
multiple of 16, few K quads per warp), for every launcher: y fp16, residual +=, the fused
qkv/RoPE/K-V write with q, k and v in different formats (llama.cpp's Q4_K_M recipe mixes them),
gate/up with SwiGLU, the lm_head with its argmax partials, and the embedding row — which must
equal the reference's dequantized row bit for bit. Outputs are NaN-poisoned before each launch
and must be fully written; the same launch twice gives the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref
from drvqwen.format import weight_formats as wf
from drvqwen.format.int4_tiles import from_tile_major
from drvqwen.format.kquant_lanes import from_lane_words
from drvqwen.launchers.gemv_fmt import DENSE_F16, device_parts, device_tensors, lane_word_scales, tile_major_parts
from kernel_testing import (TOL_GEMV, assert_same_bits, dev, graph_time_us, massive_residual,  # noqa: F401
                            normed_fp16, random_fmt_weight, report)

# (label, N, K)
SHAPES = [("0.5b.q_proj", 896, 896), ("0.5b.gate_proj", 4864, 896), ("0.5b.down_proj", 896, 4864),
          ("7b.o_proj", 3584, 3584), ("7b.down_proj", 3584, 18944),
          ("odd.n1.k256", 1, 256), ("odd.n37.k384", 37, 384), ("odd.n200.k1280", 200, 1280)]
# Every format of weight_formats.py, and a dense FP16 matrix (a GGUF's F16 projection kept as it
# is: the same kernels, WF_DENSE).
FORMATS = list(wf.FORMATS.values()) + [DENSE_F16]
# Only pairs that can exist: a format whose group does not divide K stores no such weight.
CASES = [(fmt, label, n, k) for fmt in FORMATS for label, n, k in SHAPES if fmt.fits(k)]
EPS = 1e-6
N_PAGES = 9
MAX_PAGES = 32768 // 16


def test_every_format_has_a_gpu_kernel():
    """CPU: the formats a file may hold are exactly those kernels/weight_formats.cuh reads, and
    every real projection shape of the 0.5B and 7B fits every format it can hold."""
    from drvqwen.launchers.gemv_fmt import GPU_FORMAT_IDS

    assert set(wf.FORMATS) == set(GPU_FORMAT_IDS)
    assert {f.name for f in FORMATS if f.fits(3584) and f.fits(18944)} == {f.name for f in FORMATS}


def test_format_defines_fit_the_real_recipes_two_blocks_per_sm():
    """CPU (NVRTC): compiled for the formats of llama.cpp's Q4_K_M files — the 7B's Q4_K with
    Q6_K, the 0.5B's Q5_0, Q8_0, Q4_K and Q6_K — both fused gemv_fmt kernels fit 2 blocks of 8
    warps per SM without spilling; a set where one does not (a dense FP16 gate/up) keeps 1 for
    that kernel alone, and its build does not spill."""
    from drvqwen.cuda.nvrtc import compile_kernel
    from drvqwen.launchers.gemv_fmt import DENSE_ID, format_defines

    by = {f.name: f.id for f in wf.FORMATS.values()}
    for names in (("q4_k", "q6_k"), ("q5_g32", "q8_g32", "q4_k", "q6_k")):
        defs = dict(format_defines(by[n] for n in names))
        assert defs["WF_FORMATS"] == sum(1 << by[n] for n in names)
        assert defs["GF_QKV_MIN_BLOCKS"] == defs["GF_GATE_UP_MIN_BLOCKS"] == 2, names
    defs = dict(format_defines([by["q4_k"], DENSE_ID]))
    assert defs["GF_GATE_UP_MIN_BLOCKS"] == 1 and defs["GF_QKV_MIN_BLOCKS"] == 2
    spilled = [r.function for r in compile_kernel("gemv_fmt", defines=defs).resources.values() if r.spills]
    assert not spilled


def test_format_defines_without_nvrtc_keep_one_block(monkeypatch):
    """CPU: where NVRTC cannot compile (no library, no cache to write), the defines are the mask
    with 1 block per SM for both fused kernels, and no error reaches the plan."""
    from drvqwen.cuda import nvrtc
    from drvqwen.cuda.errors import NvrtcError
    from drvqwen.launchers import gemv_fmt

    def fail(*_a, **_k):
        raise NvrtcError("nvrtcCreateProgram", "no NVRTC here")

    monkeypatch.setattr(nvrtc, "compile_kernel", fail)
    gemv_fmt._format_defines.cache_clear()
    try:
        assert dict(gemv_fmt.format_defines([2, 12])) == {"WF_FORMATS": (1 << 2) | (1 << 12),
                                                          "GF_QKV_MIN_BLOCKS": 1, "GF_GATE_UP_MIN_BLOCKS": 1}
    finally:
        gemv_fmt._format_defines.cache_clear()


def test_a_plan_whose_formats_leave_out_a_projection_compiles_it_dense():
    """CPU: a formats dict without some projection plans that weight as dense FP16, and the
    kernels are compiled for dense too (the mask covers the plan as planned)."""
    import dataclasses

    from drvqwen.decode import plan_decode
    from drvqwen.format.tensor_set import default_formats
    from drvqwen.launchers import FixedOccupancy
    from drvqwen.launchers.gemv_fmt import DENSE_ID, compiled_formats

    from helpers import TINY

    cfg = dataclasses.replace(TINY, max_position=64)
    formats = {p: (9 if "down_proj" in p else 10) for p in default_formats(cfg) if "o_proj" not in p}
    plan = plan_decode(cfg, occupancy=FixedOccupancy(4), formats=formats)
    assert {9, 10, DENSE_ID} <= compiled_formats(plan.fmt_defines)


def test_the_launchers_refuse_an_unknown_format_id_and_mixed_gate_up():
    """CPU: a format id without a GPU kernel is named when a build is asked for it, and the fused
    gate/up GEMV refuses gate and up in different formats, naming both."""
    from drvqwen.launchers import BufferSpec, FixedOccupancy, LaunchError
    from drvqwen.launchers.gemv_fmt import GemvFmtGateUpSwiglu, fmt_weight, format_mask

    with pytest.raises(LaunchError, match="weight format id 7 has no GPU kernel"):
        format_mask([10, 7])
    f, k = 64, 256
    q4k, q6k = wf.FORMATS[10], wf.FORMATS[12]
    specs = {}
    for prefix, fmt in (("gate", q4k), ("up", q6k)):
        specs.update({n: BufferSpec(n, shape, dt) for n, (dt, shape) in device_tensors(fmt, prefix, f, k).items()})
    gate, up = fmt_weight(specs.__getitem__, "gate", q4k), fmt_weight(specs.__getitem__, "up", q6k)
    with pytest.raises(LaunchError, match=r"gate \(q4_k\) and up \(q6_k\): .* one format"):
        GemvFmtGateUpSwiglu(BufferSpec("h", (f,), np.float16), BufferSpec("r", (k,), np.float32),
                            BufferSpec("n", (k,), np.float16), gate, up, f=f, k=k, eps=1e-6,
                            occupancy=FixedOccupancy(132))


def test_a_kernel_compiled_for_other_formats_is_refused():
    """CPU: a launcher refuses a weight whose format its kernel was not compiled for, naming it."""
    from drvqwen.launchers import BufferSpec, FixedOccupancy, LaunchError
    from drvqwen.launchers.gemv_fmt import GemvFmt, fmt_weight

    q4k, q6k = wf.FORMATS[10], wf.FORMATS[12]
    n, k = 64, 512
    specs = {name: BufferSpec(name, shape, dt) for name, (dt, shape) in device_tensors(q4k, "w", n, k).items()}
    w = fmt_weight(specs.__getitem__, "w", q4k)
    y, x = BufferSpec("y", (n,), np.float16), BufferSpec("x", (k,), np.float16)
    occ = FixedOccupancy(132)
    GemvFmt(y, x, w, n=n, k=k, occupancy=occ, defines=(("WF_FORMATS", 1 << q4k.id),))
    with pytest.raises(LaunchError, match="q4_k is not among the formats"):
        GemvFmt(y, x, w, n=n, k=k, occupancy=occ, defines=(("WF_FORMATS", 1 << q6k.id),))


def test_a_weight_past_32_bit_offsets_is_refused():
    """CPU: the kernels index each stored plane with 32-bit element offsets; a weight of 2^32
    or more elements is refused with its name before any launch."""
    from drvqwen.launchers import LaunchError
    from drvqwen.launchers.gemv_fmt import FmtWeight

    with pytest.raises(LaunchError, match=r"lm_head: 1048576×4096 weights: .* 2\^32"):
        FmtWeight(wf.FORMATS[2], {}, "lm_head").check(2**20, 4096)


def test_tile_major_codes_need_whole_quads_and_padded_rows():
    """CPU: a weight whose codes the GPU holds tile-major (4–6 bits: q4_g32) is refused at K = 96
    even where the kernel itself steps by chunks (the embedding's quad of 32, the mma prefill
    GEMM's), and its qweight must have the padded size, rows rounded up to a tile: [208, K/8] for
    N = 200, where the file's [200, K/8] is refused. An 8-bit format keeps the file's size and K = 96."""
    from drvqwen.launchers import BufferSpec, LaunchError
    from drvqwen.launchers.gemv_fmt import FmtWeight, codes_tile_major

    def weight(fmt, n, k, qweight_rows):
        specs = {t.rsplit(".", 1)[1]: BufferSpec(t, shape, dt) for t, (dt, shape) in device_tensors(fmt, "W", n, k).items()}
        specs["qweight"] = BufferSpec("W.qweight", (qweight_rows, specs["qweight"].shape[1]), np.uint32)
        return FmtWeight(fmt, specs, "W")

    q4, q8 = wf.FORMATS[2], wf.FORMATS[9]
    assert codes_tile_major(q4) and not codes_tile_major(q8)
    with pytest.raises(LaunchError, match=r"W: format q4_g32 at K=96: the GPU kernels need K a multiple of 128"):
        weight(q4, 64, 96, 64).check(64, 96, quad=32)
    weight(q8, 64, 96, 64).check(64, 96, quad=32)
    weight(q4, 200, 1280, 208).check(200, 1280)
    with pytest.raises(LaunchError, match=r"W\.qweight: expected 33280 elements"):
        weight(q4, 200, 1280, 200).check(200, 1280)
    weight(q8, 200, 1280, 200).check(200, 1280)
    # 5-bit codes: the high bits (4 words a row and quad) are padded the same way.
    q5 = wf.FORMATS[5]
    specs = {t.rsplit(".", 1)[1]: BufferSpec(t, shape, dt) for t, (dt, shape) in device_tensors(q5, "W", 200, 1280).items()}
    specs["qweight"] = BufferSpec("W.qweight", (208, 160), np.uint32)
    with pytest.raises(LaunchError, match=r"W\.qhigh: expected 8320 elements"):
        FmtWeight(q5, specs, "W").check(200, 1280)
    specs["qhigh"] = BufferSpec("W.qhigh", (208, 40), np.uint32)
    FmtWeight(q5, specs, "W").check(200, 1280)


def _time(label, ln):
    if label.startswith("7b"):
        us = graph_time_us(ln)
        print(f"  {label}: {us:.2f} µs/call, {ln.bytes_moved / us / 1e3:.0f} GB/s ({ln.bytes_moved / 1e6:.2f} MB)")


def _check_plain_and_residual(dev, rng, fmt, label: str, n: int, k: int, tag: str = "", **launch):
    """y = W x (fp16 out, poisoned first, the same bits twice) and residual += W x against float64,
    with `launch` passed to both launchers (blocks, defines). Returns the residual launcher."""
    from drvqwen.launchers.gemv_fmt import GemvFmt, GemvFmtResidual

    w, w64 = random_fmt_weight(dev, rng, fmt, n, k)
    x = rng.standard_normal(k).astype(np.float16)
    want = w64 @ x.astype(np.float64)
    xd = dev.upload("x", x)
    y = dev.poisoned("y", (n,), np.float16)
    ln = GemvFmt(y, xd, w, n=n, k=k, **launch)
    ln.launch()
    got = y.download()
    report(f"{fmt.name}.{label}.f16{tag}", got, want, TOL_GEMV)
    y.fill_bytes(0xFF)
    ln.launch()
    assert_same_bits(label, got, y.download())

    # Qwen2's huge channels need rows to hide among: at N = 1 the one row would be huge, and its
    # FP32 ulp (~2e-3 at 3e4) would swamp the added dot product the check measures.
    r0 = massive_residual(rng, n) if n >= 64 else rng.standard_normal(n).astype(np.float32)
    res = dev.upload("residual", r0)
    rl = GemvFmtResidual(res, xd, w, n=n, k=k, **launch)
    rl.launch()
    got = res.download()
    report(f"{fmt.name}.{label}.delta{tag}", got.astype(np.float64) - r0, want, TOL_GEMV)
    return rl


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,label,n,k", CASES, ids=[f"{c[0].name}-{c[1]}" for c in CASES])
def test_gemv_fmt(dev, rng, fmt, label, n, k):
    _time(f"{label}.{fmt.name}", _check_plain_and_residual(dev, rng, fmt, label, n, k))


# GF_FLAT_SPLIT's plain and residual GEMVs on 3 blocks, each owning several tiles, so that warp
# ranges begin and end inside tiles: K = 3584 (28 quads over 8 warps, 74–75 tiles a block),
# K = 1280 (10 over 8, 4–5 tiles), K = 384 (3 quads, 3 warps, 2–3 tiles; N = 101: the last tile
# past the rows).
FLAT_SHAPES = [("7b.o_proj", 3584, 3584), ("odd.n200.k1280", 200, 1280), ("odd.n101.k384", 101, 384)]
FLAT = [(fmt, label, n, k) for fmt in FORMATS if fmt.name in ("q4_k", "q6_k", "q5_g32", "q8_g32")
        for label, n, k in FLAT_SHAPES if fmt.fits(k)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,label,n,k", FLAT, ids=[f"{c[0].name}-{c[1]}" for c in FLAT])
def test_gemv_fmt_flat_split(dev, rng, fmt, label, n, k):
    _check_plain_and_residual(dev, rng, fmt, label, n, k, ".flat", blocks=3, defines=_compiled_for("flat", [fmt]))


# GF_TINY=0: the codes as exact c − z in FP16 (wf_pairs) instead of subnormals (wf_pairs_tiny, the
# default), the comparison build of tools/bench_gemv.py --fmt-defines; every format that has both.
EXACT = [(fmt, label, n, k) for fmt in FORMATS if fmt.name in ("q4_k", "q5_k", "q4_g32", "q5_g32_min", "q8_g32")
         for label, n, k in (("7b.o_proj", 3584, 3584), ("odd.n101.k384", 101, 384)) if fmt.fits(k)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,label,n,k", EXACT, ids=[f"{c[0].name}-{c[1]}" for c in EXACT])
def test_gemv_fmt_exact_codes(dev, rng, fmt, label, n, k):
    _check_plain_and_residual(dev, rng, fmt, label, n, k, ".exact",
                              defines=_compiled_for("model", [fmt]) + (("GF_TINY", 0),))


# Integer weights and inputs, every partial sum an integer below 2^24: the FP32 result is exact
# whatever the order of the additions, so each residual GEMV must equal float64 bit for bit. This
# is what shows that the tensor cores multiply the subnormal codes of wf_pairs_tiny exactly (the
# PTX ISA leaves mma's handling of subnormal inputs unspecified; a flushed or truncated code
# changes an integer here, where the random cases' 1e-3 bound could hide it). Scales 1 (K-quants:
# d = dmin = 1 with 6-bit sc and m), offsets −2^(b−1); every code of the range occurs.
INTEGER = [fmt for fmt in FORMATS if fmt.name in ("q4_g32", "q4_g32_min", "q5_g32", "q5_g32_min", "q8_g32",
                                                   "q4_k", "q5_k", "q6_k")]


def _integer_weight(dev, rng, fmt, n: int, k: int):
    from drvqwen.launchers.gemv_fmt import FmtWeight

    parts = wf.random_weight(fmt, n, k, rng)
    half = 1 << (fmt.bits - 1)
    if not fmt.superblock:
        parts["scales"] = np.ones_like(parts["scales"])
        if "offsets" in parts:
            parts["offsets"] = np.full_like(parts["offsets"], -half)
    elif fmt.has_min:
        nsb = k // fmt.superblock
        parts["superscales"] = np.ones((n, nsb, 2), np.float16)
    else:
        parts["superscales"] = np.ones_like(parts["superscales"])
    w = wf.dequantize_weight(fmt, lambda t: parts[t.rsplit(".", 1)[1]], "W").astype(np.float64)
    assert np.array_equal(w, np.round(w)), "the weights are integers"
    return FmtWeight(fmt, {p: dev.upload(f"W.{p}", a) for p, a in device_parts(fmt, parts).items()}, "W"), w


@pytest.mark.gpu
@pytest.mark.parametrize("tiny", [1, 0])
@pytest.mark.parametrize("fmt", INTEGER, ids=[f.name for f in INTEGER])
def test_gemv_fmt_integer_weights_exact(dev, rng, fmt, tiny):
    from drvqwen.launchers.gemv_fmt import GemvFmtResidual

    n, k = 64, 1024
    w, w64 = _integer_weight(dev, rng, fmt, n, k)
    x = rng.integers(-4, 5, k).astype(np.float16)
    want = w64 @ x.astype(np.float64)
    assert np.abs(w64).sum(axis=1).max() * 4 < 2**24, "every partial sum an integer below 2^24"
    res = dev.upload("residual", np.zeros(n, np.float32))
    GemvFmtResidual(res, dev.upload("x", x), w, n=n, k=k,
                    defines=_compiled_for("model", [fmt]) + (("GF_TINY", tiny),)).launch()
    got = res.download().astype(np.float64)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{fmt.name} GF_TINY={tiny}: {bad.size} of {n} rows differ, row {bad[:1]}: {got[bad[:1]]} against {want[bad[:1]]}"


# (label, Hq, Hkv, Dh, D, (q, k, v formats))
QKV = [("0.5b.q4_k_m", 14, 2, 64, 896, ("q5_g32", "q5_g32", "q8_g32")),
       ("7b.q4_k_m", 28, 4, 128, 3584, ("q4_k", "q4_k", "q6_k")),
       ("odd", 3, 1, 32, 256, ("q4_g32_min", "q5_k", "q5_g32_min"))]


# rmsnorm.cuh's two-pass prologue (RMSNORM_ONE_PASS=0: sum the squares, then read the row again)
# against the default one pass (the residual read once, the squares summed from registers).
TWO_PASS = (("RMSNORM_ONE_PASS", 0),)


def _compiled_for(compiled: str, fmts) -> tuple:
    """Defines for a case's kernel: "all" the default build (every format, one block of the fused
    kernels per SM), "model" the build a model of these formats gets (format_defines), "flat" that
    build with the warps splitting the block's items as one flat sequence (GF_FLAT_SPLIT)."""
    from drvqwen.launchers.gemv_fmt import format_defines

    if compiled == "all":
        return ()
    return format_defines(f.id for f in fmts) + ((("GF_FLAT_SPLIT", 1),) if compiled == "flat" else ())


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", ["all", "model", "flat"])
@pytest.mark.parametrize("label,hq,hkv,dh,d,fmts", QKV, ids=[q[0] for q in QKV])
def test_gemv_fmt_qkv_rope(dev, rng, label, hq, hkv, dh, d, fmts, compiled):
    from drvqwen.launchers.gemv_fmt import GemvFmtQkvRope

    by_name = {f.name: f for f in FORMATS}
    defines = _compiled_for(compiled, [by_name[f] for f in fmts])
    nq, nkv = hq * dh, hkv * dh
    ws = [random_fmt_weight(dev, rng, by_name[f], n, d, name)
          for f, n, name in zip(fmts, (nq, nkv, nkv), "qkv")]
    residual, norm_w = massive_residual(rng, d), (1 + 0.1 * rng.standard_normal(d)).astype(np.float16)
    biases = [(rng.standard_normal(n) * 0.5).astype(np.float16) for n in (nq, nkv, nkv)]
    inv_freq = ref.rope_inv_freq(dh, 1e6)
    block_table = rng.integers(0, N_PAGES, size=MAX_PAGES).astype(np.int32)
    x = normed_fp16(residual, norm_w, EPS).astype(np.float64)
    q64, k64, v64 = (w64 @ x + b.astype(np.float64) for (_w, w64), b in zip(ws, biases))
    state = dev.upload("state", np.zeros(3, np.int32))
    q_out = dev.poisoned("q", (hq, dh), np.float16)
    k_cache = dev.poisoned("k_cache", (N_PAGES, hkv, 16, dh), np.float16)
    v_cache = dev.poisoned("v_cache", (N_PAGES, hkv, 16, dh), np.float16)
    ins = (dev.upload("residual", residual), dev.upload("norm_w", norm_w), *(w for w, _ in ws),
           *(dev.upload(f"b{i}", b) for i, b in enumerate(biases)), dev.upload("inv_freq", inv_freq), state,
           dev.upload("block_table", block_table))

    def launcher(defines):
        return GemvFmtQkvRope(q_out, k_cache, v_cache, *ins, n_heads=hq, n_kv_heads=hkv, head_dim=dh, dim=d,
                              eps=EPS, defines=defines)

    ln = launcher(defines)
    # The model's build also with rmsnorm.cuh's two-pass prologue: the same bits.
    two_pass = launcher(defines + TWO_PASS) if compiled == "model" else None
    for pos in (0, 17, 1000):
        state.upload(np.array([pos, 0, pos + 1], np.int32))
        for buf in (q_out, k_cache, v_cache):
            buf.fill_bytes(0xFF)
        ln.launch()
        cos, sin = (t.astype(np.float64) for t in ref.rope_cos_sin(np.array([pos]), dh, 1e6))
        got_q = q_out.download()
        report(f"{label}.pos{pos}.q", got_q, ref.apply_rope(q64.reshape(1, hq, dh), cos, sin)[0], TOL_GEMV)
        page, slot = block_table[pos // 16], pos % 16
        for name, cache, want in (("k", k_cache, ref.apply_rope(k64.reshape(1, hkv, dh), cos, sin)[0]),
                                  ("v", v_cache, v64.reshape(hkv, dh))):
            got = cache.download()
            report(f"{label}.pos{pos}.{name}", got[page, :, slot, :], want, TOL_GEMV)
            untouched = np.ones(got.shape[:3], dtype=bool)
            untouched[page, :, slot] = False
            assert (got.view(np.uint16)[untouched] == 0xFFFF).all(), f"{name}_cache: another slot was written"
        ln.launch()
        assert_same_bits(f"{label}.pos{pos}.q", got_q, q_out.download())
        if two_pass is not None:
            outs = [got_q, k_cache.download()[page, :, slot], v_cache.download()[page, :, slot]]
            for buf in (q_out, k_cache, v_cache):
                buf.fill_bytes(0xFF)
            two_pass.launch()
            for name, a, b in zip("qkv", outs, (q_out.download(), k_cache.download()[page, :, slot],
                                                v_cache.download()[page, :, slot])):
                assert_same_bits(f"{label}.pos{pos}.{name}: two passes against one", a, b)
    _time(f"{label}.qkv_rope.{compiled}", ln)


# (label, F, D, format)
GATE_UP = [("0.5b.q5_g32", 4864, 896, "q5_g32"), ("7b.q4_k", 18944, 3584, "q4_k"), ("odd.q8_g32", 200, 256, "q8_g32"),
           ("odd.q6_k", 40, 512, "q6_k")]


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", ["all", "model", "flat"])
@pytest.mark.parametrize("label,f,d,fname", GATE_UP, ids=[g[0] for g in GATE_UP])
def test_gemv_fmt_gate_up_swiglu(dev, rng, label, f, d, fname, compiled):
    from drvqwen.launchers.gemv_fmt import GemvFmtGateUpSwiglu

    fmt = {x.name: x for x in FORMATS}[fname]
    defines = _compiled_for(compiled, [fmt])
    (g, g64), (u, u64) = (random_fmt_weight(dev, rng, fmt, f, d, name) for name in ("gate", "up"))
    residual, norm_w = massive_residual(rng, d), (1 + 0.1 * rng.standard_normal(d)).astype(np.float16)
    x = normed_fp16(residual, norm_w, EPS).astype(np.float64)
    want = ref.swiglu(g64 @ x, u64 @ x)
    h = dev.poisoned("h", (f,), np.float16)
    ins = (dev.upload("residual", residual), dev.upload("norm_w", norm_w), g, u)
    ln = GemvFmtGateUpSwiglu(h, *ins, f=f, k=d, eps=EPS, defines=defines)
    ln.launch()
    got = h.download()
    report(label, got, want, TOL_GEMV)
    h.fill_bytes(0xFF)
    ln.launch()
    assert_same_bits(label, got, h.download())
    if compiled == "model":  # rmsnorm.cuh's two-pass prologue: the same bits
        h.fill_bytes(0xFF)
        GemvFmtGateUpSwiglu(h, *ins, f=f, k=d, eps=EPS, defines=defines + TWO_PASS).launch()
        assert_same_bits(f"{label}: two passes against one", got, h.download())
    _time(f"{label}.gate_up.{compiled}", ln)


# (label, V, D, format, text_vocab)
LM_HEAD = [("0.5b-like.q8_g32", 4099, 896, "q8_g32", 4000), ("7b-like.q6_k", 2000, 3584, "q6_k", 2000),
           ("odd.q4_k", 37, 256, "q4_k", 30)]


@pytest.mark.gpu
@pytest.mark.parametrize("label,v,d,fname,text_vocab", LM_HEAD, ids=[x[0] for x in LM_HEAD])
def test_lm_head_fmt(dev, rng, label, v, d, fname, text_vocab):
    from drvqwen.launchers import ArgmaxFinal
    from drvqwen.launchers.gemv_fmt import LmHeadFmt, lm_head_fmt_partials

    fmt = {x.name: x for x in FORMATS}[fname]
    w, w64 = random_fmt_weight(dev, rng, fmt, v, d, "lm_head")
    x = rng.standard_normal(d).astype(np.float16)
    want = w64 @ x.astype(np.float64)
    want[text_vocab:] = -np.inf
    logits = dev.poisoned("logits", (v,), np.float32)
    n_part = lm_head_fmt_partials(v, d)
    pv, pi = dev.poisoned("pv", (n_part,), np.float32), dev.poisoned("pi", (n_part,), np.int32)
    ln = LmHeadFmt(logits, pv, pi, dev.upload("x", x), w, vocab_size=v, dim=d, text_vocab=text_vocab)
    nt = dev.poisoned("next_token", (1,), np.int32)
    am = ArgmaxFinal(nt, pv, pi, n_partials=ln.n_partials)
    ln.launch()
    am.launch()
    got = logits.download()
    assert np.isneginf(got[text_vocab:]).all(), "padding rows must get the logit -inf"
    report(label, got[:text_vocab], want[:text_vocab], TOL_GEMV)
    assert int(nt.download()[0]) == int(np.argmax(got)), "argmax of the partials != argmax of the logits"


QUANTIZED = list(wf.FORMATS.values())      # a dense FP16 embedding runs embedding.cu


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", QUANTIZED, ids=[f.name for f in QUANTIZED])
def test_embedding_fmt_rows_bit_exact(dev, rng, fmt):
    """The embedding row on the GPU is the reference's dequantized row, bit for bit."""
    from drvqwen.launchers.gemv_fmt import EmbeddingFmt, EmbeddingFmtRows

    v, d = 300, 1024
    w, _ = random_fmt_weight(dev, rng, fmt, v, d, "model.embed_tokens")
    parts = {p: a.download() for p, a in w.parts.items()}
    for part, words in tile_major_parts(fmt).items():   # the device layout back to the file's
        parts[part] = from_tile_major(parts[part].reshape(-1, d // 128, 16, words), v)
    if lane_word_scales(fmt):
        parts["scales"], parts["superscales"] = from_lane_words(parts["scales"])
    want = wf.dequantize_weight(fmt, lambda t: parts[t.rsplit(".", 1)[1]], "model.embed_tokens")
    ids = np.array([0, 299, 17, 17, 150], np.int32)
    out = dev.poisoned("residual", (len(ids), d), np.float32)
    EmbeddingFmtRows(out, w, dev.upload("ids", ids), n_rows=len(ids), vocab_size=v, dim=d).launch()
    got = out.download()
    assert_same_bits(f"{fmt.name}.rows", got, want[ids])
    one = dev.poisoned("residual1", (d,), np.float32)
    EmbeddingFmt(one, w, dev.upload("state", np.array([5, 123, 6], np.int32)), vocab_size=v, dim=d).launch()
    assert_same_bits(f"{fmt.name}.decode", one.download(), want[123])


def test_k_quant_scales_in_the_files_layout_are_refused():
    """CPU: a q4_k or q5_k weight's scales on the GPU are the lane-word plane, uint32
    [N, K/256, 4] (device_tensors), and the kernels read no superscales; the file's uint8
    [N, K/256, 12] in their place is refused (the kernels would read 16 bytes a super-block from 12)."""
    from drvqwen.launchers import BufferSpec, LaunchError
    from drvqwen.launchers.base import NULL
    from drvqwen.launchers.gemv_fmt import FmtWeight, fmt_weight

    for fmt in (f for f in FORMATS if f.name in ("q4_k", "q5_k")):
        dev_specs = {t: BufferSpec(t, shape, dt) for t, (dt, shape) in device_tensors(fmt, "W", 64, 512).items()}
        w = fmt_weight(dev_specs.__getitem__, "W", fmt)
        assert "superscales" not in w.parts and w.args("w")["w_aux"] is NULL
        w.check(64, 512)
        file_scales = BufferSpec("W.scales", *fmt.tensors("W", 64, 512)["W.scales"][::-1])
        file_w = FmtWeight(fmt, {**w.parts, "scales": file_scales}, "W")
        with pytest.raises(LaunchError, match=r"W\.scales: expected 512 elements of uint32, got W\.scales uint8\[64, 2, 12\]"):
            file_w.check(64, 512)
