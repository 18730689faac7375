"""Per-tensor weight formats (format/weight_formats.py, gguf_blocks.py): every GGUF type with a
format of its own round-trips to `gguf`'s dequantized float32 bits; the planes pack and unpack;
a GGUF converted with `--weights source` keeps its values and opens with the formats it was
written with; the table's format ids are validated; version-1/2 files still open."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from drvqwen import reference as ref
from drvqwen.errors import FormatError
from drvqwen.format import gguf_blocks, weight_formats as wf
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.tensor_set import default_formats
from drvqwen.format.nanoqwen_writer import write_legacy_copy

from helpers import TINY, random_dense

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants  # noqa: E402

# Byte offsets of the fp16 fields (d, m/dmin) in each block: random bytes there could be NaN/Inf.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")     # gguf-py has a quantizer for these


def random_blocks(type_name: str, n: int, k: int, rng) -> np.ndarray:
    """Random bytes of a [n, k] tensor of `type_name` (every bit pattern is a valid block) with
    finite fp16 scale fields, normal and subnormal, of both signs."""
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        d = rng.standard_normal(raw.shape[0]) * 10.0 ** rng.integers(-7, 1, raw.shape[0])
        raw[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def _ours(type_name: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    fmt, p = gguf_blocks.read_blocks(type_name, raw, n, k)
    stored = wf.pack_codes(fmt, p.pop("codes")) | p
    return wf.dequantize_weight(fmt, lambda name: stored[name.rsplit(".", 1)[1]], "w")


@pytest.mark.parametrize("type_name", list(F16_FIELDS))
def test_random_blocks_dequantize_to_gguf_bits(type_name, rng):
    n, k = 6, 512
    raw = random_blocks(type_name, n, k, rng)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k).astype(np.float32)
    got = _ours(type_name, raw, n, k)
    assert got.dtype == np.float32
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{bad.size} values differ, first at {bad[0]}: {got.flat[bad[0]]} vs {want.flat[bad[0]]}"


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_gguf_quantized_weights_round_trip(type_name, rng):
    """Blocks made by gguf's own quantizer from weight-like values (a real row's distribution)."""
    n, k = 5, 896
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    w[:, rng.integers(0, k, 4)] *= 30                                   # a few outliers
    raw = quants.quantize(w, GGMLQuantizationType[type_name])
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)
    assert np.array_equal(_ours(type_name, raw, n, k).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fid", list(wf.FORMATS))
def test_planes_pack_and_unpack(fid, rng):
    fmt = wf.FORMATS[fid]
    n, k = 3, 256
    codes = rng.integers(0, 1 << fmt.bits, (n, k)).astype(np.uint8)
    parts = wf.pack_codes(fmt, codes)
    shapes = fmt.tensors("w", n, k)
    for part, arr in parts.items():
        assert arr.dtype == np.uint32 and arr.shape == shapes[f"w.{part}"][1]
    assert np.array_equal(wf.unpack_codes(fmt, parts["qweight"], parts.get("qhigh")), codes)


# Bytes per weight of each GGUF type, as ggml defines its blocks: (block bytes, block inputs).
GGUF_BYTES = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
              "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


@pytest.mark.parametrize("type_name", list(GGUF_BYTES))
def test_each_gguf_type_is_stored_in_the_gguf_bytes(type_name):
    fmt = wf.EXACT_FOR_GGUF[type_name]
    nbytes, inputs = GGUF_BYTES[type_name]
    assert GGML_QUANT_SIZES[GGMLQuantizationType[type_name]] == (inputs, nbytes)
    n, k = 7, 1536
    assert wf.parts_nbytes(fmt, n, k) == n * k * nbytes // inputs
    assert fmt.bits_per_weight == 8 * nbytes / inputs


def test_bits_per_weight_of_each_format():
    got = {f.name: f.bits_per_weight for f in wf.FORMATS.values()}
    assert got["int4_g128"] == 4.125 and got["q5_g32"] == 5.5 and got["q8_g32"] == 8.5
    assert got["q4_k"] == 4.5 and got["q5_k"] == 5.5 and got["q6_k"] == 6.5625
    for f in wf.FORMATS.values():
        assert wf.parts_nbytes(f, 64, 512) * 8 == f.bits_per_weight * 64 * 512


def test_k_quants_need_whole_super_blocks():
    for name in ("q4_k", "q5_k", "q6_k"):
        fmt = next(f for f in wf.FORMATS.values() if f.name == name)
        assert fmt.fits(256) and fmt.fits(4864) and not fmt.fits(896) and not fmt.fits(128)
    assert wf.FORMATS[5].fits(896)


def test_q8_requantization_error_bound(rng):
    w = (rng.standard_normal((7, 256)) * 0.05).astype(np.float32)
    p = wf.quantize_dense(wf.Q8_G32, w)
    back = wf.dequantize_weight(wf.Q8_G32, lambda n: p[n.rsplit(".", 1)[1]], "w")
    s = np.repeat(p["scales"].astype(np.float32), 32, axis=1)
    assert (np.abs(back - w) <= s / 2 * (1 + 1e-6)).all()


# ---- a GGUF with one type per tensor, converted with --weights source ----------------------------

MIX = ("Q5_0", "Q8_0", "Q4_1", "Q4_0", "Q5_1")


def _mixed_types(cfg) -> dict[str, str]:
    from drvqwen.format.tensor_set import weight_shapes

    return {p + ".weight": MIX[i % len(MIX)] for i, p in enumerate(weight_shapes(cfg))}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    from drvqwen.format.convert import GGUFSource, convert
    from drvqwen.format.synthetic import write_synthetic_gguf

    d = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(7)
    cfg = TINY
    src = write_synthetic_gguf(d / "mixed.gguf", cfg, random_dense(cfg, rng), qtype=_mixed_types(cfg))
    report = convert(src, d / "mixed.nanoqwen", weights="source")
    return GGUFSource(src), NanoqwenFile(d / "mixed.nanoqwen"), report


def test_source_conversion_keeps_every_value(mixed):
    source, f, report = mixed
    assert f.header.version == 4 and not f.has_default_formats
    types = _mixed_types(f.config)
    for name, ty in types.items():
        prefix = name[: -len(".weight")]
        assert wf.FORMATS[f.formats[prefix]] is gguf_blocks.exact_format(ty), prefix
        want = source.get(name)
        assert np.array_equal(f.weight(prefix).view(np.uint32), want.view(np.uint32)), prefix
    # F32 norms and biases are kept as F32.
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert f.tensors[norm].dtype == np.float32
    assert np.array_equal(np.asarray(f.tensor(norm)), source.get(norm))
    assert all(e.rel_l2 == 0.0 for e in report.errors)
    rows = {(r.source_type, r.format_name): r for r in report.mapping.values()}
    assert rows[("Q5_0", "q5_g32")].exact and sum(r.count for r in rows.values()) == len(types)
    assert report.bytes_per_token > 0


def test_reference_on_source_formats_equals_dense_gguf(mixed):
    source, f, _ = mixed
    ids = [3, 70, 101, 32, 258, 9]
    got = ref.Model(ref.Weights.from_nanoqwen(f), max_tokens=16).forward(ids)
    want = ref.Model(ref.Weights.from_dense(source.config, source.get), max_tokens=16).forward(ids)
    assert np.array_equal(got, want)


def test_int4_policy_gives_the_default_formats(mixed, tmp_path):
    from drvqwen.format.convert import convert

    source, _, _ = mixed
    report = convert(source, tmp_path / "int4.nanoqwen", weights="int4")
    f = NanoqwenFile(tmp_path / "int4.nanoqwen")
    assert f.has_default_formats and f.formats == default_formats(f.config)
    assert report.weights == "int4" and {r.format_name for r in report.mapping.values()} == {"int4_g128", "dense"}


def test_the_gpu_takes_every_format_and_names_a_weight_it_cannot(mixed, monkeypatch, tmp_path):
    """Every format runs on the GPU (gemv_fmt.cu, gemm_fmt.cu); what does not is refused before any
    allocation with one line: a format without a kernel (naming the weight and its format), or a
    layer whose gate_proj and up_proj differ in format (the fused gate/up kernels read one)."""
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.format.synthetic import write_synthetic
    from drvqwen.gpu_weights import GPUWeights, check_gpu_formats
    from drvqwen.launchers import gemv_fmt

    _, f, _ = mixed                                  # its types cycle: gate and up differ in layer 0
    gate, up = (wf.FORMATS[f.formats[f"model.layers.0.mlp.{p}"]].name for p in ("gate_proj", "up_proj"))
    assert gate != up
    with pytest.raises(FormatError, match=rf"layer 0 stores gate_proj in {gate} and up_proj in {up}"):
        GPUWeights(f)
    km = NanoqwenFile(write_synthetic(tmp_path / "km.nanoqwen", TINY, seed=3, tokenizer_json=f.tokenizer_json,
                                      formats=recipe_formats(TINY, "q4_k_m")))
    assert check_gpu_formats(km) is None
    used = sorted({fid for fid in km.formats.values() if fid != wf.PLAIN})
    monkeypatch.setattr(gemv_fmt, "GPU_FORMAT_IDS", frozenset(gemv_fmt.GPU_FORMAT_IDS) - {used[-1]})
    prefix = next(p for p, fid in km.formats.items() if fid == used[-1])
    with pytest.raises(FormatError, match=rf"{prefix} is stored in weight format {wf.FORMATS[used[-1]].name}"):
        GPUWeights(km)


def test_tile_major_planes_need_whole_tiles_and_their_scratch_is_counted(tmp_path):
    """The GPU holds the 4–6-bit codes and high bits tile-major in whole 16-row tiles: a model
    whose Q4_K embedding and Q6_K lm_head have 1000 rows (a vocabulary resized to no multiple of
    16) is refused before any allocation with one line naming the first such tensor and its rows;
    at 512 rows it passes. The load's scratch (layout_scratch_bytes) is the largest of those
    planes, which the decode step's memory check counts."""
    import dataclasses

    from drvqwen.format.recipes import recipe_formats
    from drvqwen.format.synthetic import write_synthetic
    from drvqwen.gpu_weights import check_gpu_formats, layout_scratch_bytes, tile_major_planes
    from helpers import minimal_tokenizer_json

    odd = dataclasses.replace(TINY, vocab_size=1000)
    f = NanoqwenFile(write_synthetic(tmp_path / "odd.nanoqwen", odd, seed=5, tokenizer_json=minimal_tokenizer_json(),
                                     formats=recipe_formats(odd, "q4_k_m")))
    assert check_gpu_formats(f) == (f"{f.path}: model.embed_tokens.qweight has 1000 rows; the GPU holds it "
                                    f"tile-major and needs a multiple of 16")
    ok = NanoqwenFile(write_synthetic(tmp_path / "ok.nanoqwen", TINY, seed=5, tokenizer_json=minimal_tokenizer_json(),
                                      formats=recipe_formats(TINY, "q4_k_m")))
    assert check_gpu_formats(ok) is None
    planes = tile_major_planes(ok)
    assert {"lm_head.qweight", "lm_head.qhigh", "model.embed_tokens.qweight"} <= set(planes)
    assert all(pair_dim == 0 for pair_dim, _ in planes.values())
    assert layout_scratch_bytes(ok) == max(ok.tensors[n].nbytes for n in planes) > 0


