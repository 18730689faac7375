"""Small helpers shared by tests (not fixtures): tiny configs, random models, error metrics."""

from __future__ import annotations

import numpy as np

from drvqwen.config import QwenConfig
from drvqwen.format import quant
from drvqwen.format.nanoqwen import NanoqwenWriter, expected_tensors
from drvqwen.format.synthetic import minimal_tokenizer_json  # noqa: F401  (tests import it from here)

TINY = QwenConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=64, max_position=1024)




# The control tokens of the Qwen2.5 vocabulary that drvqwen's prompts and stop rules use.
QWEN_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
                "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


def byte_tokenizer_json(n_control: int = len(QWEN_CONTROL)) -> str:
    """A byte-level tokenizer.json that can encode any text: the 256 bytes at ids 0..255 (no
    merges) and the first `n_control` of QWEN_CONTROL as special tokens at 256, 257, …

    With TINY's 512 rows it leaves ids 256 + n_control … 511 without text, like the padded
    rows of the real Qwen2.5 lm_head."""
    import tokenizers
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers.models import BPE

    from drvqwen.tokenizer import _BYTE_TO_CHAR

    tk = tokenizers.Tokenizer(BPE(vocab={_BYTE_TO_CHAR[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_CONTROL[:n_control]])
    return tk.to_str()


def random_dense(cfg: QwenConfig, rng: np.random.Generator, std: float = 0.02) -> dict[str, np.ndarray]:
    """HF-named float32 tensors for `cfg`: std-0.02 weights, norms near 1, biases ~0.1."""
    out: dict[str, np.ndarray] = {}
    for name, (dt, shape) in expected_tensors(cfg).items():
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            n, kw = shape
            out[base + ".weight"] = (rng.standard_normal((n, kw * 8)) * std).astype(np.float32)
        elif "norm" in name:
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(".bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return out


def write_model(path, cfg: QwenConfig, dense: dict[str, np.ndarray], tokenizer_json: str | None = None):
    """Quantize `dense` and write a `.nanoqwen`; returns {name: stored array}."""
    stored = {}
    with NanoqwenWriter(path, cfg, tokenizer_json or minimal_tokenizer_json()) as w:
        for name, (dt, shape) in expected_tensors(cfg).items():
            if name.endswith(".scales"):
                continue
            if name.endswith(".qweight"):
                base = name[: -len(".qweight")]
                qw, s = quant.quantize_packed(dense[base + ".weight"])
                w.add(name, qw)
                w.add(base + ".scales", s)
                stored[name], stored[base + ".scales"] = qw, s
            else:
                stored[name] = dense[name].astype(np.float16)
                w.add(name, stored[name])
    return stored


def rel_l2(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def write_tiny_gguf(path, cfg: QwenConfig, dense: dict[str, np.ndarray], *, tied: bool = False,
                    big_endian: bool = False, qtype: str = "F32", n_pad: int = 0,
                    eos_id: int | None = None):
    """A qwen2 GGUF of `cfg` holding `dense` (HF names, float32), written with gguf-py.

    The vocabulary: the 256 bytes, one merge ("ĠĠ", two spaces, id 256: a GGUF BPE vocabulary
    must carry merges), QWEN_CONTROL as control tokens from 257 on, then `n_pad` llama.cpp
    filler rows `[PAD…]` (type unused); cfg.vocab_size must cover them.
    tied: no output.weight (llama.cpp then uses token_embd). qtype: the GGML type of the 2-D
    weights ("F32", "F16" or "Q8_0"); 1-D tensors stay F32. Returns the path.
    """
    import gguf

    from drvqwen.format.convert import gguf_name
    from drvqwen.tokenizer import _BYTE_TO_CHAR

    sp = _BYTE_TO_CHAR[32]
    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + [sp + sp] + list(QWEN_CONTROL)
    types = [1] * 257 + [3] * len(QWEN_CONTROL)
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(n_pad)]
    types += [5] * n_pad
    assert len(tokens) <= cfg.vocab_size
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
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    for name, a in dense.items():
        if tied and name == "lm_head.weight":
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
    return path
