"""The end-of-generation set and the text vocabulary: stored in the `.nanoqwen` file (format
version 2), derived for version-1 files, and used by the CPU backend, which never chooses an
id of the lm_head's padded rows (no text can come of them)."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest

from drvqwen.errors import FormatError
from drvqwen.format import nanoqwen
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.nanoqwen_writer import write_legacy_copy
from drvqwen.tokenizer import Tokenizer

from helpers import QWEN_CONTROL, TINY, byte_tokenizer_json, random_dense, write_model, write_tiny_gguf

# byte_tokenizer_json: 256 bytes, then QWEN_CONTROL at 256 … 264; TINY has 512 rows.
TEXT_VOCAB = 256 + len(QWEN_CONTROL)
EOG_NAMES = ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


@pytest.fixture
def tiny(tmp_path, rng):
    path = tmp_path / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng), tokenizer_json=byte_tokenizer_json())
    return path


def _ids(names, base=256):
    return {base + QWEN_CONTROL.index(n) for n in names}


def test_file_stores_the_eog_set_and_text_vocab(tiny):
    with NanoqwenFile(tiny) as f:
        assert f.header.version == nanoqwen.VERSION == 4
        assert f.text_vocab == TEXT_VOCAB
        assert f.eog_ids == _ids(EOG_NAMES)
        tok = Tokenizer.from_json(f.tokenizer_json)
        assert f.eog_ids == {tok.token_to_id(n) for n in EOG_NAMES}


def _as_version_1(path):
    """Rewrite `path` as a version-1 file (table without format ids, bytes 156 … 251 zero)."""
    tmp = path.with_name(path.name + ".v1")
    write_legacy_copy(path, tmp, 1)
    tmp.replace(path)


def test_version_1_files_still_open_with_derived_facts(tiny):
    with NanoqwenFile(tiny) as f:
        want = (f.text_vocab, f.eog_ids)
    _as_version_1(tiny)
    with NanoqwenFile(tiny) as f:
        assert f.header.version == 1 and f.header.eog_ids is None
        assert (f.text_vocab, f.eog_ids) == want


def _patch(path, off, fmt, *vals):
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, off, *vals)
    struct.pack_into("<I", raw, 252, zlib.crc32(bytes(raw[:252])))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("off,fmt,vals,expect", [
    (8, "<I", (5,), "header field version: 5, this drvqwen reads versions 1, 2, 3, 4 (written by a newer drvqwen"),
    (156, "<I", (0,), "header field text_vocab: 0, must be in [1, 512]"),
    (156, "<I", (513,), "header field text_vocab: 513"),
    (160, "<I", (13,), "header field n_eog: 13, at most 12"),
    (164, "<I", (512,), "header field eog_ids: id 512 outside the vocabulary of 512"),
])
def test_bad_v2_fields_are_named(tiny, off, fmt, vals, expect):
    _patch(tiny, off, fmt, *vals)
    with pytest.raises(FormatError) as ei:
        NanoqwenFile(tiny)
    assert str(tiny) in str(ei.value) and expect in str(ei.value)


def test_cpu_backend_never_chooses_a_padded_id(tiny, rng):
    from drvqwen.generate import CPUBackend, generate
    from drvqwen.sampler import SamplingParams

    with NanoqwenFile(tiny) as f:
        b = CPUBackend(f, 256)
        logits = b.prefill([1, 2, 3])
        assert logits.shape == (TINY.vocab_size,)
        assert np.isneginf(logits[TEXT_VOCAB:]).all() and np.isfinite(logits[:TEXT_VOCAB]).all()
        # Make the padded rows the most likely ones: they must still never be picked.
        b.weights.lm_head[TEXT_VOCAB:] = b.weights.lm_head[:TEXT_VOCAB].mean(0) * 50
        for params in (SamplingParams(), SamplingParams(temperature=5.0, seed=int(rng.integers(1 << 30)))):
            toks = generate(b, [1, 2, 3], 40, params, ignore_stop=True).tokens
            assert toks and max(toks) < TEXT_VOCAB, toks


def test_converter_stores_names_and_metadata_eos(tmp_path, rng):
    pytest.importorskip("gguf")
    from drvqwen.format.convert import convert

    src = write_tiny_gguf(tmp_path / "t.gguf", TINY, random_dense(TINY, rng), n_pad=20, eos_id=42)
    out = tmp_path / "t.nanoqwen"
    convert(src, out)
    with NanoqwenFile(out) as f:
        tok = Tokenizer.from_json(f.tokenizer_json)
        # 256 bytes + "ĠĠ" + the controls; the 20 [PAD…] rows and the rest of the 512 rows have no text.
        assert f.text_vocab == 257 + len(QWEN_CONTROL) == tok.text_vocab_size
        assert tok.decode([f.text_vocab + 3]) == ""
        assert f.eog_ids == {tok.token_to_id(n) for n in EOG_NAMES} | {42}


def test_hf_generation_config_eos_is_added(tmp_path, rng):
    from safetensors.numpy import save_file

    from drvqwen.format.convert import convert

    src = tmp_path / "hf"
    src.mkdir()
    save_file(random_dense(TINY, rng), str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(TINY.to_hf_dict() | {"eos_token_id": 258}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 99]}))
    (src / "tokenizer.json").write_text(byte_tokenizer_json())
    convert(src, tmp_path / "m.nanoqwen")
    with NanoqwenFile(tmp_path / "m.nanoqwen") as f:
        assert f.eog_ids == _ids(EOG_NAMES) | {99, 258}
        assert f.text_vocab == TEXT_VOCAB


def test_fillers_of_older_conversions_are_no_text(tmp_path, rng):
    """Files converted before the GGUF filler rows were left out carry "[PAD<id>]" tokens in
    their tokenizer.json (built as ordinary BPE pieces): they count as no text (never chosen,
    decoded to nothing) all the same."""
    from drvqwen.generate import CPUBackend
    from drvqwen.tokenizer_gguf import BYTE_TO_CHAR, _assemble

    sp = BYTE_TO_CHAR[32]
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + [sp + sp] + list(QWEN_CONTROL)
    text_vocab = len(tokens)
    tokens += [f"[PAD{i}]" for i in range(text_vocab, text_vocab + 30)]
    types = [1] * 257 + [3] * len(QWEN_CONTROL) + [1] * 30        # what older drvqwen built
    old_json = _assemble(tokens, types, [f"{sp} {sp}"], "old.gguf").to_str()
    tok = Tokenizer.from_json(old_json)
    assert tok.vocab_size == text_vocab + 30 and tok.text_vocab_size == text_vocab
    assert tok.decode([104, text_vocab + 3, 105]) == "hi"
    sd = tok.stream_decoder()
    assert sd.push(text_vocab + 3) == "" and sd.push(104) == "h"
    path = tmp_path / "old.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng), tokenizer_json=old_json)
    _as_version_1(path)
    with NanoqwenFile(path) as f:
        assert f.text_vocab == text_vocab
        assert np.isneginf(CPUBackend(f, 64).prefill([1, 2])[text_vocab:]).all()
