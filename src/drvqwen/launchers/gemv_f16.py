"""Launcher of kernels/gemv_f16.cu: the FP16 lm_head GEMV (mma.sync) with the first pass of the argmax.

    LmHead   logits fp32 [V] = W fp16 [V, D] · x fp16 [D] (−inf for the rows from text_vocab
             on: the padding no token has), and per 32 rows the best (value, index) pair →
             part_val fp32 / part_idx int32 [ceil(V/32)]

One block per 32 rows (two 16-row MMA tiles, each over 4 warps that split K), 256 threads.
`n_tokens=T` (T ≤ 16), the verify pass of speculative decoding: gemv_f16_lm_head_tokens in the
single-token launch's grid and block, x [T, D], logits [T, V], the partials [T, ceil(V/32)],
each token's bit for bit the single-token kernel's (gemv_f16.cu, "T tokens"). One build serves
every T: at LM_TOKENS = 16 the T-token kernel still runs two blocks per SM (gemv_f16.cu,
"Registers").
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, i32, mirrored, require
from .gemv_int4 import token_count  # the verify pass's bound on T, shared with its GEMVs

ROWS_PER_BLOCK = mirrored("gemv_f16", "LM_ROWS_PER_BLOCK", 32)
THREADS = mirrored("gemv_f16", "LM_WARPS * 32", 256)
TOKENS = mirrored("gemv_f16", "LM_TOKENS", 16)  # tokens gemv_f16_lm_head_tokens is built for
mirrored("gemv_f16", "LM_TILES * LM_TILE_ROWS", ROWS_PER_BLOCK)  # two 16-row MMA tiles per block


def lm_head_partials(vocab_size: int) -> int:
    """Number of (value, index) partials LmHead writes: one per ROWS_PER_BLOCK rows."""
    return -(-vocab_size // ROWS_PER_BLOCK)


class LmHead(Launcher):
    """logits fp32 [V] = W x and the per-block argmax partials (see the module doc).

    text_vocab: rows below it are token ids; the rows from it up to vocab_size are the
    lm_head's padding, whose logits are −inf so that neither the argmax nor the sampler can
    choose them (default vocab_size: every row is a token).
    n_tokens = T (1..16): the T-token kernel (module doc), logits fp32 [T, V], part_val /
    part_idx [T, ceil(V/32)], x fp16 [T, D].

    Raises:
        LaunchError: D not a multiple of 8, text_vocab outside [1, vocab_size], n_tokens outside
            1..16, or a buffer of the wrong size or dtype.
    """

    def __init__(self, logits, part_val, part_idx, x, weight, *, vocab_size: int, dim: int,
                 text_vocab: int | None = None, stream: Stream | None = None, n_tokens: int | None = None):
        super().__init__(stream)
        require(dim > 0 and dim % 8 == 0, f"lm_head: D={dim} must be a positive multiple of 8")
        n_valid = vocab_size if text_vocab is None else int(text_vocab)
        require(1 <= n_valid <= vocab_size, f"lm_head: text_vocab={n_valid} must be in [1, {vocab_size}]")
        self.text_vocab = n_valid
        t = token_count(n_tokens, "lm_head")
        require(t <= TOKENS, f"lm_head: n_tokens={t} must be within 1..{TOKENS}")
        n_part = lm_head_partials(vocab_size)
        check_buffer(logits, "logits", t * vocab_size, np.float32)
        check_buffer(part_val, "part_val", t * n_part, np.float32)
        check_buffer(part_idx, "part_idx", t * n_part, np.int32)
        check_buffer(x, "x", t * dim, np.float16)
        check_buffer(weight, "weight", vocab_size * dim, np.float16)
        self.n_partials = n_part
        self.bytes_moved = vocab_size * dim * 2 + t * (2 * dim + 4 * vocab_size)
        args = dict(logits=logits, part_val=part_val, part_idx=part_idx, x=x, weight=weight, V=i32(vocab_size),
                    D=i32(dim), n_valid=i32(n_valid))
        kernel = "gemv_f16_lm_head" if n_tokens is None else "gemv_f16_lm_head_tokens"
        if n_tokens is not None:
            args["n_tokens"] = i32(t)
        self._add(KernelRef("gemv_f16", kernel, pdl=True), (n_part,), (THREADS,), args,
                  reads=(x, weight), writes=(logits, part_val, part_idx), bytes_moved=self.bytes_moved)
