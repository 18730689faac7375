"""Launchers of kernels/gemv_int4.cu's Q4_K decode GEMVs: the INT4 GEMV engine over weights in
the GGUF's Q4_K (GemvQ4kWeights there: each lane's 32-input sub-block scale inside its A
fragments, the super-block's d on the MMA sums, dmin·m·Σx apart).

    GemvQ4kResidual       residual fp32 [N] += W x                          (o_proj, down_proj)
    GemvQ4kGateUpSwiglu   h fp16 [F] = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual)

They do what GemvFmtResidual and GemvFmtGateUpSwiglu (gemv_fmt.py) do for a Q4_K weight, with
gemv_int4.cu's MMA per item instead of gemv_fmt.cu's four (one a lane), so the decode step runs
its Q4_K projections here (decode.py). They take FmtWeights in format q4_k: qweight uint32
[N, K/8] (layout id 1), scales uint8 [N, K/256, 12], superscales fp16 [N, K/256, 2]; K a
multiple of 256. Launch shape: gemv_int4's (gemv_launch_shape), with K/32 fp32 more of dynamic
shared memory a block for Σx of every 32-input chunk; the kernels are compiled for 2 blocks of
8 warps a SM (GEMV_Q4K_MIN_BLOCKS).
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from ..format import weight_formats as wf
from .base import DEFAULT_OCCUPANCY, KernelRef, Launcher, Occupancy, check_buffer, f32, i32, mirrored, require
from .gemv_int4 import gemv_launch_shape, tiles

Q4K_ID = next(f.id for f in wf.FORMATS.values() if f.name == "q4_k")
SUPER = 256  # inputs per Q4_K super-block: K must be a multiple
LANE_INPUTS = mirrored("gemv_int4", "GEMV_LANE_INPUTS", 32)  # inputs per Σx in shared memory


def takes(w, k: int) -> bool:
    """Whether these kernels take FmtWeight `w` at input width k: format q4_k, K a multiple of 256."""
    return w.fmt.id == Q4K_ID and k > 0 and k % SUPER == 0


def _check(w, n: int, k: int) -> None:
    require(takes(w, k), f"gemv_q4k: {w.name} is {w.fmt.name} at K={k}; these kernels take q4_k with K a "
                         f"multiple of {SUPER}")
    w.check(n, k)


def _args(w, prefix: str) -> dict:
    """<prefix>_qweight, _scales, _aux: the codes, the packed (sc, m) bytes, the (d, dmin) pairs."""
    return {f"{prefix}_qweight": w.parts["qweight"], f"{prefix}_scales": w.parts["scales"],
            f"{prefix}_aux": w.parts["superscales"]}


def smem_extra(k: int) -> int:
    """Dynamic shared memory a block needs besides gemv_int4's x and partials: Σx of every
    32-input chunk, fp32."""
    return 4 * (k // LANE_INPUTS)


class _GemvQ4kLauncher(Launcher):
    """Shared by the launchers here; occupancy, warps, blocks and defines as for gemv_int4's."""

    def _build(self, kernel: str, n_tiles: int, k: int, mt: int, args: dict, *, reads, writes,
               occupancy: Occupancy | None, warps: int | None, blocks: int | None, defines: tuple) -> None:
        occ = occupancy or DEFAULT_OCCUPANCY
        ref = KernelRef("gemv_int4", kernel, tuple(defines), pdl=True)
        grid, threads, smem = gemv_launch_shape(n_tiles, k, mt, lambda t, s: occ.blocks_per_sm(ref, t, s),
                                                occ.sm_count, warps=warps, blocks=blocks, extra_smem=smem_extra(k))
        self._add(ref, (grid,), (threads,), args, smem_bytes=smem, reads=reads, writes=writes,
                  bytes_moved=self.bytes_moved)


class GemvQ4kResidual(_GemvQ4kLauncher):
    """residual fp32 [N] += W x (o_proj, down_proj), W a q4_k FmtWeight [N, K], x fp16 [K].

    Raises:
        LaunchError: a weight not in q4_k, K not a multiple of 256, or a buffer of the wrong size
            or dtype.
    """

    def __init__(self, residual, x, w, *, n: int, k: int, stream: Stream | None = None,
                 occupancy: Occupancy | None = None, warps: int | None = None, blocks: int | None = None,
                 defines: tuple = ()):
        super().__init__(stream)
        _check(w, n, k)
        check_buffer(residual, "residual", n, np.float32)
        check_buffer(x, "x", k, np.float16)
        self.bytes_moved = w.nbytes(n, k) + 2 * k + 8 * n
        self._build("gemv_q4k_residual", tiles(n), k, 1, dict(residual=residual, x=x, **_args(w, "w"), N=i32(n), K=i32(k)),
                    reads=(residual, x) + w.buffers, writes=(residual,), occupancy=occupancy, warps=warps,
                    blocks=blocks, defines=defines)


class GemvQ4kGateUpSwiglu(_GemvQ4kLauncher):
    """h fp16 [F] = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual fp32 [D]) · norm_weight fp16 [D]
    (post_attention_layernorm), gate and up q4_k FmtWeights [F, D]: the norm, both projections
    and SwiGLU in one launch.

    Raises:
        LaunchError: a weight not in q4_k, D not a multiple of 256, or a buffer of the wrong size
            or dtype.
    """

    def __init__(self, h, residual, norm_weight, gate, up, *, f: int, k: int, eps: float,
                 stream: Stream | None = None, occupancy: Occupancy | None = None, warps: int | None = None,
                 blocks: int | None = None, defines: tuple = ()):
        super().__init__(stream)
        _check(gate, f, k)
        _check(up, f, k)
        check_buffer(h, "h", f, np.float16)
        check_buffer(residual, "residual", k, np.float32)
        check_buffer(norm_weight, "norm_weight", k, np.float16)
        self.bytes_moved = gate.nbytes(f, k) + up.nbytes(f, k) + 6 * k + 2 * f
        self._build("gemv_q4k_gate_up_swiglu", tiles(f), k, 2,
                    dict(h=h, residual=residual, norm_w=norm_weight, **_args(gate, "gate"), **_args(up, "up"),
                         F=i32(f), K=i32(k), eps=f32(eps)),
                    reads=(residual, norm_weight) + gate.buffers + up.buffers, writes=(h,), occupancy=occupancy,
                    warps=warps, blocks=blocks, defines=defines)
