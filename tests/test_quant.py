"""INT4 g128 quantizer and layout id 1: exact pack/unpack, the error bound, and the GPU's
magic-number unpack of one 32-bit word emulated bit for bit in numpy."""

import numpy as np
import pytest

from drvqwen.format import quant


@pytest.mark.parametrize("shape", [(1, 128), (7, 256), (96, 896), (33, 4864)])
def test_pack_unpack_roundtrip_exact(rng, shape):
    q = rng.integers(-8, 8, size=shape, dtype=np.int8)
    qw = quant.pack(q)
    assert qw.dtype == np.uint32 and qw.shape == (shape[0], shape[1] // 8)
    np.testing.assert_array_equal(quant.unpack(qw), q)


def test_quantize_within_bound(rng):
    # std 0.02 like HF's init, plus outlier rows/groups and an all-zero group.
    w = (rng.standard_normal((64, 896)) * 0.02).astype(np.float32)
    w[3, 5] = 1.5
    w[10, 128:256] = 0.0
    qw, s = quant.quantize_packed(w)
    w_hat = quant.dequantize(qw, s)
    err = np.abs(w - w_hat)
    bound = quant.error_bound(w, s)
    assert (err <= bound).all(), f"max excess {np.max(err - bound)}"
    # Each group's RMS error stays within the plain max/7 quantizer's step / 2.
    rms = np.sqrt(np.mean(np.square(w - w_hat).reshape(64, 7, 128), axis=2))
    assert (rms <= quant.group_rms_bound(w)).all()
    # The default scale max/7 never clips: every error is within half a step, and the
    # outlier maps exactly to +7 steps.
    assert (err <= np.repeat(s.astype(np.float32), 128, axis=1) / 2 * (1 + 1e-6)).all()
    assert np.isclose(w_hat[3, 5], 1.5, rtol=1e-3)
    assert (w_hat[10, 128:256] == 0).all()
    e = quant.reconstruction_error(w, w_hat)
    # Relative error of Gaussian weights with s = max/7: about 0.12 (uniform noise of step s
    # over a signal of std ~ max/3); anything far above means broken rounding.
    assert e["rel_l2"] < 0.2


def test_clip_search_lowers_weight_error_within_bounds(rng):
    w = (rng.standard_normal((32, 512)) * 0.02).astype(np.float32)
    q, s = quant.quantize(w, alphas=quant.CLIP_SEARCH)
    w_hat = quant.dequantize_codes(q, s)
    assert (np.abs(w - w_hat) <= quant.error_bound(w, s)).all()
    rms = np.sqrt(np.mean(np.square(w - w_hat).reshape(32, 4, 128), axis=2))
    assert (rms <= quant.group_rms_bound(w)).all()
    plain = quant.reconstruction_error(w, quant.dequantize_codes(*quant.quantize(w)))
    search = quant.reconstruction_error(w, w_hat)
    print("search", search, "plain", plain)
    assert search["rel_l2"] < plain["rel_l2"]


def test_reconstruction_error_by_blocks_of_rows_is_the_whole_s(rng):
    """The converter checks a weight a block of rows at a time; the figures are those of the
    whole weight, computed here directly in float64."""
    w = rng.standard_normal((37, 256)).astype(np.float32)
    w_hat = quant.dequantize_codes(*quant.quantize(w))
    d = w.astype(np.float64) - w_hat
    rel = np.sqrt(np.sum(d * d) / np.sum(w.astype(np.float64) ** 2))
    e = quant.reconstruction_error_rows((w[r:r + 5], w_hat[r:r + 5]) for r in range(0, 37, 5))
    assert e["rel_l2"] == pytest.approx(rel, rel=1e-12) and e["max_abs"] == np.abs(d).max()
    assert e["snr_db"] == pytest.approx(-20 * np.log10(rel), rel=1e-12)
    assert quant.reconstruction_error(w, w)["rel_l2"] == 0.0


def test_codes_range_and_bad_shapes(rng):
    w = rng.standard_normal((4, 256)).astype(np.float32)
    q, s = quant.quantize(w)
    assert q.min() >= -8 and q.max() <= 7 and s.dtype == np.float16 and s.shape == (4, 2)
    with pytest.raises(ValueError):
        quant.quantize(rng.standard_normal((4, 100)).astype(np.float32))
    with pytest.raises(ValueError):
        quant.pack(np.full((1, 8), 9, np.int8))


def _half(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def test_magic_number_unpack_matches_layout(rng):
    """The kernel's lop3/OR-into-1024.0 unpack, done in numpy on whole arrays of words,
    yields inputs 0..7 in order: the layout and the kernel agree."""
    q = rng.integers(-8, 8, size=(16, 1024), dtype=np.int8)
    words = quant.pack(q).astype(np.uint32)
    magic = np.uint32(0x64006400)
    out = []
    for w in (words, words >> np.uint32(8)):
        lo = (w & np.uint32(0x000F000F)) | magic          # nibbles p, p+4 → 1024 + v
        hi = (w & np.uint32(0x00F000F0)) | magic          # nibbles p+1, p+5 → 1024 + 16 v
        out.append((_half(lo & 0xFFFF) - 1032, _half(lo >> 16) - 1032))
        out.append((_half(hi & 0xFFFF) / 16 - 72, _half(hi >> 16) / 16 - 72))
    got = np.stack([x for pair in out for x in pair], axis=-1).reshape(q.shape)
    np.testing.assert_array_equal(got, q.astype(np.float32))
