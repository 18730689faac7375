"""Every launcher passes each kernel the arguments its `.cu` declaration names, in its order (no GPU).

A kernel's parameter list lives in its `extern "C"` declaration; the launchers pass arguments by
name (`LaunchSpec.args`); `launchers.signatures` reads the declarations from kernels/*.cu, macro-
instantiated kernels included — the entry points NVRTC builds, no more, no fewer. Here every
launcher — the decode plan's (both attention kernels, head_dim 64 and 128), the prefill's, the
sampler's, the page hand-over's, the load's INT4 weight rearrangement, the benchmark GEMVs, the
verify pass's T-token GEMVs, attention (head_dim 64 and 128), lm_head and argmax_final, and the
per-format GEMVs of `gemv_fmt` — is planned over buffers that need no GPU, and each of its
launches must name every parameter of its kernel, in order, with an argument of the parameter's
kind (pointer, int32, uint32, uint64, float32, tensor map). So a launcher that passes arguments in
another order, or a kernel that gains, loses or renames a parameter, fails here; and every kernel
of kernels/*.cu must be launched by some launcher checked here (smoke.cu's aside: the cuda
layer's own tests launch those by hand, tests/test_cuda_layer.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import launchers
from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
from drvqwen.cuda import DeviceArray
from drvqwen.cuda.sources import kernel_source, list_kernels
from drvqwen.decode import ATTENTION_KERNELS, plan_decode
from drvqwen.verify_plan import plan_verify
from drvqwen.format import weight_formats as wf
from drvqwen.format.int4_tiles import device_words
from drvqwen.kv_cache import PAGE_TOKENS
from drvqwen.launchers import BufferSpec, FixedOccupancy
from drvqwen.launchers import gemm_int4, sampling
from drvqwen.launchers.gemm_fmt import GemmFmtGateUpSwigluRows, GemmFmtResidualRows, GemmFmtRows
from drvqwen.launchers.gemm_fmt_wgmma import GemmFmtwGateUpSwigluRows, GemmFmtwResidualRows, GemmFmtwRows
from drvqwen.launchers.gemv_fmt import EmbeddingFmtRows, FmtWeight, GemvFmt, device_tensors
from drvqwen.format.tensor_set import weight_shapes
from drvqwen.launchers.signatures import KernelSignature, arg_kind, kernel_signatures

# Kernels no launcher runs: the cuda layer's smoke tests launch them with positional arguments.
HAND_LAUNCHED_FILES = {"smoke"}
OCCUPANCY = FixedOccupancy(132, lambda _k, _t, _s: 2)
ROWS = 64                                    # a prefill chunk's row capacity


def _signatures() -> dict[str, tuple[str, KernelSignature]]:
    out = {}
    for file in list_kernels():
        for name, sig in kernel_signatures(kernel_source(file).text.decode()).items():
            assert name not in out, f"kernel {name} defined in both {out[name][0]}.cu and {file}.cu"
            out[name] = (file, sig)
    return out


SIGNATURES = _signatures()


def _buf(name: str, n: int, dtype) -> BufferSpec:
    return BufferSpec(name, (n,), dtype)


class _FakeTensorMap:
    """What gemm_int4 encodes from x's address (128 opaque bytes), made without a driver."""

    def raw_bytes(self) -> bytes:
        return bytes(128)


