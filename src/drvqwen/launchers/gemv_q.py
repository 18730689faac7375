"""Launcher of kernels/gemv_q.cu: the decode GEMV over one weight of any grouped integer format
(format/weight_formats.py), one kernel per format.

    GemvQ   y fp16 [N] = W x          (out given)
            residual fp32 [N] += W x  (residual given instead)

W is the weight's stored parts: qweight uint32, qhigh uint32 (5- and 6-bit codes), scales and
offsets (formats with an offset) in the format's dtype; x fp16 [K].
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from ..format import weight_formats as wf
from .base import NULL, KernelRef, Launcher, check_buffer, i32, mirrored, require

WARPS = mirrored("gemv_q", "GQ_WARPS", 8)


def gemv_q_kernel(fmt: wf.WeightFormat) -> KernelRef:
    """The kernel of format `fmt` (gemv_q_<name> in kernels/gemv_q.cu)."""
    return KernelRef("gemv_q", f"gemv_q_{fmt.name}")


class GemvQ(Launcher):
    """y = W x (fp16 out) or residual += W x (fp32) for W [n, k] stored in `fmt`.

    parts: {"qweight", "scales", and "qhigh" / "offsets" where the format has them} → buffers
    with the shapes and dtypes `fmt.tensors` names.

    Raises:
        LaunchError: K not a multiple of 32 and of the group, both or neither of out/residual,
            a missing part, or a buffer of the wrong size or dtype.
    """

    def __init__(self, fmt: wf.WeightFormat, parts: dict, x, *, n: int, k: int, out=None, residual=None,
                 stream: Stream | None = None):
        super().__init__(stream)
        require(n > 0 and fmt.fits(k), f"gemv_q {fmt.name}: N={n}, K={k}: K must be a positive multiple of 32 "
                                      f"and of the group {fmt.group}")
        require((out is None) != (residual is None), "gemv_q: give exactly one of out (fp16) and residual (fp32)")
        want = fmt.tensors("w", n, k)
        for name, (dt, shape) in want.items():
            part = name.split(".", 1)[1]
            require(part in parts, f"gemv_q {fmt.name}: part {part} missing")
            check_buffer(parts[part], f"W.{part}", int(np.prod(shape)), dt)
        check_buffer(x, "x", k, np.float16)
        if out is not None:
            check_buffer(out, "out", n, np.float16)
        else:
            check_buffer(residual, "residual", n, np.float32)
        self.fmt = fmt
        w_bytes = wf.parts_nbytes(fmt, n, k)
        self.bytes_moved = w_bytes + 2 * k + (2 * n if out is not None else 8 * n)
        def opt(part):
            return parts[part] if part in parts else NULL        # a null pointer in the kernel

        args = dict(out_f16=out if out is not None else NULL, residual=residual if residual is not None else NULL,
                    qweight=parts["qweight"], qhigh=opt("qhigh"), scales=parts["scales"], offsets=opt("offsets"), x=x,
                    N=i32(n), K=i32(k))
        written = out if out is not None else residual
        self._add(gemv_q_kernel(fmt), (-(-n // WARPS),), (WARPS * 32,), args,
                  reads=[x] + [parts[p] for p in ("qweight", "qhigh", "scales", "offsets") if p in parts],
                  writes=(written,), bytes_moved=self.bytes_moved)
