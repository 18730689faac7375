"""Launcher of kernels/attention_prefill.cu: causal GQA attention of a prompt chunk over the
paged KV cache.

    AttentionPrefill   out fp16 [rows, Hq, Dh] = causal softmax(q Kᵀ/√Dh) V for the chunk's rows
                       r < n_rows at positions start + r (prefill_state)
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .attention_decode import check_attention_shapes
from .base import KernelRef, Launcher, check_buffer, check_prefill_state, i32, mirrored

Q_TILE = mirrored("attention_prefill", "APF_QTILE", 16)        # queries per block (M of the MMA)
KV_TILE = mirrored("attention_prefill", "APF_KV_TILE", 64)     # positions per pipeline step (4 pages)
STAGES = mirrored("attention_prefill", "APF_STAGES", 2)


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory: stages × (K, V) × 64 token rows of Dh fp16 padded by 16 bytes."""
    return STAGES * 2 * KV_TILE * (2 * head_dim + 16)


mirrored("attention_prefill", "ApfShape<64>::SMEM_BYTES", smem_bytes(64))
mirrored("attention_prefill", "ApfShape<128>::SMEM_BYTES", smem_bytes(128))


class AttentionPrefill(Launcher):
    """out fp16 [rows, Hq, Dh] = causal attention of q fp16 [rows, Hq, Dh] over one layer's
    paged cache [P, Hkv, 16, Dh], rows r < prefill_state[1] at positions prefill_state[0] + r.

    Raises:
        LaunchError: unsupported head_dim or GQA group, or a buffer of the wrong size or dtype.
    """

    def __init__(self, out, q, k_cache, v_cache, block_table, prefill_state, *, rows: int, n_heads: int,
                 n_kv_heads: int, head_dim: int, stream: Stream | None = None):
        super().__init__(stream)
        check_attention_shapes("attention_prefill", n_heads, n_kv_heads, head_dim)
        check_buffer(out, "out", rows * n_heads * head_dim, np.float16)
        check_buffer(q, "q", rows * n_heads * head_dim, np.float16)
        check_prefill_state(prefill_state)
        self.n_heads, self.head_dim = n_heads, head_dim
        self._add(KernelRef("attention_prefill", f"attention_prefill_hd{head_dim}", pdl=True), (-(-rows // Q_TILE), n_kv_heads),
                  (32 * (n_heads // n_kv_heads),),
                  dict(out=out, q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                       prefill_state=prefill_state, Hq=i32(n_heads), Hkv=i32(n_kv_heads)),
                  smem_bytes=smem_bytes(head_dim), reads=(q, k_cache, v_cache, block_table, prefill_state),
                  writes=(out,))

    def flops_for(self, start: int, n_rows: int) -> int:
        """QKᵀ and PV multiply-adds actually needed (causal) for a chunk, ×2 FLOPs each."""
        keys = n_rows * start + n_rows * (n_rows + 1) // 2
        return 2 * 2 * self.n_heads * self.head_dim * keys
