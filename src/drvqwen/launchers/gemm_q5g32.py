"""Launchers of kernels/gemm_int4.cu's Q5_0 kernels: the prefill GEMMs over q5_g32 weights (the
GGUF's Q5_0 bytes: 4-bit codes in layout id 1, one high bit a weight in the qhigh plane, an FP16
scale per 32 inputs) on gemm_int4.cu's mainloop — the consumers unpack the codes with their high
bits into wgmma's A registers and multiply each 32-input chunk by its scale (GemmQ5g32Scales),
where gemm_fmt_wgmma.cu's producer warpgroup dequantizes into shared memory and is the limit.

    GemmQ5g32StackedRows       out fp32 [M, ldo], columns col0 … = x fp16 [M, K] · [W0; W1; W2]ᵀ
                               (q, k and v of a layer in one launch, q and k, or one matrix)
    GemmQ5g32ResidualRows      residual fp32 [M, N] += x Wᵀ                     (o_proj, down_proj)
    GemmQ5g32GateUpSwigluRows  h fp16 [M, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ)

llama.cpp's K-quant recipes give a tensor whose K is not a multiple of the 256-input super-block
Q5_0 in place of Q4_K (format/recipes.py): on Qwen2.5-Coder-0.5B (K = 896) every projection but
down_proj. The kernels exist in all three tile builds (each stage holds the rows' 16 B of high
bits behind the code words: SMEM_Q5 at 128 tokens) and plan as gemm_int4.py's launchers
(plan_launch: persistent, stream-K ranges with a SplitKScratch). K must be a multiple of 128.
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from ..format import weight_formats as wf
from ..format.quant import GROUP_SIZE
from .base import check_buffer, check_prefill_state, i32, mirrored, require
from .gemm_int4 import BLOCK_ROWS, SplitKScratch, _GemmLauncher, smem_bytes, stages, x_tensor_map
from .gemv_fmt import FmtWeight

Q5G32_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q5_g32")
HIGH_ROW_BYTES = GROUP_SIZE // 8  # Q5_0's high bits of one row and 128-input group: 16 B


def smem_bytes_q5(bm: int) -> int:
    """GEMM_Q5_SMEM_BYTES of the build with `bm` tokens a tile: gemm_int4.cu's stages, each with
    the 128 rows' high-bit words (2 KiB) behind the code words."""
    return smem_bytes(bm) + stages(bm) * BLOCK_ROWS * HIGH_ROW_BYTES


SMEM_Q5 = mirrored("gemm_int4", "GEMM_Q5_SMEM_BYTES", smem_bytes_q5(128))


def fits(w: FmtWeight, k: int) -> bool:
    """Whether these kernels take weight `w` at input width k: format q5_g32, K a multiple of 128."""
    return w.fmt.id == Q5G32_ID and k > 0 and k % GROUP_SIZE == 0


def _args(w: FmtWeight, prefix: str) -> dict:
    """<prefix>_qweight, _qhigh, _scales: the low nibbles, the high bits and the FP16 scales."""
    return {f"{prefix}_qweight": w.parts["qweight"], f"{prefix}_qhigh": w.parts["qhigh"],
            f"{prefix}_scales": w.parts["scales"]}


class _GemmQ5g32Launcher(_GemmLauncher):
    def _check_fmt(self, w: FmtWeight, n: int, k: int) -> None:
        require(w.fmt.id == Q5G32_ID, f"{w.name}: format {w.fmt.name}, these kernels read q5_g32 only")
        require(k > 0 and k % GROUP_SIZE == 0, f"{w.name}: K={k} must be a positive multiple of {GROUP_SIZE}")
        w.check(n, k)

    def _build_q5(self, kernel: str, rows: int, n_blocks: int, k: int, out: dict, args: dict, dims: dict, *, reads,
                  writes, max_blocks: int | None, split_k: SplitKScratch | None, blocks: int | None,
                  tile_tokens: int | None, x) -> None:
        """Plan (plan_launch over the three builds), then build: the kernel's parameters are `out`
        (its output), x's tensor map for the planned tile, then `args` up to prefill_state."""
        bm = self._tiling(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                          tile_tokens=tile_tokens)
        self._build_gemm(kernel, rows, n_blocks, k, {**out, "x_map": x_tensor_map(x, rows, k, bm), **args}, dims,
                         reads=reads, writes=writes, max_blocks=max_blocks, split_k=split_k, smem=smem_bytes_q5(bm))


