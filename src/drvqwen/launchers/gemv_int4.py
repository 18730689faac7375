"""Launchers of kernels/gemv_int4.cu: the decode GEMVs over INT4 (layout id 1) weights.

    GemvInt4               y fp16 [N]            = W x
    GemvInt4Qkv            qkv fp32 [Nq + 2 Nkv] = [Wq x; Wk x; Wv x]     (bias and RoPE: RopeKv)
    GemvInt4Residual       residual fp32 [N]    += W x                    (o_proj, down_proj)
    GemvInt4GateUpSwiglu   h fp16 [F]            = silu(Wg x) ⊙ (Wu x)    (gate_proj + up_proj)

W is INT4 layout id 1: qweight uint32 [N, K/8] and scales fp16 [N, K/128] (format/quant.py).

The launch shape (`gemv_launch_shape`) comes from a small cost model: the kernel's work is
16-row tiles × K groups, blocks own contiguous ranges of tiles and their W warps split K.
The model picks W and the grid so that the tiles spread evenly over the SMs in one wave,
with the resident blocks per SM taken from the occupancy it is given (the driver's, by
default), so it can be evaluated — and tested — without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..cuda import Stream
from ..format.quant import GROUP_SIZE
from .base import DEFAULT_OCCUPANCY, KernelRef, Launcher, Occupancy, check_buffer, i32, mirrored, require

TILE_ROWS = mirrored("gemv_int4", "GEMV_TILE_ROWS", 16)   # output rows per tile (M of one MMA)
MAX_WARPS = mirrored("gemv_int4", "GEMV_MAX_WARPS", 8)    # K-split warps per block
mirrored("gemv_int4", "GEMV_GROUP", GROUP_SIZE)

# The cost model. An "item" is one warp's work on one K group of one 16-row tile of one
# matrix: 32 lanes × 2 rows × 16 B = 1 KiB of INT4 weights.
ITEM_BYTES = 1024
# A warp alone keeps one 4-item batch (4 KiB) in flight per HBM round trip (~1 µs loaded):
# ~250 ns per item when bandwidth is not the limit.
UNLOADED_NS_PER_ITEM = 250.0
# HBM bytes per ns when it is the limit: 4.3 TB/s, the device-to-device copy bandwidth
# measured on the H200 (read + write counted).
HBM_BYTES_PER_NS = 4300.0
# Modelled times within 3 % count as equal (the model is coarse: on the H200, down_proj ran
# 17.6 µs with W = 6 and 16.8 µs with W = 8, which the model had 1.3 % apart the other way).
TIE_BAND = 1.03


def tiles(n: int) -> int:
    """16-row tiles covering n rows."""
    return -(-n // TILE_ROWS)


def int4_bytes(n: int, k: int) -> int:
    """Bytes of an INT4 [N, K] matrix with its fp16 group scales."""
    return n * k // 2 + n * (k // GROUP_SIZE) * 2


def gemv_smem_bytes(k: int, tiles_per_block: int, warps: int, mt: int) -> int:
    """Dynamic shared memory of a gemv_int4 block: x in fp16 (2K bytes), then the warps'
    per-row partial sums, tiles_per_block × MT matrices × W warps × 16 rows × fp32."""
    return 2 * k + tiles_per_block * mt * warps * TILE_ROWS * 4


def gemv_launch_shape(n_tiles: int, k: int, mt: int, blocks_per_sm: Callable[[int, int], int], sm_count: int,
                      warps: int | None = None, blocks: int | None = None) -> tuple[int, int, int]:
    """(grid blocks G, threads per block 32·W, dynamic shared memory bytes) of a gemv_int4 kernel.

    Each block owns ceil-or-floor(T/G) consecutive 16-row tiles and its W warps split the K
    groups (gemv_int4.cu). For each W in 1..8 (W ≤ K/128), the resident block count
    (blocks_per_sm(threads, smem) × sm_count) caps G; with makespan m = ceil(T / G_max) tiles
    per block, G = ceil(T / m) (no more blocks than the makespan needs). The modelled time is
    the busiest warp's item count times the time per item:
    max(UNLOADED_NS_PER_ITEM, active warps × ITEM_BYTES / HBM_BYTES_PER_NS). The smallest time
    wins; within TIE_BAND, more warps per block (x staged fewer times, more loads in flight).

    Args:
        n_tiles: T, 16-row tiles of the output (all matrices stacked, gate/up counted once).
        k: K, a multiple of 128.
        mt: matrices read per tile (2 for gate/up, else 1).
        blocks_per_sm: (threads, dynamic smem bytes) → resident blocks per SM (occupancy).
        sm_count: SMs of the GPU.
        warps, blocks: force W or G (benchmark variants), e.g. blocks=n_tiles for one tile per block.
    Raises:
        LaunchError: no shape is possible (e.g. `warps` above K/128 or MAX_WARPS).
    """
    groups = k // GROUP_SIZE
    best = None
    for w in range(1, min(MAX_WARPS, groups) + 1):
        if warps is not None and w != warps:
            continue
        occ = blocks_per_sm(32 * w, gemv_smem_bytes(k, 1, w, mt))
        g_max = max(1, occ * sm_count)
        g = min(n_tiles, g_max) if blocks is None else min(blocks, n_tiles)
        per_block = -(-n_tiles // g)
        if blocks is None:
            g = -(-n_tiles // per_block)
        smem = gemv_smem_bytes(k, per_block, w, mt)
        items = per_block * -(-groups // w)
        active = g * w
        t_ns = items * max(UNLOADED_NS_PER_ITEM, active * ITEM_BYTES / HBM_BYTES_PER_NS)
        if best is None or t_ns < best[0] / TIE_BAND or (t_ns <= best[0] * TIE_BAND and w > best[1]):
            best = (t_ns, w, g, smem)
    require(best is not None, f"gemv_int4: no launch shape for K={k} with warps={warps}")
    _, w, g, smem = best
    return g, 32 * w, smem


def _check_int4(qweight, scales, what: str, n: int, k: int) -> None:
    check_buffer(qweight, f"{what}.qweight", n * k // 8, np.uint32)
    check_buffer(scales, f"{what}.scales", n * (k // GROUP_SIZE), np.float16)


class _GemvInt4Launcher(Launcher):
    """Shared by the gemv_int4 launchers: the launch shape from the kernel's occupancy."""

    def _build_gemv(self, kernel: str, n_tiles: int, k: int, mt: int, params: list, *, reads, writes,
                    occupancy: Occupancy | None, warps: int | None, blocks: int | None) -> None:
        require(k > 0 and k % GROUP_SIZE == 0, f"gemv_int4: K={k} must be a positive multiple of {GROUP_SIZE}")
        require(n_tiles >= 1, "gemv_int4: N must be >= 1")
        occ = occupancy or DEFAULT_OCCUPANCY
        ref = KernelRef("gemv_int4", kernel)
        grid, threads, smem = gemv_launch_shape(
            n_tiles, k, mt, lambda t, s: occ.blocks_per_sm(ref, t, s), occ.sm_count, warps=warps, blocks=blocks)
        self._add(ref, (grid,), (threads,), params, smem_bytes=smem, reads=reads, writes=writes,
                  bytes_moved=self.bytes_moved)


