"""Launchers of kernels/gemm_int4.cu's K-quant kernels: the prefill GEMMs over Q4_K, Q5_K and Q6_K
weights as the GGUF stores them, on gemm_int4.cu's mainloop — the consumers unpack the codes into
wgmma's A registers with each sub-block's scale (and the offset of Q4_K and Q5_K: GemmQ4kScales,
GemmQ5kScales, GemmQ6kScales), where gemm_fmt_wgmma.cu's producer warpgroup dequantizes into
shared memory and is the limit.

    GemmQ4kQkvRopeRows       q_out fp16 [M, Hq, Dh], the chunk's K/V cache slots
                             = rope(x Wqᵀ + bq), rope(x Wkᵀ + bk), x Wvᵀ + bv (q, k, v all Q4_K;
                             or v in Q6_K: one launch, the grid in a part a format)
    GemmQ4kStackedRows       out fp32 [M, ldo], columns col0 … = x fp16 [M, K] · [W0; W1]ᵀ
                             (q and k of a layer in one launch, or one matrix)
    GemmQ4kResidualRows      residual fp32 [M, N] += x Wᵀ                     (o_proj, down_proj)
    GemmQ4kGateUpSwigluRows  h fp16 [M, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ)
    GemmQ5kQkvRopeRows, GemmQ5kStackedRows, GemmQ5kResidualRows, GemmQ5kGateUpSwigluRows
                             the same four over Q5_K (llama.cpp's Q5_K_M)
    GemmQ6kRows              out fp32 [M, ldo], columns col0 … = x Wᵀ         (v_proj)
    GemmQ6kResidualRows      residual fp32 [M, N] += x Wᵀ                     (down_proj)

(llama.cpp's Q4_K_M stores every projection in Q4_K but v_proj and down_proj of some layers, in
Q6_K; its Q5_K_M the same with Q5_K.) They take FmtWeights in format q4_k, q5_k or q6_k
(gemv_fmt.py) and plan as gemm_int4.py's launchers (plan_launch: persistent, stream-K ranges with
a SplitKScratch), among all three tile builds; the Q5_K and Q6_K stages also hold the high-bit
plane (SMEM_Q5K, SMEM_Q6K), Q6_K's two of them at 256 tokens, where three do not fit in shared
memory (gemm_int4.cu: gemm_stages). K must be a multiple of 256 (a super-block).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from ..cuda import Stream, get_device
from ..format import weight_formats as wf
from ..format.quant import GROUP_SIZE
from .base import check_buffer, check_prefill_state, i32, mirrored, require
from .gemm_int4 import (BLOCK_ROWS, SPLIT_UNIT_FLOATS, GemmTiling, SplitKScratch, _GemmLauncher,
                        check_qkv_rope_outputs, smem_bytes, smem_bytes_extra, unit_floats, x_tensor_map)
from .gemv_fmt import FmtWeight

Q4K_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q4_k")
Q5K_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q5_k")
Q6K_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q6_k")
SUPER = 256                 # inputs per super-block: K must be a multiple
Q4K_TILES = (256, 128, 64)  # the builds the kernels exist in: Q4_K's every build of gemm_int4.cu,
Q5K_TILES = (256, 128, 64)  # Q5_K's (three stages of 74 KB at 256)
Q6K_TILES = (256, 128, 64)  # Q6_K's too (two stages at 256)
KQUANT_TILES = Q4K_TILES    # the builds a model with either format needs
HIGH_ROW_BYTES = GROUP_SIZE // 4  # Q6_K's high bits of one row and 128-input group: 32 B
HIGH_ROW_BYTES_Q5K = GROUP_SIZE // 8  # Q5_K's: 16 B


def smem_bytes_q6k(bm: int) -> int:
    """GEMM_Q6K_SMEM_BYTES of the build with `bm` tokens a tile: gemm_int4.cu's stages, each with
    the 128 rows' high-bit words (4 KiB) behind the code words (smem_bytes_extra)."""
    return smem_bytes_extra(bm, HIGH_ROW_BYTES)


SMEM_Q6K = mirrored("gemm_int4", "GEMM_Q6K_SMEM_BYTES", smem_bytes_q6k(128))


def smem_bytes_q5k(bm: int) -> int:
    """GEMM_Q5K_SMEM_BYTES of the build with `bm` tokens a tile: gemm_int4.cu's stages, each with
    the 128 rows' high-bit words (2 KiB) behind the code words."""
    return smem_bytes_extra(bm, HIGH_ROW_BYTES_Q5K)


