"""Launchers of kernels/gemm_int4.cu's kernels for the GGUF's 32-input block formats with one FP16
scale a block, Q4_0 (q4_g32: 4-bit codes in layout id 1), Q5_0 (q5_g32: the same and a high-bit
plane) and Q8_0 (q8_g32: one byte a code), and with an FP16 offset beside it, Q4_1 and Q5_1
(q4_g32_min, q5_g32_min: Q4_0's and Q5_0's codes, unsigned), on gemm_int4.cu's mainloop — the
consumers unpack the codes into wgmma's A registers and scale each 32-input chunk
(GemmQ4g32Scales, GemmQ5g32Scales, GemmQ8g32Scales, GemmQ4g32MinScales, GemmQ5g32MinScales), where
gemm_fmt_wgmma.cu's producer warpgroup dequantizes into shared memory and is the limit.

    GemmQ32QkvRopeRows       q_out fp16 [M, Hq, Dh], the chunk's K/V cache slots
                             = rope(x Wqᵀ + bq), rope(x Wkᵀ + bk), x Wvᵀ + bv (q, k, v in one format)
    GemmQ32StackedRows       out fp32 [M, ldo], columns col0 … = x fp16 [M, K] · [W0; W1; W2]ᵀ
                             (q, k and v of a layer in one launch, q and k, or one matrix)
    GemmQ32ResidualRows      residual fp32 [M, N] += x Wᵀ                     (o_proj, down_proj)
    GemmQ32GateUpSwigluRows  h fp16 [M, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ)

Each takes FmtWeights all in one of the five formats and launches that format's kernel
(gemm_q4g32_*, gemm_q5g32_*, gemm_q8g32_*, gemm_q4g32min_*, gemm_q5g32min_*); llama.cpp's Q5_K_M
gives Q5_1 where Q4_K_M gives Q5_0 (format/recipes.py). llama.cpp's K-quant recipes give a tensor whose K is
not a multiple of the 256-input super-block Q5_0 in place of Q4_K and Q8_0 in place of Q6_K
(format/recipes.py): on Qwen2.5-Coder-0.5B (K = 896) every projection but down_proj; Q4_0, Q5_0
and Q8_0 are presets of their own. The kernels exist in all three tile builds: Q4_0's stage is
the INT4 one (SMEM_Q4), Q5_0's holds the rows' 16 B of high bits behind the code words (SMEM_Q5),
Q8_0's the group's second 64 B (a group is 128 B a row: SMEM_Q8; two stages at 256 tokens). They
plan as gemm_int4.py's launchers (plan_launch: persistent, stream-K ranges with a SplitKScratch)
over their builds. K must be a multiple of 128.
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from ..format import weight_formats as wf
from ..format.quant import GROUP_SIZE
from .base import check_buffer, check_prefill_state, i32, mirrored, require
from .gemm_int4 import (BLOCK_ROWS, TILE_TOKENS, SplitKScratch, _GemmLauncher, check_qkv_rope_outputs,
                        smem_bytes_extra, x_tensor_map)
from .gemv_fmt import FmtWeight

Q4G32_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q4_g32")
Q5G32_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q5_g32")
Q8G32_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q8_g32")
Q4G32MIN_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q4_g32_min")
Q5G32MIN_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q5_g32_min")
# Per format: the kernels' name stem, the stage's extra bytes a row and group (none for Q4_0, Q5_0's
# high bits, Q8_0's second 64 B of codes), the tile builds its kernels exist in, whether it has a
# qhigh plane, whether it has an offsets plane (Q4_1, Q5_1).
FORMATS = {Q4G32_ID: ("q4g32", 0, (256, 128, 64), False, False),
           Q5G32_ID: ("q5g32", GROUP_SIZE // 8, (256, 128, 64), True, False),
           Q8G32_ID: ("q8g32", GROUP_SIZE // 2, (256, 128, 64), False, False),
           Q4G32MIN_ID: ("q4g32min", 0, (256, 128, 64), False, True),
           Q5G32MIN_ID: ("q5g32min", GROUP_SIZE // 8, (256, 128, 64), True, True)}
NAMES = ", ".join(wf.FORMATS[i].name for i in FORMATS)
Q32_TILES = TILE_TOKENS  # the builds a model with any of these formats needs


def smem_bytes_q32(fmt_id: int, bm: int) -> int:
    """GEMM_Q4_SMEM_BYTES / GEMM_Q5_SMEM_BYTES / GEMM_Q8_SMEM_BYTES of the build with `bm` tokens a tile: gemm_int4.cu's
    stages, each with the 128 rows' extra bytes (none for Q4_0, 2 KiB for Q5_0, 8 KiB for Q8_0) behind the code
    words (smem_bytes_extra: Q8_0 two stages at 256 tokens)."""
    return smem_bytes_extra(bm, FORMATS[fmt_id][1])


SMEM_Q4 = mirrored("gemm_int4", "GEMM_Q4_SMEM_BYTES", smem_bytes_q32(Q4G32_ID, 128))
SMEM_Q5 = mirrored("gemm_int4", "GEMM_Q5_SMEM_BYTES", smem_bytes_q32(Q5G32_ID, 128))
SMEM_Q8 = mirrored("gemm_int4", "GEMM_Q8_SMEM_BYTES", smem_bytes_q32(Q8G32_ID, 128))


def fits(w: FmtWeight, k: int) -> bool:
    """Whether these kernels take weight `w` at input width k: format q4_g32, q5_g32, q8_g32, q4_g32_min or q5_g32_min, K
    a multiple of 128."""
    return w.fmt.id in FORMATS and k > 0 and k % GROUP_SIZE == 0


class _GemmQ32Launcher(_GemmLauncher):
    def _check_fmts(self, ws: list[FmtWeight], ns: list[int], k: int) -> int:
        """The format id every weight of `ws` (row counts `ns`, input width k) shares; raises
        LaunchError naming the first weight that is not q4_g32 / q5_g32 / q8_g32 / q4_g32_min / q5_g32_min or not the first's."""
        fmt_id = ws[0].fmt.id
        for w, n in zip(ws, ns):
            require(w.fmt.id in FORMATS, f"{w.name}: format {w.fmt.name}, these kernels read {NAMES} only")
            require(w.fmt.id == fmt_id, f"{w.name}: format {w.fmt.name}, not {ws[0].fmt.name} as {ws[0].name}")
            require(k > 0 and k % GROUP_SIZE == 0, f"{w.name}: K={k} must be a positive multiple of {GROUP_SIZE}")
            w.check(n, k)
        return fmt_id

    @staticmethod
    def _parts(w: FmtWeight, prefix: str) -> dict:
        """<prefix>_qweight (, _qhigh), _scales (, _offsets): the codes (, the high bits of Q5_0 and Q5_1),
        the FP16 scales (, the FP16 offsets of Q4_1 and Q5_1)."""
        high = {f"{prefix}_qhigh": w.parts["qhigh"]} if FORMATS[w.fmt.id][3] else {}
        offsets = {f"{prefix}_offsets": w.parts["offsets"]} if FORMATS[w.fmt.id][4] else {}
        return {f"{prefix}_qweight": w.parts["qweight"], **high, f"{prefix}_scales": w.parts["scales"], **offsets}

    def _build_q32(self, fmt_id: int, role: str, rows: int, n_blocks: int, k: int, out: dict, args: dict,
                   dims: dict, *, reads, writes, max_blocks: int | None, split_k: SplitKScratch | None,
                   blocks: int | None, tile_tokens: int | None, x) -> None:
        """Plan over the format's builds (the fastest estimate, or `tile_tokens`), then build
        gemm_<stem>_<role>: its parameters are `out` (its outputs), x's tensor map for the planned
        tile, then `args` up to prefill_state."""
        stem, _extra, tiles, _high, _offsets = FORMATS[fmt_id]
        bm = self._plan_builds(tiles, f"gemm_{stem}_{role}", rows, n_blocks, k, max_blocks=max_blocks,
                               split_k=split_k, blocks=blocks, tile_tokens=tile_tokens)
        self._build_gemm(f"gemm_{stem}_{role}", rows, n_blocks, k,
                         {**out, "x_map": x_tensor_map(x, rows, k, bm), **args}, dims, reads=reads, writes=writes,
                         max_blocks=max_blocks, split_k=split_k, smem=smem_bytes_q32(fmt_id, bm))


