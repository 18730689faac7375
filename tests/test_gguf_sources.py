"""GGUF sources written with gguf-py (tests/helpers.write_tiny_gguf): byte order, tied output,
tensor shapes — each converted model equals the little-endian, untied original, or the file
is refused with one line naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.errors import FormatError
from drvqwen.format.nanoqwen import NanoqwenFile

from helpers import TINY, random_dense, write_tiny_gguf

gguf = pytest.importorskip("gguf")


def _convert(src, out):
    from drvqwen.format.convert import convert

    convert(src, out)
    return NanoqwenFile(out)


@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_big_endian_equals_little_endian(tmp_path, rng, qtype):
    dense = random_dense(TINY, rng)
    le = _convert(write_tiny_gguf(tmp_path / "le.gguf", TINY, dense, qtype=qtype), tmp_path / "le.nanoqwen")
    be = _convert(write_tiny_gguf(tmp_path / "be.gguf", TINY, dense, qtype=qtype, big_endian=True),
                  tmp_path / "be.nanoqwen")
    assert be.config == le.config
    for name in le.tensors:
        assert np.array_equal(np.asarray(be.tensor(name)), np.asarray(le.tensor(name))), name
    # And both hold the source's values, not byte-swapped garbage: the F32 norm as it is (a
    # GGUF keeps its formats), an F16 file's projections as their F16 values.
    np.testing.assert_array_equal(np.asarray(be.tensor("model.norm.weight")), dense["model.norm.weight"])
    if qtype == "F16":
        name = "model.layers.1.mlp.down_proj.weight"
        np.testing.assert_array_equal(np.asarray(be.tensor(name)), dense[name].astype(np.float16))


def test_big_endian_quantized_is_refused(tmp_path, rng):
    from drvqwen.format.convert import open_source

    src = write_tiny_gguf(tmp_path / "beq.gguf", TINY, random_dense(TINY, rng), qtype="Q8_0", big_endian=True)
    with pytest.raises(FormatError) as ei:
        open_source(src)
    msg = str(ei.value)
    assert "beq.gguf: big-endian GGUF with tensor" in msg and "Q8_0" in msg and "\n" not in msg


def test_gguf_without_output_is_tied(tmp_path, rng):
    dense = random_dense(TINY, rng)
    untied = _convert(write_tiny_gguf(tmp_path / "u.gguf", TINY, dense), tmp_path / "u.nanoqwen")
    tied = _convert(write_tiny_gguf(tmp_path / "t.gguf", TINY, dense, tied=True), tmp_path / "t.nanoqwen")
    assert not untied.config.tie_word_embeddings
    assert tied.config.tie_word_embeddings            # the header says what the file is
    assert tied.header.config.tie_word_embeddings
    assert np.array_equal(np.asarray(tied.tensor("lm_head.weight")),
                          np.asarray(tied.tensor("model.embed_tokens.weight")))
    assert not np.array_equal(np.asarray(untied.tensor("lm_head.weight")),
                              np.asarray(untied.tensor("model.embed_tokens.weight")))


def test_wrong_tensor_shape_is_named_before_reading(tmp_path, rng):
    from drvqwen.format.convert import open_source

    dense = random_dense(TINY, rng)
    dense["model.layers.1.mlp.up_proj.weight"] = dense["model.layers.1.mlp.up_proj.weight"][:, :128]
    src = write_tiny_gguf(tmp_path / "s.gguf", TINY, dense)
    with pytest.raises(FormatError) as ei:
        open_source(src)
    assert "s.gguf: GGUF tensor blk.1.ffn_up.weight: shape [384, 128], the config implies [384, 256]" \
        in str(ei.value)
