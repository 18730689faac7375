"""format/kquant_lanes.py, the q4_k/q5_k scales' device layout (lane words), on the CPU.

to_lane_words against its definition written out field by field (word t: sc_t, m_t, sc_{t+4},
m_{t+4} in 6 bits each from weight_formats.get_scale_min, byte t of (d, dmin) on top) over random
bytes (every bit pattern of the 12 packed bytes is a valid block: 96 bits = 16 six-bit values);
the four words of a super-block together, uint32 [..., 4]; from_lane_words its inverse;
device_parts and device_tensors making q4_k's and q5_k's scales one lane-word plane (and only
theirs); the refusal of arrays that are not the same super-blocks, and of words not [..., 4].
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.errors import FormatError
from drvqwen.format import weight_formats as wf
from drvqwen.format.kquant_lanes import from_lane_words, to_lane_words


def _random(rng, shape):
    scales = rng.integers(0, 256, shape + (12,), dtype=np.uint8)
    superscales = rng.integers(0, 1 << 16, shape + (2,), dtype=np.uint16).view(np.float16)
    return scales, superscales


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (16, 14)])
def test_lane_words_match_their_definition(rng, shape):
    scales, superscales = _random(rng, shape)
    words = to_lane_words(scales, superscales)
    assert words.shape == shape + (4,) and words.dtype == np.uint32
    sc, m = wf.get_scale_min(scales)
    d_bytes = np.ascontiguousarray(superscales).view(np.uint8)          # [..., 4]: D_0 … D_3
    for idx in np.ndindex(*shape):
        for t in range(4):
            w = int(words[idx + (t,)])
            fields = (w & 63, (w >> 6) & 63, (w >> 12) & 63, (w >> 18) & 63, w >> 24)
            want = (sc[idx + (t,)], m[idx + (t,)], sc[idx + (t + 4,)], m[idx + (t + 4,)], d_bytes[idx + (t,)])
            assert fields == tuple(int(x) for x in want), (idx, t)


def test_from_lane_words_inverts_them(rng):
    scales, superscales = _random(rng, (7, 9))
    back_sc, back_ss = from_lane_words(to_lane_words(scales, superscales))
    assert back_sc.tobytes() == scales.tobytes() and back_ss.tobytes() == superscales.tobytes()
    assert back_sc.shape == scales.shape and back_ss.shape == superscales.shape


def test_device_parts_rearrange_the_k_quants_with_a_min_only(rng):
    from drvqwen.launchers.gemv_fmt import DENSE_F16, device_parts, device_tensors, lane_word_scales

    assert not lane_word_scales(DENSE_F16)
    for fid, fmt in wf.FORMATS.items():
        parts = wf.random_weight(fmt, 32, 512, rng)
        dev = device_parts(fmt, parts)
        tensors = device_tensors(fmt, "w", 32, 512)
        assert set(dev) == {t.rsplit(".", 1)[1] for t in tensors}, fmt.name
        assert lane_word_scales(fmt) == (fmt.name in ("q4_k", "q5_k")), fmt.name
        if lane_word_scales(fmt):
            want = to_lane_words(parts["scales"], parts["superscales"])
            assert dev["scales"].tobytes() == want.tobytes()
            assert tensors["w.scales"] == (np.dtype(np.uint32), (32, 2, 4)) == (dev["scales"].dtype, dev["scales"].shape)
            assert "superscales" not in dev and "superscales" in parts
        else:
            assert tensors == fmt.tensors("w", 32, 512)
            if "scales" in parts:
                assert dev["scales"] is parts["scales"]


@pytest.mark.parametrize("sc_shape,ss_shape", [((4, 2, 12), (4, 3, 2)), ((4, 2, 11), (4, 2, 2)),
                                               ((4, 2, 12), (4, 2))])
def test_arrays_of_other_super_blocks_are_refused(sc_shape, ss_shape):
    with pytest.raises(FormatError, match="not .* of the same super-blocks"):
        to_lane_words(np.zeros(sc_shape, np.uint8), np.zeros(ss_shape, np.float16))


@pytest.mark.parametrize("words", [np.zeros((4, 3), np.uint32), np.zeros((4, 4), np.int32), np.zeros((), np.uint32)])
def test_words_not_four_a_super_block_are_refused(words):
    with pytest.raises(FormatError, match="is not uint32"):
        from_lane_words(words)
