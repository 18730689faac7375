"""Launchers of kernels/rmsnorm.cu: RMSNorm of the FP32 residual stream into an FP16 GEMV input.

    RmsNorm       out fp16 [rows, D] = rmsnorm(x fp32 [rows, D]) · w fp16 [D]   (reference.rmsnorm)
                  a block a row: the decode step's final norm, the verify pass's rows
    RmsNormRows   the same bits, a warp a row: the prefill's T rows
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, f32, i32, mirrored, require

THREADS = mirrored("rmsnorm", "RMSNORM_THREADS", 1024)
MAX_CHUNKS = mirrored("rmsnorm", "RMSNORM_MAX_CHUNKS", 4)   # float4 chunks per thread, in registers
MAX_DIM = MAX_CHUNKS * THREADS * 4


ROWS_WARPS = mirrored("rmsnorm", "RMSNORM_ROWS_WARPS", 4)  # rmsnorm_rows: rows a block, a warp each
ROWS_THREADS = mirrored("rmsnorm", "RMSNORM_ROWS_THREADS", 128)


def _check_dim(dim: int) -> None:
    require(dim > 0 and dim % 4 == 0 and dim <= MAX_DIM,
            f"rmsnorm: D={dim} must be a positive multiple of 4, at most {MAX_DIM}")


class RmsNorm(Launcher):
    """out fp16 [rows, D] = rmsnorm(x fp32 [rows, D]) · weight fp16 [D], all in FP32; one block per
    row of `threads` (default THREADS): the same bits at any block size (rmsnorm.cuh).

    Raises:
        LaunchError: D not a multiple of 4 or above MAX_DIM, threads not a multiple of 32 in
            32 … THREADS, or a buffer of the wrong size/dtype.
    """

    def __init__(self, out, x, weight, *, dim: int, eps: float, rows: int = 1, threads: int | None = None,
                 stream: Stream | None = None):
        super().__init__(stream)
        _check_dim(dim)
        check_buffer(out, "out", rows * dim, np.float16)
        check_buffer(x, "x", rows * dim, np.float32)
        check_buffer(weight, "weight", dim, np.float16)
        threads = threads or THREADS
        require(threads % 32 == 0 and 32 <= threads <= THREADS, f"rmsnorm: {threads} threads: a multiple of 32 in 32..{THREADS}")
        self.bytes_moved = rows * dim * (4 + 2) + dim * 2
        self._add(KernelRef("rmsnorm", "rmsnorm", pdl=True), (rows,), (threads,),
                  dict(out=out, x=x, weight=weight, D=i32(dim), eps=f32(eps)),
                  reads=(x, weight), writes=(out,), bytes_moved=self.bytes_moved)


class RmsNormRows(Launcher):
    """out fp16 [rows, D] = rmsnorm(x fp32 [rows, D]) · weight fp16 [D], RmsNorm's bits, one warp per
    row (rmsnorm_rows): ROWS_WARPS rows a block of ROWS_THREADS, ceil(rows / ROWS_WARPS) blocks. For
    the prefill's many rows, where a block per row waits on its barrier and its single load per
    thread; a warp per row keeps the row's loads in flight together (kernels/rmsnorm.cu).

    Raises:
        LaunchError: D not a multiple of 4 or above MAX_DIM, rows < 1, or a buffer of the wrong
            size/dtype.
    """

    def __init__(self, out, x, weight, *, dim: int, eps: float, rows: int, stream: Stream | None = None):
        super().__init__(stream)
        _check_dim(dim)
        require(rows >= 1, f"rmsnorm_rows: rows={rows} must be at least 1")
        check_buffer(out, "out", rows * dim, np.float16)
        check_buffer(x, "x", rows * dim, np.float32)
        check_buffer(weight, "weight", dim, np.float16)
        self.bytes_moved = rows * dim * (4 + 2) + dim * 2
        self._add(KernelRef("rmsnorm", "rmsnorm_rows", pdl=True), (-(-rows // ROWS_WARPS),), (ROWS_THREADS,),
                  dict(out=out, x=x, weight=weight, rows=i32(rows), D=i32(dim), eps=f32(eps)),
                  reads=(x, weight), writes=(out,), bytes_moved=self.bytes_moved)
