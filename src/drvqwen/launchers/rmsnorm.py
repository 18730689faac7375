"""Launcher of kernels/rmsnorm.cu: RMSNorm of the FP32 residual stream into an FP16 GEMV input.

    RmsNorm   out fp16 [rows, D] = rmsnorm(x fp32 [rows, D]) · w fp16 [D]   (reference.rmsnorm)
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, f32, i32, mirrored, require

THREADS = mirrored("rmsnorm", "RMSNORM_THREADS", 1024)
MAX_CHUNKS = mirrored("rmsnorm", "RMSNORM_MAX_CHUNKS", 4)   # float4 chunks per thread, in registers
MAX_DIM = MAX_CHUNKS * THREADS * 4


def row_threads(dim: int) -> int:
    """Threads per row for the prefill's many rows: one per float4 of the row, rounded
    up to a warp. The kernel's sum has the same order at any block size (rmsnorm.cuh), and a
    1024-thread block for a row of 224 float4 (the 0.5B's D = 896) would hold an SM's threads
    for 224 busy ones: 2 rows per SM at a time where 9 fit."""
    return min(THREADS, -(-dim // 4 // 32) * 32)


class RmsNorm(Launcher):
    """out fp16 [rows, D] = rmsnorm(x fp32 [rows, D]) · weight fp16 [D], all in FP32; one block per
    row of `threads` (default THREADS; the prefill passes row_threads(D)): the same bits at any.

    Raises:
        LaunchError: D not a multiple of 4 or above MAX_DIM, threads not a multiple of 32 in
            32 … THREADS, or a buffer of the wrong size/dtype.
    """

    def __init__(self, out, x, weight, *, dim: int, eps: float, rows: int = 1, threads: int | None = None,
                 stream: Stream | None = None):
        super().__init__(stream)
        require(dim > 0 and dim % 4 == 0 and dim <= MAX_DIM,
                f"rmsnorm: D={dim} must be a positive multiple of 4, at most {MAX_DIM}")
        check_buffer(out, "out", rows * dim, np.float16)
        check_buffer(x, "x", rows * dim, np.float32)
        check_buffer(weight, "weight", dim, np.float16)
        threads = threads or THREADS
        require(threads % 32 == 0 and 32 <= threads <= THREADS, f"rmsnorm: {threads} threads: a multiple of 32 in 32..{THREADS}")
        self.bytes_moved = rows * dim * (4 + 2) + dim * 2
        self._add(KernelRef("rmsnorm", "rmsnorm", pdl=True), (rows,), (threads,),
                  dict(out=out, x=x, weight=weight, D=i32(dim), eps=f32(eps)),
                  reads=(x, weight), writes=(out,), bytes_moved=self.bytes_moved)
