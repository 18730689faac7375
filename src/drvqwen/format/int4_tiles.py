"""The INT4 weights' device layout: the `.nanoqwen` file's layout id 1 rearranged tile-major.

The file stores an INT4 g128 projection as layout id 1 (format/quant.py): qweight uint32
[N, K/8], row-major, 16 words (64 B) per row and 128-input group. The GPU's INT4 kernels
(kernels/gemv_int4.cu, gemm_int4.cu) read it rearranged, in the same words and nibbles:

    tiles uint32 [ceil(N/16), K/128, 16, 16]
        [j, g, m, :] = the 16 words of group g of matrix row tile_rows(N, pair_dim)[16 j + m]
                       (zeros where that is -1: rows past N)

One (tile, group) item — the 16 rows of a 16-row weight tile in one group — is 1 KiB of
contiguous memory, where layout id 1 spreads it over 16 pieces of 64 B, K/2 bytes apart. The
decode GEMV loads an item per group and warp (two 16-byte loads a lane: 512 contiguous bytes each
instead of 8 pieces of 64 B in 8 DRAM rows), and the synthetic 7B's decode step took 6 % less
in a timing probe of it (kernels/int4_matmul.cuh says where the figures are). The rows of an item are in the
order of the kernels' MMA rows (int4_matmul.cuh: gemv_tile_rows):

    pair_dim = 0   plain: slot m of tile j is row 16 j + m (o_proj, gate_proj, up_proj, down_proj)
    pair_dim = Dh  RoPE-paired: slots g and g + 8 (g < 8) of tile j are dims 8 jj + g and
                   8 jj + g + Dh/2 of head j // (Dh/16), jj = j % (Dh/16) (q_proj, k_proj, v_proj)

so the item's slots are the rows a GEMV tile multiplies, in its order, and a RoPE pair lands in
one lane. The scales stay as in the file ([N, K/128], row-major).

The per-tensor formats' 4–6-bit codes (qweight uint32 [N, K/8], the same words) take this layout
too with pair_dim 0, and their high bits (qhigh: W = 4 words a row and group for 5-bit codes,
8 for 6-bit) the same way, [ceil(N/16), K/128, 16, W] (`to_tile_major(plane, 0, W)`;
kernels/weight_formats.cuh says why).

The file keeps layout id 1 (the CPU reference and every other reader of the file read it as such);
the weights are rearranged on the GPU when a model is loaded (gpu_weights.py, kernels/
weight_layout.cu), and the kernel tests upload `to_tile_major(qweight, pair_dim)`.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError

TILE_ROWS = 16      # rows of a weight tile: the M of the m16n8k16 MMA
GROUP_WORDS = 16    # uint32 words of a row per 128-input group
PLANE_WORDS = (4, 8, 16)  # the planes' words a row and group: 5-, 6-bit high bits, 4-bit codes


def tile_rows(n: int, pair_dim: int = 0) -> np.ndarray:
    """int64 [ceil(n/16) · 16]: the matrix row at each (tile, slot) position of the device
    layout (position 16 j + m), -1 past the last row.

    Raises:
        FormatError: pair_dim not 0 or a positive multiple of 16 that divides n.
    """
    tiles = -(-n // TILE_ROWS)
    pos = np.arange(tiles * TILE_ROWS, dtype=np.int64)
    if pair_dim == 0:
        return np.where(pos < n, pos, -1)
    if pair_dim < 0 or pair_dim % TILE_ROWS or n % pair_dim:
        raise FormatError(f"INT4 device layout: pair_dim {pair_dim} must be a positive multiple of "
                          f"{TILE_ROWS} dividing the {n} rows")
    j, m = pos // TILE_ROWS, pos % TILE_ROWS
    per_head = pair_dim // TILE_ROWS
    head, jj = j // per_head, j % per_head
    return head * pair_dim + 8 * jj + m % 8 + (m >= 8) * (pair_dim // 2)


def to_tile_major(qweight: np.ndarray, pair_dim: int = 0, group_words: int = GROUP_WORDS) -> np.ndarray:
    """A plane of W = group_words words a row and 128-input group → the device layout: layout id 1
    qweight uint32 [N, K/8] (W = 16) → uint32 [ceil(N/16), K/128, 16, 16] (module docstring), rows
    past N zero. With another W, any plane of W words a row and
    128-input group, [N, K/128 · W] → [ceil(N/16), K/128, 16, W] the same way (the per-tensor
    formats' high bits: W = 4 for 5-bit codes, 8 for 6-bit; kernels/weight_formats.cuh).

    Raises:
        FormatError: not a uint32 [N, K/128 · W] array (K a multiple of 128), or a bad pair_dim.
    """
    if group_words not in PLANE_WORDS:
        raise FormatError(f"INT4 device layout: {group_words} words a row and group, want one of {PLANE_WORDS}")
    if qweight.dtype != np.uint32 or qweight.ndim != 2 or qweight.shape[1] % group_words:
        raise FormatError(f"INT4 device layout: qweight {qweight.dtype} {list(qweight.shape)}, want uint32 "
                          f"[N, K/128 · {group_words}] with K a multiple of 128")
    n, kw = qweight.shape
    rows = tile_rows(n, pair_dim)
    padded = np.zeros((rows.size, kw), np.uint32)
    padded[rows >= 0] = qweight[rows[rows >= 0]]
    return np.ascontiguousarray(padded.reshape(-1, TILE_ROWS, kw // group_words, group_words).transpose(0, 2, 1, 3))


def from_tile_major(tiles: np.ndarray, n: int, pair_dim: int = 0) -> np.ndarray:
    """The inverse of `to_tile_major`: uint32 [ceil(n/16), K/128, 16, W] → [n, K/128 · W].

    Raises:
        FormatError: an array of another shape or dtype, or a bad pair_dim.
    """
    t = -(-n // TILE_ROWS)
    if (tiles.dtype != np.uint32 or tiles.ndim != 4 or tiles.shape[0] != t or tiles.shape[2] != TILE_ROWS
            or tiles.shape[3] not in PLANE_WORDS):
        raise FormatError(f"INT4 device layout: {tiles.dtype} {list(tiles.shape)}, want uint32 [{t}, K/128, 16, W] "
                          f"with W in {PLANE_WORDS}")
    kw = tiles.shape[1] * tiles.shape[3]
    flat = tiles.transpose(0, 2, 1, 3).reshape(t * TILE_ROWS, kw)
    rows = tile_rows(n, pair_dim)
    out = np.empty((n, kw), np.uint32)
    out[rows[rows >= 0]] = flat[rows >= 0]
    return out


def device_words(n: int, k: int, group_words: int = GROUP_WORDS) -> int:
    """uint32 words of an [n, k] INT4 matrix in the device layout (rows padded to a tile); with
    group_words W, of a plane of W words a row and 128-input group."""
    return -(-n // TILE_ROWS) * TILE_ROWS * (k // 128) * group_words