def _int4(name: str, n: int, k: int) -> tuple[BufferSpec, BufferSpec]:
    """An INT4 weight as the INT4 kernels take it: qweight in the device layout (rows padded to a
    16-row tile, format/int4_tiles.py), scales [n, k/128]."""
    return _buf(f"{name}.qweight", device_words(n, k), np.uint32), _buf(f"{name}.scales", n * k // 128, np.float16)


def _prefill_launchers(cfg) -> list[tuple[str, launchers.Launcher]]:
    """The prefill's launchers at `cfg`'s widths (prefill.Prefill._build's list, one layer)."""
    R, D, F, V = ROWS, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hq, Hkv, Dh, nq, nkv = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_dim, cfg.kv_dim
    ps, bt = _buf("prefill_state", 2, np.int32), _buf("block_table", 8, np.int32)
    cache = {c: BufferSpec(c, (8, Hkv, PAGE_TOKENS, Dh), np.float16) for c in ("k_cache", "v_cache")}
    # The GEMMs encode x's tensor map at once: x is a device array by address (no memory behind it).
    xn, attn, h = (DeviceArray(n, 1 << 20, (R, k), np.float16) for n, k in (("xn", D), ("attn", nq), ("h", F)))
    gemm = dict(rows=R, max_blocks=132)
    return [
        ("embedding", launchers.EmbeddingRows(_buf("residual", R * D, np.float32), _buf("embed", V * D, np.float16),
                                              _buf("ids", R, np.int32), n_rows=R, vocab_size=V, dim=D)),
        ("qkv_proj", launchers.GemmInt4QkvRows(_buf("qkv", R * (nq + 2 * nkv), np.float32), xn, *_int4("q", nq, D),
                                               *_int4("k", nkv, D), *_int4("v", nkv, D), ps, n_q=nq, n_kv=nkv, k=D,
                                               head_dim=Dh, **gemm)),
        ("qkv_rope", launchers.GemmInt4QkvRopeRows(_buf("q", R * nq, np.float16), cache["k_cache"], cache["v_cache"],
                                                   xn, *_int4("q", nq, D), *_int4("k", nkv, D), *_int4("v", nkv, D),
                                                   _buf("q_bias", nq, np.float16), _buf("k_bias", nkv, np.float16),
                                                   _buf("v_bias", nkv, np.float16), _buf("rope_cs", R * Dh, np.float32),
                                                   ps, bt, n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, k=D, **gemm)),
        ("rope_table", launchers.RopeTableRows(_buf("rope_cs", R * Dh, np.float32), _buf("inv_freq", Dh // 2, np.float32),
                                               ps, rows=R, head_dim=Dh)),
        ("rope_kv", launchers.RopeKvRows(_buf("q", R * nq, np.float16), cache["k_cache"], cache["v_cache"],
                                         _buf("qkv", R * (nq + 2 * nkv), np.float32), _buf("q_bias", nq, np.float16),
                                         _buf("k_bias", nkv, np.float16), _buf("v_bias", nkv, np.float16),
                                         _buf("inv_freq", Dh // 2, np.float32), ps, bt, rows=R, n_heads=Hq,
                                         n_kv_heads=Hkv, head_dim=Dh)),
        ("attention", launchers.AttentionPrefill(_buf("attn", R * nq, np.float16), _buf("q", R * nq, np.float16),
                                                 cache["k_cache"], cache["v_cache"], bt, ps, rows=R, n_heads=Hq,
                                                 n_kv_heads=Hkv, head_dim=Dh)),
        ("attention_wgmma", launchers.AttentionPrefill(_buf("attn", R * nq, np.float16), _buf("q", R * nq, np.float16),
                                                       cache["k_cache"], cache["v_cache"], bt, ps, rows=R, n_heads=Hq,
                                                       n_kv_heads=Hkv, head_dim=Dh, engine="wgmma")),
        ("attention_wgmma_ranges", launchers.AttentionPrefill(
            _buf("attn", R * nq, np.float16), _buf("q", R * nq, np.float16), cache["k_cache"], cache["v_cache"], bt, ps,
            rows=R, n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, engine="wgmma-ranges", occupancy=OCCUPANCY)),
        ("o_proj", launchers.GemmInt4ResidualRows(_buf("residual", R * D, np.float32), attn, *_int4("o", D, nq), ps,
                                                  n=D, k=nq, **gemm)),
        ("gate_up_swiglu", launchers.GemmInt4GateUpSwigluRows(_buf("h", R * F, np.float16), xn, *_int4("g", F, D),
                                                              *_int4("u", F, D), ps, f=F, k=D, **gemm)),
        ("down_proj", launchers.GemmInt4ResidualRows(_buf("residual", R * D, np.float32), h, *_int4("d", D, F), ps,
                                                     n=D, k=F, **gemm)),
        ("gemm_f32", launchers.GemmInt4(_buf("out", R * D, np.float32), xn, *_int4("w", D, D), ps, n=D, k=D, **gemm)),
        ("begin_chunk", launchers.PrefillBeginChunk(ps)),
        ("decode_resume", launchers.DecodeResume(_buf("state", 3, np.int32), _buf("next_token", 1, np.int32))),
    ]


def _tokens_launchers(cfg, t: int = 5) -> list[tuple[str, launchers.Launcher]]:
    """The T-token GEMVs of the verify pass (gemv_int4's `…_tokens` kernels) at `cfg`'s widths."""
    D, F, Hq, Hkv, Dh, nq, nkv = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, cfg.q_dim, cfg.kv_dim)
    cache = [BufferSpec(c, (8, Hkv, PAGE_TOKENS, Dh), np.float16) for c in ("k_cache", "v_cache")]
    res = _buf("residual", t * D, np.float32)

    def qkv(**kw):
        return launchers.GemvInt4QkvRope(
            _buf("q", t * nq, np.float16), *cache, res, _buf("norm_w", D, np.float16), *_int4("q", nq, D),
            *_int4("k", nkv, D), *_int4("v", nkv, D), _buf("q_bias", nq, np.float16), _buf("k_bias", nkv, np.float16),
            _buf("v_bias", nkv, np.float16), _buf("inv_freq", Dh // 2, np.float32), _buf("state", 3, np.int32),
            _buf("block_table", 8, np.int32), n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, dim=D, eps=1e-6,
            occupancy=OCCUPANCY, n_tokens=t, **kw)

    def gate_up(**kw):
        return launchers.GemvInt4GateUpSwiglu(_buf("h", t * F, np.float16), res, _buf("norm_w", D, np.float16),
                                              *_int4("g", F, D), *_int4("u", F, D), f=F, k=D, eps=1e-6,
                                              occupancy=OCCUPANCY, n_tokens=t, **kw)
    xn = _buf("xn", t * D, np.float16)
    return [
        ("qkv_rope_tokens", qkv()),
        ("qkv_rope_x_tokens", qkv(x_normed=xn)),
        ("residual_tokens", launchers.GemvInt4Residual(res, _buf("h", t * F, np.float16), *_int4("d", D, F), n=D, k=F,
                                                       occupancy=OCCUPANCY, n_tokens=t)),
        ("gate_up_tokens", gate_up()),
        ("gate_up_x_tokens", gate_up(x_normed=xn)),
    ]


def _attention_tokens_launcher(cfg, t: int = 5) -> tuple[str, launchers.Launcher]:
    """The verify pass's T-token decode attention (attention_decode's `…_tokens` kernels) at `cfg`'s widths."""
    Hq, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    parts = tuple(BufferSpec(n, sh, np.float32)
                  for n, sh in launchers.attention_decode.partial_shapes(Hq, Dh, 3, n_tokens=t).items())
    cache = [BufferSpec(c, (8, Hkv, PAGE_TOKENS, Dh), np.float16) for c in ("k_cache", "v_cache")]
    return ("attention_tokens", launchers.AttentionDecode(
        _buf("attn", t * Hq * Dh, np.float16), _buf("q", t * Hq * Dh, np.float16), *cache,
        _buf("block_table", 8, np.int32), _buf("state", 3, np.int32), parts, n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh,
        blocks_per_kv_head=3, n_tokens=t))


def _other_launchers(cfg) -> list[tuple[str, launchers.Launcher]]:
    """The sampler's, the page hand-over's, the benchmark GEMVs', the load's INT4 rearrangement
    (gpu_weights.py) and the per-format ones outside the step."""
    V, D = cfg.vocab_size, cfg.hidden_size
    tok, logits = _buf("next_token", 1, np.int32), _buf("logits", V, np.float32)
    info, params = _buf("info", sampling.INFO_INTS, np.int32), _buf("params", sampling.PARAMS_BYTES, np.uint8)
    out = [
        ("sample", launchers.SampleToken(tok, info, params, logits, vocab_size=V)),
        ("penalized", launchers.PenalizedSampleToken(tok, info, params, logits,
                                                     _buf("history", sampling.HISTORY_INTS, np.int32), vocab_size=V)),
        ("publish", launchers.PublishToken(_buf("host token ring", 8, np.int32), params, tok, ring_size=8)),
        ("set_entry", launchers.SetBlockTableEntry(_buf("block_table", 8, np.int32), _buf("new_page", 1, np.int32),
                                                   _buf("state", 3, np.int32), n_pages=8)),
        ("argmax", launchers.Argmax(tok, logits, _buf("pv", 64, np.float32), _buf("pi", 64, np.int32),
                                    vocab_size=V, n_partials=64)),
        ("gemv_f16", launchers.GemvInt4(_buf("y", D, np.float16), _buf("x", D, np.float16), *_int4("w", D, D), n=D,
                                        k=D, occupancy=OCCUPANCY)),
        *_tokens_launchers(cfg),
        ("lm_head_tokens", launchers.LmHead(_buf("logits", 3 * V, np.float32), _buf("pv", 3 * (-(-V // 32)), np.float32),
                                            _buf("pi", 3 * (-(-V // 32)), np.int32), _buf("x", 3 * D, np.float16),
                                            _buf("lm_head", V * D, np.float16), vocab_size=V, dim=D, n_tokens=3)),
        ("argmax_final_tokens", launchers.ArgmaxFinal(_buf("next_token", 3, np.int32), _buf("pv", 3 * 64, np.float32),
                                                      _buf("pi", 3 * 64, np.int32), n_partials=64, n_tokens=3)),
        ("gpu_sleep", launchers.GpuSleep(1.0)),
        ("int4_tile_major", launchers.Int4TileMajor(_buf("dst", device_words(D, D), np.uint32),
                                                    _buf("src", D * D // 8, np.uint32), n=D, k=D,
                                                    pair_dim=cfg.head_dim)),
        ("kquant_lane_words", launchers.KQuantLaneWords(_buf("lanes", D * D // 256 * 4, np.uint32),
                                                        _buf("scales", D * D // 256 * 12, np.uint8),
                                                        _buf("superscales", D * D // 256 * 2, np.float16),
                                                        supers=D * D // 256)),
        *[(f"stream_read_{kind}", launchers.StreamRead(_buf("out", 2 * threads, np.uint32), _buf("src", 2 * 65536, np.uint8),
                                                       blocks=2, bytes_per_block=65536, kind=kind))
          for kind, threads in (("ld", 256), ("bulk", 128))],
    ]
    fmt = wf.EXACT_FOR_GGUF["Q5_0"]
    w = FmtWeight(fmt, {name.rsplit(".", 1)[1]: BufferSpec(name, shape, dt)
                        for name, (dt, shape) in device_tensors(fmt, "w", D, D).items()}, "w")
    ps, R = _buf("prefill_state", 2, np.int32), ROWS
    xw = DeviceArray("xn", 1 << 20, (R, D), np.float16)  # the wgmma GEMMs encode x's tensor map at once
    out += [("gemv_fmt_f16", GemvFmt(_buf("y", D, np.float16), _buf("x", D, np.float16), w, n=D, k=D,
                                     occupancy=OCCUPANCY)),
            ("gemm_fmt_rows", GemmFmtRows(_buf("qkv", R * 3 * D, np.float32), _buf("xn", R * D, np.float16), w, ps,
                                          n=D, k=D, rows=R, ldo=3 * D, col0=D)),
            ("gemm_fmt_residual", GemmFmtResidualRows(_buf("res", R * D, np.float32), _buf("xn", R * D, np.float16), w,
                                                      ps, n=D, k=D, rows=R)),
            ("gemm_fmt_gate_up", GemmFmtGateUpSwigluRows(_buf("h", R * D, np.float16), _buf("xn", R * D, np.float16),
                                                         w, w, ps, f=D, k=D, rows=R)),
            ("gemm_fmtw_rows", GemmFmtwRows(_buf("qkv", R * 3 * D, np.float32), xw, w, ps, n=D, k=D, rows=R, ldo=3 * D,
                                            col0=D, max_blocks=132)),
            *_kquant_launchers(ps, R, xw),
            ("gemm_fmtw_residual", GemmFmtwResidualRows(_buf("res", R * D, np.float32), xw, w, ps, n=D, k=D, rows=R,
                                                        max_blocks=132)),
            ("gemm_fmtw_gate_up", GemmFmtwGateUpSwigluRows(_buf("h", R * D, np.float16), xw, w, w, ps, f=D, k=D, rows=R,
                                                           max_blocks=132)),
            ("embedding_fmt_rows", EmbeddingFmtRows(_buf("r", 4 * D, np.float32), w, _buf("ids", 4, np.int32), n_rows=4,
                                                    vocab_size=D, dim=D))]
    return out


def _kquant_launchers(ps, R, xw) -> list[tuple[str, launchers.Launcher]]:
    """gemm_int4.cu's K-quant kernels (launchers/gemm_kquant.py) on q4_k, q5_k and q6_k weights of
    K = D = 1024."""
    from drvqwen.launchers.gemm_kquant import (GemmQ4kGateUpSwigluRows, GemmQ4kQkvRopeRows, GemmQ4kResidualRows,
                                               GemmQ4kStackedRows, GemmQ5kGateUpSwigluRows, GemmQ5kQkvRopeRows,
                                               GemmQ5kResidualRows, GemmQ5kStackedRows, GemmQ6kResidualRows,
                                               GemmQ6kRows)

    D = 1024

    def weight(fmt_name: str) -> FmtWeight:
        fmt = next(f for f in wf.FORMATS.values() if f.name == fmt_name)
        return FmtWeight(fmt, {name.rsplit(".", 1)[1]: BufferSpec(name, shape, dt)
                               for name, (dt, shape) in device_tensors(fmt, "w", D, D).items()}, "w")

    w6 = weight("q6_k")
    q6 = next(f for f in wf.FORMATS.values() if f.name == "q6_k")
    wkv6 = FmtWeight(q6, {name.rsplit(".", 1)[1]: BufferSpec(name, shape, dt)
                          for name, (dt, shape) in device_tensors(q6, "wkv6", D // 4, D).items()}, "wkv6")
    kc = DeviceArray("k_cache", 1 << 22, (4, 2, 16, 128), np.float16)   # [P, Hkv, 16, Dh]
    vc = DeviceArray("v_cache", 1 << 23, (4, 2, 16, 128), np.float16)
    x = DeviceArray("xq", 1 << 21, (R, D), np.float16)
    out = []
    for f, Stacked, Residual, GateUp, QkvRope in (
            ("q4k", GemmQ4kStackedRows, GemmQ4kResidualRows, GemmQ4kGateUpSwigluRows, GemmQ4kQkvRopeRows),
            ("q5k", GemmQ5kStackedRows, GemmQ5kResidualRows, GemmQ5kGateUpSwigluRows, GemmQ5kQkvRopeRows)):
        fmt = next(m for m in wf.FORMATS.values() if m.name == f"{f[:2]}_k")
        w = weight(fmt.name)
        wkv = FmtWeight(fmt, {name.rsplit(".", 1)[1]: BufferSpec(name, shape, dt)
                              for name, (dt, shape) in device_tensors(fmt, "wkv", D // 4, D).items()}, "wkv")
        out += [(f"gemm_{f}_stacked", Stacked(_buf("qkv", R * 3 * D, np.float32), x, [w, w], ps, ns=[D, D], k=D,
                                                rows=R, ldo=3 * D, max_blocks=132)),
                (f"gemm_{f}_residual", Residual(_buf("res", R * D, np.float32), x, w, ps, n=D, k=D, rows=R,
                                                  max_blocks=132)),
                (f"gemm_{f}_gate_up", GateUp(_buf("h", R * D, np.float16), x, w, w, ps, f=D, k=D, rows=R,
                                               max_blocks=132)),
                (f"gemm_{f}_qkv_rope", QkvRope(
                    _buf("q", R * D, np.float16), kc, vc, x, w, wkv, wkv, _buf("qb", D, np.float16),
                    _buf("kb", D // 4, np.float16), _buf("vb", D // 4, np.float16), _buf("cs", R * 128, np.float32),
                    ps, _buf("bt", 64, np.int32), n_heads=D // 128, n_kv_heads=D // 512, head_dim=128, k=D, rows=R,
                    max_blocks=132)),
                (f"gemm_{f}_q6k_qkv_rope", QkvRope(  # v in Q6_K: one launch in two parts
                    _buf("q", R * D, np.float16), kc, vc, x, w, wkv, wkv6, _buf("qb", D, np.float16),
                    _buf("kb", D // 4, np.float16), _buf("vb", D // 4, np.float16), _buf("cs", R * 128, np.float32),
                    ps, _buf("bt", 64, np.int32), n_heads=D // 128, n_kv_heads=D // 512, head_dim=128, k=D, rows=R,
                    max_blocks=132))]
    return [*out,
            ("gemm_q6k_rows", GemmQ6kRows(_buf("qkv", R * 3 * D, np.float32), x, w6, ps, n=D, k=D, rows=R, ldo=3 * D,
                                          col0=D, max_blocks=132)),
            ("gemm_q6k_residual", GemmQ6kResidualRows(_buf("res", R * D, np.float32), x, w6, ps, n=D, k=D, rows=R,
                                                      max_blocks=132)),
            *(ln for f in ("q4_g32", "q5_g32", "q8_g32", "q4_g32_min", "q5_g32_min")
              for ln in _q32_launchers(ps, R, x, weight(f)))]


def _q32_launchers(ps, R, x, w) -> list[tuple[str, launchers.Launcher]]:
    """gemm_int4.cu's Q4_0, Q5_0 or Q8_0 kernels (launchers/gemm_q32.py) on weights of K = D = 1024 in w's
    format: the stacked rows with one, two and three matrices (the unused ones' parameters still
    passed)."""
    from drvqwen.launchers.gemm_q32 import (GemmQ32GateUpSwigluRows, GemmQ32QkvRopeRows, GemmQ32ResidualRows,
                                            GemmQ32StackedRows)

    D, f = 1024, w.fmt.name
    wkv = FmtWeight(w.fmt, {name.rsplit(".", 1)[1]: BufferSpec(name, shape, dt)
                            for name, (dt, shape) in device_tensors(w.fmt, "wkv", D // 4, D).items()}, "wkv")
    kc = DeviceArray("k_cache", 1 << 22, (4, 2, 16, 128), np.float16)   # [P, Hkv, 16, Dh]
    vc = DeviceArray("v_cache", 1 << 23, (4, 2, 16, 128), np.float16)
    return [*((f"gemm_{f}_stacked{m}", GemmQ32StackedRows(_buf("qkv", R * 3 * D, np.float32), x, [w] * m, ps,
                                                           ns=[D] * m, k=D, rows=R, ldo=3 * D, max_blocks=132))
              for m in (1, 2, 3)),
            (f"gemm_{f}_residual", GemmQ32ResidualRows(_buf("res", R * D, np.float32), x, w, ps, n=D, k=D, rows=R,
                                                       max_blocks=132)),
            (f"gemm_{f}_gate_up", GemmQ32GateUpSwigluRows(_buf("h", R * D, np.float16), x, w, w, ps, f=D, k=D,
                                                          rows=R, max_blocks=132)),
            (f"gemm_{f}_qkv_rope", GemmQ32QkvRopeRows(
                _buf("q", R * D, np.float16), kc, vc, x, w, wkv, wkv, _buf("qb", D, np.float16),
                _buf("kb", D // 4, np.float16), _buf("vb", D // 4, np.float16), _buf("cs", R * 128, np.float32), ps,
                _buf("bt", 64, np.int32), n_heads=D // 128, n_kv_heads=D // 512, head_dim=128, k=D, rows=R,
                max_blocks=132))]


def gguf_like_formats(cfg) -> dict[str, int]:
    """Per-tensor formats as llama.cpp's Q4_K_M GGUFs hold them: K-quants where K allows (Q4_K,
    Q6_K for v and down), Q5_0/Q8_0 where it does not (the 0.5B's K = 896)."""
    out = {}
    for prefix, (_n, k) in weight_shapes(cfg).items():
        kq = k % 256 == 0
        heavy = prefix.endswith(("v_proj", "down_proj", "lm_head"))
        name = ("Q6_K" if heavy else "Q4_K") if kq else ("Q8_0" if heavy else "Q5_0")
        out[prefix] = wf.EXACT_FOR_GGUF[name].id
    return out


@pytest.fixture(scope="module")
def planned(request):
    """(where, LaunchSpec) of every launch of every launcher this module checks."""
    mp = pytest.MonkeyPatch()
    mp.setattr(gemm_int4, "_encode_x_map", lambda _ptr, _rows, _k, _bm: _FakeTensorMap())
    request.addfinalizer(mp.undo)
    entries = []
    for cfg in (QWEN25_CODER_05B.with_layers(1), QWEN25_CODER_7B.with_layers(1)):     # head_dim 64, 128
        for attention in ATTENTION_KERNELS:
            plan = plan_decode(cfg, 256, attention=attention, occupancy=OCCUPANCY)
            entries += [(f"decode {attention} {cfg.head_dim}: {n}", l) for n, l in plan.steps]
        plan = plan_decode(cfg.with_layers(2), 256, occupancy=OCCUPANCY, l2_prefetch_bytes=30_000_000,
                           l2_prefetch_qkv=True)
        entries += [(f"decode l2_prefetch {cfg.head_dim}: {n}", l) for n, l in plan.steps if "l2_prefetch" in n]
        plan = plan_decode(cfg, 256, occupancy=OCCUPANCY, formats=gguf_like_formats(cfg))
        entries += [(f"decode per-tensor {cfg.head_dim}: {n}", l) for n, l in plan.steps]
        plan = plan_decode(cfg, 256, attention="plain", occupancy=OCCUPANCY, persistent=True)
        entries.append((f"decode persistent {cfg.head_dim}", plan.persistent))
        entries += [(f"prefill {cfg.head_dim}: {n}", l) for n, l in _prefill_launchers(cfg)]
        entries.append(_attention_tokens_launcher(cfg))
        for prenorm in (True, False):
            plan = plan_verify(cfg, 256, 16, occupancy=OCCUPANCY, prenorm=prenorm)
            entries += [(f"verify {cfg.head_dim} prenorm={prenorm}: {n}", l) for n, l in plan.steps]
    entries += _other_launchers(QWEN25_CODER_05B)
    return [(f"{where}.{i}", spec) for where, launcher in entries for i, spec in enumerate(launcher.specs)]


def mismatches(spec, sig: KernelSignature) -> list[str]:
    """How a launch's arguments differ from its kernel's declaration (empty when they agree)."""
    want = [(p.name, p.kind) for p in sig.params]
    got = [(name, arg_kind(value)) for name, value in spec.args.items()]
    if [n for n, _ in got] != [n for n, _ in want]:
        return [f"{sig.kernel}: passes ({', '.join(n for n, _ in got)}), declares ({', '.join(n for n, _ in want)})"]
    return [f"{sig.kernel}: {name} is passed as {g}, declared {w}" for (name, g), (_, w) in zip(got, want) if g != w]


def test_the_kernel_files_read_as_kernels():
    """The reader finds the kernels a person sees: plain ones, macro-instantiated ones (one per
    instantiation), every kind of parameter."""
    assert {"rmsnorm", "attention_decode_hd64", "attention_decode_hd128", "attention_decode_tma_hd128",
            "attention_prefill_hd64", "gemv_fmt_qkv_rope", "embedding_fmt", "gpu_sleep"} <= set(SIGNATURES)
    kinds = {p.kind for _f, sig in SIGNATURES.values() for p in sig.params}
    assert kinds == {"pointer", "int32", "uint32", "uint64", "float32", "tensor map"}
    tma = [(p.name, p.kind) for p in SIGNATURES["attention_decode_tma_hd64"][1].params]
    assert tma[4:6] == [("k_map", "tensor map"), ("v_map", "tensor map")] and tma[-1] == ("layer_page0", "int32")
    aux = SIGNATURES["gemv_fmt_f16"][1].params[5]      # the lm_head's and GEMVs' weight: 4 pointers per weight
    assert (aux.name, aux.kind) == ("w_aux", "pointer")


@pytest.mark.parametrize("file", list_kernels())
def test_the_reader_finds_every_entry_point_the_compiler_builds(file):
    """What the reader takes for a file's kernels is what NVRTC compiles into its cubin (the
    ptxas report's entry points): no kernel missed, none made up."""
    from drvqwen.cuda.nvrtc import compile_kernel

    built = {r.function for r in compile_kernel(file).resources.values() if r.is_entry}
    assert built and built == {k for k, (f, _sig) in SIGNATURES.items() if f == file}


def test_launchers_pass_what_the_kernels_declare(planned):
    bad = []
    for where, spec in planned:
        file, sig = SIGNATURES[spec.kernel.kernel]
        assert spec.kernel.file == file, f"{where}: {spec.kernel.kernel} is in {file}.cu, not {spec.kernel.file}.cu"
        bad += [f"{where}: {m}" for m in mismatches(spec, sig)]
    assert not bad, "\n".join(bad)


def test_every_kernel_is_launched_by_a_checked_launcher(planned):
    launched = {spec.kernel.kernel for _where, spec in planned}
    unlaunched = {k for k, (file, _sig) in SIGNATURES.items() if file not in HAND_LAUNCHED_FILES} - launched
    assert not unlaunched, f"kernels no launcher checked here runs: {sorted(unlaunched)}"
    assert len(launched) >= 35


def test_arguments_in_another_order_fail(planned):
    where, spec = next((w, s) for w, s in planned if s.kernel.kernel == "rmsnorm")
    names = list(spec.args)
    swapped = dict(spec.args)
    swapped = {n: swapped[n] for n in [names[1], names[0], *names[2:]]}     # x before out
    moved = type(spec)(spec.kernel, spec.grid, spec.block, swapped)
    assert mismatches(spec, SIGNATURES["rmsnorm"][1]) == []
    assert mismatches(moved, SIGNATURES["rmsnorm"][1]) == ["rmsnorm: passes (x, out, weight, D, eps), "
                                                           "declares (out, x, weight, D, eps)"]
    # A value of the wrong kind under the right name (an int where the kernel takes a float).
    wrong = type(spec)(spec.kernel, spec.grid, spec.block, {**spec.args, "eps": launchers.base.i32(0)})
    assert mismatches(wrong, SIGNATURES["rmsnorm"][1]) == ["rmsnorm: eps is passed as int32, declared float32"]


def test_a_kernel_that_gains_a_parameter_fails(planned):
    _where, spec = next((w, s) for w, s in planned if s.kernel.kernel == "rmsnorm")
    text = kernel_source("rmsnorm").text.decode()
    grown = text.replace("int D, float eps)", "int D, float eps, int rows)", 1)
    assert grown != text
    sig = kernel_signatures(grown)["rmsnorm"]
    assert mismatches(spec, sig) == ["rmsnorm: passes (out, x, weight, D, eps), declares (out, x, weight, D, eps, rows)"]


def test_the_reader_expands_macros_and_refuses_what_it_cannot_read():
    text = """
#define ENTRY(NAME, T)                                                   \\
    extern "C" __global__ void __launch_bounds__(256) k_##NAME(          \\
        T* __restrict__ out,  /* [n] out */                              \\
        const __grid_constant__ CUtensorMap map, unsigned int n) {       \\
        body<T>(out, map, n);                                            \\
    }
ENTRY(f16, __half)
ENTRY(f32, float)
// extern "C" in a comment is no declaration
extern "C" __global__ void plain(const int* state,   // [3]
                                 float eps, u64 ns) { }
"""
    sigs = kernel_signatures(text)
    assert sorted(sigs) == ["k_f16", "k_f32", "plain"]
    assert [(p.name, p.ctype, p.kind) for p in sigs["k_f32"].params] == [
        ("out", "float* __restrict__", "pointer"), ("map", "const __grid_constant__ CUtensorMap", "tensor map"),
        ("n", "unsigned int", "uint32")]
    assert [p.kind for p in sigs["plain"].params] == ["pointer", "float32", "uint64"]
    assert sigs["k_f16"].declaration.endswith("...\nENTRY(f16, __half)")
    with pytest.raises(ValueError, match="readable as kernels"):
        kernel_signatures('extern "C" __device__ int helper(int x) { return x; }')
    with pytest.raises(ValueError, match="no launcher argument kind"):
        kernel_signatures('extern "C" __global__ void k(double x) { }')
    with pytest.raises(ValueError, match="never instantiated"):
        kernel_signatures('#define E(N) extern "C" __global__ void N(int x) { }\n')
