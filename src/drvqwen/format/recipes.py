"""llama.cpp's choice of GGUF type per tensor for a quantization preset ("recipe"), stated for
drvqwen's weight prefixes, so that a synthetic model can be written in the formats a user's
downloaded GGUF has (tools/make_synthetic.py --recipe q4_k_m).

Q4_K_M (llama.cpp's llama-quant.cpp, `llama_tensor_get_type` and `tensor_type_fallback`):
- every matrix weight Q4_K, the token embedding included;
- the output (lm_head) Q6_K;
- attn_v (v_proj) and ffn_down (down_proj) Q6_K where `use_more_bits(j, n)` holds: the first
  eighth, the last eighth, and every third in between (j < n/8, j ≥ 7n/8, or
  (j − n/8) mod 3 = 2, integer division as in C). j is not the layer number: llama.cpp counts
  the attn_v (and ffn_down) tensors in the order it meets them in its source file, and the
  official Qwen2.5 GGUFs were made from files listing tensors sorted by name, blk.10 before
  blk.2. So j is the layer's place among the layer numbers sorted as strings (`quant_order`);
  with 24 layers the picked layers are 0, 1, 3, 6–10, 13, 16, 19 and 21, as in the real 0.5B;
- a tensor whose K is not a multiple of the 256-input super-block falls back to a 32-input
  type: Q4_K → Q5_0, Q6_K → Q8_0 (and the output straight to Q8_0).
On the real Qwen2.5-Coder-0.5B (K = 896 but for down_proj's 4864) this gives every tensor the
type its Q4_K_M GGUF holds (Q5_0 ×133, Q8_0 ×13, Q6_K ×12, Q4_K ×12; tested on the file).

Q5_K_M: the same rules with Q5_K where Q4_K_M has Q4_K (llama-quant.cpp takes Q4_K_M and Q5_K_M
down one branch for attn_v and ffn_down); a K off the super-block falls back to Q5_1 (Q6_K's to
Q8_0). Not checked against a real Q5_K_M file.

Q4_0, Q5_0 and Q8_0 (one function for the 32-input block presets): every matrix in the preset's
type, the token embedding included; the output Q6_K unless the preset is Q8_0 (which keeps it)
or its K is not a multiple of 256 (then Q8_0). No per-layer choice: `use_more_bits` is for the
K-quant presets only.
"""

from __future__ import annotations

from ..config import QwenConfig
from . import weight_formats as wf
from .tensor_set import LM_HEAD, default_formats, proj_prefix, weight_shapes

RECIPES = ("int4", "q4_k_m", "q5_k_m", "q4_0", "q5_0", "q8_0")
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def use_more_bits(i: int, n: int) -> bool:
    """Whether layer i of n gets the larger type in llama.cpp's *_K_M recipes (module doc)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quant_order(n: int) -> list[int]:
    """The layers 0..n-1 in the order llama.cpp met them quantizing the official GGUFs: their
    numbers sorted as strings (0, 1, 10, 11, …, 19, 2, 20, …; module doc)."""
    return sorted(range(n), key=str)


def q4_k_m_types(cfg: QwenConfig) -> dict[str, str]:
    """Weight prefix → the GGUF type llama.cpp's Q4_K_M recipe gives it, fallbacks applied."""
    return k_m_types(cfg, "Q4_K")


def k_m_types(cfg: QwenConfig, base: str) -> dict[str, str]:
    """Weight prefix → the GGUF type llama.cpp's *_K_M recipe of base type `base` ("Q4_K": Q4_K_M,
    "Q5_K": Q5_K_M) gives it, fallbacks applied."""
    shapes = weight_shapes(cfg)
    types = {p: base for p in shapes}
    types[LM_HEAD] = "Q6_K"
    n = cfg.num_layers
    for j, layer in enumerate(quant_order(n)):
        if use_more_bits(j, n):
            types[proj_prefix(layer, "v_proj")] = types[proj_prefix(layer, "down_proj")] = "Q6_K"
    for p, ty in types.items():
        if shapes[p][1] % wf.SUPERBLOCK:
            types[p] = "Q8_0" if p == LM_HEAD else _FALLBACK[ty]
    return types


def block32_types(cfg: QwenConfig, preset: str) -> dict[str, str]:
    """Weight prefix → the GGUF type llama.cpp's Q4_0, Q5_0 or Q8_0 preset (`preset` "Q4_0",
    "Q5_0", "Q8_0") gives it (module doc)."""
    types = {p: preset for p in weight_shapes(cfg)}
    if preset != "Q8_0":
        types[LM_HEAD] = "Q6_K" if weight_shapes(cfg)[LM_HEAD][1] % wf.SUPERBLOCK == 0 else "Q8_0"
    return types


def recipe_formats(cfg: QwenConfig, recipe: str) -> dict[str, int]:
    """Weight prefix → format id for `recipe` ("int4": the default formats; "q4_k_m", "q5_k_m", "q4_0",
    "q5_0", "q8_0").

    Raises:
        ValueError: an unknown recipe.
    """
    if recipe == "int4":
        return default_formats(cfg)
    if recipe in ("q4_k_m", "q5_k_m"):
        return {p: wf.EXACT_FOR_GGUF[ty].id for p, ty in k_m_types(cfg, recipe[:2].upper() + "_K").items()}
    if recipe in ("q4_0", "q5_0", "q8_0"):
        return {p: wf.EXACT_FOR_GGUF[ty].id for p, ty in block32_types(cfg, recipe.upper()).items()}
    raise ValueError(f"recipe {recipe!r}: choose one of {', '.join(RECIPES)}")