# ---- the table's format ids ---------------------------------------------------------------------

def _records(path):
    """(name, offset of its format byte) of every table record of a version-3 file."""
    raw = path.read_bytes()
    table_off, table_size = struct.unpack_from("<QQ", raw, 88)
    out, pos = [], table_off
    while pos < table_off + table_size:
        (nlen,) = struct.unpack_from("<H", raw, pos)
        name = raw[pos + 2:pos + 2 + nlen].decode()
        fmt_at = pos + 2 + nlen + 1
        ndim = raw[fmt_at + 1]
        out.append((name, fmt_at))
        pos = fmt_at + 2 + 8 * ndim + 20
    return out


def _set_format(path, dst, name, fid):
    raw = bytearray(path.read_bytes())
    at = dict(_records(path))[name]
    raw[at] = fid
    table_off, table_size = struct.unpack_from("<QQ", raw, 88)
    struct.pack_into("<I", raw, 148, zlib.crc32(bytes(raw[table_off:table_off + table_size])))
    struct.pack_into("<I", raw, 252, zlib.crc32(bytes(raw[:252])))
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("name,fid,expect", [
    ("model.layers.0.mlp.up_proj.scales", 9, "format id 9, but the other parts of model.layers.0.mlp.up_proj have"),
    ("model.layers.0.mlp.up_proj.qweight", 77, "weight format id 77 unknown to this drvqwen"),
    ("model.norm.weight", 1, "weight format id 1 on a dense tensor"),
    ("model.layers.1.self_attn.o_proj.scales", 0, "part of a quantized weight with format id 0"),
])
def test_bad_format_ids_are_named(mixed, tmp_path, name, fid, expect):
    _, f, _ = mixed
    bad = _set_format(f.path, tmp_path / "bad.nanoqwen", name, fid)
    with pytest.raises(FormatError, match=expect) as ei:
        NanoqwenFile(bad)
    assert str(bad) in str(ei.value) and "\n" not in str(ei.value)


