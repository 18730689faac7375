"""Format version 4 (format/weight_formats.py, recipes.py, nanoqwen.py): the high-bit plane's
bit positions, spelled out by hand; the K-quants' packed scale bytes as gguf reads them;
`random_weight`; a GGUF of K-quant blocks converted with `--weights source`; version-3 files;
llama.cpp's Q4_K_M recipe on a synthetic model, which the CPU reference runs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from drvqwen import reference as ref
from drvqwen.config import PRESETS
from drvqwen.errors import FormatError
from drvqwen.format import weight_formats as wf
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.nanoqwen_writer import write_legacy_copy
from drvqwen.format.recipes import k_m_types, q4_k_m_types, quant_order, recipe_formats, use_more_bits
from drvqwen.format.synthetic import minimal_tokenizer_json, write_synthetic

from helpers import TINY

BY_NAME = {f.name: f for f in wf.FORMATS.values()}


# ---- the high-bit plane ---------------------------------------------------------------------------

# (format, K, input, code, qhigh word, its expected value): the code's high bits alone, placed by
# the rule "input 32c + 8i + ORDER[p] → bits 4p + HB·(i mod 4/HB) of word HB·c + i div (4/HB)",
# ORDER = [0, 2, 4, 6, 1, 3, 5, 7], worked out by hand for each case.
HAND = [
    ("q5_g32", 64, 0, 16, 0, 1 << 0),            # c0 i0 e0: p0, bit 0
    ("q5_g32", 64, 1, 16, 0, 1 << 16),           # c0 i0 e1: p4, bit 16
    ("q5_g32", 64, 9, 16, 0, 1 << 17),           # c0 i1 e1: p4, bit 16 + 1
    ("q5_g32", 64, 31, 16, 0, 1 << 31),          # c0 i3 e7: p7, bit 28 + 3
    ("q5_g32", 64, 50, 16, 1, 1 << 6),           # c1 i2 e2: p1, bit 4 + 2
    ("q6_k", 256, 0, 16, 0, 1 << 0),             # c0 i0 e0: word 0, bits 0 (low), 1
    ("q6_k", 256, 0, 32, 0, 1 << 1),
    ("q6_k", 256, 8, 48, 0, 0b11 << 2),          # c0 i1 e0: word 0, bits 2, 3
    ("q6_k", 256, 16, 16, 1, 1 << 0),            # c0 i2 e0: word 1, bits 0, 1
    ("q6_k", 256, 27, 32, 1, 1 << 23),           # c0 i3 e3: p5, word 1, bits 22, 23
    ("q6_k", 256, 39, 16, 2, 1 << 28),           # c1 i0 e7: p7, word 2, bits 28, 29
    ("q6_k", 256, 255, 48, 15, 0b11 << 30),      # c7 i3 e7: p7, word 15, bits 30, 31
]


@pytest.mark.parametrize("name,k,inp,code,word,value", HAND)
def test_high_bits_sit_where_the_layout_says(name, k, inp, code, word, value):
    fmt = BY_NAME[name]
    codes = np.zeros((1, k), np.uint8)
    codes[0, inp] = code
    parts = wf.pack_codes(fmt, codes)
    assert not parts["qweight"].any()                       # the low nibble of 16, 32, 48 is 0
    want = np.zeros(k // 32 * (fmt.bits - 4), np.uint32)
    want[word] = value
    assert np.array_equal(parts["qhigh"][0], want)
    assert np.array_equal(wf.unpack_codes(fmt, parts["qweight"], parts["qhigh"]), codes)


@pytest.mark.parametrize("fid", list(wf.FORMATS))
def test_planes_round_trip_at_several_widths(fid, rng):
    fmt = wf.FORMATS[fid]
    for k in (256, 1024, 4864):
        codes = rng.integers(0, 1 << fmt.bits, (4, k)).astype(np.uint8)
        parts = wf.pack_codes(fmt, codes)
        assert np.array_equal(wf.unpack_codes(fmt, parts["qweight"], parts.get("qhigh")), codes)


# ---- the K-quants' scale bytes -----------------------------------------------------------------------

def test_scale_min_bytes_are_gguf_s(rng):
    quants = pytest.importorskip("gguf").quants
    sc = rng.integers(0, 64, (50, 8), dtype=np.uint8)
    m = rng.integers(0, 64, (50, 8), dtype=np.uint8)
    packed = wf.pack_scale_min(sc, m)
    got_sc, got_m = quants.Q4_K.get_scale_min(packed)
    assert np.array_equal(got_sc, sc) and np.array_equal(got_m, m)
    raw = rng.integers(0, 256, (50, 12), dtype=np.uint8)      # 96 bits = 16 × 6: a bijection
    assert np.array_equal(wf.pack_scale_min(*wf.get_scale_min(raw)), raw)


# ---- random_weight ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fid", list(wf.FORMATS))
def test_random_weight_has_the_format_s_parts_and_a_model_s_magnitude(fid):
    fmt = wf.FORMATS[fid]
    n, k = 48, 1024
    parts = wf.random_weight(fmt, n, k, np.random.default_rng(5))
    want = {name.rsplit(".", 1)[1]: spec for name, spec in fmt.tensors("w", n, k).items()}
    assert set(parts) == set(want)
    for part, a in parts.items():
        assert (a.dtype, a.shape) == want[part], part
    w = wf.dequantize_weight(fmt, lambda name: parts[name.rsplit(".", 1)[1]], "w")
    rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
    assert np.isfinite(w).all() and 0.01 <= rms <= 0.06, rms
    again = wf.random_weight(fmt, n, k, np.random.default_rng(5))
    assert all(np.array_equal(again[p], parts[p]) for p in parts)


def test_random_weight_refuses_a_k_the_format_cannot_hold(rng):
    with pytest.raises(ValueError, match="K=896 is not a multiple of 256"):
        wf.random_weight(BY_NAME["q4_k"], 4, 896, rng)


# ---- a GGUF of K-quant blocks, converted with --weights source ----------------------------------

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def test_k_quant_gguf_converts_to_its_two_level_formats(tmp_path, rng):
    from test_weight_formats import random_blocks

    from drvqwen.format.convert import GGUFSource, convert
    from drvqwen.format.synthetic import synthetic_dense, write_synthetic_gguf
    from drvqwen.format.tensor_set import weight_shapes

    cfg = TINY
    dense = synthetic_dense(cfg, rng)
    types = {}
    for i, (prefix, (n, k)) in enumerate(weight_shapes(cfg).items()):
        if k % 256 == 0:
            types[prefix + ".weight"] = ty = K_TYPES[i % 3]
            dense[prefix + ".weight"] = random_blocks(ty, n, k, rng)
    src = write_synthetic_gguf(tmp_path / "k.gguf", cfg, dense, qtype=types)
    report = convert(src, tmp_path / "k.nanoqwen", weights="source")
    f, source = NanoqwenFile(tmp_path / "k.nanoqwen"), GGUFSource(src)
    assert f.header.version == 4 and report.fallbacks == []
    for name, ty in types.items():
        prefix = name[: -len(".weight")]
        assert wf.FORMATS[f.formats[prefix]].name == ty.lower(), prefix
        assert np.array_equal(f.weight(prefix).view(np.uint32), source.get(name).view(np.uint32)), prefix
    rows = {(r.source_type, r.format_name): r.count for r in report.mapping.values() if r.exact}
    for ty, count in Counter(types.values()).items():
        assert rows[(ty, ty.lower())] == count


# ---- version 3 ------------------------------------------------------------------------------------------

def test_a_version_3_file_opens_when_its_formats_kept_their_layout(tmp_path):
    v4 = write_synthetic(tmp_path / "v4.nanoqwen", TINY, 3, minimal_tokenizer_json(),
                         formats={p: (9 if "v_proj" in p else fid) for p, fid in recipe_formats(TINY, "int4").items()})
    v3 = write_legacy_copy(v4, tmp_path / "v3.nanoqwen", 3)
    a, b = NanoqwenFile(v4), NanoqwenFile(v3)
    assert b.header.version == 3 and b.formats == a.formats
    p = "model.layers.1.self_attn.v_proj"
    assert np.array_equal(a.weight(p), b.weight(p))


def test_a_version_3_file_in_a_changed_layout_is_refused_in_one_line(tmp_path):
    formats = recipe_formats(TINY, "int4") | {"model.layers.0.mlp.up_proj": BY_NAME["q5_g32"].id}
    v4 = write_synthetic(tmp_path / "v4.nanoqwen", TINY, 3, minimal_tokenizer_json(), formats=formats)
    v3 = write_legacy_copy(v4, tmp_path / "v3.nanoqwen", 3)
    NanoqwenFile(v4)                                          # the same tables open as version 4
    with pytest.raises(FormatError, match="up_proj.*version-3 file.*convert the model again") as ei:
        NanoqwenFile(v3)
    assert str(v3) in str(ei.value) and "\n" not in str(ei.value)


# ---- llama.cpp's Q4_K_M recipe --------------------------------------------------------------------------

def test_use_more_bits_picks_the_layers_llama_cpp_picks():
    # 24 tensors: the first and last three, and 5, 8, …, 20 (3 + 3·k + 2).
    assert [j for j in range(24) if use_more_bits(j, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    # … counted over the layers sorted by name: blk.0, blk.1, blk.10 … blk.19, blk.2, blk.20 …
    assert quant_order(24)[:4] == [0, 1, 10, 11] and quant_order(24)[12:14] == [2, 20]
    picked = sorted(quant_order(24)[j] for j in range(24) if use_more_bits(j, 24))
    assert picked == [0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21]           # the real 0.5B GGUF's


def test_q4_k_m_recipe_on_the_0_5b_gives_the_real_gguf_s_types():
    """The official Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF holds Q5_0 ×133, Q8_0 ×13,
    Q6_K ×12, Q4_K ×12 (its gate/up/q/k/o and token_embd Q5_0, output Q8_0)."""
    types = q4_k_m_types(PRESETS["0.5b"])
    assert Counter(types.values()) == {"Q5_0": 133, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12}
    assert types["model.embed_tokens"] == "Q5_0" and types["lm_head"] == "Q8_0"
    assert types["model.layers.3.mlp.down_proj"] == "Q6_K" and types["model.layers.2.mlp.down_proj"] == "Q4_K"
    assert types["model.layers.3.self_attn.v_proj"] == "Q8_0" and types["model.layers.2.self_attn.v_proj"] == "Q5_0"


def test_q4_k_m_recipe_on_the_7b_is_all_k_quants():
    types = q4_k_m_types(PRESETS["7b"])
    assert types["lm_head"] == "Q6_K" and types["model.embed_tokens"] == "Q4_K"
    names = sorted(str(i) for i in range(28))                      # blk.N as llama.cpp met them
    more = {int(names[j]) for j in range(28) if use_more_bits(j, 28)}
    for i in range(28):
        want = "Q6_K" if i in more else "Q4_K"
        assert types[f"model.layers.{i}.self_attn.v_proj"] == want == types[f"model.layers.{i}.mlp.down_proj"]
        assert types[f"model.layers.{i}.self_attn.q_proj"] == "Q4_K"


@pytest.mark.parametrize("preset", ["0.5b", "7b"])
def test_q5_k_m_recipe_is_q4_k_m_with_the_five_bit_types(preset):
    """Q5_K_M picks the same tensors for Q6_K (and Q8_0) as Q4_K_M; where Q4_K_M has Q4_K it has
    Q5_K, and where Q4_K_M falls back to Q5_0 it falls back to Q5_1."""
    five = {"Q4_K": "Q5_K", "Q5_0": "Q5_1", "Q6_K": "Q6_K", "Q8_0": "Q8_0"}
    q4, q5 = q4_k_m_types(PRESETS[preset]), k_m_types(PRESETS[preset], "Q5_K")
    assert q5 == {p: five[ty] for p, ty in q4.items()}
    assert recipe_formats(PRESETS[preset], "q5_k_m") == {p: wf.EXACT_FOR_GGUF[ty].id for p, ty in q5.items()}


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4km") / "tiny_q4km.nanoqwen"
    return NanoqwenFile(write_synthetic(path, TINY, 11, minimal_tokenizer_json(),
                                        formats=recipe_formats(TINY, "q4_k_m")))


def test_block32_recipes_give_llama_cpp_s_preset_types():
    """q4_0 / q5_0 / q8_0: every matrix and the embedding in the preset's type; the output Q6_K for
    Q4_0 and Q5_0 where K is a multiple of 256, Q8_0 where it is not (the 0.5B) and for Q8_0."""
    from drvqwen.format.recipes import block32_types
    from drvqwen.format.tensor_set import LM_HEAD

    for preset, k_ok in (("7b", True), ("0.5b", False)):
        cfg = PRESETS[preset]
        t4, t5, t8 = (block32_types(cfg, p) for p in ("Q4_0", "Q5_0", "Q8_0"))
        assert t5.pop(LM_HEAD) == ("Q6_K" if k_ok else "Q8_0") and set(t5.values()) == {"Q5_0"}
        assert t4.pop(LM_HEAD) == ("Q6_K" if k_ok else "Q8_0") and set(t4.values()) == {"Q4_0"}
        assert set(t8.values()) == {"Q8_0"} and len(t8) == len(t5) + 1
        fm = recipe_formats(cfg, "q8_0")
        assert set(fm.values()) == {wf.EXACT_FOR_GGUF["Q8_0"].id}


def test_synthetic_q4_k_m_has_the_recipe_s_formats(q4_k_m):
    # TINY: K = 256 but for down_proj's 384; 3 layers, of which use_more_bits picks layer 2.
    f = q4_k_m
    assert f.header.version == 4
    names = {p: ("dense" if fid == 0 else wf.FORMATS[fid].name) for p, fid in f.formats.items()}
    assert names["model.embed_tokens"] == "q4_k" and names["lm_head"] == "q6_k"
    for i in range(3):
        assert names[f"model.layers.{i}.self_attn.q_proj"] == "q4_k"
        assert names[f"model.layers.{i}.self_attn.v_proj"] == ("q6_k" if i == 2 else "q4_k")
        assert names[f"model.layers.{i}.mlp.down_proj"] == ("q8_g32" if i == 2 else "q5_g32")


def test_reference_runs_the_q4_k_m_model_as_its_dequantized_weights(q4_k_m):
    f = q4_k_m
    ids = [3, 17, 40, 5, 77]
    ours = ref.Model(ref.Weights.from_nanoqwen(f), max_tokens=16)
    logits = ours.forward(ids)
    assert logits.shape == (len(ids), TINY.vocab_size) and np.isfinite(logits).all()

    def get(name):
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix in f.formats:
            return wf.dequantize_weight(wf.FORMATS[f.formats[prefix]], f.tensor, prefix)
        return np.asarray(f.tensor(name)).astype(np.float32)

    dense = ref.Model(ref.Weights.from_dense(f.config, get), max_tokens=16)
    assert np.array_equal(dense.forward(ids), logits)
    ours.reset()
    tokens = [int(np.argmax(ours.forward(ids)[-1]))]
    for _ in range(3):
        tokens.append(int(np.argmax(ours.forward(tokens[-1:])[-1])))
    assert len(tokens) == 4 and all(0 <= t < TINY.vocab_size for t in tokens)


def test_info_shows_formats_and_bytes_per_token(q4_k_m, capsys):
    from drvqwen import cli
    from drvqwen.format.tensor_set import EMBED

    f = q4_k_m
    assert cli.main(["info", str(f.path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    counts = Counter(wf.FORMATS[fid].name for fid in f.formats.values())
    # embedding + 3 × (q, k, o, gate, up) + v of layers 0, 1; lm_head + v of layer 2; down.
    assert counts == {"q4_k": 18, "q6_k": 2, "q5_g32": 2, "q8_g32": 1}
    assert "q4_k ×18, q5_g32 ×2, q6_k ×2, q8_g32 ×1" in out
    # Every tensor once but the embedding, of which one row: summed here from the table.
    want = sum(i.nbytes for n, i in f.tensors.items() if wf.weight_prefix(n) != EMBED) + \
        sum(i.nbytes for n, i in f.tensors.items() if wf.weight_prefix(n) == EMBED) // TINY.vocab_size
    assert f"{want:,} B" in out and f"the file is {f.header.file_size / 1e6:.1f} MB" in out


def test_a_gguf_type_without_a_format_is_named_with_its_tensor(tmp_path, rng, capsys):
    """Q2_K has no exact drvqwen format: `--weights source` re-quantizes it to 8 bits and says
    which tensor, of which type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from drvqwen.format.convert import convert
    from drvqwen.format.synthetic import synthetic_dense, write_synthetic_gguf
    from drvqwen.loading import print_quant_summary

    cfg = TINY
    dense = synthetic_dense(cfg, rng)
    name = "model.layers.1.self_attn.q_proj.weight"
    n, k = dense[name].shape
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K]
    raw = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    raw[:, 80:84] = (rng.uniform(0.5, 1.5, (raw.shape[0], 2)) * 1e-3).astype(np.float16).view(np.uint8)  # d, dmin
    dense[name] = raw.reshape(n, -1)
    src = write_synthetic_gguf(tmp_path / "q2k.gguf", cfg, dense, qtype={name: "Q2_K"})
    report = convert(src, tmp_path / "q2k.nanoqwen", weights="source")
    assert report.fallbacks == [("blk.1.attn_q.weight", "Q2_K", "q8_g32")]
    print_quant_summary(report)
    err = " ".join(capsys.readouterr().err.split())
    assert "blk.1.attn_q.weight: GGUF type Q2_K has no exact drvqwen format: re-quantized to q8_g32" in err
