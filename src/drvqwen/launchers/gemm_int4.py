"""Launchers of kernels/gemm_int4.cu: the prefill GEMMs over INT4 (layout id 1) weights.

    GemmInt4                   out fp32 [M, N]               = x fp16 [M, K] · Wᵀ
    GemmInt4QkvRows            qkv fp32 [M, Nq + 2 Nkv]      = x [Wq; Wk; Wv]ᵀ
    GemmInt4ResidualRows       residual fp32 [M, N]         += x Wᵀ              (o_proj, down_proj)
    GemmInt4GateUpSwigluRows   h fp16 [M, F]                 = silu(x Wgᵀ) ⊙ (x Wuᵀ)

M = prefill_state[1] ≤ rows: buffers and grids are sized for a row *capacity* (`rows`), the
kernels read the live row count from prefill_state int32 [2] = (start, n_rows) and write only
rows < n_rows, so one launch list serves every chunk of up to `rows` rows.

The kernels read x through a TMA tensor map (box 128 tokens × 64 inputs, 128-byte swizzle: the
layout wgmma reads), encoded here from x's address: `x` must be a device array (the prefill
builds its launch lists on the GPU), not a planned BufferSpec.

The kernels are persistent: the grid is at most one block per SM (`max_blocks`, default the
GPU's SM count) and each block loops over the tiles of 128 tokens × 128 weight rows that the live
M gives. `max_blocks=0` launches one block per tile at the capacity instead (the plain form,
for comparison: tools/bench_gemm.py runs both).
"""

from __future__ import annotations

import functools

import numpy as np

from ..cuda import Stream, encode_tiled_2d, get_device
from ..cuda.tensormap import Swizzle
from ..format.quant import GROUP_SIZE
from .base import KernelRef, Launcher, check_buffer, check_prefill_state, i32, mirrored, require
from .gemv_int4 import _check_int4, int4_bytes

BM = mirrored("gemm_int4", "GEMM_BM", 128)                      # tokens per block (wgmma N)
THREADS = mirrored("gemm_int4", "GEMM_THREADS", 288)            # 2 consumer warpgroups + 1 producer warp
BLOCK_ROWS = mirrored("gemm_int4", "GEMM_BLOCK_ROWS", 128)      # weight rows per block (gate/up: 64 features × 2)
TILE_ROWS = mirrored("gemm_int4", "INT4_TILE_ROWS", 16)
BOX_INPUTS = mirrored("gemm_int4", "GEMM_BOX_INPUTS", 64)       # inputs per TMA box row (128 B)
# 4 stages × (32 KiB of activations (128 tokens × 128 inputs) + 8 KiB of INT4 weights (128 rows
# × 64 B)) + 1 KiB of alignment slack + the 8 mbarriers (above the 48 KiB default: KernelLaunch
# opts in).
SMEM_BYTES = mirrored("gemm_int4", "GEMM_SMEM_BYTES", 4 * (BM * 128 * 2 + BLOCK_ROWS * 64) + 1024 + 3 * 4 * 8)


def x_tensor_map(x, rows: int, k: int):
    """The TMA descriptor of x fp16 [rows, K] the kernels take: box BM tokens × 64 inputs,
    128-byte swizzle (rows past `rows` read as zero).

    Raises:
        LaunchError: x is not a device array (a planned buffer has no address yet).
    """
    require(k > 0 and k % GROUP_SIZE == 0, f"gemm_int4: K={k} must be a positive multiple of {GROUP_SIZE}")
    require(isinstance(getattr(x, "ptr", None), int),
            f"gemm_int4: x must be a device array (its tensor map is encoded at once), got {x!r}")
    return _encode_x_map(x.ptr, rows, k)


@functools.lru_cache(maxsize=256)
def _encode_x_map(ptr: int, rows: int, k: int):
    # Every layer's GEMMs read the same few activation buffers (xn, attn, h): one encode each
    # (~60 µs from Python) instead of one per launcher. The map is plain bytes, passed by value.
    return encode_tiled_2d(ptr, np.float16, (rows, k), (BM, BOX_INPUTS), swizzle=Swizzle.CU_TENSOR_MAP_SWIZZLE_128B)


def persistent_grid(tiles_at_capacity: int, max_blocks: int | None) -> int:
    """Blocks of a persistent GEMM launch (here and gemm_fmt_wgmma.py): one per SM (`max_blocks`
    None: the GPU's SM count, or `max_blocks`), never more than the tiles at the row capacity;
    `max_blocks=0` gives one block per tile.

    Raises:
        LaunchError: max_blocks < 0.
    """
    require(max_blocks is None or max_blocks >= 0, f"max_blocks={max_blocks} must be >= 0 (0: one block per tile)")
    if max_blocks is None:
        max_blocks = get_device().info.sm_count
    return tiles_at_capacity if max_blocks == 0 else min(tiles_at_capacity, max_blocks)


