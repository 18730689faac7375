"""Model sources for `drvqwen convert`: an HF checkpoint folder or a GGUF file. Each gives the
config, the tokenizer.json text, the end-of-sequence ids it names, and tensors by HF name as
float32 (`get`); a GGUF also its tensors' GGML types and raw blocks (`type_name`, `blocks`).

- HF folder: config.json (model_type qwen2), *.safetensors (bf16/fp16/fp32, read with the
  `safetensors` numpy loader, which handles bf16 through ml_dtypes), tokenizer.json.
  A tied checkpoint (`tie_word_embeddings`, 0.5B–3B) uses the embedding as lm_head.
- GGUF (any tensor type the `gguf` package dequantizes): metadata `qwen2.*`, tensors
  `token_embd`, `blk.N.attn_q` …, and its own `output.weight` (the official 0.5B GGUF stores it
  separately, as Q8_0); without one the model is tied (as llama.cpp reads it). Big-endian
  files are read when their weights are F32/F16. The tokenizer is rebuilt from the GGUF's
  tokens and merges (tokenizer_gguf.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import QwenConfig
from ..errors import ConfigError, DrvqwenError, FormatError
from . import gguf_blocks
from . import weight_formats as wf
from .gguf_check import check_gguf
from .tensor_set import expected_tensors


# ---------------------------------------------------------------------------------------------
# Sources: each gives the config, the tokenizer.json text, and tensors by HF name (float32).
# ---------------------------------------------------------------------------------------------
INDEX_NAME = "model.safetensors.index.json"


def hf_source_files(folder: Path) -> list[Path]:
    """The files a conversion of HF `folder` reads, in a fixed order: config.json,
    generation_config.json (if present), tokenizer.json, then the index and exactly the
    shards it names, or every *.safetensors without an index (HFSource's rule).

    Raises:
        FormatError: the index is malformed (see _read_index).
    """
    files = [folder / "config.json"]
    if (folder / "generation_config.json").is_file():
        files.append(folder / "generation_config.json")
    files.append(folder / "tokenizer.json")
    index = folder / INDEX_NAME
    if index.exists():
        files += [index] + [folder / n for n in sorted(set(_read_index(index).values()))]
    else:
        files += sorted(folder.glob("*.safetensors"))
    return files


class HFSource:
    """A Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json).

    With a `model.safetensors.index.json`, exactly the shards its `weight_map` names are read
    and each tensor is taken from the shard the index names for it; other `*.safetensors` in
    the folder (a stale shard of an older download) are ignored. Without an index, every
    `*.safetensors` is read. Either way a tensor stored in two files is refused: which copy is
    the model cannot be known.

    `hf_source_files` lists the files this reads (what the conversion cache hashes).
    """

    kind = "hf"

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = folder
        self.config = QwenConfig.from_hf_json(folder / "config.json")
        tok = folder / "tokenizer.json"
        if not tok.is_file():
            raise FormatError(f"{tok}: file not found (the HF folder needs its tokenizer.json)")
        try:
            self.tokenizer_json = tok.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"{tok}: not UTF-8 ({e.reason} at byte {e.start})") from None
        # End-of-sequence ids the checkpoint names itself (generation_config.json, config.json),
        # added to the end-of-generation set found by name.
        self.eos_ids = _hf_eos_ids(folder)
        index = folder / INDEX_NAME
        weight_map = _read_index(index) if index.exists() else None
        if weight_map is not None:
            files = [folder / n for n in sorted(set(weight_map.values()))]
            for fpath in files:
                if not fpath.is_file():
                    raise FormatError(f"{index}: shard {fpath.name} named in weight_map is missing")
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FormatError(f"{folder}: no *.safetensors files")
        self._where: dict[str, object] = {}
        self._handles = []
        found_in: dict[str, Path] = {}
        for fpath in files:
            try:
                h = safe_open(str(fpath), framework="numpy")
            except Exception as e:  # safetensors raises its own error types
                raise FormatError(f"{fpath}: not a readable safetensors file ({e})") from None
            self._handles.append(h)
            for k in h.keys():
                if k in found_in:
                    raise FormatError(f"{folder}: tensor {k} is stored twice, in {found_in[k].name} "
                                      f"and {fpath.name}")
                found_in[k] = fpath
                if weight_map is not None and weight_map.get(k) != fpath.name:
                    if k in weight_map:
                        raise FormatError(f"{index}: tensor {k} is mapped to {weight_map[k]} but "
                                          f"stored in {fpath.name}")
                    continue      # not part of the model the index describes
                self._where[k] = h
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(found_in))
            if absent:
                raise FormatError(f"{index}: tensor {absent[0]} is not in its shard {weight_map[absent[0]]}")

    def get(self, name: str) -> np.ndarray:
        if name == "lm_head.weight" and name not in self._where:
            if not self.config.tie_word_embeddings:
                raise FormatError(f"{self.folder}: lm_head.weight missing and tie_word_embeddings is false")
            name = "model.embed_tokens.weight"
        h = self._where.get(name)
        if h is None:
            raise FormatError(f"{self.folder}: tensor {name} missing from the safetensors files")
        return np.asarray(h.get_tensor(name)).astype(np.float32)


def _read_index(index: Path) -> dict[str, str]:
    """The weight_map of a model.safetensors.index.json: tensor name → shard file name.

    Raises:
        FormatError: unreadable JSON, no weight_map object, or a shard name that is not a plain
            file name of the folder (no paths: the index cannot point outside the checkpoint).
    """
    import json

    try:
        d = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FormatError(f"{index}: not a readable JSON index ({e})") from None
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise FormatError(f"{index}: no weight_map object")
    for k, v in wm.items():
        if not isinstance(v, str) or not v.endswith(".safetensors") or Path(v).name != v or v.startswith("."):
            raise FormatError(f"{index}: weight_map[{k!r}]={v!r} is not a shard file name of the folder")
    return wm


def _hf_eos_ids(folder: Path) -> tuple[int, ...]:
    """eos_token_id (an int or a list) of generation_config.json and config.json, if any."""
    import json

    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            v = json.loads((folder / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for x in (v if isinstance(v, list) else [v]):
            if isinstance(x, int) and not isinstance(x, bool):
                ids.append(x)
    return tuple(ids)


# GGUF tensor names for the HF ones (llama.cpp's convert_hf_to_gguf.py, Qwen2 mapping).
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """HF tensor name → GGUF tensor name (e.g. model.layers.3.mlp.up_proj.weight → blk.3.ffn_up.weight)."""
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    parts = hf_name.split(".")
    layer = parts[2]
    rest = ".".join(parts[3:])
    for hf, gg in _GGUF_LAYER.items():
        if rest == hf or rest.startswith(hf + "."):
            return f"blk.{layer}.{gg}{rest[len(hf):]}"
    raise KeyError(hf_name)


# GGML types whose data gguf-py hands over as plain numpy arrays of the file's byte order
# (dtype '>f4' in a big-endian file), so reading them with their dtype is right either way.
_PLAIN_FLOAT_TYPES = ("F32", "F16", "F64")


def _dense_shapes(cfg: QwenConfig) -> dict[str, tuple[int, ...]]:
    """HF name → shape of every dense tensor a source must provide for `cfg` (the INT4
    projections as their [N, K] weights)."""
    out = {}
    for name, (_, shape) in expected_tensors(cfg).items():
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            out[name[: -len(".qweight")] + ".weight"] = (shape[0], shape[1] * 8)
        else:
            out[name] = shape
    return out


class _Metadata:
    """GGUF metadata as QwenConfig.from_gguf_fields reads it: called with a key (the value or
    None), and `keys()` (to find keys drvqwen does not interpret, e.g. RoPE scaling variants)."""

    def __init__(self, reader):
        self.reader = reader

    def __call__(self, key: str):
        f = self.reader.fields.get(key)
        return None if f is None else f.contents()

    def keys(self):
        return self.reader.fields.keys()


class GGUFSource:
    """A GGUF file of a qwen2 model; tensors dequantized to float32 by the `gguf` package.

    Checked when opened, before any tensor is read: every tensor the model needs is there
    with the shape the config implies; a GGUF without `output.weight` is tied (llama.cpp uses
    `token_embd` as the output then), and the header says so. Big-endian GGUFs (gguf-py writes
    them) are read when their weights are F32/F16: those arrive as numpy arrays of the file's
    byte order. Quantized blocks carry no byte-order mark — gguf-py stores them unswapped,
    llama.cpp's endian converter swaps their scales — so a big-endian file with a quantized
    tensor is refused, naming the tensor, rather than guessed at.
    """

    kind = "gguf"

    def __init__(self, path: Path):
        import gguf

        from ..tokenizer import Tokenizer

        self.path = path
        check_gguf(path)                 # counts, lengths, offsets: before gguf-py trusts them
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError/struct errors for a non-GGUF file
            raise FormatError(f"{path}: not a readable GGUF file ({e})") from None
        self._tensors = {t.name: t for t in self.reader.tensors}
        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise FormatError(f"{path}: GGUF tensor token_embd.weight missing")
        # No output.weight: llama.cpp ties the output to token_embd, and so does get().
        self.tied = "output.weight" not in self._tensors
        self.config = QwenConfig.from_gguf_fields(_Metadata(self.reader), str(path), vocab_size=int(emb.shape[-1]),
                                                  tied=self.tied)
        self._check_tensors()
        self.tokenizer_json = Tokenizer.from_gguf(self.reader).to_json()
        # The end-of-sequence ids the metadata names (llama.cpp adds them to its EOG set too).
        self.eos_ids = tuple(int(v) for v in (self._field(f"tokenizer.ggml.{k}_token_id")
                                              for k in ("eos", "eot", "eom")) if v is not None)

    def _gguf_tensor_name(self, hf_name: str) -> str:
        g = gguf_name(hf_name)
        return "token_embd.weight" if g == "output.weight" and self.tied else g

    def _check_tensors(self) -> None:
        from gguf import GGML_QUANT_SIZES

        big_endian = self.reader.byte_order == "S"
        for hf_name, shape in _dense_shapes(self.config).items():
            g = self._gguf_tensor_name(hf_name)
            t = self._tensors.get(g)
            if t is None:
                raise FormatError(f"{self.path}: GGUF tensor {g} missing")
            got = tuple(int(d) for d in reversed(t.shape))
            if got != shape:
                raise FormatError(f"{self.path}: GGUF tensor {g}: shape {list(got)}, the config "
                                  f"implies {list(shape)}")
            ty = t.tensor_type.name
            if t.tensor_type not in GGML_QUANT_SIZES:
                raise FormatError(f"{self.path}: GGUF tensor {g}: type {ty} is not a weight type")
            if big_endian and ty not in _PLAIN_FLOAT_TYPES:
                raise FormatError(f"{self.path}: big-endian GGUF with tensor {g} of type {ty}: only "
                                  f"F32/F16 tensors can be read from a big-endian file (convert it "
                                  f"to little-endian with gguf-py's gguf_convert_endian.py)")

    def _field(self, key: str):
        f = self.reader.fields.get(key)
        if f is None:
            return None
        return f.contents()

    def type_name(self, name: str) -> str:
        """The GGML type (`Q5_0`, `F32` …) of the tensor `name` (HF name)."""
        return self._tensors[self._gguf_tensor_name(name)].tensor_type.name

    def blocks(self, prefix: str) -> tuple[wf.WeightFormat, dict[str, np.ndarray]]:
        """The weight `prefix` (`lm_head`, `model.layers.3.mlp.up_proj` …) as the codes,
        scales and offsets of the format that holds its GGUF type exactly
        (gguf_blocks.read_blocks).

        Raises:
            FormatError: its type has no exact format, or its bytes do not match its shape.
        """
        name = prefix + ".weight"
        t = self._tensors[self._gguf_tensor_name(name)]
        n, k = (int(d) for d in reversed(t.shape))
        try:
            return gguf_blocks.read_blocks(t.tensor_type.name, t.data, n, k)
        except (KeyError, ValueError) as e:
            raise FormatError(f"{self.path}: GGUF tensor {t.name}: {e}") from None

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` (HF name) as float32 [out, in] (or [n] for vectors).

        Raises:
            FormatError: the tensor is missing, or its type cannot be dequantized.
        """
        from gguf import quants

        gname = self._gguf_tensor_name(name)
        t = self._tensors.get(gname)
        if t is None:
            raise FormatError(f"{self.path}: GGUF tensor {gname} missing")
        if t.tensor_type.name in _PLAIN_FLOAT_TYPES:
            # astype honours the array's byte order; quants.dequantize would reinterpret the
            # bytes as little-endian and turn a big-endian file into garbage.
            a = np.asarray(t.data).astype(np.float32)
        else:
            try:
                a = quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise FormatError(f"{self.path}: GGUF tensor {gname}: type {t.tensor_type.name} "
                                  f"cannot be dequantized by this gguf package") from None
        # ggml stores shape innermost-first; numpy's row-major view is the HF [out, in] order.
        return np.asarray(a, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


def open_source(src: str | Path):
    """An HFSource for a folder, a GGUFSource for a GGUF file. Raises DrvqwenError otherwise."""
    p = Path(src)
    if p.is_dir():
        if not (p / "config.json").is_file():   # any folder at all, say: not a checkpoint
            raise ConfigError(f"{p}: a folder with no config.json: not an HF checkpoint folder (config.json, "
                              f"*.safetensors, tokenizer.json) nor a GGUF file")
        return HFSource(p)
    if not p.exists():
        raise DrvqwenError(f"{p}: file not found")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return GGUFSource(p)
    raise FormatError(f"{p}: not an HF checkpoint folder or a GGUF file (magic {magic!r})")
