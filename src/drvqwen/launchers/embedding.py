"""Launchers of kernels/embedding.cu: the token embedding into the FP32 residual stream.

    Embedding       residual fp32 [D]    = embed[state[1]]      (decode: token id from device state)
    EmbeddingRows   residual fp32 [T, D] = embed[ids[t]]        (prefill)
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, check_state, i32, mirrored, require

THREADS = mirrored("embedding", "EMBEDDING_THREADS", 256)


def _grid_x(dim: int) -> int:
    """Blocks per row: one thread per 16-byte chunk (8 fp16) of the row."""
    return -(-(dim // 8) // THREADS)


def _check_dim(dim: int) -> None:
    require(dim > 0 and dim % 8 == 0, f"embedding: D={dim} must be a positive multiple of 8")


class Embedding(Launcher):
    """residual fp32 [D] = embed fp16 [V, D] row state[1] (the token id is read on the GPU).

    Raises:
        LaunchError: D not a multiple of 8, or a buffer of the wrong size or dtype.
    """

    def __init__(self, residual, embed, state, *, vocab_size: int, dim: int, stream: Stream | None = None):
        super().__init__(stream)
        _check_dim(dim)
        check_buffer(residual, "residual", dim, np.float32)
        check_buffer(embed, "embed", vocab_size * dim, np.float16)
        check_state(state)
        self.bytes_moved = dim * (2 + 4)
        self._add(KernelRef("embedding", "embedding", pdl=True), (_grid_x(dim),), (THREADS,),
                  dict(residual=residual, embed=embed, state=state, V=i32(vocab_size), D=i32(dim)),
                  reads=(embed, state), writes=(residual,), bytes_moved=self.bytes_moved)


class EmbeddingRows(Launcher):
    """residual fp32 [T, D] = embed[ids[t]] for T token ids in a device int32 [T] array.

    Raises:
        LaunchError: D not a multiple of 8, or a buffer of the wrong size or dtype.
    """

    def __init__(self, residual, embed, ids, *, n_rows: int, vocab_size: int, dim: int,
                 stream: Stream | None = None):
        super().__init__(stream)
        _check_dim(dim)
        check_buffer(residual, "residual", n_rows * dim, np.float32)
        check_buffer(embed, "embed", vocab_size * dim, np.float16)
        check_buffer(ids, "ids", n_rows, np.int32)
        self.bytes_moved = n_rows * dim * (2 + 4)
        self._add(KernelRef("embedding", "embedding_rows"), (_grid_x(dim), n_rows), (THREADS,),
                  dict(residual=residual, embed=embed, ids=ids, V=i32(vocab_size), D=i32(dim)),
                  reads=(embed, ids), writes=(residual,), bytes_moved=self.bytes_moved)
