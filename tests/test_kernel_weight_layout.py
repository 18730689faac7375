"""kernels/weight_layout.cu (launchers.weight_layout.Int4TileMajor): an INT4 weight rearranged
into the device layout on the GPU, bit for bit what format/int4_tiles.py's to_tile_major gives;
KQuantLaneWords: a q4_k/q5_k weight's scales and superscales written as one plane of lane
words, bit for bit format/kquant_lanes.py's to_lane_words.

GPU: random words (every bit pattern, so a word moved to the wrong place or a nibble reordered
shows) at awkward shapes (N not a multiple of 16: the last tile's padding must be written as
zeros; one row; one group) and the real ones (the 7B's q and k and its stacked q/k/v rows
RoPE-paired by head dim 128, the 0.5B's by 64, the 7B's gate_proj and down_proj plain), into a
destination poisoned with 0xFF bytes; the source left as it was. And GPUWeights on an INT4
model: every projection's qweight on the device is to_tile_major of the file's (q, k and v
paired by the head dim), every other tensor the file's bytes, through either uploader.

CPU: the launch (one thread per 16-byte vector of the destination; for the lane words one per
super-block) and the refusals of a bad shape, pair_dim or buffer.

test_int4_tile_major_matches_the_host[n333.k384] and [n96.k256.dh32], and
test_kquant_lane_words_match_the_host[n17.k768], are the cases compute-sanitizer runs
(tools/sanitize_nodes.txt).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.format.int4_tiles import device_words, from_tile_major, to_tile_major
from drvqwen.format.kquant_lanes import to_lane_words
from drvqwen.launchers import BufferSpec, LaunchError
from kernel_testing import dev  # noqa: F401

# (label, N, K, pair_dim)
CASES = [("n333.k384", 333, 384, 0), ("n1.k128", 1, 128, 0), ("n17.k1152", 17, 1152, 0),
         ("n96.k256.dh32", 96, 256, 32), ("7b.q_proj", 3584, 3584, 128), ("7b.k_proj", 512, 3584, 128),
         ("7b.qkv", 4608, 3584, 128), ("0.5b.q_proj", 896, 896, 64), ("7b.gate_proj", 18944, 3584, 0),
         ("7b.down_proj", 3584, 18944, 0)]


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    """Where the first differing word of two device-layout arrays is: (tile, group, slot, word)."""
    i = int(np.flatnonzero(got.reshape(-1) != want.reshape(-1))[0])
    where = np.unravel_index(i, want.shape)
    return f"[tile, group, slot, word] = {list(map(int, where))}: got {got.reshape(-1)[i]:#010x}, want " \
           f"{want.reshape(-1)[i]:#010x}"


# The high-bit planes of the per-tensor formats: (label, N, K, words a row and 128-input group)
HIGH_CASES = [("q6k.n333.k384", 333, 384, 8), ("q5.n17.k1152", 17, 1152, 4), ("q6k.7b.down_proj", 3584, 18944, 8),
              ("q5.0.5b.gate_proj", 4864, 896, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("label,n,k,words", HIGH_CASES, ids=[c[0] for c in HIGH_CASES])
def test_high_bit_planes_tile_major_match_the_host(dev, rng, label, n, k, words):
    """The 5- and 6-bit formats' high bits (4 or 8 words a row and 128-input group), rows plain:
    bit for bit to_tile_major(plane, 0, words), rows past N zero, the source unchanged."""
    from drvqwen.launchers.weight_layout import Int4TileMajor

    plane = rng.integers(0, 2**32, size=(n, k // 128 * words), dtype=np.uint32)
    want = to_tile_major(plane, 0, words)
    src = dev.upload("src", plane)
    dst = dev.poisoned("dst", want.shape, np.uint32)
    Int4TileMajor(dst, src, n=n, k=k, group_words=words).launch()
    got = dst.download()
    assert got.size == device_words(n, k, words)
    assert got.tobytes() == want.tobytes(), f"{label}: {_first_difference(got, want)}"
    assert np.array_equal(from_tile_major(got, n), plane)
    assert src.download().tobytes() == plane.tobytes(), f"{label}: the source changed"


@pytest.mark.gpu
@pytest.mark.parametrize("label,n,k,pair_dim", CASES, ids=[c[0] for c in CASES])
def test_int4_tile_major_matches_the_host(dev, rng, label, n, k, pair_dim):
    from drvqwen.launchers.weight_layout import Int4TileMajor

    qweight = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    want = to_tile_major(qweight, pair_dim)
    src = dev.upload("src", qweight)
    dst = dev.poisoned("dst", want.shape, np.uint32)
    ln = Int4TileMajor(dst, src, n=n, k=k, pair_dim=pair_dim)
    ln.launch()
    got = dst.download()
    assert got.shape == want.shape and got.size == device_words(n, k)
    assert got.tobytes() == want.tobytes(), f"{label}: {_first_difference(got, want)}"
    assert np.array_equal(from_tile_major(got, n, pair_dim), qweight)
    assert src.download().tobytes() == qweight.tobytes(), f"{label}: the source changed"
    # Again over the result of the first launch: the same bits (every word written, none read from dst).
    dst.fill_bytes(0x5A)
    ln.launch()
    assert dst.download().tobytes() == want.tobytes(), f"{label}: a second launch differs"


# q4_k/q5_k scales as lane words: (label, N, K) — one super-block, awkward rows, the 7B's gate_proj
# and down_proj, the 0.5B's down_proj (its only K a multiple of 256).
LANE_CASES = [("n1.k256", 1, 256), ("n17.k768", 17, 768), ("7b.gate_proj", 18944, 3584),
              ("7b.down_proj", 3584, 18944), ("0.5b.down_proj", 896, 4864)]


@pytest.mark.gpu
@pytest.mark.parametrize("label,n,k", LANE_CASES, ids=[c[0] for c in LANE_CASES])
def test_kquant_lane_words_match_the_host(dev, rng, label, n, k):
    """Random scale bytes and superscales (every bit pattern: 12 packed bytes are always eight
    valid (sc, m)) into a poisoned lane-word plane: bit for bit to_lane_words of them, the sources
    unchanged."""
    from drvqwen.launchers.weight_layout import KQuantLaneWords

    scales = rng.integers(0, 256, size=(n, k // 256, 12), dtype=np.uint8)
    superscales = rng.integers(0, 1 << 16, size=(n, k // 256, 2), dtype=np.uint16).view(np.float16)
    want = to_lane_words(scales, superscales)
    sc, ss = dev.upload("scales", scales), dev.upload("superscales", superscales)
    lanes = dev.upload("lanes", np.full((n, k // 256, 4), 0xA5A5A5A5, np.uint32))
    KQuantLaneWords(lanes, sc, ss, supers=n * k // 256).launch()
    got = lanes.download()
    assert got.shape == want.shape
    bad = np.flatnonzero(got.reshape(-1, 4) != want.reshape(-1, 4))
    assert bad.size == 0, f"{label}: lane word {int(bad[0]) % 4} of super-block {int(bad[0]) // 4} differs"
    assert sc.download().tobytes() == scales.tobytes() and ss.download().tobytes() == superscales.tobytes()


def _download_through_each_uploader(f, monkeypatch):
    """GPUWeights of the open file `f` through each uploader this machine has (registered host
    memory where it can be mapped read-only, else staging only): yields (uploader, {name: the
    device array downloaded}), the weights freed before the next."""
    from drvqwen import startup
    from drvqwen.cuda import read_only_register_supported
    from drvqwen.gpu_weights import GPUWeights

    for via in ("registered", "staging") if read_only_register_supported() else ("staging",):
        monkeypatch.setenv(startup.UPLOAD, via)
        w = GPUWeights(f)
        try:
            got = {name: arr.download() for name, arr in w.arrays.items()}
        finally:
            w.close()
        yield via, got


@pytest.mark.gpu
def test_gpu_weights_hold_the_int4_projections_in_the_device_layout(tmp_path, rng, monkeypatch):
    """A tiny INT4 model (head_dim 64, 4 q heads and 2 k/v heads, N = 128 … 384) through
    GPUWeights with each uploader: a projection's qweight holds the words of
    to_tile_major(file's, pair_dim) in the file's shape, with pair_dim the head dim for q_proj,
    k_proj and v_proj and 0 for the others; every other tensor
    (scales, biases, norms, the embedding and lm_head) is the file's bytes in the file's shape."""
    from drvqwen.format.nanoqwen import NanoqwenFile
    from helpers import TINY, random_dense, write_model

    path = tmp_path / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng))
    with NanoqwenFile(path) as f:
        projections = [i.name for i in f if i.name.startswith("model.layers.") and i.name.endswith(".qweight")]
        assert len(projections) == 7 * TINY.num_layers
        for via, got in _download_through_each_uploader(f, monkeypatch):
            assert set(got) == {i.name for i in f}
            for info in f:
                file = np.asarray(f.tensor(info.name))
                if info.name in projections:
                    pair_dim = TINY.head_dim if info.name.split(".")[-2] in ("q_proj", "k_proj", "v_proj") else 0
                    want = to_tile_major(file, pair_dim)  # in the file's shape on the device
                else:
                    want = file
                assert got[info.name].shape == file.shape, (via, info.name)
                assert got[info.name].tobytes() == want.tobytes(), (via, info.name)


# ---- CPU: the launch and the refusals ---------------------------------------------------------

def _plan(n: int, k: int, pair_dim: int = 0, dst_words: int | None = None, src_words: int | None = None,
          group_words: int = 16):
    from drvqwen.launchers.weight_layout import Int4TileMajor

    words = group_words if group_words in (4, 8, 16) else 16
    dst = BufferSpec("dst", (device_words(n, k, words) if dst_words is None else dst_words,), np.uint32)
    src = BufferSpec("src", (n * k // 128 * words if src_words is None else src_words,), np.uint32)
    return Int4TileMajor(dst, src, n=n, k=k, pair_dim=pair_dim, group_words=group_words)


@pytest.mark.parametrize("n,k,pair_dim,words", [(333, 384, 0, 16), (4608, 3584, 128, 16), (18944, 3584, 0, 16),
                                                (1, 128, 0, 16), (333, 384, 0, 8), (4864, 896, 0, 4)])
def test_the_launch_covers_every_vector_of_the_destination(n, k, pair_dim, words):
    (spec,) = _plan(n, k, pair_dim, group_words=words).specs
    vectors = -(-n // 16) * 16 * k // 128 * words // 4       # 16-byte vectors of dst
    assert spec.args["group_vecs"].value == words // 4
    threads = spec.block[0]
    assert spec.grid == (-(-vectors // threads),) and spec.smem_bytes == 0
    assert [a.value for a in (spec.args["N"], spec.args["K"], spec.args["pair_dim"])] == [n, k, pair_dim]


@pytest.mark.parametrize("kw,match", [
    (dict(n=333, k=384, dst_words=333 * 384 // 8), "dst: expected 16128 elements"),   # the file's size, not padded
    (dict(n=64, k=256, src_words=64 * 256 // 8 + 1), "src: expected 2048 elements"),
    (dict(n=64, k=200), "K must be a multiple of 128"),
    (dict(n=0, k=128), r"int4_to_tile_major: \[0, 128\]"),
    (dict(n=64, k=128, pair_dim=24), "pair_dim 24 must be 0 or a multiple of 16 dividing N=64"),
    (dict(n=96, k=128, pair_dim=64), "pair_dim 64 must be 0 or a multiple of 16 dividing N=96"),
    (dict(n=64, k=128, pair_dim=-16), "pair_dim -16"),
    (dict(n=64, k=128, group_words=2), r"group_words 2 must be one of \(4, 8, 16\)"),
    (dict(n=333, k=384, group_words=8, src_words=333 * 384 // 16 + 8), "src: expected 7992 elements"),
    (dict(n=2**20, k=2**15, group_words=16), "4294967296 words, the kernel indexes them in 32 bits"),
])
def test_bad_shapes_and_buffers_are_refused(kw, match):
    with pytest.raises(LaunchError, match=match):
        _plan(**kw)


def test_the_lane_words_launch_covers_every_super_block():
    from drvqwen.launchers.weight_layout import KQuantLaneWords

    supers = 18944 * 3584 // 256
    (spec,) = KQuantLaneWords(BufferSpec("lw", (18944, 14, 4), np.uint32), BufferSpec("sc", (18944, 14, 12), np.uint8),
                              BufferSpec("ss", (18944, 14, 2), np.float16), supers=supers).specs
    assert spec.grid == (-(-supers // spec.block[0]),) and spec.args["supers"].value == supers and spec.smem_bytes == 0


@pytest.mark.parametrize("supers,lw_elems,sc_elems,ss_elems,match", [
    (0, 0, 0, 0, "0 super-blocks: need 1"),
    (2**31 // 3 + 1, 4 * (2**31 // 3 + 1), 12 * (2**31 // 3 + 1), 2 * (2**31 // 3 + 1), "fewer than 2\\^31 / 3"),
    (4, 12, 48, 8, "lanes: expected 16 elements"),
    (4, 16, 47, 8, "scales: expected 48 elements"),
    (4, 16, 48, 4, "superscales: expected 8 elements"),
])
def test_bad_lane_word_buffers_are_refused(supers, lw_elems, sc_elems, ss_elems, match):
    from drvqwen.launchers.weight_layout import KQuantLaneWords

    with pytest.raises(LaunchError, match=match):
        KQuantLaneWords(BufferSpec("lw", (lw_elems,), np.uint32), BufferSpec("sc", (sc_elems,), np.uint8),
                        BufferSpec("ss", (ss_elems,), np.float16), supers=supers)


def test_gpu_weights_refuse_an_int4_projection_of_rows_no_multiple_of_16():
    """The device layout holds whole 16-row tiles in the file's [N, K/8] words, so GPUWeights
    refuses a projection whose N is no multiple of 16 with one line naming the tensor and its
    rows — before it asks the GPU for anything (no Qwen2 shape has one)."""
    from types import SimpleNamespace

    from drvqwen.errors import FormatError
    from drvqwen.gpu_weights import GPUWeights
    from helpers import TINY

    w = object.__new__(GPUWeights)
    w.config = TINY
    w.arrays = {"model.layers.0.mlp.up_proj.qweight": SimpleNamespace(shape=(384, 32), nbytes=384 * 32 * 4),
                "model.layers.0.mlp.down_proj.qweight": SimpleNamespace(shape=(100, 48), nbytes=100 * 48 * 4)}
    with pytest.raises(FormatError, match=r"^model\.layers\.0\.mlp\.down_proj\.qweight: 100 rows, the GPU's "
                                          r"tile-major planes need a multiple of 16$"):
        w._device_layout({n: (0, 16) for n in w.arrays})


@pytest.mark.gpu
def test_gpu_weights_hold_4_to_6_bit_codes_tile_major(tmp_path, monkeypatch):
    """A model in per-tensor formats (the 0.5B's shapes, 2 layers, llama.cpp's Q4_K_M recipe:
    q4_k, q5_0 and q6_k codes of 4–6 bits, q8_0 of 8) through GPUWeights: the qweight and qhigh
    of every weight whose codes have 4–6 bits hold to_tile_major(file's, 0, words) with rows in
    plain order (launchers.gemv_fmt.tile_major_parts), each q4_k weight's scales the lane words
    (uint32 [N, K/256, 4]) to_lane_words of the file's scales and superscales, with no superscales
    of its own, the 8-bit codes and every other tensor the file's bytes, through either uploader."""
    from drvqwen.config import QWEN25_CODER_05B
    from drvqwen.format import weight_formats as wf
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.format.synthetic import write_synthetic
    from drvqwen.gpu_weights import lane_word_weights
    from drvqwen.launchers.gemv_fmt import tile_major_parts
    from helpers import minimal_tokenizer_json

    cfg = QWEN25_CODER_05B.with_layers(2)
    formats = recipe_formats(cfg, "q4_k_m")
    path = tmp_path / "q4_k_m.nanoqwen"
    write_synthetic(path, cfg, seed=99, tokenizer_json=minimal_tokenizer_json(), formats=formats)
    with NanoqwenFile(path) as f:
        tiled = {f"{p}.{part}": words for p, fid in f.formats.items() if fid != wf.PLAIN
                 for part, words in tile_major_parts(wf.FORMATS[fid]).items()}
        bits = {wf.FORMATS[fid].bits for fid in f.formats.values() if fid != wf.PLAIN}
        assert 8 in bits and {4, 5, 6} <= bits, bits   # every kind is there to compare
        assert {n.rsplit(".", 1)[1] for n in tiled} == {"qweight", "qhigh"}
        lanes = {f"{p}.scales": to_lane_words(f.tensor(f"{p}.scales"), f.tensor(f"{p}.superscales"))
                 for p in lane_word_weights(f)}
        assert lanes, "the recipe has q4_k weights"
        want = {}
        for info in f:
            file = np.asarray(f.tensor(info.name))
            if info.name.endswith(".superscales") and info.name.replace(".superscales", ".scales") in lanes:
                continue   # in the lane words
            want[info.name] = (to_tile_major(file, 0, tiled[info.name]) if info.name in tiled
                               else lanes.get(info.name, file.astype(np.float16) if file.dtype == np.float32 else file))
        for via, got in _download_through_each_uploader(f, monkeypatch):
            assert set(got) == set(want), (via, set(got) ^ set(want))
            for name, a in want.items():
                # tile-major codes keep their file shape on the GPU (to_tile_major's is 4-D): bytes
                # only there; the lane words have a shape of their own, [N, K/256, 4]
                assert got[name].tobytes() == a.tobytes(), (via, name)
                assert name in tiled or got[name].shape == a.shape, (via, name, got[name].shape, a.shape)


def test_gpu_weights_refuse_superscales_stored_before_their_scales(tmp_path):
    """A q4_k weight's superscales reached before its scales (a file whose writer put them in
    that order: drvqwen's own never does) are refused in one line naming both tensors, before
    any GPU memory is taken: the staging upload's batched copies would overwrite them."""
    from types import SimpleNamespace

    from drvqwen.config import QWEN25_CODER_05B
    from drvqwen.errors import FormatError
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.format.synthetic import write_synthetic
    from drvqwen.gpu_weights import GPUWeights, lane_word_weights
    from helpers import minimal_tokenizer_json

    cfg = QWEN25_CODER_05B.with_layers(2)   # one layer alone has no q4_k weight: its down_proj is q6_k
    path = tmp_path / "q4_k_m.nanoqwen"
    write_synthetic(path, cfg, seed=5, tokenizer_json=minimal_tokenizer_json(), formats=recipe_formats(cfg, "q4_k_m"))
    with NanoqwenFile(path) as f:
        (prefix, *_more) = lane_word_weights(f)
        nothing_yet = SimpleNamespace(arrays={}, pool=None)   # no array uploaded, no pool to take from
        with pytest.raises(FormatError, match=rf"^{prefix}\.superscales: stored before {prefix}\.scales; "):
            GPUWeights._file_plane(nothing_yet, f, prefix, f.tensors[f"{prefix}.superscales"], {})
