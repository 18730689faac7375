"""Launchers of kernels/attention_decode.cu: paged GQA decode attention, split-KV.

    AttentionDecode   out fp16 [Hq, Dh] = softmax(q Kᵀ/√Dh) V over positions < state[2]
                      two launches: attention_decode_hd{Dh} (one partial per split) and
                      attention_combine (the partials merged, in a fixed order)

Split-KV ("flash-decoding"): the NS = S × (warps per block) splits of each KV head divide its
pages; each writes a partial result that attention_combine merges:

    partial_out  fp32 [NS, Hq, Dh]   Σ_t e^(s_t − m) v_t over the split's positions (unnormalised)
    max_logits   fp32 [NS, Hq]       m, the split's largest scaled score (log2 units)
    exp_sums     fp32 [NS, Hq]       Σ_t e^(s_t − m)

(the names vLLM's paged attention uses).

`n_tokens=T` (T ≤ 16) plans the verify pass of speculative decoding: the `…_tokens` kernels, q,
out and the partials [T, …], token j the query at position state[0] + j over the first
state[2] + j keys (causal inside the chunk), each token's output bit for bit the single-token
kernels' at that length (attention_decode.cu, "T tokens"). The splits run on the single-token
launch's grid (S, Hkv), whose warps share out the (token, split) pairs that hold pages, and the
combine once per token (grid (Hq, T)): NS, the one launch parameter in the arithmetic, is the
same.

The attention kernels call griddepcontrol.wait first, but the decode step launches them
without programmatic dependent launch: measured on the H200 (synthetic 7B, `drvqwen bench`
graph ITL, one run), PDL on every decode kernel gave 2.605 ms, PDL on every kernel but
attention 2.138 ms, no PDL 2.366 ms — launched early, the split kernel's blocks (96 KiB of
stages each, two per SM) take the SMs' shared memory while they wait, and the launches around
them lose more than attention gains. The same holds for the combine alone: launched as a
programmatic dependent that lets its own dependents launch only at its exit (a compile-time
switch of commit 6c9e276), the 7B's graph ITL was 2.211 / 2.204 ms against 2.170 / 2.182
at 512 tokens and 2.824 / 2.839 against 2.674 / 2.677 at 16384, the 0.5B's 0.676 / 0.676
against 0.642 / 0.657 at 512 (in turns in one run,
docs/bench/2026-12-04_6c9e276_h200_{syn7b,syn05b}_fused_combine_2.json). The warp-specialised TMA kernel
(attention_decode_tma.py, the default) writes the same partials and shares the combine and
the split rule here; this plain kernel stays the reference and the fallback.
"""

from __future__ import annotations

import math

import numpy as np

from ..cuda import Stream
from ..kv_cache import PAGE_TOKENS
from .base import (DEFAULT_OCCUPANCY, KernelRef, Launcher, Occupancy, check_buffer, check_state, i32, mirrored,
                   require)
from .gemv_int4 import token_count  # the verify pass's bound on T, shared with its GEMVs

WARPS = mirrored("attention_decode", "ATTN_WARPS", 4)                 # warps (= splits) per block
MAX_GROUP = mirrored("attention_decode", "ATTN_MAX_GROUP", 8)         # query heads per KV head (MMA rows)
COMBINE_THREADS = mirrored("attention_decode", "ATTN_COMBINE_THREADS", 1024)
# The single-token combine's blocks per head (each a contiguous C-th of the dims, 1024 / C
# threads; the output's bits do not depend on C: attention_decode.cu, attention_combine_dims).
COMBINE_MIN_SPLIT = mirrored("attention_decode", "ATTN_COMBINE_MIN_SPLIT", 4)
COMBINE_MAX_SPLIT = mirrored("attention_decode", "ATTN_COMBINE_MAX_SPLIT", 32)  # a block of ≥ one warp
COMBINE_SPLIT = 4
HEAD_DIMS = (64, 128)                                                 # the kernels' instantiations
# The split rule's short-context terms (attention_decode.cuh, attn_pages_per_split).
SHORT_SPLITS = mirrored("attention_decode", "ATTN_SHORT_SPLITS", 128)
SHORT_MAX_PAGES = mirrored("attention_decode", "ATTN_SHORT_MAX_PAGES", 4)


