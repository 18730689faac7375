"""Launcher of kernels/attention_decode_cluster.cu: short-context paged decode attention in one
launch.

    AttentionDecodeCluster   out fp16 [Hq, Dh] = softmax(q Kᵀ/√Dh) V over positions < state[2]
                             attention_decode_cluster_hd{Dh}: one cluster of CLUSTER blocks per KV
                             head, WARPS splits a block, the splits merged in the cluster's shared
                             memory (no partials in global memory, no combine launch)

The splits are those of attention_decode.cu (the same split rule and per-page arithmetic) over
NS = CLUSTER · WARPS splits a KV head; the merge is two-level (a block's warps, then the
cluster's blocks), so its bits differ from the two-launch kernels' (both against the float64
reference: tests/test_kernel_attention_decode_cluster.py). Only CLUSTER · Hkv blocks run, so it
is built for short contexts, where the two-launch kernels pay two latency chains for few bytes.
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .attention_decode import check_attention_shapes
from .base import KernelRef, Launcher, check_buffer, check_state, i32, mirrored, require

CLUSTER = mirrored("attention_decode_cluster", "ACL_CLUSTER", 8)  # blocks per KV head: one cluster
WARPS = mirrored("attention_decode_cluster", "ACL_WARPS", 8)      # warps (= splits) per block
N_SPLITS = CLUSTER * WARPS                                         # splits per KV head (the default build)


class AttentionDecodeCluster(Launcher):
    """out fp16 [Hq, Dh] = softmax(q Kᵀ/√Dh) V over positions < state[2] of one layer's paged
    cache (k_cache / v_cache [P, Hkv, 16, Dh] fp16, block_table int32, state int32 [3]), in one
    launch of grid (CLUSTER, Hkv), block 32 · WARPS. `defines`: compile-time choices of the kernel
    (tests: (("ACL_POISON_SMEM", 1),), NaN in its merge buffers before the splits run;
    (("ACL_CLUSTER", 16),): clusters of 16 blocks, the grid's x with them — the decode step's
    second short-context band, decode.default_short_attention).

    Raises:
        LaunchError: unsupported head_dim or GQA group (attention_decode's), or a buffer of the
            wrong size or dtype.
    """

    def __init__(self, out, q, k_cache, v_cache, block_table, state, *, n_heads: int, n_kv_heads: int,
                 head_dim: int, stream: Stream | None = None, defines: tuple[tuple[str, int], ...] = ()):
        super().__init__(stream)
        check_attention_shapes("attention_decode_cluster", n_heads, n_kv_heads, head_dim)
        check_buffer(out, "out", n_heads * head_dim, np.float16)
        check_buffer(q, "q", n_heads * head_dim, np.float16)
        check_state(state)
        cluster = int(dict(defines).get("ACL_CLUSTER", CLUSTER))
        require(1 <= cluster <= 16, f"attention_decode_cluster: ACL_CLUSTER={cluster}, want 1..16")
        self.n_splits = cluster * WARPS
        self.kv_bytes_per_token = 2 * n_kv_heads * head_dim * 2  # K and V, fp16
        self._add(KernelRef("attention_decode_cluster", f"attention_decode_cluster_hd{head_dim}", tuple(defines)),
                  (cluster, n_kv_heads), (32 * WARPS,),
                  dict(out=out, q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, state=state,
                       Hq=i32(n_heads), Hkv=i32(n_kv_heads)),
                  reads=(q, k_cache, v_cache, block_table, state), writes=(out,))

    def clusters_at_once(self) -> int:
        """Clusters of this launch the GPU runs at once (Function.max_active_clusters; loads the
        kernel). Fewer than its Hkv clusters and some KV heads wait for others to finish: the
        step then keeps this kernel for no band (decode.default_short_attention).

        Raises:
            CudaError: the driver refused the query (no usable GPU).
        """
        spec = self.specs[0]
        return spec.kernel.function().max_active_clusters((*spec.grid, 1, 1)[:3], spec.block[0])

    def bytes_for(self, seq_len: int) -> int:
        """KV bytes read at a given length."""
        return seq_len * self.kv_bytes_per_token
