"""The tensors of one decoder layer, by role: what decode and prefill both hand their launchers.

    input_layernorm, post_attention_layernorm   fp16 [D]
    q_proj, k_proj, v_proj, o_proj,             (qweight uint32 [N, K/8], scales fp16 [N, K/128])
    gate_proj, up_proj, down_proj               INT4 layout id 1 (format/quant.py; on the GPU its
                                                words in the device layout, format/int4_tiles.py); in a file of
                                                per-tensor formats (qweight, scales) of any format, or
                                                (weight fp16 [N, K], None) where dense — the INT4
                                                launchers take only the first kind
    q_bias, k_bias, v_bias                      fp16 [Nq] / [Nkv] / [Nkv]

Names are Hugging Face's (`model.layers.3.mlp.down_proj.qweight`), the `.nanoqwen` file's and
the GPU weight pool's, so the same lookup serves planned buffers and uploaded ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .format.tensor_set import proj_prefix


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weight buffers (DeviceArray or planned BufferSpec), by role."""

    input_layernorm: Any
    post_attention_layernorm: Any
    q_proj: tuple[Any, Any]
    k_proj: tuple[Any, Any]
    v_proj: tuple[Any, Any]
    o_proj: tuple[Any, Any]
    gate_proj: tuple[Any, Any]
    up_proj: tuple[Any, Any]
    down_proj: tuple[Any, Any]
    q_bias: Any
    k_bias: Any
    v_bias: Any

    @classmethod
    def of(cls, lookup: Callable[[str], Any], layer: int) -> LayerWeights:
        """The layer's buffers from `lookup(tensor name)`.

        Raises:
            KeyError: a tensor the layer needs is missing.
        """
        pre = f"model.layers.{layer}"

        def proj(name: str) -> tuple[Any, Any]:
            p = proj_prefix(layer, name)
            try:
                return lookup(f"{p}.qweight"), lookup(f"{p}.scales")
            except KeyError:            # a dense FP16 projection (a per-tensor file): (weight, None)
                return lookup(f"{p}.weight"), None

        return cls(
            input_layernorm=lookup(f"{pre}.input_layernorm.weight"),
            post_attention_layernorm=lookup(f"{pre}.post_attention_layernorm.weight"),
            q_proj=proj("q_proj"), k_proj=proj("k_proj"), v_proj=proj("v_proj"), o_proj=proj("o_proj"),
            gate_proj=proj("gate_proj"), up_proj=proj("up_proj"), down_proj=proj("down_proj"),
            q_bias=lookup(f"{pre}.self_attn.q_proj.bias"), k_bias=lookup(f"{pre}.self_attn.k_proj.bias"),
            v_bias=lookup(f"{pre}.self_attn.v_proj.bias"),
        )
