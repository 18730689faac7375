"""`.nanoqwen` round trip and every kind of bad input (docs/file-format.md): each gives a FormatError
naming the file and the field, and the CLI turns it into one line and exit status 2."""

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from drvqwen.errors import FormatError
from drvqwen.format import nanoqwen
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.nanoqwen_writer import NanoqwenWriter

from helpers import TINY, minimal_tokenizer_json, random_dense, write_model


@pytest.fixture
def model_file(tmp_path, rng):
    path = tmp_path / "tiny.nanoqwen"
    stored = write_model(path, TINY, random_dense(TINY, rng))
    return path, stored


def test_roundtrip_bit_exact(model_file):
    path, stored = model_file
    with NanoqwenFile(path) as f:
        assert f.config == TINY
        assert f.tokenizer_json == minimal_tokenizer_json()
        assert set(f.tensors) == set(stored)
        for name, a in stored.items():
            b = f.tensor(name)
            assert b.dtype == a.dtype and b.shape == a.shape
            assert np.asarray(b).tobytes() == a.tobytes(), name
            assert f.tensors[name].offset % nanoqwen.DATA_ALIGN == 0
        f.verify_data()


def test_writer_leaves_nothing_on_error(tmp_path, rng):
    path = tmp_path / "bad.nanoqwen"
    with pytest.raises(FormatError, match="missing"):
        with NanoqwenWriter(path, TINY, minimal_tokenizer_json()) as w:
            w.add("model.embed_tokens.weight", np.zeros((TINY.vocab_size, TINY.hidden_size), np.float16))
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def _rewrite_header(path: Path, **fields_at):
    """Patch header fields (offset → (fmt, value)) and recompute the header CRC, so that the
    check under test — not the CRC — is what fires."""
    raw = bytearray(path.read_bytes())
    for off, (fmt, val) in fields_at.items():
        struct.pack_into(fmt, raw, int(off), val)
    struct.pack_into("<I", raw, 252, zlib.crc32(bytes(raw[:252])))
    path.write_bytes(bytes(raw))


def _flip(path: Path, offset: int):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def _table_offset(path: Path) -> int:
    return struct.unpack_from("<Q", path.read_bytes(), 88)[0]


CORRUPTIONS = {
    "missing file": (lambda p: p.unlink(), "file not found"),
    "not nanoqwen": (lambda p: p.write_bytes(b"GGUF" + b"\0" * 600), "not a .nanoqwen file"),
    "empty file": (lambda p: p.write_bytes(b""), "not a .nanoqwen file"),
    "truncated header": (lambda p: p.write_bytes(p.read_bytes()[:100]), "truncated"),
    "truncated data": (lambda p: p.write_bytes(p.read_bytes()[:-5000]), "file_size"),
    "trailing bytes": (lambda p: p.write_bytes(p.read_bytes() + b"x"), "trailing"),
    "wrong magic": (lambda p: p.write_bytes(b"NANOQWEX" + p.read_bytes()[8:]), "magic"),
    "wrong version": (lambda p: _rewrite_header(p, **{"8": ("<I", 99)}), "version"),
    "size fields disagree": (lambda p: _rewrite_header(p, **{"136": ("<Q", 10**6)}), "file_size"),
    "table outside file": (lambda p: _rewrite_header(p, **{"96": ("<Q", 10**12)}), "table_offset"),
    "bad config": (lambda p: _rewrite_header(p, **{"36": ("<I", 3)}), "num_kv_heads"),
    "bad quant": (lambda p: _rewrite_header(p, **{"72": ("<I", 64)}), "quant"),
    "flipped header byte": (lambda p: _flip(p, 20), "header_crc32"),
    "flipped table byte": (lambda p: _flip(p, _table_offset(p) + 7), "table checksum"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_a_clear_error(model_file, kind):
    path, _ = model_file
    damage, expect = CORRUPTIONS[kind]
    damage(path)
    with pytest.raises(FormatError) as ei:
        NanoqwenFile(path)
    msg = str(ei.value)
    assert str(path) in msg and expect in msg, msg
    assert "\n" not in msg


def test_flipped_data_byte_found_by_verify(model_file):
    path, _ = model_file
    with NanoqwenFile(path) as f:
        off = f.tensors["model.norm.weight"].offset
    _flip(path, off + 3)
    with NanoqwenFile(path) as f:  # data CRCs are checked on request only
        with pytest.raises(FormatError, match="model.norm.weight"):
            f.verify_data()


def _cli(*args, env=None):
    e = dict(os.environ)
    e["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "drvqwen.cli", *args], capture_output=True,
                          text=True, env=e, timeout=120)


@pytest.mark.parametrize("kind", ["missing file", "truncated data", "flipped header byte", "wrong version"])
def test_cli_reports_one_line_no_traceback(model_file, kind):
    path, _ = model_file
    CORRUPTIONS[kind][0](path)
    for cmd in (["info", str(path)], ["run", "--model", str(path), "--prompt", "hi", "--device", "cpu"]):
        r = _cli(*cmd)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
        assert len(lines) == 1 and "error:" in lines[0] and path.name in lines[0], r.stderr


def test_cli_info_prints_config(model_file):
    path, _ = model_file
    r = _cli("info", str(path), "--verify")
    assert r.returncode == 0, r.stderr
    assert "hidden_size" in r.stdout and str(TINY.hidden_size) in r.stdout


def test_cli_convert_refuses_to_overwrite_its_source(model_file, tmp_path):
    """-o naming the source itself (the same path, a link to it, a hard link of it) is refused
    before anything is written: the conversion would replace its own input."""
    path, _ = model_file
    before = path.read_bytes()
    link, hard = tmp_path / "link.nanoqwen", tmp_path / "hard.nanoqwen"
    link.symlink_to(path)
    os.link(path, hard)
    for out in (path, link, hard):
        r = _cli("convert", str(path), "-o", str(out))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"{out}: is the source {path} itself" in r.stderr
    assert path.read_bytes() == before


def test_cli_convert_bad_source_leaves_no_output(tmp_path):
    src = tmp_path / "not_a_model.bin"
    src.write_bytes(b"hello world" * 100)
    out = tmp_path / "out.nanoqwen"
    r = _cli("convert", str(src), "-o", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "not_a_model.bin" in r.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["not_a_model.bin"]


def test_info_shows_a_float32_widened_float_by_its_shortest_decimal():
    """A GGUF's float32 1e-06 arrives as the double 9.999999974752427e-07: info shows 1e-06;
    a double that is no float32 (an HF config's 123456.789) is shown as it is."""
    from drvqwen.nanoqwen_cli import _shown_float

    assert _shown_float(float(np.float32(1e-6))) == 1e-6
    assert _shown_float(float(np.float32(1e6))) == 1e6
    assert _shown_float(123456.789) == 123456.789 and _shown_float(1.2345678901e-6) == 1.2345678901e-6