class _GemmLauncher(Launcher):
    """Shared by the gemm_int4 launchers. `flops` is 2·rows·N·K at full capacity (rows tokens)."""

    flops: int = 0

    def _build_gemm(self, kernel: str, rows: int, n_blocks: int, k: int, args: dict, *, reads, writes,
                    max_blocks: int | None) -> None:
        require(k > 0 and k % GROUP_SIZE == 0, f"gemm_int4: K={k} must be a positive multiple of {GROUP_SIZE}")
        require(rows >= 1 and n_blocks >= 1, f"gemm_int4: rows={rows} and N must be >= 1")
        grid = persistent_grid(-(-rows // BM) * n_blocks, max_blocks)
        self._add(KernelRef("gemm_int4", kernel), (grid,), (THREADS,), args,
                  smem_bytes=SMEM_BYTES, reads=reads, writes=writes, bytes_moved=self.bytes_moved)


class GemmInt4(_GemmLauncher):
    """out fp32 [M, N] = x fp16 [M, K] · Wᵀ (W INT4 [N, K]), M = prefill_state[1] ≤ rows.

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, out, x, qweight, scales, prefill_state, *, n: int, k: int, rows: int,
                 max_blocks: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(out, "out", rows * n, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = int4_bytes(n, k) + 2 * rows * k + 4 * rows * n
        self._build_gemm("gemm_int4_f32", rows, -(-n // BLOCK_ROWS), k,
                         dict(out=out, x_map=x_tensor_map(x, rows, k), qweight=qweight, scales=scales,
                              prefill_state=prefill_state, N=i32(n), K=i32(k)),
                         reads=(x, qweight, scales, prefill_state), writes=(out,), max_blocks=max_blocks)


class GemmInt4QkvRows(_GemmLauncher):
    """qkv fp32 [M, Nq + 2 Nkv] = x [Wq; Wk; Wv]ᵀ for the rows of a prefill chunk (one launch).

    Raises:
        LaunchError: Nq or Nkv not a multiple of 16, K not a multiple of 128, or a buffer of the
            wrong size or dtype.
    """

    def __init__(self, qkv, x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales,
                 prefill_state, *, n_q: int, n_kv: int, k: int, rows: int, max_blocks: int | None = None,
                 stream: Stream | None = None):
        super().__init__(stream)
        require(n_q % TILE_ROWS == 0 and n_kv % TILE_ROWS == 0,
                f"gemm_int4_qkv: Nq={n_q} and Nkv={n_kv} must be multiples of {TILE_ROWS}")
        check_buffer(qkv, "qkv", rows * (n_q + 2 * n_kv), np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        _check_int4(q_qweight, q_scales, "q_proj", n_q, k)
        _check_int4(k_qweight, k_scales, "k_proj", n_kv, k)
        _check_int4(v_qweight, v_scales, "v_proj", n_kv, k)
        check_prefill_state(prefill_state)
        n = n_q + 2 * n_kv
        self.flops = 2 * rows * n * k
        self.bytes_moved = int4_bytes(n, k) + 2 * rows * k + 4 * rows * n
        self._build_gemm("gemm_int4_qkv", rows, -(-n // BLOCK_ROWS), k,
                         dict(qkv=qkv, x_map=x_tensor_map(x, rows, k), q_qweight=q_qweight, q_scales=q_scales,
                              k_qweight=k_qweight, k_scales=k_scales, v_qweight=v_qweight, v_scales=v_scales,
                              prefill_state=prefill_state, Nq=i32(n_q), Nkv=i32(n_kv), K=i32(k)),
                         reads=(x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales, prefill_state),
                         writes=(qkv,), max_blocks=max_blocks)


class GemmInt4ResidualRows(_GemmLauncher):
    """residual fp32 [M, N] += x fp16 [M, K] · Wᵀ (o_proj, down_proj of a prefill chunk).

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, residual, x, qweight, scales, prefill_state, *, n: int, k: int, rows: int,
                 max_blocks: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(residual, "residual", rows * n, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = int4_bytes(n, k) + 2 * rows * k + 8 * rows * n
        self._build_gemm("gemm_int4_residual", rows, -(-n // BLOCK_ROWS), k,
                         dict(residual=residual, x_map=x_tensor_map(x, rows, k), qweight=qweight, scales=scales,
                              prefill_state=prefill_state, N=i32(n), K=i32(k)),
                         reads=(residual, x, qweight, scales, prefill_state), writes=(residual,), max_blocks=max_blocks)


class GemmInt4GateUpSwigluRows(_GemmLauncher):
    """h fp16 [M, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ): gate_proj, up_proj and SwiGLU of a prefill chunk.

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, h, x, gate_qweight, gate_scales, up_qweight, up_scales, prefill_state, *,
                 f: int, k: int, rows: int, max_blocks: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(h, "h", rows * f, np.float16)
        check_buffer(x, "x", rows * k, np.float16)
        _check_int4(gate_qweight, gate_scales, "gate_proj", f, k)
        _check_int4(up_qweight, up_scales, "up_proj", f, k)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * 2 * f * k
        self.bytes_moved = 2 * int4_bytes(f, k) + 2 * rows * k + 2 * rows * f
        # A block holds 64 features of gate and the same 64 of up.
        self._build_gemm("gemm_int4_gate_up_swiglu", rows, -(-f // (BLOCK_ROWS // 2)), k,
                         dict(h=h, x_map=x_tensor_map(x, rows, k), gate_qweight=gate_qweight, gate_scales=gate_scales,
                              up_qweight=up_qweight, up_scales=up_scales, prefill_state=prefill_state, F=i32(f),
                              K=i32(k)),
                         reads=(x, gate_qweight, gate_scales, up_qweight, up_scales, prefill_state), writes=(h,),
                         max_blocks=max_blocks)
