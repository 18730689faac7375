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


class RmsNorm(Launcher):
    """out fp16 [rows, D] = rmsnorm(x fp32 [rows, D]) · weight fp16 [D], all in FP32.

    Raises:
        LaunchError: D not a multiple of 4 or above MAX_DIM, or a buffer of the wrong size/dtype.
    """

    def __init__(self, out, x, weight, *, dim: int, eps: float, rows: int = 1, stream: Stream | None = None):
        super().__init__(stream)
        require(dim > 0 and dim % 4 == 0 and dim <= MAX_DIM,
                f"rmsnorm: D={dim} must be a positive multiple of 4, at most {MAX_DIM}")
        check_buffer(out, "out", rows * dim, np.float16)
        check_buffer(x, "x", rows * dim, np.float32)
        check_buffer(weight, "weight", dim, np.float16)
        self.bytes_moved = rows * dim * (4 + 2) + dim * 2
        self._add(KernelRef("rmsnorm", "rmsnorm", pdl=True), (rows,), (THREADS,),
                  dict(out=out, x=x, weight=weight, D=i32(dim), eps=f32(eps)),
                  reads=(x, weight), writes=(out,), bytes_moved=self.bytes_moved)
