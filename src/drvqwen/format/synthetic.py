"""Synthetic `.nanoqwen` models of any Qwen2.5 shape, written straight from a seed; and small
synthetic GGUF files (gguf-py's writer), the converter's and the format fuzzer's inputs.

Speed does not depend on the weights' values, so benchmarks and tests at the 7B shape (and
at any other) run on synthetic weights (docs/model.md#real-and-synthetic-weights), also on a
machine that has no real checkpoint and no network. Writing random INT4 codes and FP16 scales
directly takes seconds, where a 15 GB bf16 checkpoint plus its conversion takes minutes.

Values: INT4 codes uniform in [-8, 7] (std ≈ 4.6) with per-group scales around 0.02/4.6, so
dequantized projections have std ≈ 0.02 (HF's initialisation); norms near 1; biases ~0.02; the
embedding std 0.02 plus a few channels of large magnitude (~1e3–3e4, as real Qwen2 models
carry) so that range problems in the FP32 residual stream and RMSNorm show up. A weight in
another format (`formats`, e.g. llama.cpp's Q4_K_M recipe, format/recipes.py) takes
`weight_formats.random_weight`'s values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ..config import QwenConfig
from . import weight_formats as wf
from .tensor_set import expected_tensors, weight_shapes
from .nanoqwen_writer import NanoqwenWriter

CODE_STD = float(np.std(np.arange(-8, 8)))        # 4.61: std of uniform codes in [-8, 7]
WEIGHT_STD = 0.02
# (channel, value) pairs of the large residual channels, scaled into range for small models.
LARGE_CHANNELS = ((0.07, 3.0e4), (0.31, -8.0e3), (0.77, 1.5e3))


def synthetic_tensor(name: str, dtype: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One synthetic tensor of the given table dtype/shape (see module doc for the values)."""
    if name.endswith(".qweight"):
        # 8 uniform nibbles per word = a uniform uint32.
        return rng.integers(0, 2**32, size=shape, dtype=np.uint32)
    if name.endswith(".scales"):
        s = WEIGHT_STD / CODE_STD * (1 + 0.2 * rng.standard_normal(shape, dtype=np.float32))
        return np.abs(s).astype(np.float16)
    if "norm" in name:
        return (1 + 0.05 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
    if name.endswith(".bias"):
        return (WEIGHT_STD * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
    a = (WEIGHT_STD * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
    if name == "model.embed_tokens.weight":
        d = shape[1]
        for frac, val in LARGE_CHANNELS:
            a[:, int(frac * d)] = (val * (1 + 0.01 * rng.standard_normal(shape[0], dtype=np.float32))).astype(np.float16)
    return a


def minimal_tokenizer_json() -> str:
    """A tiny byte-level BPE tokenizer.json (94 printable ASCII tokens, no merges).

    Synthetic models embed it when no real tokenizer is given: speed runs and kernel tests
    never look at the text, and it keeps a 7B synthetic file free of a 7 MB tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={chr(c): i for i, c in enumerate(range(33, 127))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def write_synthetic(path: str | Path, cfg: QwenConfig, seed: int, tokenizer_json: str,
                    progress: Callable[[str, int, int], None] | None = None,
                    formats: dict[str, int] | None = None) -> Path:
    """Write a synthetic `.nanoqwen` for `cfg` from `seed` (deterministic). formats: weight
    prefix → format id (tensor_set.expected_tensors), default the default formats. Returns the
    path."""
    rng = np.random.default_rng(seed)
    names = expected_tensors(cfg, formats)
    shapes = weight_shapes(cfg)
    fid_of = formats or {}
    parts: dict[str, np.ndarray] = {}
    # Every row may be chosen (text_vocab = vocab_size): speed does not depend on the text, and
    # a synthetic model's choice should range over the whole lm_head as a real one's does.
    with NanoqwenWriter(path, cfg, tokenizer_json, text_vocab=cfg.vocab_size) as w:
        for i, (name, (dt, shape)) in enumerate(names.items(), 1):
            prefix = wf.weight_prefix(name)
            fid = fid_of.get(prefix, wf.INT4_G128.id) if prefix else wf.PLAIN
            if prefix is None or fid == wf.INT4_G128.id:
                w.add(name, synthetic_tensor(name, dt, shape, rng), format_id=fid)
            else:
                if name.endswith(".qweight"):       # the first part of a weight: all of them made
                    parts = wf.random_weight(wf.FORMATS[fid], *shapes[prefix], rng)
                w.add(name, parts[name.rsplit(".", 1)[1]], format_id=fid)
            if progress:
                progress(name, i, len(names))
    return Path(path)



# The control tokens of the Qwen2.5 vocabulary that prompts and the end-of-generation rule use.
QWEN_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
                "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


def synthetic_dense(cfg: QwenConfig, rng: np.random.Generator, std: float = 0.02) -> dict[str, np.ndarray]:
    """HF-named float32 tensors for `cfg` (what a checkpoint holds before quantization):
    std-`std` weights, norms near 1, biases ~0.1."""
    out: dict[str, np.ndarray] = {}
    for name, (_, shape) in expected_tensors(cfg).items():
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            n, kw = shape
            out[name[: -len(".qweight")] + ".weight"] = (rng.standard_normal((n, kw * 8)) * std).astype(np.float32)
        elif "norm" in name:
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(".bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return out


def write_synthetic_gguf(path: str | Path, cfg: QwenConfig, dense: dict[str, np.ndarray], *,
                         tied: bool = False, big_endian: bool = False, qtype: str | dict[str, str] = "F32",
                         n_pad: int = 0, eos_id: int | None = None) -> Path:
    """A qwen2 GGUF of `cfg` holding `dense` (HF names, float32 [out, in]), as llama.cpp lays it
    out, written with gguf-py.

    Vocabulary: the 256 bytes (ids 0..255), one merge ("ĠĠ", two spaces, id 256: a GGUF BPE
    vocabulary carries merges), QWEN_CONTROL as control tokens from 257 on, then `n_pad`
    llama.cpp filler rows `[PAD…]` (type unused); cfg.vocab_size must cover them all.

    Args:
        tied: leave out output.weight (llama.cpp then uses token_embd as the output).
        big_endian: write the file in big-endian byte order.
        qtype: GGML type of the 2-D weights: "F32", "F16", or a type the `gguf` package can
            quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); or a dict HF name → type (names not in it
            F32). 1-D tensors stay F32. A uint8 array in `dense` is taken as the raw blocks
            of its type (any quantized type, [out, in / block_size · block_bytes]).
        eos_id: tokenizer.ggml.eos_token_id, if given.
    Returns:
        The path.
    """
    import gguf

    from ..tokenizer_gguf import BYTE_TO_CHAR
    from .convert import gguf_name

    sp = BYTE_TO_CHAR[32]
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + [sp + sp] + list(QWEN_CONTROL)
    types = [1] * 257 + [3] * len(QWEN_CONTROL)
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(n_pad)]
    types += [5] * n_pad
    if len(tokens) > cfg.vocab_size:
        raise ValueError(f"write_synthetic_gguf: {len(tokens)} tokens for vocab_size {cfg.vocab_size}")
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), "qwen2", endianess=endian)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{sp} {sp}"])
    if eos_id is not None:
        w.add_eos_token_id(eos_id)
    for name, a in dense.items():
        if tied and name == "lm_head.weight":
            continue
        qt = getattr(gguf.GGMLQuantizationType, qtype if isinstance(qtype, str) else qtype.get(name, "F32"))
        if a.dtype == np.uint8:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a), raw_dtype=qt)
            continue
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), a)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), a.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
