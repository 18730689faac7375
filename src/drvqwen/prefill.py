"""Prefill on the GPU: the prompt's tokens through every layer in batched kernels.

Per chunk of up to `max_chunk_rows` prompt tokens (rows r at positions start + r):

    prefill_begin_chunk             prefill_state = (start, n_rows)            (device scalars)
    embedding                       residual fp32 [R, D] = embed[ids]
    rope_table                      rope_cs fp32 [R, Dh/2, 2] = cos, sin of each RoPE angle at start + r
    per layer l:
      L{l}.input_layernorm          xn   fp16 [R, D]          = rmsnorm(residual) · w
      L{l}.qkv_rope                 q    fp16 [R, Hq, Dh]     = rope(xn Wqᵀ + bq); K/V cache[start + r] =
                                                                rope(xn Wkᵀ + bk), xn Wvᵀ + bv   (INT4 GEMM)
      L{l}.attention                attn fp16 [R, Hq·Dh]      = causal softmax(q Kᵀ/√Dh) V over the paged cache
      L{l}.o_proj                   residual += attn Woᵀ                               (INT4 GEMM)
      L{l}.post_attention_layernorm xn   fp16 [R, D]
      L{l}.gate_up_swiglu           h    fp16 [R, F]          = silu(xn Wgᵀ) · (xn Wuᵀ)  (INT4 GEMM)
      L{l}.down_proj                residual += h Wdᵀ                                  (INT4 GEMM)

but the last layer stops after its qkv_rope (its K/V are the cache's; the rest of its rows'
outputs are read by nothing). Once, after the last chunk, on the prompt's last row only:

    last_row                        last_state = (start + n - 1, 1)            (device scalars)
    L{L-1}.attention                attn[0] = the last row's attention (the prefill kernel, one row)
    L{L-1}.o_proj                   residual[last row] += attn[0] Woᵀ            (decode GEMV)
    L{L-1}.gate_up_swiglu           h[0] = silu(xn Wgᵀ) · (xn Wuᵀ), xn = rmsnorm(residual[last row])
    L{L-1}.down_proj                residual[last row] += h[0] Wdᵀ              (decode GEMV)
    norm                            decode xn fp16 [D] = rmsnorm(residual[last row]) · w_norm
    lm_head, argmax | sample, …     a decode launch list's own sampler step (LaunchList.sampler_step)
    decode_resume                   decode state = (T, next_token, T + 1)

so the KV cache holds positions 0 … T-1 and the next decode step (`DecodeStep.decode_token()`,
or a graph of it) decodes the chosen token at position T with the same weights, cache, sequence
and stream. The sequence's pages and position change only through `DecodeStep.seq`
(sequence.py): the prompt's pages are reserved at once, the position resumed at its end.

With `qkv_rope=False` the QKV GEMM writes FP32 q | k | v into a buffer and a second launch adds
the bias, rotates and writes q and the cache (L{l}.qkv_proj, then L{l}.rope_kv, as the per-tensor
formats do below; no rope_table): the same bits, one more launch a layer and an FP32 round trip
(to compare).

Weights in per-tensor formats (a GGUF kept in its formats, plan.formats): Q4_K, Q5_K and Q6_K
projections run gemm_int4.cu's K-quant kernels (launchers/gemm_kquant.py: a layer whose q, k and
v are all Q4_K, or all Q5_K, as L{l}.qkv_rope with the rope_table, as the INT4 layers — so too,
by default (`mixed_qkv`), a layer whose q and k are one of them and v Q6_K, as llama.cpp's *_K_M
recipes give some layers, in one launch of two parts; else q and k of one of them as L{l}.qk_proj),
Q4_0, Q5_0, Q8_0, Q4_1 and Q5_1 ones its kernels for them (launchers/gemm_q32.py: q, k and v
of one of them as L{l}.qkv_rope too; q and k as L{l}.qk_proj), the other formats
gemm_fmt_wgmma.cu (gemm_fmt.cu where K is not a multiple of 128, or with fmt_gemm="mma"; q, k
and v as launches into their columns of qkv); every layer not in a qkv_rope launch then runs
L{l}.rope_kv, and the embedding rows are read in their format (gemv_fmt.cu); the rest of the list
is the same.
`Prefill(mode="per_token")` runs a prompt through the decode step's own launches, one token at a
time (`_run_per_token`): its cache is exactly what decoding writes, the GEMM path's reference.

Chunking: prompts longer than `max_chunk_rows` (default 1024) run in chunks of that many rows;
each chunk's attention reads every earlier position from the paged cache, so a prompt of any
length up to max_context works, with buffers sized for one chunk (~94 MB of activations at 7B,
plus the split-K scratch and the attention's KV-split partials).

Why the last layer runs one row: only the last row's output becomes a logit, and the last layer
is the only one whose outputs feed no later layer's K/V. Its attention, o_proj, RMSNorm, gate/up
and down over all the chunk's rows are ~1/L of the prefill's work (at 7B and 512 tokens ~0.39 ms
of 12.5) and are replaced by the decode step's GEMVs on one row (~0.05 ms): the same kernels and
sums the decode step runs (gemv_int4.cu, gemv_fmt.cu: weights read once, at bandwidth). A chunk
that is not the prompt's last needs none of its last layer past the K/V. `last_layer="all_rows"`
runs the last layer over every row as the others (to compare: logits within TOL of each other,
the same cache bit for bit).

Where the time goes at 512 tokens (synthetic 7B, H200): the INT4 GEMMs (gemm_int4.cu, wgmma)
are most of it; attention, RoPE/K/V writes and the RMSNorms ~2 ms together
(docs/benchmarks.md has the measured figures).

Launch lists: the kernels read (start, n_rows) from the device `prefill_state`, so a list of
pre-packed launches depends only on its grid size. Grids are sized for the chunk's row count
rounded up to ROW_BUCKET = 64 rows (a "row bucket"); one list per bucket is built on first use and
reused for every later chunk and prompt of that size (building ~230 launches costs a few ms of
Python, once). Rows past n_rows within a bucket are computed by the embedding and RMSNorm
launches (harmless: they are never read) and skipped by every other kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .cuda import DEFAULT_ALIGN_BYTES, DeviceArray, Pool
from .decode import DecodeStep
from .launch_list import LaunchList, NamedLaunch, named_launches
from .errors import DrvqwenError
from .launchers import (AttentionPrefill, DecodeResume, EmbeddingRows, GemmInt4GateUpSwigluRows, GemmInt4QkvRopeRows,
                        GemmInt4QkvRows, GemmInt4ResidualRows, GemvFmtGateUpSwiglu, GemvFmtResidual,
                        GemvInt4GateUpSwiglu, GemvInt4Residual, GpuSleep, Launcher, LaunchError, PrefillBeginChunk,
                        RmsNorm, RopeKvRows, RopeTableRows)
from .format import weight_formats as wf
from .format.quant import GROUP_SIZE as GEMM_GROUP
from .format.tensor_set import EMBED, proj_prefix
from .launchers import gemm_fmt_wgmma
from .launchers.gemm_fmt import GemmFmtGateUpSwigluRows, GemmFmtResidualRows, GemmFmtRows
from .launchers.gemm_fmt_wgmma import GemmFmtwGateUpSwigluRows, GemmFmtwResidualRows, GemmFmtwRows
from .launchers import gemm_kquant
from .launchers.gemm_kquant import Q4K_ID, Q5K_ID, Q6K_ID
from .launchers import gemm_q32
from .launchers.gemm_q32 import GemmQ32GateUpSwigluRows, GemmQ32QkvRopeRows, GemmQ32ResidualRows, GemmQ32StackedRows
from .launchers.gemm_kquant import (GemmQ4kGateUpSwigluRows, GemmQ4kQkvRopeRows, GemmQ4kResidualRows,
                                    GemmQ4kStackedRows, GemmQ5kGateUpSwigluRows, GemmQ5kQkvRopeRows,
                                    GemmQ5kResidualRows, GemmQ5kStackedRows, GemmQ6kResidualRows, GemmQ6kRows)
from .launchers.gemv_fmt import DENSE_F16, EmbeddingFmtRows, fmt_weight
from .launchers.gemm_int4 import BLOCK_ROWS as GEMM_BLOCK_ROWS, SplitKScratch, split_k_need
from .launchers.attention_prefill import ENGINE_FILES as ATTENTION_FILES, ENGINES as ATTENTION_ENGINES, \
    AttentionSplitScratch, engine_build, kv_splits_for, tile_splits_needed
from .launchers.rmsnorm import row_threads as norm_row_threads
from .layer_weights import LayerWeights


class KminLaunchers(NamedTuple):
    """The register-unpack GEMMs of one K-quant with a min (gemm_kquant.py)."""
    stacked: type
    residual: type
    gate_up: type
    qkv_rope: type  # q, k and v in this format, or (mixed_qkv) v in Q6_K


# Q4_K and Q5_K, the two share every launch shape (Q5_K adds the high-bit plane).
KMIN_LAUNCHERS = {Q4K_ID: KminLaunchers(GemmQ4kStackedRows, GemmQ4kResidualRows, GemmQ4kGateUpSwigluRows,
                                        GemmQ4kQkvRopeRows),
                  Q5K_ID: KminLaunchers(GemmQ5kStackedRows, GemmQ5kResidualRows, GemmQ5kGateUpSwigluRows,
                                        GemmQ5kQkvRopeRows)}
# The K-quants' residual GEMMs (o_proj, down_proj) by format id: Q4_K's and Q5_K's, and Q6_K's.
KQUANT_RESIDUAL = {**{fid: ls.residual for fid, ls in KMIN_LAUNCHERS.items()}, Q6K_ID: GemmQ6kResidualRows}

# Chunk row counts are rounded up to a multiple of this: the grids of a launch list depend only
# on the rounded count, so a few lists serve every prompt. Half the GEMM's 128-token block: a
# short prompt's embedding/RMSNorm launches do not compute 128 rows (the GEMM reads rows past the
# bucket as zeros through its tensor map).
ROW_BUCKET = 64

# The kernel files the prefill launches (kernels/X.cu for launchers/X.py), which the engine
# compiles before it builds anything (engine.engine_kernels); tests/test_startup.py checks the
# list against the launchers this module uses. KERNEL_FILES_FMT: for weights in per-tensor
# formats (the embedding row from gemv_fmt.cu, or embedding.cu where it is dense FP16).
# The attention kernel of a chunk (Prefill's `attention_engine`; launchers/attention_prefill.py):
# wgmma, faster than mma.sync at every chunk position and both models' shapes (the kernel's header).
# Its range schedule ("wgmma-ranges") wins on chunks from ~2 048 positions at Dh = 128 and loses
# at position 0 and at Dh = 64 (the kernel's table): the split schedule stays the default.
ATTENTION_ENGINE = "wgmma"
# From this chunk position on, a head dim of 128 runs the range schedule instead (Prefill's
# `late_attention_from`; None: never): at 2 048 it takes 68.9 µs against 73.8 for a 7B chunk of 512
# rows, at 1 024 the two tie, at 0 it loses (kernels/attention_prefill_wgmma.cu's table). A 7B
# prompt of 32 000 tokens: 1431 → 1364 ms; of 8 192: 234.6 → 230.1 (512-row chunks). In 1024-row
# chunks, 8 192 tokens: 208.7 / 209.1 ms against 210.7 with every chunk on the split schedule
# (docs/benchmarks.md). At 1024 rows the switch stays right: from position 1024 the split schedule
# takes 78.4 µs against the range schedule's 80.4, from 2048 117.5 against 115.3, from 7168 312.9
# against 290.5 (tools/bench_attention_prefill.py, docs/bench/2026-12-04_884f055_h200_attention_prefill_1024rows.json).
# Those runs timed the range schedule in its two-warpgroup build; it now runs the three-warpgroup
# one (launchers/attention_prefill.py: ENGINE_BUILDS), 3–8 % faster from 2048 on, so the switch
# may pay earlier: still to measure at 1024.
LATE_ATTENTION_ENGINE, LATE_ATTENTION_FROM = "wgmma-ranges", 2048


def late_attention_builds(config) -> set[tuple[str, tuple[tuple[str, int], ...]]]:
    """(kernel file, defines) of the range-scheduled attention a default Prefill of `config`
    launches for chunks from LATE_ATTENTION_FROM on — a build of its own (ENGINE_BUILDS), which
    the engine compiles with the rest before the first prompt (engine.engine_kernels); empty where
    no chunk takes it (head dim ≠ 128, or the split schedule's engine not wgmma)."""
    if not late_attention_applies(ATTENTION_ENGINE, config.head_dim, LATE_ATTENTION_FROM):
        return set()
    return {(ATTENTION_FILES[LATE_ATTENTION_ENGINE], engine_build(LATE_ATTENTION_ENGINE))}


def late_attention_applies(attention_engine: str, head_dim: int, late_from: int | None) -> bool:
    """Whether a Prefill with `attention_engine` runs late chunks on the range schedule."""
    return late_from is not None and attention_engine == "wgmma" and head_dim == 128


KERNEL_FILES = ("prefill_state", "embedding", "rmsnorm", "gemm_int4", "gemv_int4", "rope_kv",
                ATTENTION_FILES[ATTENTION_ENGINE])
KERNEL_FILES_FMT = ("prefill_state", "embedding", "gemv_fmt", "rmsnorm", "gemm_fmt", "gemm_fmt_wgmma", "rope_kv",
                    ATTENTION_FILES[ATTENTION_ENGINE])
# Which GEMMs run the projections (Prefill's `fmt_gemm`): "wgmma" — the default — runs a model
# in per-tensor formats on gemm_fmt_wgmma.cu wherever K is a multiple of its 128-input stage
# (every Qwen2.5 shape) and an INT4 model on gemm_int4.cu; "mma" runs the per-tensor
# projections on gemm_fmt.cu everywhere (the version before, kept for K off that stage). An INT4
# model's projections always run on gemm_int4.cu: its weights are in the INT4 kernels' device
# layout (format/int4_tiles.py), which the per-tensor GEMMs do not read.
FMT_GEMMS = ("wgmma", "mma")
# How the prompt runs: "gemm" (the chunk launch lists below) or "per_token" (through the decode
# step's own launches one token at a time: its cache is exactly what decoding writes; a
# reference for the GEMM path's tests).
PREFILL_MODES = ("gemm", "per_token")
# What the last layer runs past its K/V (Prefill's `last_layer`): "last_row" — the default — the
# prompt's last row only, through the decode step's GEMVs (module doc); "all_rows" every row, as
# the other layers (to compare).
LAST_LAYER_MODES = ("last_row", "all_rows")

# Prompt rows per chunk. Each chunk streams every layer's weights once and launches every
# layer's kernels once, so fewer, larger chunks cost less — up to a point: measured on the H200
# (`drvqwen bench --prefill-chunk-rows`, docs/benchmarks.md), the 7B's 8 192-token TTFT is
# 221.8 ms at 512 rows, 213.0 at 768, 205.4–207.7 at 1024, 209.4 at 1536, 210.4–210.8 at 2048;
# its 32 000-token TTFT 1252, 1186, 1182 and 1199 ms at 512, 1024, 1536 and 2048. 1024 rows
# double the activation buffers of 512 (~94 MB at 7B) for most of the gain; a prompt of at most
# 1024 tokens is one chunk.
DEFAULT_CHUNK_ROWS = 1024


def rows_view(arr: DeviceArray, rows: int) -> DeviceArray:
    """The first `rows` rows of a [capacity, …] buffer as its own DeviceArray (no copy)."""
    return DeviceArray(f"{arr.name}[:{rows}]", arr.ptr, (rows, *arr.shape[1:]), arr.dtype)


def _format_weight(weights, formats: dict, prefix: str):
    """The per-tensor-format weight of projection `prefix` (e.g. "model.layers.3.self_attn.o_proj")
    as the format kernels take it (format/weight_formats.py: fmt_weight), PLAIN tensors as dense FP16."""
    fid = formats[prefix]
    return fmt_weight(weights.__getitem__, prefix, DENSE_F16 if fid == wf.PLAIN else wf.FORMATS[fid])


def _row_ptr(arr: DeviceArray, row: int) -> DeviceArray:
    """Row `row` of a 2-D buffer as a 1-D DeviceArray (no copy)."""
    n = int(np.prod(arr.shape[1:]))
    return DeviceArray(f"{arr.name}[{row}]", arr.ptr + row * n * arr.dtype.itemsize, (n,), arr.dtype)


class Prefill:
    """The prompt pass of one model, sharing a `DecodeStep`'s weights, KV cache, pages and stream.

    Args:
        decode_step: the decode step whose state this prefill leaves ready to continue.
        max_chunk_rows: prompt rows per chunk (rounded up to a multiple of 64).
        mode: "gemm" (the chunk launch lists) or "per_token" (the decode step's launches).
        fmt_gemm: the GEMMs of per-tensor formats (FMT_GEMMS).
        split_k: let the wgmma GEMMs split K where few tiles would leave SMs idle
            (kernels/gemm_split_k.cuh); False runs every GEMM whole (to compare).
        pdl: launch the chunk's kernels that support it as programmatic dependents (each
            starts while the one before drains, and waits for it with griddepcontrol.wait);
            False launches them plainly (to compare).
        attention_splits: KV splits per query tile of the attention (kernels/attention_prefill.cu,
            "KV splits"): True picks them per row bucket (kv_splits_for), False runs each
            query tile whole (to compare).
        qkv_rope: INT4 weights, and the per-tensor layers whose q, k, v are all Q4_K, all Q4_0,
            all Q5_0 or all Q8_0: the bias, RoPE and K/V cache writes in the QKV GEMM's epilogue
            (gemm_int4_qkv_rope, gemm_q4k_qkv_rope, gemm_q4g32_qkv_rope, gemm_q5g32_qkv_rope,
            gemm_q8g32_qkv_rope); False runs them as rope_kv_rows after an FP32 QKV GEMM (to
            compare: the same bits).
        attention_engine: the attention kernel (launchers/attention_prefill.py, ENGINES): "mma"
            (kernels/attention_prefill.cu), "wgmma" (kernels/attention_prefill_wgmma.cu, the split
            schedule) or "wgmma-ranges" (the same file's range schedule).
        last_layer: "last_row" (the last layer past its K/V on the prompt's last row only) or
            "all_rows" (LAST_LAYER_MODES; module doc).
        late_attention_from: chunks starting at this position or later run the range schedule
            (LATE_ATTENTION_ENGINE) where the engine is "wgmma" and the head dim 128; None: never.
        kquant_gemm: per-tensor formats on the wgmma GEMMs: Q4_K, Q5_K and Q6_K projections on
            gemm_int4.cu's mainloop, unpacked in the consumers' registers (launchers/gemm_kquant.py);
            False runs them on gemm_fmt_wgmma.cu as every other format (to compare).
        q32_gemm: per-tensor formats on the wgmma GEMMs: Q4_0, Q5_0, Q8_0, Q4_1 and Q5_1 projections on
            gemm_int4.cu's mainloop (launchers/gemm_q32.py); False runs them on gemm_fmt_wgmma.cu
            (to compare).
        mixed_qkv: with kquant_gemm, a layer whose q and k are Q4_K (Q5_K) and v Q6_K runs its QKV
            as one launch in two parts (gemm_q4k_q6k_qkv_rope, gemm_q5k_q6k_qkv_rope) instead of
            L{l}.qk_proj, L{l}.v_proj and L{l}.rope_kv (False: the three, to compare). The default:
            in turns on one GPU, the synthetic 7B's TTFT(512) in the Q5_K_M layout 13.9 / 13.7 ms
            against 14.2 / 14.4, in Q4_K_M 13.3 / 13.1 against 13.4 / 13.4 (docs/kernels.md).
        attention_defines: (name, value) pairs replacing or added to the defines of each wgmma
            attention engine's build (launchers/attention_prefill.py ENGINE_BUILDS; the kernel
            header's builds, e.g. (("APW_WARPGROUPS", 2), ("APW_Q_SMEM", 0))); () their own.
    Raises:
        DrvqwenError: the activation buffers do not fit in GPU memory.
    """

    def __init__(self, decode_step: DecodeStep, max_chunk_rows: int = DEFAULT_CHUNK_ROWS, mode: str = "gemm",
                 fmt_gemm: str = "wgmma", split_k: bool = True, pdl: bool = True,
                 attention_splits: bool = True, qkv_rope: bool = True, attention_engine: str = ATTENTION_ENGINE,
                 last_layer: str = "last_row", late_attention_from: int | None = LATE_ATTENTION_FROM,
                 kquant_gemm: bool = True, q32_gemm: bool = True, attention_defines: tuple = (),
                 mixed_qkv: bool = True):
        if max_chunk_rows < 1:
            raise DrvqwenError(f"max_chunk_rows={max_chunk_rows}: must be >= 1")
        if mode not in PREFILL_MODES:
            raise DrvqwenError(f"prefill mode {mode!r}: choose one of {', '.join(PREFILL_MODES)}")
        if fmt_gemm not in FMT_GEMMS:
            raise DrvqwenError(f"fmt_gemm {fmt_gemm!r}: choose one of {', '.join(FMT_GEMMS)}")
        if attention_engine not in ATTENTION_ENGINES:
            raise DrvqwenError(f"attention engine {attention_engine!r}: choose one of {', '.join(ATTENTION_ENGINES)}")
        if last_layer not in LAST_LAYER_MODES:
            raise DrvqwenError(f"last_layer {last_layer!r}: choose one of {', '.join(LAST_LAYER_MODES)}")
        self.fmt_gemm = fmt_gemm
        self.attention_engine = attention_engine
        self.attention_defines = tuple(attention_defines)
        if self.attention_defines and attention_engine == "mma":
            raise DrvqwenError(f"attention defines {', '.join(f'{k}={v}' for k, v in self.attention_defines)}: "
                               "they build the wgmma attention kernel, the mma engine takes none")
        self.last_row = last_layer == "last_row" and mode != "per_token"
        # Chunks from this position on take the range-scheduled attention (None: none do).
        self.late_from = (late_attention_from if mode != "per_token" and late_attention_applies(
            attention_engine, decode_step.config.head_dim, late_attention_from) else None)
        self.pdl = pdl
        # RoPE in the QKV GEMM's epilogue: the INT4 GEMMs only (the format GEMMs write FP32 q | k | v).
        self.qkv_rope = qkv_rope and decode_step.plan.formats is None
        # Q4_K, Q5_K and Q6_K projections on the register-unpack GEMMs (gemm_kquant.py), where fmt_gemm is "wgmma".
        self.kquant_gemm = kquant_gemm and fmt_gemm == "wgmma"
        # Q4_0, Q5_0, Q8_0, Q4_1 and Q5_1 projections on the register-unpack GEMMs (gemm_q32.py), likewise.
        self.q32_gemm = q32_gemm and fmt_gemm == "wgmma"
        # q, k in Q4_K/Q5_K and v in Q6_K as one QKV launch (the K-quant GEMMs), else three.
        self.mixed_qkv = mixed_qkv and self.kquant_gemm
        self.decode_step = step = decode_step
        cfg = self.config = step.config
        # Per-tensor formats: a layer whose q, k and v are all in one format of the register GEMMs
        # (Q4_K, Q4_0, Q5_0, Q8_0) takes them in one launch with the bias, RoPE and K/V writes in its
        # epilogue (gemm_q4k_qkv_rope, gemm_q32's), as the INT4 layers do.
        self.register_rope = (qkv_rope and decode_step.plan.formats is not None
                              and any(self._rope_qkv(decode_step.plan.formats, l)
                                      for l in range(decode_step.config.num_layers)))
        # Per token, the prompt runs through the decode step's own launches (`_run_per_token`)
        # and needs none of the chunk buffers.
        self.per_token = mode == "per_token"
        bucket = ROW_BUCKET
        self.chunk_rows = (min(-(-max_chunk_rows // bucket), -(-step.max_context // bucket)) * bucket
                           if not self.per_token else ROW_BUCKET)
        C, D, F = self.chunk_rows, cfg.hidden_size, cfg.intermediate_size
        nq, nkv = cfg.q_dim, cfg.kv_dim
        act = {  # name: (shape, dtype) — one chunk's rows; ids hold the whole prompt (+ a bucket of slack)
            "prefill_state": ((2,), np.int32), "last_state": ((2,), np.int32),
            "ids": ((step.max_context + C,), np.int32),
            "residual": ((C, D), np.float32), "xn": ((C, D), np.float16),
            "q": ((C, nq), np.float16), "attn": ((C, nq), np.float16), "h": ((C, F), np.float16),
        }
        if self.qkv_rope or self.register_rope:  # the chunk's RoPE cos and sin, read by the QKV GEMMs
            act["rope_cs"] = ((C, cfg.head_dim), np.float32)
        if not self.qkv_rope:  # FP32 q | k | v between the QKV GEMMs and rope_kv_rows (per-tensor layers too)
            act["qkv"] = ((C, nq + 2 * nkv), np.float32)
        size = sum(-(-int(np.prod(s)) * np.dtype(d).itemsize // DEFAULT_ALIGN_BYTES) * DEFAULT_ALIGN_BYTES
                   for s, d in act.values()) + DEFAULT_ALIGN_BYTES
        # The wgmma GEMMs' split-K scratch (INT4 or per-tensor formats), sized for the largest split
        # any row bucket's list takes.
        split_units, split_tiles = self._split_k_need() if split_k and not self.per_token else (0, 0)
        if split_units:
            size += SplitKScratch.nbytes(split_units, split_tiles) + 2 * DEFAULT_ALIGN_BYTES
        # The attention's KV splits per row bucket, and their partials and counters, sized for the
        # largest bucket × splits and shared by every layer's launch.
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.attention_splits = ({rows: kv_splits_for(rows, *heads, engine=attention_engine,
                                                      defines=self.attention_defines)
                                  for rows in range(ROW_BUCKET, C + 1, ROW_BUCKET)}
                                 if attention_splits and not self.per_token else {})
        # The last layer's one-row attention (`_tail`): splits as a one-row launch picks them.
        self.tail_splits = (kv_splits_for(1, *heads, engine=attention_engine, defines=self.attention_defines)
                            if attention_splits else 1)
        tile_splits = max((tile_splits_needed(rows, s, *heads[:2], attention_engine, self.attention_defines)
                           for rows, s in [*self.attention_splits.items(), (1, self.tail_splits)] if s > 1),
                          default=0)
        if self.late_from is not None:  # the range schedule's pieces, every bucket
            tile_splits = max(tile_splits, tile_splits_needed(C, kv_splits_for(C, *heads, engine=LATE_ATTENTION_ENGINE),
                                                              *heads[:2], LATE_ATTENTION_ENGINE, self.attention_defines))
        if tile_splits:
            size += AttentionSplitScratch.nbytes(tile_splits, *heads) + 3 * DEFAULT_ALIGN_BYTES
        self.pool = Pool(size, name="prefill")
        self.buf = {name: self.pool.alloc(name, s, d) for name, (s, d) in act.items()}
        self.split_k = SplitKScratch(self.pool.alloc, split_units, split_tiles) if split_units else None
        self.attention_scratch = AttentionSplitScratch(self.pool.alloc, tile_splits, *heads) if tile_splits else None
        self.buf["ids"].upload(np.zeros(act["ids"][0], np.int32))  # padding rows embed token 0
        st = step.stream
        self._begin = PrefillBeginChunk(self.buf["prefill_state"], stream=st)
        w = step.weights
        # The final norm reads the prompt's last row: its pointer is set per prompt.
        self._norm = RmsNorm(step.buf["xn"], _row_ptr(self.buf["residual"], 0), w["model.norm.weight"],
                             dim=D, eps=cfg.rms_norm_eps, stream=st)
        self._resume = DecodeResume(step.buf["state"], step.buf["next_token"], stream=st)
        self._begin_last = PrefillBeginChunk(self.buf["last_state"], stream=st)
        self._tail_steps: list[tuple[str, Launcher]] | None = None  # built on first use (`_tail`)
        self._lists: dict[int, list[NamedLaunch]] = {}
        self._late_lists: dict[int, list[NamedLaunch]] = {}  # chunks from late_from on
        # rows → the (name, launcher) list behind launches(rows) (timing, tests); with late_from,
        # each layer's `attention` and `attention_late` both (launches keeps one per chunk).
        self.launchers: dict[int, list[tuple[str, Launcher]]] = {}

    def _split_k_need(self) -> tuple[int, int]:
        """(units, tiles) of SplitKScratch the wgmma GEMMs of every row bucket's list need at most
        ((0, 0): none splits): (row blocks, K) of each GEMM of a layer — q, k and v apart where the
        weights keep their formats — at every row bucket. The mma GEMMs (gemm_fmt.cu) never split."""
        cfg = self.config
        D, F, nq, nkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim
        blocks = lambda n: -(-n // GEMM_BLOCK_ROWS)  # noqa: E731
        if self.decode_step.plan.formats is None:
            shapes = [(blocks(nq + 2 * nkv), D), (blocks(D), nq), (blocks(2 * F), D), (blocks(D), F)]
            tile = None  # gemm_int4 picks its build per launch
        elif self.fmt_gemm == "mma":
            return 0, 0
        else:
            shapes = [(blocks(n), k) for n, k in ((nq, D), (nkv, D), (D, nq), (2 * F, D), (D, F))
                      if gemm_fmt_wgmma.fits(k)]
            if self.kquant_gemm or self.q32_gemm:  # q and k stacked on the Q4_K, Q4_0, Q5_0, Q8_0 GEMMs, or q, k and v
                shapes += [(blocks(nq + nkv), D), (blocks(nq + 2 * nkv), D)]
            tile = gemm_fmt_wgmma.BM  # its one build: the plan's P is for that tile, not gemm_int4's pick
        if not shapes:
            return 0, 0
        # The K-quant and 32-input-block GEMMs plan at 64 and 256 tokens too (gemm_kquant.py,
        # gemm_q32.py): the scratch covers every build.
        register = self.kquant_gemm or self.q32_gemm
        builds = set(gemm_kquant.KQUANT_TILES) | set(gemm_q32.Q32_TILES)
        tiles = (tile, *sorted(builds)) if tile is not None and register else (tile,)
        need = [split_k_need(rows, blocks, k, tile_tokens=bm)
                for rows in range(ROW_BUCKET, self.chunk_rows + 1, ROW_BUCKET) for blocks, k in shapes for bm in tiles]
        return max(u for u, _ in need), max(t for _, t in need)

    # ---- launch lists ---------------------------------------------------------------------------
    def launches(self, rows: int, late: bool = False) -> list[NamedLaunch]:
        """The chunk launch list for grids of `rows` rows (a multiple of 64), built once; `late`:
        for a chunk from late_from on (each layer's attention on the range schedule)."""
        if self.per_token:
            raise LaunchError("a per-token prefill runs through the decode step's launches: it has no chunk "
                              "launch list")
        if rows % ROW_BUCKET or not 0 < rows <= self.chunk_rows:
            raise LaunchError(f"prefill launch list for {rows} rows: want a multiple of {ROW_BUCKET} "
                                f"in 1..{self.chunk_rows}")
        if rows not in self._lists:
            full = self._build(rows)  # both attentions of each layer where late_from is set
            self._lists[rows] = [nl for nl in full if not nl.name.endswith(".attention_late")]
            self._late_lists[rows] = [nl for nl in full if not nl.name.endswith(".attention")]
            if self.last_row:
                self._tail()  # built with the first list: a prompt's first run builds nothing
        return (self._late_lists if late and self.late_from is not None else self._lists)[rows]

    def _embedding(self, rows: int) -> EmbeddingRows:
        """The embedding launcher of the `rows` list (its first launch), whose ids are set per chunk."""
        name, launcher = self.launchers[rows][0]
        assert name == "embedding", name
        return launcher

    def _build(self, R: int) -> list[NamedLaunch]:
        step, cfg, w, st = self.decode_step, self.config, self.decode_step.weights, self.decode_step.stream
        # Views of the first R rows: the launchers check element counts against `rows`.
        res, xn, q, attn, h = (rows_view(self.buf[n], R) for n in ("residual", "xn", "q", "attn", "h"))
        qkv = rows_view(self.buf["qkv"], R) if "qkv" in self.buf else None
        attn_flat = DeviceArray(attn.name, attn.ptr, (R, cfg.num_heads, cfg.head_dim), attn.dtype)
        q_heads = DeviceArray(q.name, q.ptr, (R, cfg.num_heads, cfg.head_dim), q.dtype)
        ps = self.buf["prefill_state"]
        D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        Hq, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv, eps = cfg.q_dim, cfg.kv_dim, cfg.rms_norm_eps
        nt = norm_row_threads(D)  # the RMSNorms' block: a thread per float4 of a row
        ids = DeviceArray("ids[chunk]", self.buf["ids"].ptr, (R,), np.int32)
        fm = step.plan.formats
        if fm is not None:
            return self._build_fmt(R, res, xn, qkv, q, attn, h, attn_flat, q_heads, ids, fm, step.plan.fmt_defines)
        sk = self.split_k
        steps: list[tuple[str, Launcher]] = [
            ("embedding", EmbeddingRows(res, w["model.embed_tokens.weight"], ids, n_rows=R, vocab_size=V,
                                        dim=D, stream=st))]
        if self.qkv_rope:
            rope_cs = rows_view(self.buf["rope_cs"], R)
            steps.append(("rope_table", RopeTableRows(rope_cs, step.buf["inv_freq"], ps, rows=R, head_dim=Dh,
                                                      stream=st)))
        for l in range(cfg.num_layers):
            lw = LayerWeights.of(w.__getitem__, l)
            k_l, v_l = step.kv.layer_view("k_cache", l), step.kv.layer_view("v_cache", l)
            steps.append((f"L{l}.input_layernorm", RmsNorm(xn, res, lw.input_layernorm, dim=D, eps=eps, rows=R,
                                                           threads=nt, stream=st)))
            if self.qkv_rope:
                steps.append((f"L{l}.qkv_rope", GemmInt4QkvRopeRows(
                    q, k_l, v_l, xn, *lw.q_proj, *lw.k_proj, *lw.v_proj, lw.q_bias, lw.k_bias, lw.v_bias,
                    rope_cs, ps, step.buf["block_table"], n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, k=D, rows=R,
                    split_k=sk, stream=st)))
            else:
                steps += [
                    (f"L{l}.qkv_proj", GemmInt4QkvRows(qkv, xn, *lw.q_proj, *lw.k_proj, *lw.v_proj, ps, n_q=nq,
                                                       n_kv=nkv, k=D, rows=R, head_dim=Dh, split_k=sk, stream=st)),
                    (f"L{l}.rope_kv", RopeKvRows(q, k_l, v_l, qkv, lw.q_bias, lw.k_bias, lw.v_bias,
                                                 step.buf["inv_freq"], ps, step.buf["block_table"], rows=R,
                                                 n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, stream=st))]
            if self.last_row and l == cfg.num_layers - 1:
                break  # past its K/V, the last layer runs on the last row only (`_tail`)
            steps += [
                (f"L{l}.attention", AttentionPrefill(attn_flat, q_heads, k_l, v_l, step.buf["block_table"], ps,
                                                     rows=R, n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh,
                                                     kv_splits=self.attention_splits.get(R, 1),
                                                     scratch=self.attention_scratch, engine=self.attention_engine,
                                                     defines=self.attention_defines, stream=st)),
                *self._late_attention(l, R, attn_flat, q_heads, k_l, v_l),
                (f"L{l}.o_proj", GemmInt4ResidualRows(res, attn, *lw.o_proj, ps, n=D, k=nq, rows=R, split_k=sk, stream=st)),
                (f"L{l}.post_attention_layernorm", RmsNorm(xn, res, lw.post_attention_layernorm, dim=D, eps=eps,
                                                           rows=R, threads=nt, stream=st)),
                (f"L{l}.gate_up_swiglu", GemmInt4GateUpSwigluRows(h, xn, *lw.gate_proj, *lw.up_proj, ps, f=F, k=D,
                                                                  rows=R, split_k=sk, stream=st)),
                (f"L{l}.down_proj", GemmInt4ResidualRows(res, h, *lw.down_proj, ps, n=D, k=F, rows=R, split_k=sk, stream=st)),
            ]
        return self._named(R, steps)

    def _build_fmt(self, R: int, res, xn, qkv, q, attn, h, attn_flat, q_heads, ids, fm: dict[str, int],
                   defs: tuple) -> list[NamedLaunch]:
        """`_build` for weights in per-tensor formats `fm` (prefix → format id; `defs` compile the
        format kernels for them): gemm_fmt_wgmma.cu's GEMMs (or gemm_fmt.cu's, `fmt_gemm`; q, k
        and v into their columns of qkv, one launch each) and the embedding rows in their format;
        the rest is the INT4 list's."""
        step, cfg, w, st = self.decode_step, self.config, self.decode_step.weights, self.decode_step.stream
        ps = self.buf["prefill_state"]
        D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        Hq, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv, eps = cfg.q_dim, cfg.kv_dim, cfg.rms_norm_eps
        nt = norm_row_threads(D)  # the RMSNorms' block: a thread per float4 of a row

        def fw(prefix: str):
            return _format_weight(w, fm, prefix)

        def gemms(k: int):
            """(rows, residual, gate/up) GEMM launchers for input width k."""
            if self.fmt_gemm != "mma" and gemm_fmt_wgmma.fits(k):
                return GemmFmtwRows, GemmFmtwResidualRows, GemmFmtwGateUpSwigluRows
            return GemmFmtRows, GemmFmtResidualRows, GemmFmtGateUpSwigluRows

        Rows, _, GateUp = gemms(D)
        ResidualO, ResidualDown = gemms(nq)[1], gemms(F)[1]
        wgmma = (GemmFmtwRows, GemmFmtwResidualRows, GemmFmtwGateUpSwigluRows)
        sk = {c: {"split_k": self.split_k} if c in wgmma else {} for c in (Rows, GateUp, ResidualO, ResidualDown)}

        if fm[EMBED] == wf.PLAIN:
            embed = EmbeddingRows(res, w["model.embed_tokens.weight"], ids, n_rows=R, vocab_size=V, dim=D, stream=st)
        else:
            embed = EmbeddingFmtRows(res, fw(EMBED), ids, n_rows=R, vocab_size=V, dim=D, stream=st, defines=defs)
        steps: list[tuple[str, Launcher]] = [("embedding", embed)]
        if self.register_rope:
            rope_cs = rows_view(self.buf["rope_cs"], R)
            steps.append(("rope_table", RopeTableRows(rope_cs, step.buf["inv_freq"], ps, rows=R, head_dim=Dh,
                                                      stream=st)))
        ld = nq + 2 * nkv
        for l in range(cfg.num_layers):
            lw = LayerWeights.of(w.__getitem__, l)
            pw = {p: fw(proj_prefix(l, p)) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj")}
            k_l, v_l = step.kv.layer_view("k_cache", l), step.kv.layer_view("v_cache", l)
            steps.append((f"L{l}.input_layernorm", RmsNorm(xn, res, lw.input_layernorm, dim=D, eps=eps, rows=R,
                                                           threads=nt, stream=st)))
            rope_qkv = self._rope_qkv(fm, l) if self.register_rope else None
            if rope_qkv:
                steps.append((f"L{l}.qkv_rope", rope_qkv(
                    q, k_l, v_l, xn, pw["q_proj"], pw["k_proj"], pw["v_proj"], lw.q_bias, lw.k_bias, lw.v_bias,
                    rope_cs, ps, step.buf["block_table"], n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, k=D, rows=R,
                    split_k=self.split_k, stream=st)))
            else:
                steps += [
                    *self._qkv_launches(l, Rows, qkv, xn, pw, ps, R, ld, defs, sk[Rows]),
                    (f"L{l}.rope_kv", RopeKvRows(q, k_l, v_l, qkv, lw.q_bias, lw.k_bias, lw.v_bias,
                                                 step.buf["inv_freq"], ps, step.buf["block_table"], rows=R,
                                                 n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, stream=st)),
                ]
            if self.last_row and l == cfg.num_layers - 1:
                break  # past its K/V, the last layer runs on the last row only (`_tail`)
            steps += [
                (f"L{l}.attention", AttentionPrefill(attn_flat, q_heads, k_l, v_l, step.buf["block_table"], ps,
                                                     rows=R, n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh,
                                                     kv_splits=self.attention_splits.get(R, 1),
                                                     scratch=self.attention_scratch, engine=self.attention_engine,
                                                     defines=self.attention_defines, stream=st)),
                *self._late_attention(l, R, attn_flat, q_heads, k_l, v_l),
                (f"L{l}.o_proj", self._register_residual(res, attn, pw["o_proj"], ps, n=D, k=nq, rows=R)
                 or ResidualO(res, attn, pw["o_proj"], ps, n=D, k=nq, rows=R, stream=st, defines=defs, **sk[ResidualO])),
                (f"L{l}.post_attention_layernorm", RmsNorm(xn, res, lw.post_attention_layernorm, dim=D, eps=eps,
                                                           rows=R, threads=nt, stream=st)),
                (f"L{l}.gate_up_swiglu", self._register_gate_up(h, xn, pw["gate_proj"], pw["up_proj"], ps, f=F, k=D,
                                                                rows=R)
                 or GateUp(h, xn, pw["gate_proj"], pw["up_proj"], ps, f=F, k=D, rows=R, stream=st, defines=defs,
                           **sk[GateUp])),
                (f"L{l}.down_proj", self._register_residual(res, h, pw["down_proj"], ps, n=D, k=F, rows=R)
                 or ResidualDown(res, h, pw["down_proj"], ps, n=D, k=F, rows=R, stream=st, defines=defs,
                              **sk[ResidualDown])),
            ]
        return self._named(R, steps)

    def _kquant(self, w, k: int) -> int | None:
        """The format id (Q4K_ID, Q5K_ID, Q6K_ID) of projection weight `w` (input width k) where it runs on
        the register-unpack K-quant GEMMs (gemm_kquant.py), else None."""
        return w.fmt.id if self.kquant_gemm and gemm_kquant.fits(w, k) else None

    def _rope_qkv(self, fm: dict[str, int], l: int):
        """The QKV-RoPE launcher of layer l where its q, k and v (formats `fm`) are all in one format
        of the register GEMMs — all Q4_K or all Q5_K (GemmQ4kQkvRopeRows, GemmQ5kQkvRopeRows, K a
        multiple of 256), or all one of Q4_0, Q5_0, Q8_0, Q4_1, Q5_1 (GemmQ32QkvRopeRows) — or, with
        mixed_qkv, q and k in Q4_K or Q5_K with v in Q6_K (the same launchers), else None
        (the format GEMMs, then rope_kv)."""
        cfg = self.decode_step.config
        k = cfg.hidden_size
        fq, fk, fv = (fm[proj_prefix(l, p)] for p in ("q_proj", "k_proj", "v_proj"))
        fid = fq if fq == fk == fv else None
        # With mixed_qkv, q and k in Q4_K or Q5_K and v in Q6_K are one launch too (two parts), where
        # q's and k's RoPE pairs fill whole row blocks (GemmQ4kQkvRopeRows).
        mixed = (self.mixed_qkv and fq == fk and fv == Q6K_ID
                 and gemm_kquant.qk_pairs_fill_row_blocks(cfg.q_dim, cfg.kv_dim))
        if self.kquant_gemm and fq in KMIN_LAUNCHERS and (fid == fq or mixed) and k % gemm_kquant.SUPER == 0:
            return KMIN_LAUNCHERS[fq].qkv_rope
        if self.q32_gemm and fid in gemm_q32.FORMATS and k % GEMM_GROUP == 0:
            return GemmQ32QkvRopeRows
        return None

    def _q32(self, w, k: int) -> int | None:
        """The format id (Q4_0, Q5_0, Q8_0, Q4_1, Q5_1) of projection weight `w` (input width k) where it
        runs on the register-unpack GEMMs of gemm_q32.py, else None."""
        return w.fmt.id if self.q32_gemm and gemm_q32.fits(w, k) else None

    def _register_residual(self, res, x, w, ps, *, n: int, k: int, rows: int) -> Launcher | None:
        """residual += x Wᵀ on the register-unpack GEMM of W's format (o_proj, down_proj: Q4_K,
        Q5_K, Q6_K, Q4_0, Q5_0, Q8_0), or None where W runs on the format GEMMs."""
        kind = KQUANT_RESIDUAL.get(self._kquant(w, k)) or (GemmQ32ResidualRows if self._q32(w, k) else None)
        return kind and kind(res, x, w, ps, n=n, k=k, rows=rows, stream=self.decode_step.stream,
                             split_k=self.split_k)

    def _register_gate_up(self, h, x, gate, up, ps, *, f: int, k: int, rows: int) -> Launcher | None:
        """h = silu(x Wgᵀ) ⊙ (x Wuᵀ) on the register-unpack GEMM where gate and up are both Q4_K, both
        Q5_K, or both one of Q4_0, Q5_0, Q8_0, Q4_1, Q5_1, else None (the format GEMMs)."""
        q32, kq = self._q32(gate, k), self._kquant(gate, k)
        kind = (KMIN_LAUNCHERS[kq].gate_up if kq in KMIN_LAUNCHERS and kq == self._kquant(up, k) else
                GemmQ32GateUpSwigluRows if q32 and q32 == self._q32(up, k) else None)
        return kind and kind(h, x, gate, up, ps, f=f, k=k, rows=rows, stream=self.decode_step.stream,
                             split_k=self.split_k)

    def _qkv_launches(self, l: int, Rows, qkv, xn, pw: dict, ps, R: int, ld: int, defs: tuple,
                      sk: dict) -> list[tuple[str, Launcher]]:
        """Layer l's q, k and v projections in per-tensor formats into their columns of qkv (the
        layers not taken by a qkv_rope launch): all three in one of Q4_0, Q5_0, Q8_0, Q4_1, Q5_1 as one
        launch of the register-unpack GEMM (`L{l}.qkv_proj`), q and k both in one of Q4_K, Q5_K and
        those as one (`L{l}.qk_proj`), one in any of them or Q6_K alone on its register GEMM;
        the others on `Rows` (`q_proj`, `k_proj`, `v_proj`)."""
        cfg, st = self.config, self.decode_step.stream
        D, nq, nkv = cfg.hidden_size, cfg.q_dim, cfg.kv_dim
        wq, wk, wv = pw["q_proj"], pw["k_proj"], pw["v_proj"]

        def one(w, n: int, col: int) -> Launcher:
            kind = self._kquant(w, D)
            if kind in KMIN_LAUNCHERS:
                return KMIN_LAUNCHERS[kind].stacked(qkv, xn, [w], ps, ns=[n], k=D, rows=R, ldo=ld, col0=col,
                                                    stream=st, split_k=self.split_k)
            if kind == Q6K_ID:
                return GemmQ6kRows(qkv, xn, w, ps, n=n, k=D, rows=R, ldo=ld, col0=col, stream=st,
                                   split_k=self.split_k)
            if self._q32(w, D):
                return GemmQ32StackedRows(qkv, xn, [w], ps, ns=[n], k=D, rows=R, ldo=ld, col0=col, stream=st,
                                            split_k=self.split_k)
            return Rows(qkv, xn, w, ps, n=n, k=D, rows=R, ldo=ld, col0=col, stream=st, defines=defs, **sk)

        out = []
        q32 = self._q32(wq, D)
        if q32 and q32 == self._q32(wk, D):  # q and k (and v) of one 32-input block format in one launch
            with_v = self._q32(wv, D) == q32
            ws, ns = ([wq, wk, wv], [nq, nkv, nkv]) if with_v else ([wq, wk], [nq, nkv])
            out.append((f"L{l}.{'qkv_proj' if with_v else 'qk_proj'}", GemmQ32StackedRows(
                qkv, xn, ws, ps, ns=ns, k=D, rows=R, ldo=ld, col0=0, stream=st, split_k=self.split_k)))
            if with_v:
                return out
        elif self._kquant(wq, D) in KMIN_LAUNCHERS and self._kquant(wq, D) == self._kquant(wk, D):
            out.append((f"L{l}.qk_proj", KMIN_LAUNCHERS[self._kquant(wq, D)].stacked(
                qkv, xn, [wq, wk], ps, ns=[nq, nkv], k=D, rows=R, ldo=ld, col0=0, stream=st,
                split_k=self.split_k)))
        else:
            out += [(f"L{l}.q_proj", one(wq, nq, 0)), (f"L{l}.k_proj", one(wk, nkv, nq))]
        out.append((f"L{l}.v_proj", one(wv, nkv, nq + nkv)))
        return out

    def _late_attention(self, l: int, R: int, out, q, k_l, v_l) -> list[tuple[str, Launcher]]:
        """Layer l's attention on the range schedule (`L{l}.attention_late`) for the chunks from
        late_from on, beside `L{l}.attention`; `launches` keeps one of the two. None without."""
        if self.late_from is None:
            return []
        cfg, step = self.config, self.decode_step
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return [(f"L{l}.attention_late", AttentionPrefill(
            out, q, k_l, v_l, step.buf["block_table"], self.buf["prefill_state"], rows=R, n_heads=heads[0],
            n_kv_heads=heads[1], head_dim=heads[2], kv_splits=kv_splits_for(R, *heads, engine=LATE_ATTENTION_ENGINE),
            scratch=self.attention_scratch, engine=LATE_ATTENTION_ENGINE, defines=self.attention_defines,
            stream=step.stream))]

    def _tail(self) -> list[tuple[str, Launcher]]:
        """The last layer past its K/V on the prompt's last row (module doc), built once: its
        attention as a one-row launch of the prefill kernel at last_state = (position, 1), then the
        decode step's GEMVs — o_proj and down_proj adding into that row of the residual,
        gate_up_swiglu normalising it itself. The row's pointers are set per prompt
        (`_aim_tail`); the rows they write (attn[0], h[0]) are read by nothing else after."""
        if self._tail_steps is not None:
            return self._tail_steps
        step, cfg, w, st = self.decode_step, self.config, self.decode_step.weights, self.decode_step.stream
        D, F, nq, eps = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.rms_norm_eps
        Hq, Hkv, Dh, l = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers - 1
        lw = LayerWeights.of(w.__getitem__, l)
        res_row = _row_ptr(self.buf["residual"], 0)  # set per prompt to the last row
        attn_row, h_row = _row_ptr(self.buf["attn"], 0), _row_ptr(self.buf["h"], 0)
        q_row = DeviceArray("q[last]", self.buf["q"].ptr, (1, Hq, Dh), np.float16)  # set per prompt
        attn = AttentionPrefill(DeviceArray(attn_row.name, attn_row.ptr, (1, Hq, Dh), np.float16), q_row,
                                step.kv.layer_view("k_cache", l), step.kv.layer_view("v_cache", l),
                                step.buf["block_table"], self.buf["last_state"], rows=1, n_heads=Hq,
                                n_kv_heads=Hkv, head_dim=Dh, kv_splits=self.tail_splits,
                                scratch=self.attention_scratch, engine=self.attention_engine,
                                defines=self.attention_defines, stream=st)
        fm = step.plan.formats
        if fm is None:  # INT4
            o = GemvInt4Residual(res_row, attn_row, *lw.o_proj, n=D, k=nq, stream=st)
            gu = GemvInt4GateUpSwiglu(h_row, res_row, lw.post_attention_layernorm, *lw.gate_proj, *lw.up_proj,
                                      f=F, k=D, eps=eps, stream=st)
            d = GemvInt4Residual(res_row, h_row, *lw.down_proj, n=D, k=F, stream=st)
        else:
            def fw(name: str):
                return _format_weight(w, fm, proj_prefix(l, name))

            defs = step.plan.fmt_defines
            o = GemvFmtResidual(res_row, attn_row, fw("o_proj"), n=D, k=nq, stream=st, defines=defs)
            gu = GemvFmtGateUpSwiglu(h_row, res_row, lw.post_attention_layernorm, fw("gate_proj"), fw("up_proj"),
                                     f=F, k=D, eps=eps, stream=st, defines=defs)
            d = GemvFmtResidual(res_row, h_row, fw("down_proj"), n=D, k=F, stream=st, defines=defs)
        self._tail_steps = [("last_row", self._begin_last), (f"L{l}.attention", attn), (f"L{l}.o_proj", o),
                            (f"L{l}.gate_up_swiglu", gu), (f"L{l}.down_proj", d)]
        for name, launcher in self._tail_steps:
            launcher.build(pdl=self.pdl and name != "last_row")
        return self._tail_steps

    def _aim_tail(self, position: int, row: int) -> list[tuple[str, Launcher]]:
        """The tail (`_tail`) set for the prompt's last row: chunk row `row` at `position`."""
        tail = self._tail()
        by_name, l = dict(tail), self.config.num_layers - 1
        self._begin_last.set(position, 1)
        res_row = _row_ptr(self.buf["residual"], row)
        q = self.buf["q"]
        by_name[f"L{l}.attention"].set_arg("q", DeviceArray(f"q[{row}]", q.ptr + row * q.shape[1] * q.dtype.itemsize,
                                                            (1, self.config.num_heads, self.config.head_dim),
                                                            np.float16))
        for role in ("o_proj", "gate_up_swiglu", "down_proj"):  # each reads (and two add into) the row
            by_name[f"L{l}.{role}"].set_arg("residual", res_row)
        return tail

    def _named(self, R: int, steps: list[tuple[str, Launcher]]) -> list[NamedLaunch]:
        """Build the `R`-row list's launchers (programmatic dependents where the kernel supports
        it and self.pdl) and name their launches."""
        self.launchers[R] = steps
        for _, launcher in steps:
            launcher.build(pdl=self.pdl)
        return named_launches(steps)

    def flops(self, n_rows: int, start: int = 0) -> int:
        """Useful FLOPs of a chunk of n_rows at `start`: 2·n·(INT4 parameters) + causal attention."""
        cfg = self.config
        per_layer = (cfg.hidden_size * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.hidden_size
                     + 3 * cfg.hidden_size * cfg.intermediate_size)
        keys = n_rows * start + n_rows * (n_rows + 1) // 2
        attn = 2 * 2 * cfg.num_heads * cfg.head_dim * keys
        return cfg.num_layers * (2 * n_rows * per_layer + attn)

    # ---- running --------------------------------------------------------------------------------
    def run(self, ids: Sequence[int], start: int = 0, launch_list: LaunchList | None = None) -> None:
        """Queue the prefill of `ids` at positions start … start+T-1 and the choice of the next
        token (the sampler step of `launch_list`, default the decode step's greedy list);
        afterwards the decode state is (start+T, token, start+T+1). Asynchronous: the stream
        carries it; `decode_step.sync()` waits.

        start = 0 begins a new sequence (all pages released first); start > 0 continues the
        sequence whose cache holds positions 0 … start-1 — positions from start on, if it holds
        more, are rolled back first and their pages given back (`Sequence.keep`; a prompt that
        parts from the cached one after `start` ids).

        Raises:
            DrvqwenError: no ids, a token id outside the vocabulary, start + T beyond max_context,
                or start past the positions the sequence holds.
        """
        step = self.decode_step
        T = len(ids)
        if T == 0:
            raise DrvqwenError("prefill of an empty prompt (0 tokens)")
        if start + T > step.max_context:
            raise DrvqwenError(f"prompt of {start + T} tokens exceeds the KV cache of {step.max_context} "
                               f"(--max-context)")
        host_ids = np.asarray(ids, dtype=np.int64)
        if host_ids.min() < 0 or host_ids.max() >= self.config.vocab_size:
            bad = int(host_ids[(host_ids < 0) | (host_ids >= self.config.vocab_size)][0])
            raise DrvqwenError(f"token id {bad} outside the vocabulary (0..{self.config.vocab_size - 1})")
        seq = step.seq
        seq.keep(start)
        seq.reserve(start + T)
        if self.per_token:
            self._run_per_token(host_ids, start, launch_list)
            return
        # One synchronous copy of the whole prompt before anything is queued; each chunk's
        # embedding reads its slice through the pointer it is given.
        self.buf["ids"].upload_at(0, host_ids.astype(np.int32))
        last_rows = 0
        for c0 in range(0, T, self.chunk_rows):
            n = min(self.chunk_rows, T - c0)
            bucket = -(-n // ROW_BUCKET) * ROW_BUCKET
            launches = self.launches(bucket, late=self.late_from is not None and start + c0 >= self.late_from)
            # The embedding's ids: this chunk's slice of the prompt.
            self._embedding(bucket).set_arg("ids", DeviceArray("ids[chunk]", self.buf["ids"].ptr + 4 * c0,
                                                               (bucket,), np.int32))
            self._begin.set(start + c0, n).launch()
            for nl in launches:
                nl.launch.launch()
            last_rows = n
        if self.last_row:
            for _name, launcher in self._aim_tail(start + T - 1, last_rows - 1):
                launcher.launch()
        self._norm.set_arg("x", _row_ptr(self.buf["residual"], last_rows - 1))
        self._norm.launch()
        for launcher in (launch_list or step.launch_list).sampler_step():
            launcher.launch()
        self._resume.set(start + T).launch()
        seq.resume(start + T)

    def _run_per_token(self, host_ids: np.ndarray, start: int, launch_list: LaunchList | None) -> None:
        """The prompt through the decode step one token at a time (weights in per-tensor formats,
        which have no prefill GEMM yet): per token, decode_resume sets the state to (position,
        the prompt's token, position + 1) — its token read from the ids buffer — and the decode
        step's launches from the embedding to the last layer run; after the last token, the
        final norm, the sampler step and decode_resume as in `run`. Each position's K/V is what
        a decode step writes (its short-context twin's where the step has one and the position's
        attention covers at most short_below positions: LaunchList.for_length), so the cache
        equals that of decoding the prompt token by token. The pages were reserved by the caller."""
        step = self.decode_step
        T = len(host_ids)
        self.buf["ids"].upload_at(0, host_ids.astype(np.int32))
        feed = DecodeResume(step.buf["state"], DeviceArray("ids[0]", self.buf["ids"].ptr, (1,), np.int32),
                            stream=step.stream)
        lst = launch_list or step.launch_list

        def layers(of: LaunchList) -> list:
            return of.launches[:[nl.name for nl in of.launches].index("norm")]
        by_list = {id(of): layers(of) for of in lst.chain()}
        for i in range(T):
            feed.set_arg("next_token", DeviceArray(f"ids[{i}]", self.buf["ids"].ptr + 4 * i, (1,), np.int32))
            feed.set(start + i).launch()
            for nl in by_list[id(lst.for_length(start + i + 1))]:
                nl.launch.launch()
        for name, launcher in lst.launchers[lst.index("norm"):lst.index("advance_state")]:
            launcher.launch()
        self._resume.set(start + T).launch()
        step.seq.resume(start + T)

    def time_kernels(self, ids: Sequence[int], hold_ms: float = 30.0) -> dict[str, float]:
        """GPU µs of every launch of a one-chunk prefill of `ids` (from position 0).

        As DecodeStep.time_kernels: the launches and their event pairs are queued behind a
        `gpu_sleep(hold_ms)` (kernels/timing.cu), so the kernels run back to back and each pair
        brackets one kernel, not the host's launch latency. Leaves the cache holding `ids`.

        Raises:
            DrvqwenError: more ids than one chunk holds.
        """
        from .cuda import Event

        T, step = len(ids), self.decode_step
        if not 0 < T <= self.chunk_rows:
            raise DrvqwenError(f"time_kernels takes 1..{self.chunk_rows} ids (one chunk), got {T}")
        bucket = -(-T // ROW_BUCKET) * ROW_BUCKET
        launches = self.launches(bucket)
        if self.last_row:  # the last layer past its K/V, on the last row
            launches = launches + named_launches(self._aim_tail(T - 1, T - 1))
        step.seq.reset()
        step.seq.reserve(T)
        self.buf["ids"].upload_at(0, np.asarray(ids, np.int32))
        self._embedding(bucket).set_arg("ids", DeviceArray("ids[chunk]", self.buf["ids"].ptr, (bucket,), np.int32))
        hold = GpuSleep(hold_ms, stream=step.stream)
        ev = [(Event(), Event()) for _ in launches]
        hold.launch()
        self._begin.set(0, T).launch()
        for (e0, e1), nl in zip(ev, launches):
            e0.record(step.stream)
            nl.launch.launch()
            e1.record(step.stream)
        step.sync()
        times = {nl.name: e0.elapsed_ms(e1) * 1e3 for (e0, e1), nl in zip(ev, launches)}
        for e0, e1 in ev:
            e0.close()
            e1.close()
        return times

    def close(self) -> None:
        """Release the prefill's activation buffers (the DecodeStep owns everything else)."""
        self.pool.close()