SMEM_Q5K = mirrored("gemm_int4", "GEMM_Q5K_SMEM_BYTES", smem_bytes_q5k(128))


def fits(w: FmtWeight, k: int) -> bool:
    """Whether these kernels take weight `w` at input width k: format q4_k, q5_k or q6_k, K a
    multiple of 256."""
    return w.fmt.id in (Q4K_ID, Q5K_ID, Q6K_ID) and k > 0 and k % SUPER == 0


def _q4k_args(w: FmtWeight, prefix: str) -> dict:
    """<prefix>_qweight, _scales: the codes and the super-blocks' lane words ((sc, m) and (d, dmin)
    as the GPU holds them, one 16-byte vector a super-block: format/kquant_lanes.py); and
    <prefix>_qhigh, the high bits, for a q5_k weight."""
    high = {f"{prefix}_qhigh": w.parts["qhigh"]} if w.fmt.id == Q5K_ID else {}
    return {f"{prefix}_qweight": w.parts["qweight"], **high, f"{prefix}_scales": w.parts["scales"]}


class _GemmKquantLauncher(_GemmLauncher):
    fmt_id = Q4K_ID        # the format of the launcher's weights (the Q4_K and Q5_K ones: a class each)
    kernel = "gemm_q4k"    # its kernels' prefix

    def _check_fmt(self, w: FmtWeight, n: int, k: int, fmt_id: int | None = None) -> None:
        fmt_id = self.fmt_id if fmt_id is None else fmt_id
        want = wf.FORMATS[fmt_id].name
        require(w.fmt.id == fmt_id, f"{w.name}: format {w.fmt.name}, these kernels read {want} only")
        require(k > 0 and k % SUPER == 0, f"{w.name}: K={k} must be a positive multiple of {SUPER}")
        w.check(n, k, quad=SUPER)

    def _smem(self, bm: int) -> int | None:
        """The dynamic shared memory of the build: Q5_K's stages hold its high bits too."""
        return smem_bytes_q5k(bm) if self.fmt_id == Q5K_ID else None

    tiles = Q4K_TILES  # the builds the launcher's kernel exists in
    lockstep = True    # one wave of whole 256-token tiles where it applies (gemm_int4.lockstep_tiling)

    def _plan(self, rows: int, n_blocks: int, k: int, *, max_blocks: int | None, split_k: SplitKScratch | None,
              blocks: int | None, tile_tokens: int | None) -> int:
        """plan_launch over the kernel's builds (the fastest estimate; one wave of whole 256-token
        tiles where gemm_int4.lockstep_tiling applies, as for INT4), or `tile_tokens`."""
        return self._plan_builds(self.tiles, "gemm_kquant", rows, n_blocks, k, max_blocks=max_blocks,
                                 split_k=split_k, blocks=blocks, tile_tokens=tile_tokens, lockstep=self.lockstep)


def qk_pairs_fill_row_blocks(n_q: int, n_kv: int) -> bool:
    """Whether q's and k's RoPE pairs (n_q + n_kv rows, paired) fill whole row blocks of 64 pairs
    (BLOCK_ROWS stacked rows): what a mixed-format QKV launch needs, so that no row block holds
    two formats."""
    return (n_q + n_kv) // 2 % (BLOCK_ROWS // 2) == 0


# v's share of the blocks of a mixed-format QKV launch (GemmQ4kQkvRopeRows with v in Q6_K): its row
# blocks' share of the launch's row blocks. A group of Q6_K costs about what one of Q4_K or Q5_K does on this
# mainloop (the 7B's down_proj at 1024 rows, tools/bench_gemm.py --kquant: Q6_K 261.7 µs, Q4_K
# 253.6, Q5_K 275.8; docs/bench/2026-12-07_e77fde8_h100_gemm7b_m1024_kquant.json), so the parts take
# blocks by their tiles.
def v_part_blocks(blocks: int, qk_row_blocks: int, v_row_blocks: int) -> int:
    """Blocks of the v part among `blocks` (≥ 2): v's row blocks' share, rounded, at least 1 and
    leaving the q/k part at least 1."""
    share = round(blocks * v_row_blocks / (qk_row_blocks + v_row_blocks))
    return min(blocks - 1, max(1, share))


