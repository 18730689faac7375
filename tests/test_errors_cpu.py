"""User-facing error paths reachable without a GPU: each raises a DrvqwenError subclass whose
one-line message names the file, field or value at fault (src/drvqwen/errors.py).

Complements test_format.py (header corruption), test_tokenizer.py (GGUF metadata) and
test_engine_host.py / test_generate.py (prompt checks). Everything here uses the TINY model
(tests/helpers.py) or hand-made files of a few KB; no download, no GPU.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from drvqwen.config import QwenConfig
from drvqwen.errors import ConfigError, DrvqwenError, FormatError
from drvqwen.format import nanoqwen, quant
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.nanoqwen_writer import NanoqwenWriter

from helpers import TINY, minimal_tokenizer_json, random_dense, write_model


def _one_line(e: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, (p, msg)
    return msg


# ---- config.py ----------------------------------------------------------------------------------

BAD_FIELDS = [
    ({"hidden_size": 0}, "hidden_size=0"),
    ({"num_heads": True}, "num_heads=True"),
    ({"vocab_size": (1 << 20) + 1}, "vocab_size="),
    ({"intermediate_size": (1 << 18) + 1}, "intermediate_size="),
    ({"num_layers": 513}, "num_layers=513"),
    ({"num_heads": 5, "num_kv_heads": 2}, "num_heads=5"),
    ({"head_dim": 63}, "head_dim=63"),
    ({"rope_theta": 0.0}, "rope_theta=0.0"),
    ({"rms_norm_eps": 1.0}, "rms_norm_eps=1.0"),
]


@pytest.mark.parametrize("change,expect", BAD_FIELDS, ids=[str(c) for c, _ in BAD_FIELDS])
def test_config_field_is_named(change, expect):
    with pytest.raises(ConfigError) as ei:
        dataclasses.replace(TINY, **change)
    _one_line(ei, "config", expect)


def _hf_dict(cfg: QwenConfig = TINY) -> dict:
    return {"model_type": "qwen2", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "max_position_embeddings": cfg.max_position, "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings}


def test_hf_config_errors(tmp_path):
    assert QwenConfig.from_hf_dict(_hf_dict()) == TINY
    with pytest.raises(ConfigError) as ei:
        QwenConfig.from_hf_dict({**_hf_dict(), "model_type": "llama"}, source="x/config.json")
    _one_line(ei, "x/config.json", "model_type='llama'")
    d = _hf_dict()
    del d["intermediate_size"]
    with pytest.raises(ConfigError) as ei:
        QwenConfig.from_hf_dict(d, source="y/config.json")
    _one_line(ei, "y/config.json", "missing field 'intermediate_size'")
    with pytest.raises(ConfigError) as ei:
        QwenConfig.from_hf_dict({**_hf_dict(), "hidden_size": "wide"}, source="z/config.json")
    _one_line(ei, "z/config.json", "bad value", "wide")
    with pytest.raises(ConfigError) as ei:
        QwenConfig.from_hf_json(tmp_path / "config.json")
    _one_line(ei, "config.json", "file not found")
    (tmp_path / "config.json").write_text('{"model_type": "qwen2",\n "hidden_size": }')
    with pytest.raises(ConfigError) as ei:
        QwenConfig.from_hf_json(tmp_path / "config.json")
    _one_line(ei, "config.json", "not valid JSON", "line 2")


def test_gguf_config_errors():
    meta = {"general.architecture": "qwen2", "qwen2.attention.head_count": 4,
            "qwen2.embedding_length": 256}
    with pytest.raises(ConfigError) as ei:
        QwenConfig.from_gguf_fields({"general.architecture": "llama"}.get, "m.gguf", 512)
    _one_line(ei, "m.gguf", "general.architecture='llama'")
    with pytest.raises(ConfigError) as ei:
        QwenConfig.from_gguf_fields(meta.get, "m.gguf", 512)
    _one_line(ei, "m.gguf", "GGUF metadata key 'qwen2.feed_forward_length' missing")


# ---- nanoqwen writer ---------------------------------------------------------------------------

def test_writer_rejects_dtype_and_extra_tensor(tmp_path, rng):
    path = tmp_path / "w.nanoqwen"
    with pytest.raises(FormatError) as ei:
        with NanoqwenWriter(path, TINY, minimal_tokenizer_json()) as w:
            w.add("model.norm.weight", np.zeros(TINY.hidden_size, np.int64))
    _one_line(ei, str(path), "model.norm.weight", "int64", "not storable")
    assert not path.exists()

    dense = random_dense(TINY, rng)
    with pytest.raises(FormatError) as ei:
        with NanoqwenWriter(path, TINY, minimal_tokenizer_json()) as w:
            for name, (dt, shape) in nanoqwen.expected_tensors(TINY).items():
                w.add(name, np.zeros(shape, dt))
            w.add("model.extra.weight", dense["model.norm.weight"].astype(np.float16))
    _one_line(ei, str(path), "unexpected tensor model.extra.weight")
    assert not path.exists()


# ---- nanoqwen reader: the tensor table and the embedded tokenizer -------------------------------

@pytest.fixture
def model_file(tmp_path, rng):
    path = tmp_path / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng))
    return path


def _patch_header(raw: bytearray, off: int, fmt: str, val) -> None:
    struct.pack_into(fmt, raw, off, val)
    struct.pack_into("<I", raw, 252, zlib.crc32(bytes(raw[:252])))


def _rewrite_table(path: Path, edit) -> None:
    """Re-pack the (version-3) tensor table with `edit(records)` applied (records: name, code,
    shape, off, nbytes, crc, format id; same byte size), then fix the table and header CRCs so that the table check
    under test is what fires."""
    with NanoqwenFile(path) as f:
        infos = list(f.tensors.values())
    recs = [[i.name, nanoqwen.DTYPE_CODES[i.dtype], list(i.shape), i.offset, i.nbytes, i.crc32, i.format_id]
            for i in infos]
    edit(recs)
    table = b"".join(struct.pack("<H", len(n.encode())) + n.encode() + struct.pack("<BBB", c, fid, len(s))
                     + struct.pack(f"<{len(s)}Q", *s) + struct.pack("<QQI", o, nb, crc)
                     for n, c, s, o, nb, crc, fid in recs)
    raw = bytearray(path.read_bytes())
    t_off, t_size = struct.unpack_from("<QQ", raw, 88)
    assert len(table) == t_size
    raw[t_off:t_off + t_size] = table
    _patch_header(raw, 148, "<I", zlib.crc32(table))
    path.write_bytes(bytes(raw))


def _rec(recs, name):
    return next(r for r in recs if r[0] == name)


NORM = "model.norm.weight"
L0 = "model.layers.0.input_layernorm.weight"
L1 = "model.layers.1.input_layernorm.weight"
QW = "model.layers.0.self_attn.q_proj.qweight"
F32 = [c for dt, c in nanoqwen.DTYPE_CODES.items() if dt == np.dtype(np.float32)][0]

TABLE_DAMAGE = {
    "unknown dtype": (lambda r: _rec(r, NORM).__setitem__(1, 99), f"tensor {NORM}: unknown dtype code 99"),
    "nbytes": (lambda r: _rec(r, NORM).__setitem__(4, 3), f"tensor {NORM}: nbytes=3 disagrees"),
    "misaligned": (lambda r: _rec(r, NORM).__setitem__(3, _rec(r, NORM)[3] + 2), f"tensor {NORM}: offset"),
    "outside data": (lambda r: _rec(r, NORM).__setitem__(3, 1 << 40), "outside the data region"),
    "twice": (lambda r: _rec(r, L0).__setitem__(0, L1), f"tensor {L1} listed twice"),
    "missing": (lambda r: _rec(r, L0).__setitem__(0, L0.replace("0", "7")), f"tensor {L0} missing"),
    "wrong dtype": (lambda r: _rec(r, QW).__setitem__(1, F32), f"tensor {QW}: float32"),
}


@pytest.mark.parametrize("kind", list(TABLE_DAMAGE))
def test_table_errors_name_the_tensor(model_file, kind):
    edit, expect = TABLE_DAMAGE[kind]
    _rewrite_table(model_file, edit)
    with pytest.raises(FormatError) as ei:
        NanoqwenFile(model_file)
    _one_line(ei, str(model_file), expect)


def test_unprintable_table_name_keeps_the_error_on_one_line(model_file):
    """A damaged name-length field reads into binary bytes; the message must stay one line."""
    def edit(recs):
        r = _rec(recs, NORM)
        r[0] = "x\n" + "\x01" * (len(NORM) - 2)       # same byte length: the table keeps its size
    _rewrite_table(model_file, edit)
    with pytest.raises(FormatError) as ei:
        NanoqwenFile(model_file)
    _one_line(ei, str(model_file), "is not a tensor name")


def test_directory_and_tokenizer_errors(model_file, tmp_path):
    with pytest.raises(FormatError) as ei:
        NanoqwenFile(tmp_path)
    _one_line(ei, str(tmp_path), "is a directory")

    raw = bytearray(model_file.read_bytes())
    tok_off, tok_size = struct.unpack_from("<QQ", raw, 104)
    raw[tok_off] = 0xFF                       # not UTF-8 (0xFF never starts a sequence)
    model_file.write_bytes(bytes(raw))
    with pytest.raises(FormatError) as ei:
        NanoqwenFile(model_file)
    _one_line(ei, str(model_file), "embedded tokenizer checksum mismatch")

    _patch_header(raw, 152, "<I", zlib.crc32(bytes(raw[tok_off:tok_off + tok_size])))
    model_file.write_bytes(bytes(raw))
    with pytest.raises(FormatError) as ei:
        NanoqwenFile(model_file)
    _one_line(ei, str(model_file), "embedded tokenizer is not UTF-8")


def test_dequantize_wrong_dtypes(rng):
    qw, s = quant.quantize_packed(rng.standard_normal((16, 128)).astype(np.float32))
    with pytest.raises(FormatError) as ei:
        quant.dequantize(qw.astype(np.int32), s)
    _one_line(ei, "dequantize", "int32", "float16")


# ---- convert.py: HF folders and other sources ---------------------------------------------------

def _hf_folder(folder: Path, dense: dict[str, np.ndarray] | None, *, tokenizer=True, cfg=TINY) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_hf_dict(cfg)))
    if tokenizer:
        (folder / "tokenizer.json").write_text(minimal_tokenizer_json())
    if dense is not None:
        save_file(dense, str(folder / "model.safetensors"))
    return folder


def _convert_error(src, out: Path, *parts: str, cls=FormatError) -> None:
    from drvqwen.format.convert import convert

    with pytest.raises(cls) as ei:
        convert(src, out)
    _one_line(ei, *parts)
    assert not out.exists()


def test_convert_source_errors(tmp_path, rng):
    pytest.importorskip("safetensors")
    out = tmp_path / "out.nanoqwen"
    _convert_error(tmp_path / "nope", out, "nope: file not found", cls=DrvqwenError)
    (tmp_path / "noconfig").mkdir()
    _convert_error(tmp_path / "noconfig", out, "noconfig: a folder with no config.json: not an HF checkpoint folder",
                   cls=ConfigError)
    _convert_error(_hf_folder(tmp_path / "notok", {}, tokenizer=False), out,
                   "tokenizer.json: file not found")
    _convert_error(_hf_folder(tmp_path / "nosafe", None), out, "nosafe: no *.safetensors files")
    bad = _hf_folder(tmp_path / "badsafe", None)
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    _convert_error(bad, out, "model.safetensors: not a readable safetensors file")

    dense = random_dense(TINY, rng)
    only_embed = {"model.embed_tokens.weight": dense["model.embed_tokens.weight"]}
    _convert_error(_hf_folder(tmp_path / "partial", only_embed), out,
                   "partial: tensor", "missing from the safetensors files")
    _convert_error(_hf_folder(tmp_path / "nolm", {k: v for k, v in dense.items() if k != "lm_head.weight"}),
                   out, "nolm: lm_head.weight missing and tie_word_embeddings is false")
    huge = {**dense, "model.embed_tokens.weight": dense["model.embed_tokens.weight"] * 1e7}
    _convert_error(_hf_folder(tmp_path / "huge", huge), out,
                   "huge: tensor model.embed_tokens.weight has values", "FP16 cannot hold")
    nan = dict(dense)
    nan["model.layers.0.self_attn.q_proj.weight"] = nan["model.layers.0.self_attn.q_proj.weight"].copy()
    nan["model.layers.0.self_attn.q_proj.weight"][3, 5] = np.nan
    _convert_error(_hf_folder(tmp_path / "nan", nan), out,
                   "nan: tensor model.layers.0.self_attn.q_proj.weight has NaN/Inf values")


def test_bad_gguf_file_is_named(tmp_path):
    from drvqwen.format.convert import open_source
    from drvqwen.tokenizer import Tokenizer

    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(FormatError) as ei:
        open_source(path)
    _one_line(ei, "broken.gguf", "GGUF version field 4294967295")
    with pytest.raises(DrvqwenError) as ei:
        Tokenizer.from_gguf(path)
    _one_line(ei, "broken.gguf", "GGUF version field 4294967295")


def test_tokenizer_without_stop_tokens():
    from drvqwen.tokenizer import Tokenizer

    tok = Tokenizer.from_json(minimal_tokenizer_json(), source="m.nanoqwen")
    with pytest.raises(DrvqwenError) as ei:
        tok.stop_ids
    _one_line(ei, "m.nanoqwen", "tokenizer has no", "token")
    with pytest.raises(DrvqwenError) as ei:
        Tokenizer.from_json("{not json", source="m.nanoqwen")
    _one_line(ei, "m.nanoqwen", "embedded tokenizer.json is invalid")


# ---- models.py, bench.py -------------------------------------------------------------------------

def test_resolve_model_missing(tmp_path):
    from drvqwen.models import resolve_model

    with pytest.raises(DrvqwenError) as ei:
        resolve_model(str(tmp_path / "absent.nanoqwen"))
    _one_line(ei, "absent.nanoqwen: file not found")


def test_bench_unknown_preset():
    from drvqwen.bench import ensure_synthetic

    with pytest.raises(DrvqwenError) as ei:
        ensure_synthetic("13b")
    _one_line(ei, "--preset 13b: choose one of")


def test_prefill_unknown_attention_engine():
    """Prefill refuses an attention engine it has no kernel for before it touches the GPU."""
    from drvqwen.prefill import Prefill

    with pytest.raises(DrvqwenError) as ei:
        Prefill(None, attention_engine="tma")
    _one_line(ei, "attention engine 'tma': choose one of mma, wgmma")
    with pytest.raises(DrvqwenError) as ei:
        Prefill(None, last_layer="none")
    _one_line(ei, "last_layer 'none': choose one of last_row, all_rows")


# ---- cli.py argument checks (in process: main() returns 2 and prints one line) -------------------

def _cli(capsys, *argv: str) -> str:
    from drvqwen.cli import main

    assert main(list(argv)) == 2
    lines = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    return lines[0]


CLI_RUN_ERRORS = [
    ([], "give a prompt: PROMPT, --prompt TEXT, --prompt-file FILE (- = stdin)"),
    (["--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens=-1: must be >= 0"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature=-1.0: must be a finite number >= 0"),
    (["--prompt", "hi", "--top-k", "-2"], "top_k=-2: must be >= 0"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p=1.5: must be in [0, 1]"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "/nonexistent/prompt.txt: cannot read prompt"),
    (["--prompt", "hi", "--min-p", "2"], "min_p=2.0: must be in [0, 1]"),
    (["--prompt", "hi", "--repeat-penalty", "0"], "repeat_penalty=0.0: must be a finite number > 0"),
    # float32 (both backends' type for it) would hold these as inf and 0
    (["--prompt", "hi", "--repeat-penalty", "1e308"], "repeat_penalty=1e+308: must be a finite number > 0 that float32"),
    (["--prompt", "hi", "--repeat-penalty", "1e-308"], "repeat_penalty=1e-308: must be a finite number > 0 that float32"),
    (["--prompt", "hi", "--stop", ""], "stop string '': must be a non-empty string"),
    # Conflicting options are refused, never silently resolved.
    (["--prompt", "hi", "--fim-prefix", "a"], "--prompt and --fim-prefix/--fim-suffix: give one prompt source"),
    (["--prompt", "hi", "--prompt-file", "x.txt"], "--prompt and --prompt-file: give one prompt source"),
    (["hi", "--prompt", "ho"], "give the prompt once: either PROMPT or --prompt"),
    (["hi", "--prompt-file", "x.txt"], "--prompt and --prompt-file: give one prompt source"),
    (["--prompt", "hi", "--raw", "--system", "s"], "--system with --raw: a raw prompt has no chat template"),
    (["--prompt", "hi", "--eager", "--device", "cpu"], "--eager: the CPU backend has no CUDA graphs"),
]


@pytest.mark.parametrize("args,expect", CLI_RUN_ERRORS, ids=[e[:24] for _, e in CLI_RUN_ERRORS])
def test_cli_run_argument_errors(capsys, tmp_path, monkeypatch, args, expect):
    # The checks come before the model is opened: --model need not exist. stdin is a terminal
    # here (else a run without a prompt reads it).
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    line = _cli(capsys, "run", "--model", str(tmp_path / "unused.nanoqwen"), *args)
    assert expect in line, line


@pytest.mark.parametrize("args,expect", [
    (["--eager", "--device", "cpu"], "--eager: the CPU backend has no CUDA graphs"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0: a chat answer needs at least 1"),
    (["--min-p", "-0.5"], "min_p=-0.5: must be in [0, 1]"),
])
def test_cli_chat_argument_errors(capsys, tmp_path, args, expect):
    line = _cli(capsys, "chat", "--model", str(tmp_path / "unused.nanoqwen"), *args)
    assert expect in line, line


def test_cli_run_missing_model(capsys, tmp_path):
    line = _cli(capsys, "run", "--model", str(tmp_path / "absent.nanoqwen"), "--prompt", "hi")
    assert "absent.nanoqwen: file not found" in line


def test_cli_convert_output_is_a_directory(capsys, tmp_path):
    line = _cli(capsys, "convert", str(tmp_path / "src"), "-o", str(tmp_path))
    assert f"{tmp_path}: is a directory; give the output file name" in line


def test_cli_device_cuda_without_gpu(capsys, model_file):
    from drvqwen.cuda import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present: --device cuda would run")
    line = _cli(capsys, "run", "--model", str(model_file), "--raw", "--prompt", "hi",
                "--max-new-tokens", "1", "--device", "cuda")
    assert "--device cuda:" in line, line


# ---- malformed GGUF tokenizer metadata / tensors (tiny files written here) ----------------------

def _gguf(path: Path, *, model="gpt2", tokens=None, types=None, merges=("a b",)) -> Path:
    gguf = pytest.importorskip("gguf")
    from drvqwen.tokenizer_gguf import BYTE_TO_CHAR

    tokens = tokens if tokens is not None else [BYTE_TO_CHAR[b] for b in range(256)] + ["ab"]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types if types is not None else [1] * len(tokens))
    w.add_token_merges(list(merges))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_tokenizer_errors(tmp_path):
    from drvqwen.tokenizer import Tokenizer
    from drvqwen.tokenizer_gguf import BYTE_TO_CHAR

    byte_tokens = [BYTE_TO_CHAR[b] for b in range(256)]
    cases = [
        (dict(model="llama"), "tokenizer.ggml.model='llama', expected 'gpt2'"),
        (dict(types=[1] * 10), "tokenizer.ggml.token_type has 10 entries, tokenizer.ggml.tokens has 257"),
        (dict(tokens=byte_tokens + [byte_tokens[65]]), "tokenizer.ggml.tokens[256]='A' duplicates entry 65"),
        (dict(merges=("abc",)), "tokenizer.ggml.merges[0]='abc' is not 'left right'"),
        (dict(merges=("a bc",)), "tokenizer.ggml.merges do not fit tokenizer.ggml.tokens"),
    ]
    for i, (kw, expect) in enumerate(cases):
        path = _gguf(tmp_path / f"t{i}.gguf", **kw)
        with pytest.raises(DrvqwenError) as ei:
            Tokenizer.from_gguf(path)
        _one_line(ei, f"t{i}.gguf", expect)


def test_gguf_without_embedding_tensor(tmp_path):
    from drvqwen.format.convert import open_source

    path = _gguf(tmp_path / "noembd.gguf")
    with pytest.raises(FormatError) as ei:
        open_source(path)
    _one_line(ei, "noembd.gguf", "GGUF tensor token_embd.weight missing")
