"""One INT4 decoder layer's planned launches, for the decode step (one token) and the verify pass
of speculative decoding (T tokens).

    L{l}.qkv_rope        gemv_int4_qkv_rope[_tokens]        (the input RMSNorm, QKV, bias, RoPE, K/V write)
    L{l}.attention       the attention launcher the caller chose (2 launches)
    L{l}.o_proj          gemv_int4_residual[_tokens]
    L{l}.gate_up_swiglu  gemv_int4_gate_up_swiglu[_tokens]  (the post-attention RMSNorm, gate/up, SwiGLU)
    L{l}.down_proj       gemv_int4_residual[_tokens]

With prenorm (the verify pass only), each RMSNorm is a launch of its own over the T rows
(rmsnorm.cu into xn, L{l}.input_layernorm and L{l}.post_attention_layernorm) and qkv_rope and
gate_up_swiglu read the normalised rows (their …_x_tokens kernels): the same x bits, staged
with independent loads instead of normalised row after row inside every block.

One function for both, so the verify pass's layer is the decode step's with n_tokens given: the
same launchers, the same occupancy and defines, hence the same grid and block per launch (the
T-token kernels keep the single-token launch shape; launchers/gemv_int4.py says why that keeps
each token's sums bit for bit).
"""

from __future__ import annotations

import numpy as np

from .config import QwenConfig
from .kv_cache import layer_view_name
from .launchers import GemvInt4GateUpSwiglu, GemvInt4QkvRope, GemvInt4Residual, Launcher, RmsNorm
from .launchers.base import BufferSpec
from .layer_weights import LayerWeights


def layer_kv(kv: dict[str, BufferSpec], layer: int) -> tuple[BufferSpec, BufferSpec]:
    """Layer `layer`'s views of the K/V pools (kv["k_cache"/"v_cache"] fp16 [L, P, Hkv, 16, Dh]):
    two BufferSpecs fp16 [P, Hkv, 16, Dh] named as kv_cache.layer_view_name."""
    return tuple(BufferSpec(layer_view_name(p, layer), kv[p].shape[1:], np.float16)
                 for p in ("k_cache", "v_cache"))


def int4_layer_steps(cfg: QwenConfig, layer: int, w: LayerWeights, a: dict[str, BufferSpec],
                     kv_layer: tuple[BufferSpec, BufferSpec], attn: Launcher, *, gemv: dict,
                     n_tokens: int | None = None, prenorm: bool = False) -> list[tuple[str, Launcher]]:
    """The five (name, launcher) entries of INT4 layer `layer` (module doc).

    Args:
        cfg: the model.
        w: the layer's weights (LayerWeights of planned BufferSpecs).
        a: activations by name: state, block_table, inv_freq; residual fp32 [(T,) D], q and attn
            fp16 [(T,) Hq·Dh], h fp16 [(T,) F] ([T, …] with n_tokens = T).
        kv_layer: the layer's (k_cache, v_cache) views (`layer_kv`).
        attn: the layer's attention launcher (reads a["q"], writes a["attn"]).
        gemv: the GEMV launchers' occupancy and defines (dict(occupancy=…, defines=…)).
        n_tokens: None for the single-token kernels, T (1..16) for the `…_tokens` kernels.
        prenorm: with n_tokens, the RMSNorms as launches of their own into a["xn"] fp16 [T, D]
            (module doc); seven entries then.
    Raises:
        LaunchError: a shape the kernels do not run, or a buffer of the wrong size or dtype.
    """
    D, F, eps, nq = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, cfg.q_dim
    k_l, v_l = kv_layer
    nt = dict(gemv, n_tokens=n_tokens)
    pre = prenorm and n_tokens is not None
    xin = dict(x_normed=a["xn"]) if pre else {}

    def norm(name: str, weight) -> list[tuple[str, Launcher]]:
        if not pre:
            return []
        return [(f"L{layer}.{name}", RmsNorm(a["xn"], a["residual"], weight, dim=D, eps=eps, rows=n_tokens))]

    return [
        *norm("input_layernorm", w.input_layernorm),
        (f"L{layer}.qkv_rope", GemvInt4QkvRope(a["q"], k_l, v_l, a["residual"], w.input_layernorm, *w.q_proj,
                                               *w.k_proj, *w.v_proj, w.q_bias, w.k_bias, w.v_bias, a["inv_freq"],
                                               a["state"], a["block_table"], n_heads=cfg.num_heads,
                                               n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dim=D, eps=eps,
                                               **nt, **xin)),
        (f"L{layer}.attention", attn),
        (f"L{layer}.o_proj", GemvInt4Residual(a["residual"], a["attn"], *w.o_proj, n=D, k=nq, **nt)),
        *norm("post_attention_layernorm", w.post_attention_layernorm),
        (f"L{layer}.gate_up_swiglu", GemvInt4GateUpSwiglu(a["h"], a["residual"], w.post_attention_layernorm,
                                                          *w.gate_proj, *w.up_proj, f=F, k=D, eps=eps, **nt, **xin)),
        (f"L{layer}.down_proj", GemvInt4Residual(a["residual"], a["h"], *w.down_proj, n=D, k=F, **nt)),
    ]
