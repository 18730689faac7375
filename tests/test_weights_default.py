"""`drvqwen convert` without --weights: a GGUF keeps its tensors in their own formats, `--weights
int4` re-quantizes them, an HF checkpoint becomes INT4 g128 whichever is asked, and the policy
followed is said; `drvqwen info` shows the formats and the weight bytes one decode token reads.
The cache's conversions under the default policy are tested in test_cache.py."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest

from drvqwen import cli
from drvqwen.format import weight_formats as wf
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.tensor_set import default_formats, weight_shapes

from helpers import TINY, byte_tokenizer_json, random_dense, write_tiny_gguf

gguf = pytest.importorskip("gguf")

# GGUF types with exact drvqwen formats, in turn over the matrices (a K-quant where K holds
# its 256-input super-blocks), as the official GGUFs mix them.
TYPES = ("Q5_0", "Q4_K", "Q8_0", "Q6_K")
FORMAT_OF = {"Q5_0": "q5_g32", "Q8_0": "q8_g32", "Q4_K": "q4_k", "Q6_K": "q6_k"}


def _types() -> dict[str, str]:
    out = {}
    for i, (p, (_, k)) in enumerate(weight_shapes(TINY).items()):
        ty = TYPES[i % len(TYPES)]
        out[p + ".weight"] = ty if k % 256 == 0 or not ty.endswith("_K") else "Q5_0"
    return out


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    from test_weight_formats import random_blocks

    rng = np.random.default_rng(5)
    dense = random_dense(TINY, rng)
    for name, ty in _types().items():
        if ty.endswith("_K"):                       # gguf-py cannot quantize these: random blocks
            dense[name] = random_blocks(ty, *dense[name].shape, rng)
    return write_tiny_gguf(tmp_path_factory.mktemp("default") / "mixed.gguf", TINY, dense, qtype=_types())


def _convert(capsys, *args) -> tuple[NanoqwenFile, str]:
    assert cli.main(["convert", *map(str, args)]) == 0
    return NanoqwenFile(args[2]), " ".join(capsys.readouterr().err.split())


def test_a_gguf_keeps_its_formats_by_default(mixed_gguf, tmp_path, capsys):
    f, said = _convert(capsys, mixed_gguf, "-o", tmp_path / "m.nanoqwen")
    from drvqwen.format.sources import GGUFSource

    src = GGUFSource(mixed_gguf)
    assert {p: wf.FORMATS[fid].name for p, fid in f.formats.items()} == \
        {n[: -len(".weight")]: FORMAT_OF[ty] for n, ty in _types().items()}
    for prefix in f.formats:                         # the GGUF's values, bit for bit
        assert np.array_equal(f.weight(prefix), src.get(prefix + ".weight")), prefix
    assert "weights: source (the GGUF's tensors in their own formats)" in said
    assert not f.has_default_formats


def test_weights_int4_re_quantizes_a_gguf(mixed_gguf, tmp_path, capsys):
    f, said = _convert(capsys, mixed_gguf, "-o", tmp_path / "m.nanoqwen", "--weights", "int4")
    assert f.has_default_formats and f.formats == default_formats(TINY)
    assert "weights: int4 (projections re-quantized to INT4 g128" in said


def test_an_hf_checkpoint_becomes_int4_and_says_so(tmp_path, rng, capsys):
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file(random_dense(TINY, rng), str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    (src / "tokenizer.json").write_text(byte_tokenizer_json())
    for policy in ((), ("--weights", "source"), ("--weights", "int4")):
        f, said = _convert(capsys, src, "-o", tmp_path / "m.nanoqwen", *policy)
        assert f.has_default_formats, policy
        assert "weights: int4 (projections INT4 g128, embedding and lm_head FP16: an HF checkpoint has no " \
               "blocks to keep)" in said, policy


def test_info_shows_formats_and_weight_bytes_per_token(mixed_gguf, tmp_path, capsys):
    """On a GGUF converted by default: the weights per format, and the bytes one decode token
    reads, which are no more than the GGUF's own tensors' (all of them but the embedding table,
    of which one row)."""
    f, _ = _convert(capsys, mixed_gguf, "-o", tmp_path / "m.nanoqwen")
    assert cli.main(["info", str(f.path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    counts = Counter(FORMAT_OF[ty] for ty in _types().values())
    assert len(counts) == 4 and f"weight formats │ {', '.join(f'{k} ×{v}' for k, v in sorted(counts.items()))}" in out
    shown = int(re.search(r"weight bytes per decode token │ ([\d,]+) B", out)[1].replace(",", ""))
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(mixed_gguf)).tensors}
    embd = tensors.pop("token_embd.weight")
    assert shown == sum(tensors.values()) + embd // TINY.vocab_size     # kept exactly: equal


def test_weights_are_checked_a_block_of_rows_at_a_time(mixed_gguf, tmp_path, monkeypatch):
    """With blocks of 7 rows (every weight in several, the last one short), every exact copy
    still equals the GGUF's values (or conversion stops), and an INT4 re-quantization reports
    the error of the whole weight."""
    from drvqwen.format import convert as cv, quant
    from drvqwen.format.sources import GGUFSource

    monkeypatch.setattr(cv, "CHECK_ROWS", 7)
    kept = cv.convert(mixed_gguf, tmp_path / "kept.nanoqwen")
    assert len(kept.errors) == len(_types()) and all(e.max_abs == 0.0 for e in kept.errors)
    int4 = cv.convert(mixed_gguf, tmp_path / "int4.nanoqwen", weights="int4")
    f, src = NanoqwenFile(tmp_path / "int4.nanoqwen"), GGUFSource(mixed_gguf)
    for e in int4.errors:
        whole = quant.reconstruction_error(src.get(e.name + ".weight"), f.weight(e.name))
        assert e.rel_l2 == pytest.approx(whole["rel_l2"], rel=1e-9) and e.max_abs == whole["max_abs"], e.name