class GemmQ5g32StackedRows(_GemmQ5g32Launcher):
    """out fp32 [rows, ldo]: columns col0 … col0+ΣN-1 of rows < M = x fp16 [rows, K] · [W0; W1; W2]ᵀ,
    one to three q5_g32 FmtWeights stacked along N (`ws`, `ns` their row counts): a layer's q, k
    and v into qkv in one launch, q and k, or one matrix.

    Raises:
        LaunchError: not 1 to 3 weights, a weight not in q5_g32, K not a multiple of 128, columns
            past ldo, or a buffer of the wrong size or dtype.
    """

    def __init__(self, out, x, ws: list[FmtWeight], prefill_state, *, ns: list[int], k: int, rows: int, ldo: int,
                 col0: int = 0, max_blocks: int | None = None, split_k: SplitKScratch | None = None,
                 blocks: int | None = None, tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        require(1 <= len(ws) <= 3 and len(ns) == len(ws),
                f"gemm_q5g32_stacked_rows: one to three weights with a row count each, got {len(ws)} and {len(ns)}")
        for w, n in zip(ws, ns):
            self._check_fmt(w, n, k)
        n = sum(ns)
        require(0 <= col0 and col0 + n <= ldo,
                f"gemm_q5g32_stacked_rows: columns {col0} … {col0 + n - 1} outside ldo={ldo}")
        check_buffer(out, "out", rows * ldo, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = sum(w.nbytes(m, k) for w, m in zip(ws, ns)) + 2 * rows * k + 4 * rows * n
        padded = list(ws) + [ws[0]] * (3 - len(ws))  # N = 0 past the given ones: never read
        counts = list(ns) + [0] * (3 - len(ns))
        self._build_q5("gemm_q5g32_stacked_rows", rows, -(-n // BLOCK_ROWS), k,
                       dict(out=out), dict(**_args(padded[0], "w0"), **_args(padded[1], "w1"), **_args(padded[2], "w2"),
                            prefill_state=prefill_state),
                       dict(N0=i32(counts[0]), N1=i32(counts[1]), N2=i32(counts[2]), K=i32(k), ldo=i32(ldo),
                            col0=i32(col0)),
                       reads=(x, prefill_state) + tuple(b for w in ws for b in w.buffers), writes=(out,),
                       max_blocks=max_blocks, split_k=split_k, blocks=blocks, tile_tokens=tile_tokens, x=x)


class GemmQ5g32ResidualRows(_GemmQ5g32Launcher):
    """residual fp32 [M, N] += x fp16 [M, K] · Wᵀ, W in q5_g32 (o_proj, down_proj of a prefill chunk).

    Raises:
        LaunchError: W not in q5_g32, K not a multiple of 128, or a buffer of the wrong size or dtype.
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
        a = _args(w, "w")
        self._build_q5("gemm_q5g32_residual", rows, -(-n // BLOCK_ROWS), k,
                       dict(residual=residual), dict(qweight=a["w_qweight"], qhigh=a["w_qhigh"], scales=a["w_scales"],
                            prefill_state=prefill_state),
                       dict(N=i32(n), K=i32(k)),
                       reads=(residual, x, prefill_state) + w.buffers, writes=(residual,),
                       max_blocks=max_blocks, split_k=split_k, blocks=blocks, tile_tokens=tile_tokens, x=x)


class GemmQ5g32GateUpSwigluRows(_GemmQ5g32Launcher):
    """h fp16 [M, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ), gate and up in q5_g32: a prefill chunk's MLP input half.

    Raises:
        LaunchError: gate or up not in q5_g32, K not a multiple of 128, or a buffer of the wrong size
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
        self._build_q5("gemm_q5g32_gate_up_swiglu", rows, -(-f // (BLOCK_ROWS // 2)), k,  # 64 features of each a block
                       dict(h=h), dict(**_args(gate, "gate"), **_args(up, "up"), prefill_state=prefill_state),
                       dict(F=i32(f), K=i32(k)),
                       reads=(x, prefill_state) + gate.buffers + up.buffers, writes=(h,),
                       max_blocks=max_blocks, split_k=split_k, blocks=blocks, tile_tokens=tile_tokens, x=x)
