"""Small helpers shared by tests (not fixtures): tiny configs, random models, error metrics."""

from __future__ import annotations

import numpy as np

from drvqwen.config import QwenConfig
from drvqwen.format import quant
from drvqwen.format.nanoqwen import NanoqwenWriter, expected_tensors
from drvqwen.format.synthetic import minimal_tokenizer_json  # noqa: F401  (tests import it from here)

TINY = QwenConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=64, max_position=1024)




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
