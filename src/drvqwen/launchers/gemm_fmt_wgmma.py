"""Launchers of kernels/gemm_fmt_wgmma.cu: the prefill GEMMs over weights in their per-tensor
formats on wgmma, a producer warpgroup dequantizing the weights into shared memory.

    GemmFmtwRows               out fp32 [M, ldo], columns col0 … col0+N-1 = x fp16 [M, K] · Wᵀ
    GemmFmtwResidualRows       residual fp32 [M, N]                      += x Wᵀ   (o_proj, down_proj)
    GemmFmtwGateUpSwigluRows   h fp16 [M, F]            = silu(x Wgᵀ) ⊙ (x Wuᵀ)

The constructors take what gemm_fmt.py's do (and the same FmtWeight, `defines` from
gemv_fmt.format_defines), so the prefill picks either file per weight shape: these need K to be
a multiple of 128 (one stage) and x a device array (its TMA tensor map is encoded at once, as in
gemm_int4.py). The kernels are persistent: grid = min(tiles at the row capacity, SM count) — or
`max_blocks` instead of the SM count, 0 for one block per tile (gemm_int4.persistent_grid) —,
384 threads, GW_SMEM_BYTES of dynamic shared memory, the work shared out by stream-K ranges as
in gemm_int4.py's launchers (the same kernels/gemm_split_k.cuh and plan, `plan_launch`): given a
`SplitKScratch`, a range may cut a tile, and `blocks=` forces the block count.
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, check_prefill_state, i32, mirrored, require
from .gemm_int4 import GemmTiling, SplitKScratch, plan_launch, split_k_args, x_tensor_map
from .gemv_fmt import FmtWeight

BM = mirrored("gemm_fmt_wgmma", "GEMM_BM", 128)               # tokens per tile (wgmma N)
BLOCK_ROWS = mirrored("gemm_fmt_wgmma", "GW_BLOCK_ROWS", 128)  # weight rows per tile (gate/up: 64 features × 2)
THREADS = mirrored("gemm_fmt_wgmma", "GW_THREADS", 384)        # 2 consumer warpgroups + the producer warpgroup
GROUP = mirrored("gemm_fmt_wgmma", "GW_GROUP", 128)            # inputs per stage: K must be a multiple
# 3 stages × (32 KiB of activations + 32 KiB of FP16 weights, 128 × 128 each) + 1 KiB of
# alignment slack + 6 mbarriers.
SMEM_BYTES = mirrored("gemm_fmt_wgmma", "GW_SMEM_BYTES", 3 * (2 * BM * GROUP * 2) + 1024 + 2 * 3 * 8)


def fits(k: int) -> bool:
    """Whether these kernels take an input width K (a multiple of the 128-input stage)."""
    return k > 0 and k % GROUP == 0


class _GemmFmtwLauncher(Launcher):
    flops: int = 0

    def _check(self, x, w: FmtWeight, prefill_state, n: int, k: int, rows: int, defines: tuple) -> None:
        require(rows >= 1 and n >= 1, f"gemm_fmt_wgmma: rows={rows}, N={n} must be >= 1")
        require(fits(k), f"gemm_fmt_wgmma: K={k} must be a positive multiple of {GROUP}")
        w.check(n, k, quad=GROUP, defines=defines)
        check_buffer(x, "x", rows * k, np.float16)
        check_prefill_state(prefill_state)

    tiling: GemmTiling | None = None  # the launch's plan (gemm_int4.plan_launch, 128-token tiles)

    def _build(self, kernel: str, rows: int, row_blocks: int, k: int, args: dict, dims: dict, defines: tuple, *,
               reads, writes, max_blocks: int | None, split_k: SplitKScratch | None, blocks: int | None) -> None:
        """args: the kernel's parameters up to prefill_state, dims: the scalars after the split-K
        pointers (…, prefill_state, split_partials, split_counters, dims…)."""
        self.tiling = t = plan_launch(rows, row_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                                      tile_tokens=BM)
        scratch = (split_k.partials, split_k.counters) if t.split else ()
        self._add(KernelRef("gemm_fmt_wgmma", kernel, tuple(defines), pdl=True), (t.blocks,), (THREADS,),
                  {**args, **split_k_args(split_k, t, kernel), **dims},
                  smem_bytes=SMEM_BYTES, reads=(*reads, *scratch), writes=(*writes, *scratch),
                  bytes_moved=self.bytes_moved)


class GemmFmtwRows(_GemmFmtwLauncher):
    """out fp32 [rows, ldo]: columns col0 … col0+N-1 of rows < M = x fp16 [rows, K] · Wᵀ (q, k and v
    into their columns of the prefill's qkv buffer).

    Raises:
        LaunchError: a format without a GPU kernel, K not a multiple of 128 and of the format's
            group, col0 + N > ldo, x not a device array, or a buffer of the wrong size or dtype.
    """

    def __init__(self, out, x, w: FmtWeight, prefill_state, *, n: int, k: int, rows: int, ldo: int, col0: int = 0,
                 stream: Stream | None = None, defines: tuple = (), max_blocks: int | None = None,
                 split_k: SplitKScratch | None = None, blocks: int | None = None):
        super().__init__(stream)
        self._check(x, w, prefill_state, n, k, rows, defines)
        require(0 <= col0 and col0 + n <= ldo, f"gemm_fmt_wgmma: columns {col0} … {col0 + n - 1} outside ldo={ldo}")
        check_buffer(out, "out", rows * ldo, np.float32)
        self.bytes_moved = w.nbytes(n, k) + 2 * rows * k + 4 * rows * n
        self.flops = 2 * rows * n * k
        self._build("gemm_fmtw_store_rows", rows, -(-n // BLOCK_ROWS), k,
                    dict(out=out, x_map=x_tensor_map(x, rows, k), **w.args("w"), prefill_state=prefill_state),
                    dict(N=i32(n), K=i32(k), ldo=i32(ldo), col0=i32(col0), fmt=i32(w.fmt.id)),
                    defines, reads=(x, prefill_state) + w.buffers, writes=(out,), max_blocks=max_blocks,
                    split_k=split_k, blocks=blocks)


class GemmFmtwResidualRows(_GemmFmtwLauncher):
    """residual fp32 [rows, N] += x fp16 [rows, K] · Wᵀ on rows < M (o_proj, down_proj).

    Raises:
        LaunchError: as GemmFmtwRows.
    """

    def __init__(self, residual, x, w: FmtWeight, prefill_state, *, n: int, k: int, rows: int,
                 stream: Stream | None = None, defines: tuple = (), max_blocks: int | None = None,
                 split_k: SplitKScratch | None = None, blocks: int | None = None):
        super().__init__(stream)
        self._check(x, w, prefill_state, n, k, rows, defines)
        check_buffer(residual, "residual", rows * n, np.float32)
        self.bytes_moved = w.nbytes(n, k) + 2 * rows * k + 8 * rows * n
        self.flops = 2 * rows * n * k
        self._build("gemm_fmtw_residual_rows", rows, -(-n // BLOCK_ROWS), k,
                    dict(residual=residual, x_map=x_tensor_map(x, rows, k), **w.args("w"), prefill_state=prefill_state),
                    dict(N=i32(n), K=i32(k), fmt=i32(w.fmt.id)),
                    defines, reads=(residual, x, prefill_state) + w.buffers, writes=(residual,),
                    max_blocks=max_blocks, split_k=split_k, blocks=blocks)


class GemmFmtwGateUpSwigluRows(_GemmFmtwLauncher):
    """h fp16 [rows, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ) on rows < M, gate and up FmtWeights [F, K] in one
    format.

    Raises:
        LaunchError: gate and up in different formats, or as GemmFmtwRows.
    """

    def __init__(self, h, x, gate: FmtWeight, up: FmtWeight, prefill_state, *, f: int, k: int, rows: int,
                 stream: Stream | None = None, defines: tuple = (), max_blocks: int | None = None,
                 split_k: SplitKScratch | None = None, blocks: int | None = None):
        super().__init__(stream)
        require(gate.fmt.id == up.fmt.id, f"{gate.name} ({gate.fmt.name}) and {up.name} ({up.fmt.name}): the fused "
                                          f"gate/up GEMM needs both in one format")
        self._check(x, gate, prefill_state, f, k, rows, defines)
        up.check(f, k, quad=GROUP, defines=defines)
        check_buffer(h, "h", rows * f, np.float16)
        self.bytes_moved = gate.nbytes(f, k) + up.nbytes(f, k) + 2 * rows * k + 2 * rows * f
        self.flops = 2 * 2 * rows * f * k
        # A tile holds 64 features of gate and the same 64 of up.
        self._build("gemm_fmtw_gate_up_swiglu_rows", rows, -(-f // (BLOCK_ROWS // 2)), k,
                    dict(h=h, x_map=x_tensor_map(x, rows, k), **gate.args("gate"), **up.args("up"),
                         prefill_state=prefill_state),
                    dict(F=i32(f), K=i32(k), fmt=i32(gate.fmt.id)),
                    defines, reads=(x, prefill_state) + gate.buffers + up.buffers, writes=(h,), max_blocks=max_blocks,
                    split_k=split_k, blocks=blocks)