class GemmQ32QkvRopeRows(_GemmQ32Launcher):
    """The QKV projection of a prefill chunk with the bias, the RoPE and the FP16 writes in its
    epilogue: gemm_int4.py's GemmInt4QkvRopeRows (its outputs, rope_cs table and block-table
    contract) for FmtWeights wq [Hq·Dh, K], wk, wv [Hkv·Dh, K] all in one of q4_g32, q5_g32, q8_g32, q4_g32_min, q5_g32_min.

    Raises:
        LaunchError: a weight not in those formats or not in wq's, K not a multiple of 128, an odd
            head_dim, or a buffer of the wrong size, dtype or shape.
    """

    def __init__(self, q_out, k_cache, v_cache, x, wq: FmtWeight, wk: FmtWeight, wv: FmtWeight, q_bias, k_bias,
                 v_bias, rope_cs, prefill_state, block_table, *, n_heads: int, n_kv_heads: int, head_dim: int,
                 k: int, rows: int, max_blocks: int | None = None, split_k: SplitKScratch | None = None,
                 blocks: int | None = None, tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        n_q, n_kv = check_qkv_rope_outputs("gemm_q32_qkv_rope", q_out, k_cache, v_cache, q_bias, k_bias, v_bias,
                                           rope_cs, rows=rows, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                           head_dim=head_dim)
        fmt_id = self._check_fmts([wq, wk, wv], [n_q, n_kv, n_kv], k)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        n = n_q + 2 * n_kv
        self.flops = 2 * rows * n * k
        self.bytes_moved = (wq.nbytes(n_q, k) + wk.nbytes(n_kv, k) + wv.nbytes(n_kv, k) + 2 * rows * k
                            + 2 * rows * n)
        self._build_q32(fmt_id, "qkv_rope", rows, -(-n // BLOCK_ROWS), k,  # 64 RoPE pairs a block: 128 stacked rows
                        dict(q_out=q_out, k_cache=k_cache, v_cache=v_cache),
                        dict(**self._parts(wq, "q"), **self._parts(wk, "k"), **self._parts(wv, "v"), q_bias=q_bias,
                             k_bias=k_bias, v_bias=v_bias, rope_cs=rope_cs, prefill_state=prefill_state,
                             block_table=block_table),
                        dict(Hq=i32(n_heads), Hkv=i32(n_kv_heads), Dh=i32(head_dim), K=i32(k)),
                        reads=(x, q_bias, k_bias, v_bias, rope_cs, prefill_state, block_table) + wq.buffers
                        + wk.buffers + wv.buffers,
                        writes=(q_out, k_cache, v_cache), max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                        tile_tokens=tile_tokens, x=x)


class GemmQ32StackedRows(_GemmQ32Launcher):
    """out fp32 [rows, ldo]: columns col0 … col0+ΣN-1 of rows < M = x fp16 [rows, K] · [W0; W1; W2]ᵀ,
    one to three FmtWeights of one format, q4_g32, q5_g32, q8_g32, q4_g32_min or q5_g32_min, stacked along N (`ws`, `ns`
    their row counts): a layer's q, k and v into qkv in one launch, q and k, or one matrix.

    Raises:
        LaunchError: not 1 to 3 weights, a weight not in q4_g32 / q5_g32 / q8_g32 / q4_g32_min / q5_g32_min or not in the
            first's format, K not a multiple of 128, columns past ldo, or a buffer of the wrong size
            or dtype.
    """

    def __init__(self, out, x, ws: list[FmtWeight], prefill_state, *, ns: list[int], k: int, rows: int, ldo: int,
                 col0: int = 0, max_blocks: int | None = None, split_k: SplitKScratch | None = None,
                 blocks: int | None = None, tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        require(1 <= len(ws) <= 3 and len(ns) == len(ws),
                f"gemm_q32_stacked_rows: one to three weights with a row count each, got {len(ws)} and {len(ns)}")
        fmt_id = self._check_fmts(ws, ns, k)
        n = sum(ns)
        require(0 <= col0 and col0 + n <= ldo,
                f"gemm_q32_stacked_rows: columns {col0} … {col0 + n - 1} outside ldo={ldo}")
        check_buffer(out, "out", rows * ldo, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = sum(w.nbytes(m, k) for w, m in zip(ws, ns)) + 2 * rows * k + 4 * rows * n
        padded = list(ws) + [ws[0]] * (3 - len(ws))  # N = 0 past the given ones: never read
        counts = list(ns) + [0] * (3 - len(ns))
        parts = {kv: v for i, w in enumerate(padded) for kv, v in self._parts(w, f"w{i}").items()}
        self._build_q32(fmt_id, "stacked_rows", rows, -(-n // BLOCK_ROWS), k, dict(out=out),
                        dict(**parts, prefill_state=prefill_state),
                        dict(N0=i32(counts[0]), N1=i32(counts[1]), N2=i32(counts[2]), K=i32(k), ldo=i32(ldo),
                             col0=i32(col0)),
                        reads=(x, prefill_state) + tuple(b for w in ws for b in w.buffers), writes=(out,),
                        max_blocks=max_blocks, split_k=split_k, blocks=blocks, tile_tokens=tile_tokens, x=x)


class GemmQ32ResidualRows(_GemmQ32Launcher):
    """residual fp32 [M, N] += x fp16 [M, K] · Wᵀ, W in q4_g32, q5_g32, q8_g32, q4_g32_min or q5_g32_min (o_proj, down_proj
    of a prefill chunk).

    Raises:
        LaunchError: W not in q4_g32 / q5_g32 / q8_g32 / q4_g32_min / q5_g32_min, K not a multiple of 128, or a buffer of the
            wrong size or dtype.
    """

    def __init__(self, residual, x, w: FmtWeight, prefill_state, *, n: int, k: int, rows: int,
                 max_blocks: int | None = None, split_k: SplitKScratch | None = None, blocks: int | None = None,
                 tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        fmt_id = self._check_fmts([w], [n], k)
        check_buffer(residual, "residual", rows * n, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = w.nbytes(n, k) + 2 * rows * k + 8 * rows * n
        parts = {key.removeprefix("w_"): v for key, v in self._parts(w, "w").items()}
        self._build_q32(fmt_id, "residual", rows, -(-n // BLOCK_ROWS), k, dict(residual=residual),
                        dict(**parts, prefill_state=prefill_state), dict(N=i32(n), K=i32(k)),
                        reads=(residual, x, prefill_state) + w.buffers, writes=(residual,),
                        max_blocks=max_blocks, split_k=split_k, blocks=blocks, tile_tokens=tile_tokens, x=x)


class GemmQ32GateUpSwigluRows(_GemmQ32Launcher):
    """h fp16 [M, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ), gate and up in one of q4_g32, q5_g32, q8_g32, q4_g32_min, q5_g32_min: a prefill
    chunk's MLP input half.

    Raises:
        LaunchError: gate or up not in q4_g32 / q5_g32 / q8_g32 / q4_g32_min / q5_g32_min, or not in one format, K not a
            multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, h, x, gate: FmtWeight, up: FmtWeight, prefill_state, *, f: int, k: int, rows: int,
                 max_blocks: int | None = None, split_k: SplitKScratch | None = None, blocks: int | None = None,
                 tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        fmt_id = self._check_fmts([gate, up], [f, f], k)
        check_buffer(h, "h", rows * f, np.float16)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * 2 * f * k
        self.bytes_moved = gate.nbytes(f, k) + up.nbytes(f, k) + 2 * rows * k + 2 * rows * f
        self._build_q32(fmt_id, "gate_up_swiglu", rows, -(-f // (BLOCK_ROWS // 2)), k, dict(h=h),  # 64 features of each a block
                        dict(**self._parts(gate, "gate"), **self._parts(up, "up"), prefill_state=prefill_state),
                        dict(F=i32(f), K=i32(k)),
                        reads=(x, prefill_state) + gate.buffers + up.buffers, writes=(h,),
                        max_blocks=max_blocks, split_k=split_k, blocks=blocks, tile_tokens=tile_tokens, x=x)
