"""The tensors a Qwen2 model stores: Hugging Face names, shapes and weight formats.

Every name here is the Hugging Face checkpoint's (`model.layers.3.mlp.down_proj.weight`); a
quantized weight `<prefix>` is stored as the parts its format names (`.qweight`, `.scales`,
`.superscales` …, weight_formats.py). `expected_tensors` is the whole set, in the order the
converter and the synthetic writer store it; the reader (nanoqwen.py) holds a file's table
against it.
"""

from __future__ import annotations

import numpy as np

from ..config import QwenConfig
from ..errors import FormatError
from . import weight_formats as wf

ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


def proj_prefix(layer: int, proj: str) -> str:
    """HF module path of a projection, e.g. `model.layers.3.mlp.down_proj`."""
    block = "self_attn" if proj in ATTN_PROJ else "mlp"
    return f"model.layers.{layer}.{block}.{proj}"


# The weights that may be stored dense (format 0, `<prefix>.weight`) or quantized.
EMBED, LM_HEAD = "model.embed_tokens", "lm_head"


def weight_shapes(cfg: QwenConfig) -> dict[str, tuple[int, int]]:
    """Every matrix weight by prefix (`lm_head`, `model.layers.3.mlp.up_proj` …) → [N, K]."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"q_proj": (cfg.q_dim, D), "k_proj": (cfg.kv_dim, D), "v_proj": (cfg.kv_dim, D),
              "o_proj": (D, cfg.q_dim), "gate_proj": (F, D), "up_proj": (F, D),
              "down_proj": (D, F)}
    out = {EMBED: (V, D), LM_HEAD: (V, D)}
    for i in range(cfg.num_layers):
        for proj, nk in shapes.items():
            out[proj_prefix(i, proj)] = nk
    return out


def default_formats(cfg: QwenConfig) -> dict[str, int]:
    """The formats of a version-1/2 file and of a conversion from an HF checkpoint: every
    projection INT4 g128 (id 1), embedding and lm_head dense FP16 (id 0)."""
    return {p: (wf.PLAIN if p in (EMBED, LM_HEAD) else wf.INT4_G128.id) for p in weight_shapes(cfg)}


def in_per_tensor_formats(cfg: QwenConfig, formats: dict[str, int] | None) -> bool:
    """Whether a model of `cfg` whose weights have `formats` (NanoqwenFile.formats: prefix →
    id; None: `default_formats`) has any weight of cfg's layers off `default_formats` — a weight
    missing from `formats` counts as dense FP16. Such a model runs the per-tensor GPU kernels
    (gemv_fmt.cu, gemm_fmt*.cu), the others the INT4 ones."""
    if formats is None:
        return False
    want = default_formats(cfg)
    return {p: formats.get(p, wf.PLAIN) for p in want} != want


def expected_tensors(cfg: QwenConfig, formats: dict[str, int] | None = None
                     ) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every tensor a Qwen2 model of `cfg` stores, with dtype and shape.

    formats: weight prefix → format id (weight_formats.FORMATS; 0 = dense FP16 `<prefix>.weight`),
    default `default_formats(cfg)`. A quantized weight [N, K] is stored as the tensors
    `WeightFormat.tensors` names (`.qweight`, `.qhigh`, `.scales`, `.offsets`, `.superscales`).
    Dense vectors (norms, biases) are FP16 here; a file of version 3 or later may hold them, and
    dense weights, as FP32.
    Raises:
        FormatError: an unknown format id, or one that does not fit the weight's K (its group,
            or a K-quant's 256-input super-block, does not divide K).
    """
    f16 = np.dtype("<f2")
    D = cfg.hidden_size
    fm = default_formats(cfg) if formats is None else formats
    shapes = weight_shapes(cfg)
    out: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}

    def add(prefix: str) -> None:
        n, k = shapes[prefix]
        fid = fm.get(prefix, wf.PLAIN)
        if fid == wf.PLAIN:
            out[f"{prefix}.weight"] = (f16, (n, k))
            return
        fmt = wf.get_format(fid, f"tensor {prefix}")
        # INT4 g128 keeps the version-2 rule (shapes K/8, K/128; a K that is no multiple of 128
        # is refused later, naming the source file); the other formats must fit exactly here.
        if fmt.id != wf.INT4_G128.id and not fmt.fits(k):
            raise FormatError(f"tensor {prefix}: format {fmt.name} does not fit K={k} "
                              f"(K must be a multiple of {fmt.k_multiple})")
        out.update(fmt.tensors(prefix, n, k))

    # The order is the converter's and the synthetic writer's (seeded files depend on it).
    add(EMBED)
    out["model.norm.weight"] = (f16, (D,))
    add(LM_HEAD)
    for i in range(cfg.num_layers):
        out[f"model.layers.{i}.input_layernorm.weight"] = (f16, (D,))
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = (f16, (D,))
        for proj in ATTN_PROJ + MLP_PROJ:
            p = proj_prefix(i, proj)
            add(p)
            if proj in ("q_proj", "k_proj", "v_proj"):
                out[f"{p}.bias"] = (f16, (shapes[p][0],))
    return out


def bytes_per_token(sizes, vocab_size: int) -> int:
    """Weight bytes one decode step reads, from `sizes`: (tensor name, bytes) pairs of a
    model's tensors. Every tensor is read once but the embedding table (each of its parts
    [vocab_size, …] rows), of which one row. The file's sizes give what `drvqwen info` and
    `convert` report; the GPU's copy (F32 vectors held as FP16) what `drvqwen bench` counts."""
    total = 0
    for name, nbytes in sizes:
        total += nbytes // vocab_size if name.startswith(EMBED + ".") else nbytes
    return total