class GemvInt4(_GemvInt4Launcher):
    """y fp16 [N] = W x, W INT4 [N, K], x fp16 [K].

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, y, x, qweight, scales, *, n: int, k: int, stream: Stream | None = None,
                 occupancy: Occupancy | None = None, warps: int | None = None, blocks: int | None = None):
        super().__init__(stream)
        check_buffer(y, "y", n, np.float16)
        check_buffer(x, "x", k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        self.bytes_moved = int4_bytes(n, k) + 2 * k + 2 * n
        self._build_gemv("gemv_int4_f16", tiles(n), k, 1, [y, x, qweight, scales, i32(n), i32(k)],
                         reads=(x, qweight, scales), writes=(y,), occupancy=occupancy, warps=warps, blocks=blocks)


class GemvInt4Qkv(_GemvInt4Launcher):
    """qkv fp32 [Nq + 2 Nkv] = [Wq x; Wk x; Wv x] in one launch.

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, qkv, x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales, *,
                 n_q: int, n_kv: int, k: int, stream: Stream | None = None, occupancy: Occupancy | None = None,
                 warps: int | None = None, blocks: int | None = None):
        super().__init__(stream)
        check_buffer(qkv, "qkv", n_q + 2 * n_kv, np.float32)
        check_buffer(x, "x", k, np.float16)
        _check_int4(q_qweight, q_scales, "q_proj", n_q, k)
        _check_int4(k_qweight, k_scales, "k_proj", n_kv, k)
        _check_int4(v_qweight, v_scales, "v_proj", n_kv, k)
        self.bytes_moved = int4_bytes(n_q + 2 * n_kv, k) + 2 * k + 4 * (n_q + 2 * n_kv)
        self._build_gemv("gemv_int4_qkv", tiles(n_q) + 2 * tiles(n_kv), k, 1,
                         [qkv, x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales,
                          i32(n_q), i32(n_kv), i32(k)],
                         reads=(x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales), writes=(qkv,),
                         occupancy=occupancy, warps=warps, blocks=blocks)


class GemvInt4Residual(_GemvInt4Launcher):
    """residual fp32 [N] += W x (o_proj, down_proj): the residual add fused into the epilogue.

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, residual, x, qweight, scales, *, n: int, k: int, stream: Stream | None = None,
                 occupancy: Occupancy | None = None, warps: int | None = None, blocks: int | None = None):
        super().__init__(stream)
        check_buffer(residual, "residual", n, np.float32)
        check_buffer(x, "x", k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        self.bytes_moved = int4_bytes(n, k) + 2 * k + 8 * n
        self._build_gemv("gemv_int4_residual", tiles(n), k, 1, [residual, x, qweight, scales, i32(n), i32(k)],
                         reads=(residual, x, qweight, scales), writes=(residual,), occupancy=occupancy,
                         warps=warps, blocks=blocks)


class GemvInt4GateUpSwiglu(_GemvInt4Launcher):
    """h fp16 [F] = silu(Wg x) ⊙ (Wu x): gate_proj, up_proj and SwiGLU in one launch.

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, h, x, gate_qweight, gate_scales, up_qweight, up_scales, *, f: int, k: int,
                 stream: Stream | None = None, occupancy: Occupancy | None = None,
                 warps: int | None = None, blocks: int | None = None):
        super().__init__(stream)
        check_buffer(h, "h", f, np.float16)
        check_buffer(x, "x", k, np.float16)
        _check_int4(gate_qweight, gate_scales, "gate_proj", f, k)
        _check_int4(up_qweight, up_scales, "up_proj", f, k)
        self.bytes_moved = 2 * int4_bytes(f, k) + 2 * k + 2 * f
        self._build_gemv("gemv_int4_gate_up_swiglu", tiles(f), k, 2,
                         [h, x, gate_qweight, gate_scales, up_qweight, up_scales, i32(f), i32(k)],
                         reads=(x, gate_qweight, gate_scales, up_qweight, up_scales), writes=(h,),
                         occupancy=occupancy, warps=warps, blocks=blocks)
