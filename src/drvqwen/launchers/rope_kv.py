"""Launcher of kernels/rope_kv.cu: QKV bias, RoPE, and the write of K/V into the paged cache for
the rows of a prefill chunk (a decode step does the same inside its QKV GEMV, gemv_int4.py).

    RopeKvRows     q fp16 [rows, Hq, Dh] = rope(q + bq); K/V cache slots of positions
                   start … start + n_rows - 1 = rope(k + bk), v + bv
    RopeTableRows  rope_cs fp32 [rows, Dh/2, 2] = (cos, sin) of every pair's angle at start + r,
                   once per chunk, for GemmInt4QkvRopeRows (gemm_int4.py)
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from ..kv_cache import PAGE_TOKENS
from .base import KernelRef, Launcher, check_buffer, check_prefill_state, i32, mirrored, require
from .gemv_int4 import check_qkv_rope_outputs

THREADS = mirrored("rope_kv", "ROPE_THREADS", 256)  # threads per row (one block per row)
mirrored("rope_kv", "PAGE_TOKENS", PAGE_TOKENS)  # kernels/kv_cache.cuh: the page size the kernels index with


def check_rows_rope_outputs(kernel: str, q_out, q_bias, k_bias, v_bias, k_cache, v_cache, *, rows: int,
                            n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """The checks of the prefill launches that write rotated q and the K/V cache for a chunk's
    rows (RopeKvRows, and gemm_int4's GemmInt4QkvRopeRows): the outputs by the decode GEMVs' rule
    (gemv_int4.check_qkv_rope_outputs, with any even head_dim up to 2048), and the FP16 biases.
    Returns (Nq, Nkv).

    Raises:
        LaunchError: naming `kernel` and the first buffer or value that does not fit.
    """
    require(head_dim <= 2048, f"{kernel}: head_dim={head_dim} must be ≤ 2048")
    check_qkv_rope_outputs(kernel, q_out, k_cache, v_cache, n_heads, n_kv_heads, head_dim, rows, head_dim_multiple=2)
    nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
    check_buffer(q_bias, "q_bias", nq, np.float16)
    check_buffer(k_bias, "k_bias", nkv, np.float16)
    check_buffer(v_bias, "v_bias", nkv, np.float16)
    return nq, nkv


class RopeKvRows(Launcher):
    """RopeKv for the rows r < n_rows of a prefill chunk at positions start + r (prefill_state).

    q_out fp16 [rows, Hq, Dh]; qkv fp32 [rows, Nq + 2 Nkv] (GemmInt4QkvRows' output); the block
    table must hold a page for every position written.

    Raises:
        LaunchError: an odd head_dim, or a buffer of the wrong size, dtype or shape.
    """

    def __init__(self, q_out, k_cache, v_cache, qkv, q_bias, k_bias, v_bias, inv_freq, prefill_state,
                 block_table, *, rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 stream: Stream | None = None):
        super().__init__(stream)
        nq, nkv = check_rows_rope_outputs("rope_kv_rows", q_out, q_bias, k_bias, v_bias, k_cache, v_cache,
                                          rows=rows, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
        check_buffer(qkv, "qkv", rows * (nq + 2 * nkv), np.float32)
        check_buffer(inv_freq, "inv_freq", head_dim // 2, np.float32)
        check_prefill_state(prefill_state)
        self.bytes_moved = rows * (4 * (nq + 2 * nkv) + 2 * (nq + 2 * nkv))
        # One block per row, its threads over the row's (head, rotation pair) items (kernel header).
        self._add(KernelRef("rope_kv", "rope_kv_rows", pdl=True), (rows,), (THREADS,),
                  dict(q_out=q_out, k_cache=k_cache, v_cache=v_cache, qkv=qkv, q_bias=q_bias, k_bias=k_bias,
                       v_bias=v_bias, inv_freq=inv_freq, prefill_state=prefill_state, block_table=block_table,
                       Hq=i32(n_heads), Hkv=i32(n_kv_heads), Dh=i32(head_dim)),
                  reads=(qkv, q_bias, k_bias, v_bias, inv_freq, prefill_state, block_table),
                  writes=(q_out, k_cache, v_cache), bytes_moved=self.bytes_moved)


class RopeTableRows(Launcher):
    """rope_cs fp32 [rows, Dh/2, 2] = (cos, sin) of pair i's angle at position start + r for the
    rows r < n_rows of a prefill chunk (prefill_state): the accurate sincosf of rope_kv_rows,
    once per chunk, read by every layer's GemmInt4QkvRopeRows.

    Raises:
        LaunchError: an odd head_dim, or a buffer of the wrong size or dtype.
    """

    def __init__(self, rope_cs, inv_freq, prefill_state, *, rows: int, head_dim: int, stream: Stream | None = None):
        super().__init__(stream)
        require(head_dim % 2 == 0 and 2 <= head_dim <= 2048, f"rope_table: head_dim={head_dim} must be even, ≤ 2048")
        check_buffer(rope_cs, "rope_cs", rows * head_dim, np.float32)
        check_buffer(inv_freq, "inv_freq", head_dim // 2, np.float32)
        check_prefill_state(prefill_state)
        self.bytes_moved = rows * head_dim * 4
        # One thread per (row, pair).
        self._add(KernelRef("rope_kv", "rope_table_rows", pdl=True), (-(-rows * head_dim // 2 // THREADS),), (THREADS,),
                  dict(rope_cs=rope_cs, inv_freq=inv_freq, prefill_state=prefill_state, Dh=i32(head_dim)),
                  reads=(inv_freq, prefill_state), writes=(rope_cs,), bytes_moved=self.bytes_moved)