def test_a_consistent_but_wrong_format_is_refused_by_shape(mixed, tmp_path):
    """All parts of a weight relabelled to another format: the shapes no longer fit it."""
    _, f, _ = mixed
    p = "model.layers.0.mlp.down_proj"
    path = f.path
    for part in wf.PART_SUFFIXES:
        if p + part in f.tensors:
            path = _set_format(path, tmp_path / f"w{part}.nanoqwen", p + part, wf.INT4_G128.id)
    with pytest.raises(FormatError, match=f"tensor {p}"):
        NanoqwenFile(path)


@pytest.mark.parametrize("version", [1, 2])
def test_version_1_and_2_files_still_open(tmp_path, version):
    from drvqwen.format.synthetic import minimal_tokenizer_json, write_synthetic

    v3 = write_synthetic(tmp_path / "v3.nanoqwen", TINY, 3, minimal_tokenizer_json())
    old = write_legacy_copy(v3, tmp_path / f"v{version}.nanoqwen", version)
    a, b = NanoqwenFile(v3), NanoqwenFile(old)
    assert b.header.version == version and b.formats == a.formats and b.has_default_formats
    p = "model.layers.2.self_attn.v_proj"
    assert np.array_equal(a.weight(p), b.weight(p))


def test_legacy_copy_refuses_per_tensor_formats(mixed, tmp_path):
    _, f, _ = mixed
    with pytest.raises(FormatError, match="need format version 3"):
        write_legacy_copy(f.path, tmp_path / "x.nanoqwen", 2)
