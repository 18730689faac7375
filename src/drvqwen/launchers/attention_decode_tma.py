"""Launcher of kernels/attention_decode_tma.cu: warp-specialised paged decode attention.

    AttentionDecodeTma   out fp16 [Hq, Dh] = softmax(q Kᵀ/√Dh) V over positions < state[2]
                         attention_decode_tma_hd{Dh} (one producer warp issuing TMA copies of K/V
                         pages into an mbarrier ring, four consumer warps = four splits per block)
                         + attention_combine of attention_decode.cu (same partials)

The K/V pages are read through TMA descriptors of the whole pools (KVCache.tensor_map), built
once; `layer_page0` = layer × pages per layer selects the layer.
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from ..kv_cache import PAGE_TOKENS
from .attention_decode import (MAX_GROUP, check_attention_shapes, check_partials, combine_launch, partial_args,
                               split_blocks_per_kv_head)
from .base import DEFAULT_OCCUPANCY, KernelRef, Launcher, Occupancy, check_buffer, check_state, i32, mirrored, require

CONSUMERS = mirrored("attention_decode_tma", "ATMA_CONSUMERS", 4)   # consumer warps (= splits) per block
STAGES = mirrored("attention_decode_tma", "ATMA_STAGES", 3)         # ring stages per consumer warp
THREADS = mirrored("attention_decode_tma", "ATMA_THREADS", 32 * (CONSUMERS + 1))   # + the producer warp


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of attention_decode_tma, its whole footprint: consumers × stages ×
    (K page + V page) of one head, 16 × Dh fp16 each (96 KiB at Dh = 128, 48 KiB at Dh = 64),
    then the consumers' p [16][8] and alpha [8] fp32 and 2 mbarriers per stage."""
    stages = CONSUMERS * STAGES * 2 * PAGE_TOKENS * head_dim * 2
    return stages + CONSUMERS * (PAGE_TOKENS + 1) * MAX_GROUP * 4 + 2 * CONSUMERS * STAGES * 8


mirrored("attention_decode_tma", "AtmaShape<64>::SMEM_BYTES", smem_bytes(64))
mirrored("attention_decode_tma", "AtmaShape<128>::SMEM_BYTES", smem_bytes(128))


def blocks_per_kv_head(n_kv_heads: int, max_tokens: int, head_dim: int, occupancy: Occupancy | None = None) -> int:
    """S for attention_decode_tma_hd{head_dim}: every resident block slot (2 blocks per SM at
    Dh = 128 with 96 KiB of stages, 4 at Dh = 64 on an H200), no more splits than pages."""
    occ = occupancy or DEFAULT_OCCUPANCY
    per_sm = occ.blocks_per_sm(KernelRef("attention_decode_tma", f"attention_decode_tma_hd{head_dim}"),
                               THREADS, smem_bytes(head_dim))
    return split_blocks_per_kv_head(n_kv_heads, max_tokens, per_sm, CONSUMERS, occ.sm_count)


class AttentionDecodeTma(Launcher):
    """out fp16 [Hq, Dh] = softmax(q Kᵀ/√Dh) V over positions < state[2], by the TMA kernel.

    k_map / v_map: tensor maps of the whole K and V pools (TensorMap or TensorMapSpec; 2-D
    [rows, Dh] fp16 with a [16, Dh] box); partials: (partial_out, max_logits, exp_sums) of
    attention_decode.partial_shapes(..., CONSUMERS).

    Raises:
        LaunchError: unsupported head_dim or GQA group, a tensor map of the wrong box, dtype or
            size for layer_page0, or a buffer of the wrong size or dtype.
    """

    def __init__(self, out, q, k_map, v_map, block_table, state, partials, *, n_heads: int, n_kv_heads: int,
                 head_dim: int, blocks_per_kv_head: int, layer_page0: int = 0, stream: Stream | None = None,
                 k_cache=None, v_cache=None):
        super().__init__(stream)
        check_attention_shapes("attention_decode_tma", n_heads, n_kv_heads, head_dim)
        for what, m in (("k_map", k_map), ("v_map", v_map)):
            require(tuple(m.box) == (PAGE_TOKENS, head_dim) and np.dtype(m.dtype) == np.float16,
                    f"attention_decode_tma: {what} has box {list(m.box)} {np.dtype(m.dtype)}, "
                    f"want [{PAGE_TOKENS}, {head_dim}] float16")
            require((layer_page0 * n_kv_heads + 1) * PAGE_TOKENS <= m.shape[0],
                    f"attention_decode_tma: {what} has {m.shape[0]} rows, too few for layer_page0={layer_page0}")
        check_partials(partials, n_heads, head_dim, blocks_per_kv_head, CONSUMERS)
        check_buffer(out, "out", n_heads * head_dim, np.float16)
        check_buffer(q, "q", n_heads * head_dim, np.float16)
        check_state(state)
        self.n_splits = blocks_per_kv_head * CONSUMERS
        self.kv_bytes_per_token = 2 * n_kv_heads * head_dim * 2  # K and V, fp16
        # The tensor maps read the whole pools; the layer's views (k_cache, v_cache), when given,
        # name what the launch reads.
        kv_reads = tuple(c for c in (k_cache, v_cache) if c is not None) or (k_map, v_map)
        self._add(KernelRef("attention_decode_tma", f"attention_decode_tma_hd{head_dim}"),
                  (blocks_per_kv_head, n_kv_heads), (THREADS,),
                  dict(partial_args(partials), q=q, k_map=k_map, v_map=v_map, block_table=block_table, state=state,
                       Hq=i32(n_heads), Hkv=i32(n_kv_heads), layer_page0=i32(layer_page0)),
                  smem_bytes=smem_bytes(head_dim), reads=(q, *kv_reads, block_table, state), writes=partials)
        combine_launch(self, out, partials, state, n_splits=self.n_splits, n_heads=n_heads, head_dim=head_dim)

    def bytes_for(self, seq_len: int) -> int:
        """KV bytes read at a given length (the partials are L2 traffic, not counted)."""
        return seq_len * self.kv_bytes_per_token
