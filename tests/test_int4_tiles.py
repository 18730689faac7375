"""format/int4_tiles.py, the INT4 weights' device layout, on the CPU.

tile_rows against its definition (the module docstring) written out as loops, and as the inverse
of the prefill GEMM's row → tile and slot (gemm_int4.cu's gemm_lane_row and
gemm_paired_lane_row, int4_matmul.cuh's int4_head_dim_slot); div_by's division by a reciprocal
exact in the range the kernels use; a permutation of the rows, with -1 only for the padding of
a last partial tile; each RoPE pair of a head in one tile, slots g and g + 8. to_tile_major word
for word against the definition (every position of a small matrix, sampled ones of the 7B's),
rows past N zero, a C-contiguous array of device_words(n, k) words; from_tile_major its inverse
at awkward and real shapes, plain and paired; the same weights dequantized through
format/quant.py from either side; the refusals (FormatError) of a bad pair_dim, dtype or shape.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.errors import FormatError
from drvqwen.format import quant
from drvqwen.format.int4_tiles import device_words, from_tile_major, tile_rows, to_tile_major

# (label, N, K, pair_dim): awkward plain shapes (N not a multiple of 16, one row, one group), the
# smallest pairing (Dh = 16: slots g and g + 8 are dims g and g + 8, the identity), a small one of
# several heads, and the 7B's and 0.5B's q/k/v (paired) and o/gate/down (plain).
SMALL = [("n333.k384", 333, 384, 0), ("n1.k128", 1, 128, 0), ("n17.k1152", 17, 1152, 0),
         ("n48.k128.dh16", 48, 128, 16), ("n96.k256.dh32", 96, 256, 32), ("n224.k512.dh32", 224, 512, 32)]
REAL = [("7b.q_proj", 3584, 3584, 128), ("7b.k_proj", 512, 3584, 128), ("7b.qkv", 4608, 3584, 128),
        ("0.5b.q_proj", 896, 896, 64), ("0.5b.k_proj", 128, 896, 64), ("7b.o_proj", 3584, 3584, 0),
        ("7b.gate_proj", 18944, 3584, 0), ("7b.down_proj", 3584, 18944, 0), ("0.5b.down_proj", 896, 4864, 0)]


def _ids(cases):
    return [c[0] for c in cases]


def _random_qweight(rng, n: int, k: int) -> np.ndarray:
    return rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)


def rows_by_loop(n: int, pair_dim: int) -> list[int]:
    """The module docstring's definition, position 16 j + m → matrix row (-1 past N), by loops."""
    tiles = -(-n // 16)
    out = []
    for j in range(tiles):
        for m in range(16):
            if pair_dim == 0:
                row = 16 * j + m
                out.append(row if row < n else -1)
                continue
            per_head = pair_dim // 16
            head, jj = j // per_head, j % per_head
            g = m % 8
            dim = 8 * jj + g + (pair_dim // 2 if m >= 8 else 0)
            out.append(head * pair_dim + dim)
    return out


def head_dim_slot(h: int, d: int, dh: int) -> tuple[int, int]:
    """int4_matmul.cuh's int4_head_dim_slot (with int4_pair_tile), line for line: the (tile, slot)
    of dim d of head h in a RoPE-paired matrix."""
    half = dh // 2
    upper = d >= half
    i = d - half if upper else d
    return h * (dh // 16) + i // 8, i % 8 + (8 if upper else 0)


def tile_slot(row: int, pair_dim: int) -> tuple[int, int]:
    """The (tile, slot) holding matrix row `row` as gemm_int4.cu's producer finds it, line for
    line: gemm_paired_lane_row (the head by div_by) for a RoPE-paired matrix, gemm_lane_row for a
    plain one."""
    if pair_dim > 0:
        head = div_by(row, div_reciprocal(pair_dim))
        return head_dim_slot(head, row - head * pair_dim, pair_dim)
    return row // 16, row % 16


def div_by(n: int, reciprocal: int) -> int:
    """int4_matmul.cuh's div_by: the high 32 bits of the 64-bit product (__umulhi)."""
    return (n * reciprocal) >> 32


def div_reciprocal(d: int) -> int:
    """int4_matmul.cuh's div_reciprocal: ⌊(2³² − 1)/d⌋ + 1 in 32 bits."""
    return (0xFFFFFFFF // d + 1) & 0xFFFFFFFF


@pytest.mark.parametrize("d", [2, 3, 7, 8, 24, 32, 40, 48, 64, 96, 128, 256])
def test_division_by_the_reciprocal_is_exact_where_the_kernels_use_it(d):
    """n / d as one multiply-high (the QKV GEMM producers' rows and RoPE pairs: n below a few
    hundred thousand, d a head dim or half of one) equals n // d for every n up to 2²⁰ and at the
    edge the proof allows (n·d < 2³²), and the reciprocal fits 32 bits."""
    r = div_reciprocal(d)
    assert 0 < r < 2**32
    n = np.arange(1 << 20, dtype=np.uint64)
    assert np.array_equal((n * np.uint64(r)) >> np.uint64(32), n // np.uint64(d))
    edge = (2**32 - 1) // d
    for m in range(max(0, edge - 1000), edge + 1):
        assert div_by(m, r) == m // d, (m, d)


@pytest.mark.parametrize("d", [24, 40, 48])
def test_the_reciprocal_division_fails_past_its_bound(d):
    """The bound is not slack: far past n·d < 2³² the multiply-high gives a wrong quotient for
    some n (so the exactness test above tests the formula, not a truism)."""
    r = div_reciprocal(d)
    assert any(div_by(m, r) != m // d for m in range(2**32 // d * 16, 2**32 // d * 16 + 4096))


@pytest.mark.parametrize("label,n,k,pair_dim", SMALL + REAL, ids=_ids(SMALL + REAL))
def test_tile_rows_is_the_definition(label, n, k, pair_dim):
    rows = tile_rows(n, pair_dim)
    assert rows.dtype == np.int64 and rows.shape == (-(-n // 16) * 16,)
    assert rows.tolist() == rows_by_loop(n, pair_dim)


@pytest.mark.parametrize("label,n,k,pair_dim", SMALL + REAL, ids=_ids(SMALL + REAL))
def test_tile_rows_is_a_permutation_and_the_kernels_slot_is_its_inverse(label, n, k, pair_dim):
    rows = tile_rows(n, pair_dim)
    real = rows[rows >= 0]
    assert np.array_equal(np.sort(real), np.arange(n)), "every row exactly once"
    pad = np.flatnonzero(rows < 0)
    assert (rows[rows < 0] == -1).all()
    # Padding only past the last row, and only in the last tile (paired shapes have none).
    assert pad.size == rows.size - n and (pad.size == 0 or (pad[0] == n and pad[-1] == rows.size - 1))
    assert pad.size < 16 and (pair_dim == 0 or pad.size == 0)
    position = {int(r): p for p, r in enumerate(rows) if r >= 0}
    for r in range(0, n, max(1, n // 997)):  # every row of the small ones, ~1000 of the large
        tile, slot = tile_slot(r, pair_dim)
        assert position[r] == 16 * tile + slot, (r, tile, slot)


@pytest.mark.parametrize("n,pair_dim", [(96, 32), (224, 32), (512, 128), (896, 64), (4608, 128), (48, 16)])
def test_a_rope_pair_shares_a_tile(n, pair_dim):
    """Dims i and i + Dh/2 of a head (the two values RoPE rotates together) sit in slots g and
    g + 8 of one tile: one lane of the GEMV holds both."""
    rows = tile_rows(n, pair_dim).reshape(-1, 16)
    half = pair_dim // 2
    lo, hi = rows[:, :8], rows[:, 8:]
    assert (hi - lo == half).all()
    assert (lo // pair_dim == hi // pair_dim).all(), "both of one head"
    assert (lo % pair_dim < half).all()
    # The pairing differs from the plain order wherever a head has more than one tile.
    assert (pair_dim == 16) == np.array_equal(rows.reshape(-1), tile_rows(n, 0))


def _check_positions(tiles, qweight, rows, positions):
    """tiles[j, g, m, :] is group g's 16 words of row rows[16 j + m], zeros where that is -1."""
    for j, g, m in positions:
        r = rows[16 * j + m]
        want = np.zeros(16, np.uint32) if r < 0 else qweight[r, 16 * g:16 * g + 16]
        assert np.array_equal(tiles[j, g, m], want), (j, g, m, r)


@pytest.mark.parametrize("label,n,k,pair_dim", SMALL, ids=_ids(SMALL))
def test_to_tile_major_word_for_word(rng, label, n, k, pair_dim):
    qweight = _random_qweight(rng, n, k)
    tiles = to_tile_major(qweight, pair_dim)
    t, groups = -(-n // 16), k // 128
    assert tiles.shape == (t, groups, 16, 16) and tiles.dtype == np.uint32 and tiles.flags.c_contiguous
    assert tiles.size == device_words(n, k)
    _check_positions(tiles, qweight, rows_by_loop(n, pair_dim),
                     [(j, g, m) for j in range(t) for g in range(groups) for m in range(16)])
    # An item is 1 KiB of contiguous memory: item (j, g) starts (j · K/128 + g) · 256 words in.
    flat = tiles.reshape(-1)
    j, g = t - 1, groups - 1
    assert np.array_equal(flat[(j * groups + g) * 256:(j * groups + g + 1) * 256], tiles[j, g].reshape(-1))


@pytest.mark.parametrize("label,n,k,pair_dim", REAL, ids=_ids(REAL))
def test_to_tile_major_at_the_real_shapes(rng, label, n, k, pair_dim):
    qweight = _random_qweight(rng, n, k)
    tiles = to_tile_major(qweight, pair_dim)
    assert tiles.shape == (n // 16, k // 128, 16, 16) and tiles.size == device_words(n, k) == qweight.size
    positions = [(0, 0, 0), (n // 16 - 1, k // 128 - 1, 15)] + [
        (int(rng.integers(n // 16)), int(rng.integers(k // 128)), int(rng.integers(16))) for _ in range(200)]
    _check_positions(tiles, qweight, rows_by_loop(n, pair_dim), positions)
    assert np.array_equal(from_tile_major(tiles, n, pair_dim), qweight)


def test_rows_past_n_are_zero():
    """Whatever the last row holds, the padding of the last tile is zero words."""
    n, k = 333, 384
    qweight = np.full((n, k // 8), 0xFFFFFFFF, np.uint32)
    tiles = to_tile_major(qweight)
    last = tiles[-1]                               # rows 320 … 335: 13 real, 3 padding
    assert (last[:, :n - 320] == 0xFFFFFFFF).all() and (last[:, n - 320:] == 0).all()
    assert (tiles[:-1] == 0xFFFFFFFF).all()
    assert device_words(n, k) == 336 * 48 == tiles.size


@pytest.mark.parametrize("label,n,k,pair_dim", SMALL + REAL[:5], ids=_ids(SMALL + REAL[:5]))
def test_from_tile_major_inverts_to_tile_major(rng, label, n, k, pair_dim):
    qweight = _random_qweight(rng, n, k)
    back = from_tile_major(to_tile_major(qweight, pair_dim), n, pair_dim)
    assert back.dtype == np.uint32 and back.shape == qweight.shape
    assert np.array_equal(back, qweight)
    # The inverse of another row order does not give the weights back.
    if pair_dim > 16:
        assert not np.array_equal(from_tile_major(to_tile_major(qweight, pair_dim), n, 0), qweight)


@pytest.mark.parametrize("n,k,pair_dim", [(333, 384, 0), (96, 256, 32), (512, 896, 64)])
def test_the_device_layout_dequantizes_to_the_same_weights(rng, n, k, pair_dim):
    """Quantized weights (format/quant.py) in the device layout: the inverse dequantizes to the
    file's weights bit for bit, and each item's words, unpacked, are group g of its rows — the
    same nibbles, moved whole."""
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    qweight, scales = quant.quantize_packed(w)
    want = quant.dequantize(qweight, scales)
    tiles = to_tile_major(qweight, pair_dim)
    assert np.array_equal(quant.dequantize(from_tile_major(tiles, n, pair_dim), scales), want)
    rows = tile_rows(n, pair_dim)
    for j in range(tiles.shape[0]):
        for g in range(k // 128):
            items = tiles[j, g]                                   # [16 slots, 16 words]
            real = rows[16 * j:16 * j + 16] >= 0
            r = rows[16 * j:16 * j + 16][real]
            codes = quant.unpack(items[real])                     # [rows, 128]
            got = quant.dequantize_codes(codes, scales[r, g:g + 1])
            assert np.array_equal(got, want[r, 128 * g:128 * g + 128]), (j, g)
            assert (items[~real] == 0).all()


@pytest.mark.parametrize("n,pair_dim", [(64, -16), (64, 8), (64, 24), (64, 48), (96, 64), (333, 16), (40, 32)])
def test_a_bad_pair_dim_is_refused(n, pair_dim):
    with pytest.raises(FormatError, match=f"pair_dim {pair_dim} must be a positive multiple of 16 dividing the {n} rows"):
        tile_rows(n, pair_dim)
    qweight = np.zeros((n, 16), np.uint32)
    with pytest.raises(FormatError, match=f"pair_dim {pair_dim}"):
        to_tile_major(qweight, pair_dim)
    with pytest.raises(FormatError, match=f"pair_dim {pair_dim}"):
        from_tile_major(np.zeros((-(-n // 16), 1, 16, 16), np.uint32), n, pair_dim)


@pytest.mark.parametrize("bad", [np.zeros((32, 16), np.int32), np.zeros((32, 16), np.float32),
                                 np.zeros((32, 16), np.uint16), np.zeros(512, np.uint32),
                                 np.zeros((2, 16, 16), np.uint32), np.zeros((32, 8), np.uint32),
                                 np.zeros((32, 24), np.uint32)],
                         ids=["int32", "float32", "uint16", "1-D", "3-D", "k64", "k192"])
def test_to_tile_major_refuses_other_arrays(bad):
    with pytest.raises(FormatError, match=r"want uint32 \[N, K/128 · 16\] with K a multiple of 128"):
        to_tile_major(bad)


@pytest.mark.parametrize("bad,n", [(np.zeros((2, 1, 16, 16), np.int32), 32), (np.zeros((3, 1, 16, 16), np.uint32), 32),
                                   (np.zeros((2, 1, 16, 2), np.uint32), 32), (np.zeros((2, 1, 8, 16), np.uint32), 32),
                                   (np.zeros((32, 16), np.uint32), 32), (np.zeros((2, 1, 16, 16), np.uint32), 33)],
                         ids=["int32", "tiles-for-48-rows", "2-words", "8-slots", "file-layout", "n33"])
def test_from_tile_major_refuses_other_arrays(bad, n):
    with pytest.raises(FormatError, match=r"want uint32 \[\d+, K/128, 16, W\] with W in \(4, 8, 16\)"):
        from_tile_major(bad, n)


def test_device_words():
    assert device_words(333, 384) == 336 * 384 // 8
    assert device_words(1, 128) == 16 * 16
    assert device_words(3584, 18944) == 3584 * 18944 // 8
    assert device_words(16, 128) == device_words(1, 128) and device_words(17, 128) == 2 * device_words(16, 128)


@pytest.mark.parametrize("n,k,words", [(333, 384, 8), (17, 1152, 4), (16, 128, 8), (1, 256, 4)])
def test_a_plane_of_other_group_words_tile_major(rng, n, k, words):
    """The high-bit planes of the 5- and 6-bit formats (4 or 8 words a row and 128-input group,
    kernels/weight_formats.cuh): word w of row r at (r − r % 16)·(K/128)·W + (w / W)·16W +
    (r % 16)·W + w % W of the flat array, rows past N zero, from_tile_major the inverse."""
    plane = rng.integers(0, 2**32, size=(n, k // 128 * words), dtype=np.uint32)
    tiles = to_tile_major(plane, 0, words)
    assert tiles.shape == (-(-n // 16), k // 128, 16, words) and tiles.size == device_words(n, k, words)
    flat = tiles.reshape(-1)
    r, w = np.meshgrid(np.arange(n), np.arange(plane.shape[1]), indexing="ij")
    at = (r - r % 16) * (k // 128) * words + (w // words) * 16 * words + (r % 16) * words + w % words
    assert np.array_equal(flat[at], plane)
    rest = np.ones(flat.size, bool)
    rest[at.reshape(-1)] = False
    assert not flat[rest].any(), "the padding rows are zeros"
    assert np.array_equal(from_tile_major(tiles, n), plane)