def pages_per_split(n_pages: int, n_splits: int) -> int:
    """Pages per split of a KV head for n_pages pages over n_splits splits: the kernels' split
    rule (attention_decode.cuh, attn_pages_per_split), for the tests and tools that need to know
    which splits hold data (the active ones: ceil(n_pages / pages_per_split))."""
    spread = -(-n_pages // n_splits)
    short = min(SHORT_MAX_PAGES, -(-n_pages // SHORT_SPLITS))
    return max(1, spread, short)


def split_blocks_per_kv_head(n_kv_heads: int, max_tokens: int, blocks_per_sm: int, splits_per_block: int,
                             sm_count: int) -> int:
    """S, blocks per KV head of a split-KV decode attention grid (S, Hkv).

    Every resident block slot of the GPU gets a block (blocks_per_sm × SMs over the KV heads),
    because a split's page loop is latency-bound: more splits, fewer pages each. But no split
    gets less than one page at the longest context (it would only idle). At 7B on an H200
    (132 SMs, 2 blocks per SM): S = 66, 264 splits per KV head.
    """
    max_pages = -(-max_tokens // PAGE_TOKENS)
    by_sms = -(-max(1, blocks_per_sm) * sm_count // n_kv_heads)
    by_pages = -(-max_pages // splits_per_block)
    return max(1, min(by_sms, by_pages))


def partial_shapes(n_heads: int, head_dim: int, blocks_per_kv_head: int,
                   splits_per_block: int = WARPS, n_tokens: int | None = None) -> dict[str, tuple[int, ...]]:
    """Shapes of the fp32 split-KV partials (module doc) for a grid of blocks_per_kv_head blocks;
    with n_tokens = T, T of them, [T, …]."""
    n_splits = blocks_per_kv_head * splits_per_block
    lead = () if n_tokens is None else (n_tokens,)
    return {"partial_out": (*lead, n_splits, n_heads, head_dim), "max_logits": (*lead, n_splits, n_heads),
            "exp_sums": (*lead, n_splits, n_heads)}


def blocks_per_kv_head(n_kv_heads: int, max_tokens: int, head_dim: int, occupancy: Occupancy | None = None) -> int:
    """S for attention_decode_hd{head_dim} (split_blocks_per_kv_head with its occupancy)."""
    occ = occupancy or DEFAULT_OCCUPANCY
    per_sm = occ.blocks_per_sm(KernelRef("attention_decode", f"attention_decode_hd{head_dim}"), 32 * WARPS, 0)
    return split_blocks_per_kv_head(n_kv_heads, max_tokens, per_sm, WARPS, occ.sm_count)


def check_attention_shapes(kernel: str, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """The shapes both decode attention kernels are built for.

    Raises:
        LaunchError: head_dim not in HEAD_DIMS, or Hq/Hkv not an integer in 1..MAX_GROUP.
    """
    require(head_dim in HEAD_DIMS, f"{kernel} is built for head_dim in {HEAD_DIMS}, got {head_dim}")
    require(n_kv_heads >= 1 and n_heads % n_kv_heads == 0 and 1 <= n_heads // n_kv_heads <= MAX_GROUP,
            f"{kernel}: {n_heads} query heads over {n_kv_heads} KV heads; groups of 1..{MAX_GROUP} supported")


def check_partials(partials, n_heads: int, head_dim: int, blocks_per_kv_head: int, splits_per_block: int,
                   n_tokens: int | None = None) -> None:
    """partials = (partial_out, max_logits, exp_sums) against partial_shapes(...)."""
    shapes = partial_shapes(n_heads, head_dim, blocks_per_kv_head, splits_per_block, n_tokens)
    for (what, shape), buf in zip(shapes.items(), partials):
        check_buffer(buf, what, math.prod(shape), np.float32)


def partial_args(partials) -> dict:
    """partials = (partial_out, max_logits, exp_sums) as the split kernels' first arguments, by name."""
    return dict(zip(("partial_out", "max_logits", "exp_sums"), partials, strict=True))


def combine_launch(launcher: Launcher, out, partials, state, *, n_splits: int, n_heads: int, head_dim: int,
                   n_tokens: int | None = None, dim_split: int = COMBINE_SPLIT) -> None:
    """Add attention_combine to `launcher`: out fp16 [Hq, Dh] from the partials of n_splits splits,
    grid (Hq, dim_split) of COMBINE_THREADS / dim_split threads (n_tokens = T:
    attention_combine_tokens, out [T, Hq, Dh] from [T, …] partials, grid (Hq, T) of
    COMBINE_THREADS). The same bits for every dim_split (attention_decode.cu).

    Raises:
        LaunchError: dim_split outside COMBINE_MIN_SPLIT … COMBINE_MAX_SPLIT or not dividing head_dim.
    """
    partial_out, max_logits, exp_sums = partials
    t = token_count(n_tokens, "attention_decode")
    require(COMBINE_MIN_SPLIT <= dim_split <= COMBINE_MAX_SPLIT and head_dim % dim_split == 0
            and COMBINE_THREADS % dim_split == 0,
            f"attention_combine: dim_split={dim_split}; want a divisor of head_dim={head_dim} from "
            f"{COMBINE_MIN_SPLIT} to {COMBINE_MAX_SPLIT} (a block of at least one warp)")
    if n_tokens is None:
        kernel, grid, threads = "attention_combine", (n_heads, dim_split), COMBINE_THREADS // dim_split
    else:
        kernel, grid, threads = "attention_combine_tokens", (n_heads, t), COMBINE_THREADS
    launcher._add(KernelRef("attention_decode", kernel), grid, (threads,),
                  dict(out=out, partial_out=partial_out, max_logits=max_logits, exp_sums=exp_sums, state=state,
                       n_splits=i32(n_splits), Hq=i32(n_heads), Dh=i32(head_dim)),
                  smem_bytes=2 * 4 * n_splits, reads=(*partials, state), writes=(out,),
                  bytes_moved=t * (n_splits * n_heads * (head_dim + 2) * 4 + n_heads * head_dim * 2))


class AttentionDecode(Launcher):
    """out fp16 [Hq, Dh] = softmax(q Kᵀ/√Dh) V over positions < state[2] of one layer's paged
    cache (k_cache / v_cache [P, Hkv, 16, Dh]), by the plain kernel.

    partials: (partial_out, max_logits, exp_sums), fp32 scratch of partial_shapes(...);
    blocks_per_kv_head fixes the grid (graph-friendly): see `blocks_per_kv_head`.
    n_tokens = T (1..16): the T-token kernels (module doc), q and out fp16 [T, Hq, Dh], the
    partials of partial_shapes(..., n_tokens=T); token j attends to positions < state[2] + j.

    Raises:
        LaunchError: unsupported head_dim or GQA group, n_tokens outside 1..16, or a buffer of
            the wrong size or dtype.
    """

    def __init__(self, out, q, k_cache, v_cache, block_table, state, partials, *, n_heads: int,
                 n_kv_heads: int, head_dim: int, blocks_per_kv_head: int, stream: Stream | None = None,
                 n_tokens: int | None = None):
        super().__init__(stream)
        check_attention_shapes("attention_decode", n_heads, n_kv_heads, head_dim)
        self.n_tokens = t = token_count(n_tokens, "attention_decode")
        check_partials(partials, n_heads, head_dim, blocks_per_kv_head, WARPS, n_tokens)
        check_buffer(out, "out", t * n_heads * head_dim, np.float16)
        check_buffer(q, "q", t * n_heads * head_dim, np.float16)
        check_state(state)
        self.n_splits = blocks_per_kv_head * WARPS
        self.kv_bytes_per_token = 2 * n_kv_heads * head_dim * 2  # K and V, fp16
        # T tokens: the single-token grid, the same NS per token; its warps share out the
        # (token, split) pairs that hold pages (attention_decode.cu, the tokens kernels' schedule).
        args = dict(partial_args(partials), q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                    state=state, Hq=i32(n_heads), Hkv=i32(n_kv_heads))
        kernel = f"attention_decode_hd{head_dim}"
        if n_tokens is not None:
            kernel, args["n_tokens"] = f"attention_decode_tokens_hd{head_dim}", i32(t)
        self._add(KernelRef("attention_decode", kernel), (blocks_per_kv_head, n_kv_heads), (32 * WARPS,), args,
                  reads=(q, k_cache, v_cache, block_table, state), writes=partials)
        combine_launch(self, out, partials, state, n_splits=self.n_splits, n_heads=n_heads, head_dim=head_dim,
                       n_tokens=n_tokens)

    def bytes_for(self, seq_len: int) -> int:
        """KV bytes read at a given length of token 0 (token j reads seq_len + j positions; the
        partials are L2 traffic, not counted)."""
        return sum(seq_len + j for j in range(self.n_tokens)) * self.kv_bytes_per_token
