"""Launchers of kernels/argmax.cu: the deterministic greedy argmax (larger logit wins, then the
lower index; a NaN never wins).

    ArgmaxFinal   next_token int32 [1] = index of the best (value, index) partial pair
                  (n_tokens = T: argmax_final_tokens, next_token [T] from pairs [T, P], grid (T))
    Argmax        argmax_partial + argmax_final over fp32 logits [V]
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, i32, mirrored, require
from .gemv_int4 import token_count  # the verify pass's bound on T, shared with its GEMVs

THREADS = mirrored("argmax", "ARGMAX_THREADS", 1024)


class ArgmaxFinal(Launcher):
    """next_token int32 [1] = the index of the best of n_partials (value fp32, index int32)
    pairs, e.g. those LmHead writes (one per 32 rows). n_tokens = T (1..16): next_token [T], token
    j's the best of its row of part_val / part_idx [T, n_partials] (LmHead's for T tokens).

    Raises:
        LaunchError: n_tokens outside 1..16, or a buffer of the wrong size or dtype.
    """

    def __init__(self, next_token, part_val, part_idx, *, n_partials: int, stream: Stream | None = None,
                 n_tokens: int | None = None):
        super().__init__(stream)
        t = token_count(n_tokens, "argmax_final")
        check_buffer(next_token, "next_token", t, np.int32)
        check_buffer(part_val, "part_val", t * n_partials, np.float32)
        check_buffer(part_idx, "part_idx", t * n_partials, np.int32)
        self.bytes_moved = t * (8 * n_partials + 4)
        kernel = "argmax_final" if n_tokens is None else "argmax_final_tokens"
        self._add(KernelRef("argmax", kernel, pdl=True), (t,), (THREADS,),
                  dict(next_token=next_token, part_val=part_val, part_idx=part_idx, P=i32(n_partials)),
                  reads=(part_val, part_idx), writes=(next_token,), bytes_moved=self.bytes_moved)


class Argmax(Launcher):
    """next_token int32 [1] = argmax(logits fp32 [V]) in two passes over `n_partials` blocks
    (scratch part_val fp32 / part_idx int32 [n_partials]).

    Raises:
        LaunchError: n_partials < 1, or a buffer of the wrong size or dtype.
    """

    def __init__(self, next_token, logits, part_val, part_idx, *, vocab_size: int, n_partials: int,
                 stream: Stream | None = None):
        super().__init__(stream)
        require(n_partials >= 1, f"argmax: n_partials={n_partials} must be >= 1")
        chunk = -(-vocab_size // n_partials)
        check_buffer(logits, "logits", vocab_size, np.float32)
        check_buffer(part_val, "part_val", n_partials, np.float32)
        check_buffer(part_idx, "part_idx", n_partials, np.int32)
        check_buffer(next_token, "next_token", 1, np.int32)
        self.bytes_moved = 4 * vocab_size + 16 * n_partials + 4
        self._add(KernelRef("argmax", "argmax_partial", pdl=True), (n_partials,), (THREADS,),
                  dict(part_val=part_val, part_idx=part_idx, logits=logits, V=i32(vocab_size), chunk=i32(chunk)),
                  reads=(logits,), writes=(part_val, part_idx), bytes_moved=4 * vocab_size + 8 * n_partials)
        self._add(KernelRef("argmax", "argmax_final", pdl=True), (1,), (THREADS,),
                  dict(next_token=next_token, part_val=part_val, part_idx=part_idx, P=i32(n_partials)),
                  reads=(part_val, part_idx), writes=(next_token,), bytes_moved=8 * n_partials + 4)
