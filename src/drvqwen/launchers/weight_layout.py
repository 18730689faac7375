"""Launcher of kernels/weight_layout.cu: an INT4 weight rearranged into the device layout.

    Int4TileMajor   dst uint32 [ceil(N/16), K/128, 16, 16] = to_tile_major(src uint32 [N, K/8], pair_dim)
                    (format/int4_tiles.py)
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from ..format.int4_tiles import TILE_ROWS, device_words
from ..format.quant import GROUP_SIZE
from .base import KernelRef, Launcher, check_buffer, i32, mirrored, require

THREADS = mirrored("weight_layout", "WL_THREADS", 256)


class Int4TileMajor(Launcher):
    """dst = the device layout of src (layout id 1) with rows in order pair_dim (0: plain; the
    head dim: RoPE-paired, for q_proj, k_proj and v_proj). src and dst must not overlap.

    Raises:
        LaunchError: K not a multiple of 128, N < 1, pair_dim not 0 or a multiple of 16 dividing N,
            or a buffer of the wrong size or dtype.
    """

    def __init__(self, dst, src, *, n: int, k: int, pair_dim: int = 0, stream: Stream | None = None):
        super().__init__(stream)
        require(n >= 1 and k > 0 and k % GROUP_SIZE == 0, f"int4_to_tile_major: [{n}, {k}]: K must be a multiple of {GROUP_SIZE}")
        require(pair_dim == 0 or (pair_dim > 0 and pair_dim % TILE_ROWS == 0 and n % pair_dim == 0),
                f"int4_to_tile_major: pair_dim {pair_dim} must be 0 or a multiple of {TILE_ROWS} dividing N={n}")
        check_buffer(src, "src", n * k // 8, np.uint32)
        check_buffer(dst, "dst", device_words(n, k), np.uint32)
        vectors = device_words(n, k) // 4
        self.bytes_moved = n * k // 2 + device_words(n, k) * 4
        self._add(KernelRef("weight_layout", "int4_to_tile_major"), (-(-vectors // THREADS),), (THREADS,),
                  dict(dst=dst, src=src, N=i32(n), K=i32(k), pair_dim=i32(pair_dim)),
                  reads=(src,), writes=(dst,), bytes_moved=self.bytes_moved)
