"""Launchers of kernels/gemm_fmt.cu: the prefill GEMMs over weights in their per-tensor formats.

    GemmFmtRows                out fp32 [M, ldo], columns col0 … col0+N-1 = x fp16 [M, K] · Wᵀ
    GemmFmtResidualRows        residual fp32 [M, N]                      += x Wᵀ   (o_proj, down_proj)
    GemmFmtGateUpSwigluRows    h fp16 [M, F]            = silu(x Wgᵀ) ⊙ (x Wuᵀ)

W is a FmtWeight (launchers/gemv_fmt.py); `defines` compile the kernels for a model's formats
(gemv_fmt.format_defines). M = prefill_state[1] ≤ rows, as for gemm_int4: grids
and buffers are sized for a row capacity `rows`, the kernels read the live count. Grid
(ceil(rows/64), ceil(N/64)) of 128-thread blocks, static shared memory only.
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, check_prefill_state, i32, mirrored, require
from .gemv_fmt import FmtWeight

BM = mirrored("gemm_fmt", "GF_BM", 64)          # tokens per block
BN = mirrored("gemm_fmt", "GF_BN", 64)          # weight rows per block
THREADS = mirrored("gemm_fmt", "GF_THREADS", 128)
CHUNK = mirrored("gemm_fmt", "WF_CHUNK", 32)    # inputs per chunk (K a multiple; a step is two)


def _grid(rows: int, n: int) -> tuple[int, int]:
    return -(-rows // BM), -(-n // BN)


def _check(x, w: FmtWeight, prefill_state, n: int, k: int, rows: int, defines: tuple) -> None:
    require(rows >= 1 and n >= 1, f"gemm_fmt: rows={rows}, N={n} must be >= 1")
    w.check(n, k, quad=CHUNK, defines=defines)
    check_buffer(x, "x", rows * k, np.float16)
    check_prefill_state(prefill_state)


def _flops(rows: int, n: int, k: int) -> int:
    return 2 * rows * n * k


class GemmFmtRows(Launcher):
    """out fp32 [rows, ldo]: columns col0 … col0+N-1 of rows < M = x fp16 [rows, K] · Wᵀ (q, k and v
    into their columns of the prefill's qkv buffer).

    Raises:
        LaunchError: a format without a GPU kernel, K not a multiple of 32 and of the format's
            group, col0 + N > ldo, or a buffer of the wrong size or dtype.
    """

    def __init__(self, out, x, w: FmtWeight, prefill_state, *, n: int, k: int, rows: int, ldo: int, col0: int = 0,
                 stream: Stream | None = None, defines: tuple = ()):
        super().__init__(stream)
        _check(x, w, prefill_state, n, k, rows, defines)
        require(0 <= col0 and col0 + n <= ldo, f"gemm_fmt: columns {col0} … {col0 + n - 1} outside ldo={ldo}")
        check_buffer(out, "out", rows * ldo, np.float32)
        self.bytes_moved = w.nbytes(n, k) + 2 * rows * k + 4 * rows * n
        self.flops = _flops(rows, n, k)
        self._add(KernelRef("gemm_fmt", "gemm_fmt_store_rows", tuple(defines)), _grid(rows, n), (THREADS,),
                  dict(out=out, x=x, **w.args("w"), prefill_state=prefill_state, N=i32(n), K=i32(k), ldo=i32(ldo),
                       col0=i32(col0), fmt=i32(w.fmt.id)),
                  reads=(x, prefill_state) + w.buffers, writes=(out,), bytes_moved=self.bytes_moved)


class GemmFmtResidualRows(Launcher):
    """residual fp32 [rows, N] += x fp16 [rows, K] · Wᵀ on rows < M (o_proj, down_proj).

    Raises:
        LaunchError: as GemmFmtRows.
    """

    def __init__(self, residual, x, w: FmtWeight, prefill_state, *, n: int, k: int, rows: int,
                 stream: Stream | None = None, defines: tuple = ()):
        super().__init__(stream)
        _check(x, w, prefill_state, n, k, rows, defines)
        check_buffer(residual, "residual", rows * n, np.float32)
        self.bytes_moved = w.nbytes(n, k) + 2 * rows * k + 8 * rows * n
        self.flops = _flops(rows, n, k)
        self._add(KernelRef("gemm_fmt", "gemm_fmt_residual_rows", tuple(defines)), _grid(rows, n), (THREADS,),
                  dict(residual=residual, x=x, **w.args("w"), prefill_state=prefill_state, N=i32(n), K=i32(k),
                       fmt=i32(w.fmt.id)),
                  reads=(residual, x, prefill_state) + w.buffers, writes=(residual,), bytes_moved=self.bytes_moved)


class GemmFmtGateUpSwigluRows(Launcher):
    """h fp16 [rows, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ) on rows < M, gate and up FmtWeights [F, K] in one
    format.

    Raises:
        LaunchError: gate and up in different formats, or as GemmFmtRows.
    """

    def __init__(self, h, x, gate: FmtWeight, up: FmtWeight, prefill_state, *, f: int, k: int, rows: int,
                 stream: Stream | None = None, defines: tuple = ()):
        super().__init__(stream)
        require(gate.fmt.id == up.fmt.id, f"{gate.name} ({gate.fmt.name}) and {up.name} ({up.fmt.name}): the fused "
                                          f"gate/up GEMM needs both in one format")
        _check(x, gate, prefill_state, f, k, rows, defines)
        up.check(f, k, quad=CHUNK, defines=defines)
        check_buffer(h, "h", rows * f, np.float16)
        self.bytes_moved = gate.nbytes(f, k) + up.nbytes(f, k) + 2 * rows * k + 2 * rows * f
        self.flops = 2 * _flops(rows, f, k)
        self._add(KernelRef("gemm_fmt", "gemm_fmt_gate_up_swiglu_rows", tuple(defines)), _grid(rows, f), (THREADS,),
                  dict(h=h, x=x, **gate.args("gate"), **up.args("up"), prefill_state=prefill_state, F=i32(f), K=i32(k),
                       fmt=i32(gate.fmt.id)),
                  reads=(x, prefill_state) + gate.buffers + up.buffers, writes=(h,), bytes_moved=self.bytes_moved)
