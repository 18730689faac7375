"""Synthetic `.nanoqwen` models of any Qwen2.5 shape, written straight from a seed.

No real 7B weights can be fetched on the GPU machines, and speed does not depend on the
weights' values, so the 7B shape runs on synthetic weights (docs/model.md#real-and-synthetic-weights). Writing random
INT4 codes and FP16 scales directly takes seconds, where a 15 GB bf16 checkpoint plus its
conversion would cost minutes of scarce GPU time.

Values: INT4 codes uniform in [-8, 7] (std ≈ 4.6) with per-group scales around 0.02/4.6, so
dequantized projections have std ≈ 0.02 (HF's initialisation); norms near 1; biases ~0.02; the
embedding std 0.02 plus a few channels of large magnitude (~1e3–3e4, as real Qwen2 models
carry) so that range problems in the FP32 residual stream and RMSNorm show up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ..config import QwenConfig
from .nanoqwen import NanoqwenWriter, expected_tensors

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
                    progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write a synthetic `.nanoqwen` for `cfg` from `seed` (deterministic). Returns the path."""
    rng = np.random.default_rng(seed)
    names = expected_tensors(cfg)
    # Every row may be chosen (text_vocab = vocab_size): speed does not depend on the text, and
    # a synthetic model's choice should range over the whole lm_head as a real one's does.
    with NanoqwenWriter(path, cfg, tokenizer_json, text_vocab=cfg.vocab_size) as w:
        for i, (name, (dt, shape)) in enumerate(names.items(), 1):
            w.add(name, synthetic_tensor(name, dt, shape, rng))
            if progress:
                progress(name, i, len(names))
    return Path(path)

