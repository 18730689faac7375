"""Launchers of kernels/weight_layout.cu: an INT4 weight rearranged into the device layout, the
per-tensor formats' 4–6-bit codes and high bits (rows plain), and the q4_k/q5_k scales.

    Int4TileMajor      dst uint32 [ceil(N/16), K/128, 16, W] = to_tile_major(src uint32 [N, K/128 · W],
                       pair_dim, W)  (format/int4_tiles.py; W = group_words: 16 for codes, 4 or 8
                       for the high bits of the 5- and 6-bit formats)
    KQuantLaneWords    lanes uint32 [N, K/256, 4] = to_lane_words(scales uint8 [N, K/256, 12],
                       superscales fp16 [N, K/256, 2]) (format/kquant_lanes.py)
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from ..format.int4_tiles import GROUP_WORDS, PLANE_WORDS, TILE_ROWS, device_words
from ..format.quant import GROUP_SIZE
from .base import KernelRef, Launcher, check_buffer, i32, mirrored, require

THREADS = mirrored("weight_layout", "WL_THREADS", 256)


class Int4TileMajor(Launcher):
    """dst = the device layout of src (layout id 1 codes, or any plane of group_words words a row
    and 128-input group) with rows in order pair_dim (0: plain; the head dim: RoPE-paired, for
    an INT4 model's q_proj, k_proj and v_proj). src and dst must not overlap.

    Raises:
        LaunchError: K not a multiple of 128, N < 1, pair_dim not 0 or a multiple of 16 dividing N,
            group_words not 4, 8 or 16, 2^32 words or more, or a buffer of the wrong size or dtype.
    """

    def __init__(self, dst, src, *, n: int, k: int, pair_dim: int = 0, group_words: int = GROUP_WORDS,
                 stream: Stream | None = None):
        super().__init__(stream)
        require(n >= 1 and k > 0 and k % GROUP_SIZE == 0, f"int4_to_tile_major: [{n}, {k}]: K must be a multiple of {GROUP_SIZE}")
        require(pair_dim == 0 or (pair_dim > 0 and pair_dim % TILE_ROWS == 0 and n % pair_dim == 0),
                f"int4_to_tile_major: pair_dim {pair_dim} must be 0 or a multiple of {TILE_ROWS} dividing N={n}")
        require(group_words in PLANE_WORDS, f"int4_to_tile_major: group_words {group_words} must be one of {PLANE_WORDS}")
        row_words = k // GROUP_SIZE * group_words
        padded = device_words(n, k, group_words)
        require(padded < 2**32, f"int4_to_tile_major: [{n}, {k}] of {group_words} words a group: {padded} words, the "
                                f"kernel indexes them in 32 bits")
        check_buffer(src, "src", n * row_words, np.uint32)
        check_buffer(dst, "dst", padded, np.uint32)
        vectors = padded // 4
        self.bytes_moved = 4 * (n * row_words + padded)
        self._add(KernelRef("weight_layout", "int4_to_tile_major"), (-(-vectors // THREADS),), (THREADS,),
                  dict(dst=dst, src=src, N=i32(n), K=i32(k), pair_dim=i32(pair_dim), group_vecs=i32(group_words // 4)),
                  reads=(src,), writes=(dst,), bytes_moved=self.bytes_moved)


class KQuantLaneWords(Launcher):
    """lanes (uint32 [N, K/256, 4], any shape of 4·S words) = the lane words of a q4_k/q5_k
    weight's scales (uint8 [N, K/256, 12]) and superscales (fp16 [N, K/256, 2]), S super-blocks
    (format/kquant_lanes.py: to_lane_words). lanes must not overlap the other two.

    Raises:
        LaunchError: no super-block, 2^31 scale words or more (3 a super-block), or a buffer of the
            wrong size or dtype.
    """

    def __init__(self, lanes, scales, superscales, *, supers: int, stream: Stream | None = None):
        super().__init__(stream)
        require(supers >= 1 and 3 * supers < 2**31,
                f"kquant_scales_to_lanes: {supers} super-blocks: need 1 and fewer than 2^31 / 3 (32-bit indices)")
        check_buffer(lanes, "lanes", 4 * supers, np.uint32)
        check_buffer(scales, "scales", 12 * supers, np.uint8)
        check_buffer(superscales, "superscales", 2 * supers, np.float16)
        self.bytes_moved = 2 * 16 * supers
        self._add(KernelRef("weight_layout", "kquant_scales_to_lanes"), (-(-supers // THREADS),), (THREADS,),
                  dict(lanes=lanes, scales=scales, aux=superscales, supers=i32(supers)),
                  reads=(scales, superscales), writes=(lanes,), bytes_moved=self.bytes_moved)
