"""The format fuzzer (tools/fuzz_formats.py) as a test: a few hundred seeded cases of mutated
synthetic `.nanoqwen` and GGUF files through `info`, `convert` and `run`, every outcome an exit
0 or one line naming the file (exit 2) — no traceback, hang, large allocation or leftover file.
The full 10 000-case run (with the real models) is the tool's own command line.

Also the GGUF structure check (format/gguf_check.py) on fields the fuzzer aims at, each named.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from drvqwen.errors import FormatError

from helpers import load_tool

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def fz():
    return load_tool("fuzz_formats")


def test_seeded_fuzz_cases_are_clean(fz, seed, tmp_path):
    s = fz.run_fuzz(300, seed, tmp_path, progress=False)
    assert sum(s["outcomes"].values()) == 300
    assert s["outcomes"].get("ok", 0) > 0 and s["outcomes"].get("error", 0) > 0
    assert s["failures"] == [], "\n".join(f"{f['replay']}: {f['outcome']}: {f.get('mutation')}: {f['detail']}"
                                          for f in s["failures"])


@pytest.fixture
def tiny_gguf(fz, tmp_path):
    return fz.build_corpus(tmp_path / "seeds", None, None)["syn_f32.gguf"]


def _set(fz, path: Path, field_name: str, value) -> Path:
    f = next(f for f in fz.gguf_layout(path).fields if f.name == field_name)
    raw = bytearray(path.read_bytes())
    struct.pack_into(f.fmt, raw, f.offset, value)
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("field_name,value,expect", [
    ("kv[tokenizer.ggml.tokens].count", 2**40, "GGUF metadata 'tokenizer.ggml.tokens' (1099511627776 strings): needs"),
    ("kv_count", 2**62, "GGUF kv_count: 4611686018427387904 pairs cannot fit"),
    ("tensor_count", 10**9, "GGUF tensor_count: 1000000000 tensors cannot fit"),
    ("kv[general.architecture].type", 99, "GGUF metadata 'general.architecture': value type 99 is not supported"),
    ("tensor[token_embd.weight].n_dims", 9, "GGUF tensor 'token_embd.weight' n_dims: 9, must be in [1, 4]"),
    ("tensor[token_embd.weight].type", 1234, "GGUF tensor 'token_embd.weight' type: 1234 is not a GGML type"),
    ("tensor[token_embd.weight].dim1", 2**60, "GGUF tensor 'token_embd.weight' offset: bytes"),
    ("tensor[token_embd.weight].offset", 3, "GGUF tensor 'token_embd.weight' offset: 3 is not a multiple of the alignment 32"),
    ("version", 7, "GGUF version field 7"),
])
def test_gguf_structure_errors_name_the_field(fz, tiny_gguf, field_name, value, expect):
    from drvqwen.format.gguf_check import check_gguf

    _set(fz, tiny_gguf, field_name, value)
    t0 = time.perf_counter()
    with pytest.raises(FormatError) as ei:
        check_gguf(tiny_gguf)
    assert time.perf_counter() - t0 < 5        # a huge count is refused, not looped over
    assert str(tiny_gguf) in str(ei.value) and expect in str(ei.value), str(ei.value)