def plan_parts(plan: GemmTiling, token_blocks: int, qk_row_blocks: int, v_row_blocks: int,
               ranges_fit: Callable[[], bool]) -> tuple[GemmTiling, int]:
    """(plan, v_blocks) of a mixed-format QKV launch planned as one GEMM (`plan`, P ≥ 2 blocks).
    Stream-K ranges (plan.split) balance each part to within a group: v_part_blocks. Whole tiles
    do not split as evenly: the v blocks that give the fewest rounds of tiles in the slower part;
    where that is more rounds than the plan counted for the launch as one GEMM (P dividing the
    total tiles but not each part's: the 7B's 2 688-row chunk, 3 rounds of 132 becoming 4) and
    `ranges_fit()` (a scratch for P blocks of ranges, asked only then), the plan with ranges instead.

    Raises:
        LaunchError: a plan of fewer than 2 blocks.
    """
    p = plan.blocks
    require(p >= 2, f"a mixed-format QKV launch: a plan of {p} block, want 2 or more (a part a format)")
    if plan.split:
        return plan, v_part_blocks(p, qk_row_blocks, v_row_blocks)
    qk_tiles, v_tiles = token_blocks * qk_row_blocks, token_blocks * v_row_blocks

    def rounds(v: int) -> int:
        return max(-(-qk_tiles // (p - v)), -(-v_tiles // v))

    v = min(range(1, p), key=lambda v: (rounds(v), abs(v * (qk_tiles + v_tiles) - p * v_tiles)))
    if rounds(v) > -(-(qk_tiles + v_tiles) // p) and ranges_fit():
        return dataclasses.replace(plan, split=True), v_part_blocks(p, qk_row_blocks, v_row_blocks)
    return plan, v


class GemmQ4kQkvRopeRows(_GemmKquantLauncher):
    """The QKV projection of a prefill chunk over q4_k weights with the bias, the RoPE and the FP16
    writes in its epilogue: gemm_int4.py's GemmInt4QkvRopeRows (its outputs, rope_cs table and
    block-table contract) for FmtWeights wq [Hq·Dh, K], wk, wv [Hkv·Dh, K] in q4_k
    (gemm_q4k_qkv_rope). With wv in q6_k (llama.cpp's Q4_K_M on the layers whose v_proj it keeps
    in Q6_K) still one launch, gemm_q4k_q6k_qkv_rope: the plan's P blocks in two parts, the q/k
    row blocks on P − v_blocks of them and v's on v_blocks (plan_parts), each part its own stream-K
    ranges and its own slots of the scratch, the dynamic shared memory the larger of the two rings;
    q's and k's RoPE pairs must then fill whole row blocks, (Hq + Hkv)·Dh/2 a multiple of 64.

    Raises:
        LaunchError: q or k not in q4_k, v in neither q4_k nor q6_k, K not a multiple of 256, an odd
            head_dim, with v in q6_k (Hq + Hkv)·Dh/2 not a multiple of 64 or a plan of fewer than 2
            blocks, or a buffer of the wrong size, dtype or shape.
    """

    def __init__(self, q_out, k_cache, v_cache, x, wq: FmtWeight, wk: FmtWeight, wv: FmtWeight, q_bias, k_bias,
                 v_bias, rope_cs, prefill_state, block_table, *, n_heads: int, n_kv_heads: int, head_dim: int,
                 k: int, rows: int, max_blocks: int | None = None, split_k: SplitKScratch | None = None,
                 blocks: int | None = None, tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        # The outputs first, before any weight is looked at (the two kernels share the epilogue).
        n_q, n_kv = check_qkv_rope_outputs(f"{self.kernel}_qkv_rope", q_out, k_cache, v_cache, q_bias, k_bias, v_bias,
                                           rope_cs, rows=rows, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                           head_dim=head_dim)
        mixed = wv.fmt.id == Q6K_ID  # v in Q6_K: the launch in two parts
        name = f"{self.kernel}_q6k_qkv_rope" if mixed else f"{self.kernel}_qkv_rope"
        for w, n, fmt_id in ((wq, n_q, None), (wk, n_kv, None), (wv, n_kv, Q6K_ID if mixed else None)):
            self._check_fmt(w, n, k, fmt_id)
        pairs_per_block = BLOCK_ROWS // 2  # 64 RoPE pairs a block: 128 stacked rows
        qk_pairs = (n_q + n_kv) // 2
        require(not mixed or qk_pairs_fill_row_blocks(n_q, n_kv),
                f"{name}: q's and k's {qk_pairs} RoPE pairs must fill whole row blocks of {pairs_per_block}")
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        n = n_q + 2 * n_kv
        self.flops = 2 * rows * n * k
        self.bytes_moved = (wq.nbytes(n_q, k) + wk.nbytes(n_kv, k) + wv.nbytes(n_kv, k) + 2 * rows * k
                            + 2 * rows * n)
        n_blocks = -(-n // BLOCK_ROWS)  # mixed: q's and k's qk_pairs / 64 blocks, then v's
        bm = self._plan(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                        tile_tokens=tile_tokens)
        v_args, parts, smem = _q4k_args(wv, "v"), {}, self._smem(bm)
        if mixed:
            p, qk_blocks = self.tiling.blocks, qk_pairs // pairs_per_block

            def ranges_fit() -> bool:  # stream-K ranges need the scratch for P blocks, and P ≤ the SMs (no deadlock)
                return (split_k is not None and max_blocks != 0 and p <= split_k.tiles
                        and -(-p * unit_floats(bm) // SPLIT_UNIT_FLOATS) <= split_k.units
                        and p <= get_device().info.sm_count)

            self.tiling, self.v_blocks = plan_parts(self.tiling, -(-rows // bm), qk_blocks, n_blocks - qk_blocks,
                                                    ranges_fit)
            v_args = {f"v_{part}": buf for part, buf in _q6k_args(wv).items()}
            parts = dict(v_blocks=i32(self.v_blocks))
            smem = max(smem or smem_bytes(bm), smem_bytes_q6k(bm))
        self._build_gemm(name, rows, n_blocks, k,
                         dict(q_out=q_out, k_cache=k_cache, v_cache=v_cache, x_map=x_tensor_map(x, rows, k, bm),
                              **_q4k_args(wq, "q"), **_q4k_args(wk, "k"), **v_args, q_bias=q_bias,
                              k_bias=k_bias, v_bias=v_bias, rope_cs=rope_cs, prefill_state=prefill_state,
                              block_table=block_table),
                         dict(Hq=i32(n_heads), Hkv=i32(n_kv_heads), Dh=i32(head_dim), K=i32(k), **parts),
                         reads=(x, q_bias, k_bias, v_bias, rope_cs, prefill_state, block_table) + wq.buffers
                         + wk.buffers + wv.buffers,
                         writes=(q_out, k_cache, v_cache), max_blocks=max_blocks, split_k=split_k, smem=smem)


class GemmQ4kStackedRows(_GemmKquantLauncher):
    """out fp32 [rows, ldo]: columns col0 … col0+ΣN-1 of rows < M = x fp16 [rows, K] · [W0; W1]ᵀ, one
    or two q4_k FmtWeights stacked along N (`ws`, `ns` their row counts): a layer's q and k into
    qkv in one launch, or v alone.

    Raises:
        LaunchError: not 1 or 2 weights, a weight not in q4_k, K not a multiple of 256, columns
            past ldo, or a buffer of the wrong size or dtype.
    """

    def __init__(self, out, x, ws: list[FmtWeight], prefill_state, *, ns: list[int], k: int, rows: int, ldo: int,
                 col0: int = 0, max_blocks: int | None = None, split_k: SplitKScratch | None = None,
                 blocks: int | None = None, tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        require(len(ws) in (1, 2) and len(ns) == len(ws),
                f"{self.kernel}_stacked_rows: one or two weights with a row count each, got {len(ws)} and {len(ns)}")
        for w, n in zip(ws, ns):
            self._check_fmt(w, n, k)
        n = sum(ns)
        require(0 <= col0 and col0 + n <= ldo,
                f"{self.kernel}_stacked_rows: columns {col0} … {col0 + n - 1} outside ldo={ldo}")
        check_buffer(out, "out", rows * ldo, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = sum(w.nbytes(m, k) for w, m in zip(ws, ns)) + 2 * rows * k + 4 * rows * n
        n_blocks = -(-n // BLOCK_ROWS)
        bm = self._plan(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                        tile_tokens=tile_tokens)
        second = ws[1] if len(ws) > 1 else ws[0]  # N1 = 0: never read
        self._build_gemm(f"{self.kernel}_stacked_rows", rows, n_blocks, k,
                         dict(out=out, x_map=x_tensor_map(x, rows, k, bm), **_q4k_args(ws[0], "w0"),
                              **_q4k_args(second, "w1"), prefill_state=prefill_state),
                         dict(N0=i32(ns[0]), N1=i32(ns[1] if len(ns) > 1 else 0), K=i32(k), ldo=i32(ldo),
                              col0=i32(col0)),
                         reads=(x, prefill_state) + tuple(b for w in ws for b in w.buffers), writes=(out,),
                         max_blocks=max_blocks, split_k=split_k, smem=self._smem(bm))


class GemmQ4kResidualRows(_GemmKquantLauncher):
    """residual fp32 [M, N] += x fp16 [M, K] · Wᵀ, W in q4_k (o_proj, down_proj of a prefill chunk).

    Raises:
        LaunchError: W not in q4_k, K not a multiple of 256, or a buffer of the wrong size or dtype.
    """

    def __init__(self, residual, x, w: FmtWeight, prefill_state, *, n: int, k: int, rows: int,
                 max_blocks: int | None = None, split_k: SplitKScratch | None = None, blocks: int | None = None,
                 tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        self._check_fmt(w, n, k)
        check_buffer(residual, "residual", rows * n, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = w.nbytes(n, k) + 2 * rows * k + 8 * rows * n
        n_blocks = -(-n // BLOCK_ROWS)
        bm = self._plan(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                        tile_tokens=tile_tokens)
        args = {name[2:]: v for name, v in _q4k_args(w, "w").items()}  # qweight, (qhigh,) scales
        self._build_gemm(f"{self.kernel}_residual", rows, n_blocks, k,
                         dict(residual=residual, x_map=x_tensor_map(x, rows, k, bm), **args,
                              prefill_state=prefill_state),
                         dict(N=i32(n), K=i32(k)),
                         reads=(residual, x, prefill_state) + w.buffers, writes=(residual,),
                         max_blocks=max_blocks, split_k=split_k, smem=self._smem(bm))


class GemmQ4kGateUpSwigluRows(_GemmKquantLauncher):
    """h fp16 [M, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ), gate and up in q4_k: a prefill chunk's MLP input half.

    Raises:
        LaunchError: gate or up not in q4_k, K not a multiple of 256, or a buffer of the wrong size
            or dtype.
    """

    def __init__(self, h, x, gate: FmtWeight, up: FmtWeight, prefill_state, *, f: int, k: int, rows: int,
                 max_blocks: int | None = None, split_k: SplitKScratch | None = None, blocks: int | None = None,
                 tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        self._check_fmt(gate, f, k)
        self._check_fmt(up, f, k)
        check_buffer(h, "h", rows * f, np.float16)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * 2 * f * k
        self.bytes_moved = gate.nbytes(f, k) + up.nbytes(f, k) + 2 * rows * k + 2 * rows * f
        n_blocks = -(-f // (BLOCK_ROWS // 2))  # a block holds 64 features of gate and the same 64 of up
        bm = self._plan(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                        tile_tokens=tile_tokens)
        self._build_gemm(f"{self.kernel}_gate_up_swiglu", rows, n_blocks, k,
                         dict(h=h, x_map=x_tensor_map(x, rows, k, bm), **_q4k_args(gate, "gate"),
                              **_q4k_args(up, "up"), prefill_state=prefill_state),
                         dict(F=i32(f), K=i32(k)),
                         reads=(x, prefill_state) + gate.buffers + up.buffers, writes=(h,),
                         max_blocks=max_blocks, split_k=split_k, smem=self._smem(bm))


class GemmQ5kQkvRopeRows(GemmQ4kQkvRopeRows):
    """GemmQ4kQkvRopeRows over q5_k weights (gemm_q5k_qkv_rope; v in q6_k: gemm_q5k_q6k_qkv_rope,
    llama.cpp's Q5_K_M).

    Raises:
        LaunchError: as GemmQ4kQkvRopeRows's, with q5_k for q4_k.
    """

    fmt_id, kernel, tiles = Q5K_ID, "gemm_q5k", Q5K_TILES


class GemmQ5kStackedRows(GemmQ4kStackedRows):
    """GemmQ4kStackedRows over q5_k weights (gemm_q5k_stacked_rows).

    Raises:
        LaunchError: not 1 or 2 weights, a weight not in q5_k, K not a multiple of 256, columns
            past ldo, or a buffer of the wrong size or dtype.
    """

    fmt_id, kernel, tiles = Q5K_ID, "gemm_q5k", Q5K_TILES


class GemmQ5kResidualRows(GemmQ4kResidualRows):
    """GemmQ4kResidualRows over a q5_k weight (gemm_q5k_residual).

    Raises:
        LaunchError: W not in q5_k, K not a multiple of 256, or a buffer of the wrong size or dtype.
    """

    fmt_id, kernel, tiles = Q5K_ID, "gemm_q5k", Q5K_TILES


class GemmQ5kGateUpSwigluRows(GemmQ4kGateUpSwigluRows):
    """GemmQ4kGateUpSwigluRows over q5_k gate and up (gemm_q5k_gate_up_swiglu).

    Raises:
        LaunchError: gate or up not in q5_k, K not a multiple of 256, or a buffer of the wrong size
            or dtype.
    """

    fmt_id, kernel, tiles = Q5K_ID, "gemm_q5k", Q5K_TILES


def _q6k_args(w: FmtWeight) -> dict:
    """qweight, qhigh, scales, aux: the low nibbles, the high bits, the int8 sc and the FP16 d."""
    return dict(qweight=w.parts["qweight"], qhigh=w.parts["qhigh"], scales=w.parts["scales"],
                aux=w.parts["superscales"])


class GemmQ6kRows(_GemmKquantLauncher):
    """out fp32 [rows, ldo]: columns col0 … col0+N-1 of rows < M = x fp16 [rows, K] · Wᵀ, W a q6_k
    FmtWeight [N, K]: v_proj into its columns of qkv.

    Raises:
        LaunchError: W not in q6_k, K not a multiple of 256, columns past ldo, or a buffer of the
            wrong size or dtype.
    """

    tiles = Q6K_TILES

    def __init__(self, out, x, w: FmtWeight, prefill_state, *, n: int, k: int, rows: int, ldo: int, col0: int = 0,
                 max_blocks: int | None = None, split_k: SplitKScratch | None = None, blocks: int | None = None,
                 tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        self._check_fmt(w, n, k, Q6K_ID)
        require(0 <= col0 and col0 + n <= ldo, f"gemm_q6k_rows: columns {col0} … {col0 + n - 1} outside ldo={ldo}")
        check_buffer(out, "out", rows * ldo, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = w.nbytes(n, k) + 2 * rows * k + 4 * rows * n
        n_blocks = -(-n // BLOCK_ROWS)
        bm = self._plan(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                        tile_tokens=tile_tokens)
        self._build_gemm("gemm_q6k_rows", rows, n_blocks, k,
                         dict(out=out, x_map=x_tensor_map(x, rows, k, bm), **_q6k_args(w),
                              prefill_state=prefill_state),
                         dict(N=i32(n), K=i32(k), ldo=i32(ldo), col0=i32(col0)),
                         reads=(x, prefill_state) + w.buffers, writes=(out,), max_blocks=max_blocks,
                         split_k=split_k, smem=smem_bytes_q6k(bm))


class GemmQ6kResidualRows(_GemmKquantLauncher):
    """residual fp32 [M, N] += x fp16 [M, K] · Wᵀ, W in q6_k (down_proj of a prefill chunk).

    Raises:
        LaunchError: W not in q6_k, K not a multiple of 256, or a buffer of the wrong size or dtype.
    """

    tiles = Q6K_TILES

    def __init__(self, residual, x, w: FmtWeight, prefill_state, *, n: int, k: int, rows: int,
                 max_blocks: int | None = None, split_k: SplitKScratch | None = None, blocks: int | None = None,
                 tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        self._check_fmt(w, n, k, Q6K_ID)
        check_buffer(residual, "residual", rows * n, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = w.nbytes(n, k) + 2 * rows * k + 8 * rows * n
        n_blocks = -(-n // BLOCK_ROWS)
        bm = self._plan(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                        tile_tokens=tile_tokens)
        self._build_gemm("gemm_q6k_residual", rows, n_blocks, k,
                         dict(residual=residual, x_map=x_tensor_map(x, rows, k, bm), **_q6k_args(w),
                              prefill_state=prefill_state),
                         dict(N=i32(n), K=i32(k)),
                         reads=(residual, x, prefill_state) + w.buffers, writes=(residual,),
                         max_blocks=max_blocks, split_k=split_k, smem=smem_bytes_q6k(bm))
