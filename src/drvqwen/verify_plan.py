"""The verify pass of speculative decoding as a planned launch list: T = k + 1 tokens (the last
token and k proposals, T ≤ 16) at positions state[0] … state[0] + T − 1 through the INT4 model in
one pass, each position's logits and argmax bit for bit those of the decode step
(decode.plan_decode(attention="plain")) at that position.

    embedding                     residual fp32 [T, D] = embed[ids[j]]                 (embedding_rows)
    per layer l (6 launches):     decode.py's layer with n_tokens = T (layer_plan.int4_layer_steps):
      L{l}.qkv_rope               token j's K/V into the cache slot of state[0] + j
      L{l}.attention (2 launches) token j over the first state[2] + j keys (causal inside the chunk)
      L{l}.o_proj, L{l}.gate_up_swiglu, L{l}.down_proj
    norm                          xn fp16 [T, D] = rmsnorm(residual row j) · w_norm   (rmsnorm, T rows)
    lm_head                       logits fp32 [T, V], argmax partials [T, ceil(V/32)]
    argmax                        next_token int32 [T]: token j's greedy choice after ids[j]
    advance_state                 state = (pos + T, next_token[T-1], seq_len + T)      (advance_state_tokens)

The pass leaves the state T decode steps would leave; how far it stays advanced depends on how
many proposals are accepted, so the host rolls it back to the accepted count afterwards
(sequence.py, `Sequence.rollback`). Like the decode step's, the list takes no per-pass argument
(the position is read from the state, the tokens from `ids`), so a CUDA graph per T can capture
it as it is.

Why each position matches the decode step bit for bit:
- every launch has the block of the decode step's counterpart and its grid per token: the
  GEMVs and lm_head the same grid (token j is column j of the single-token kernels' MMA chains,
  in their order), attention (S, Hkv) — its warps share out the (token, split) pairs, each
  the single-token split at that token's length — and (Hq, T), the embedding (ceil(D/2048), T), the
  norm and argmax (T): one block per token where the decode step has one block.
- embedding_rows and embedding run the same embedding_row (kernels/embedding.cu) — an exact
  FP16 → FP32 conversion — on ids[j] instead of state[1].
- rmsnorm with T rows runs the decode step's final-norm kernel, one block per row, the same
  arithmetic on each row.
- the attention is the plain kernel with the decode plan's S (same NS, same partial order). The
  TMA kernel (the decode step's default) splits KV into other partials: its sums may differ in
  the last bit, so a verify pass matches a decode step with attention="plain".
- the GEMVs sum K in the decode step's order; the persistent step (plan_decode(persistent=True))
  keeps that order too (its tests compare it bit for bit with the per-launch step).

Buffers: ids int32 [T] (the tokens to run, written before the pass), next_token int32 [T], and
[T, …] of the decode step's residual, xn, q, attn, h, logits, part_val, part_idx and split-KV
partials; state, block_table and inv_freq are the decode step's own (shared with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import QwenConfig
from .decode import DecodePlan, plan_decode
from .errors import DrvqwenError
from .launchers import AdvanceState, ArgmaxFinal, AttentionDecode, EmbeddingRows, LmHead, RmsNorm, attention_decode
from .launchers.base import BufferSpec, Occupancy
from .launchers.gemv_int4 import MAX_TOKENS
from .layer_plan import int4_layer_steps, layer_kv
from .layer_weights import LayerWeights

# Attention kernels a verify pass runs (only the plain kernel has T-token kernels).
VERIFY_ATTENTION = ("plain",)
# The decode step's activations that hold one token's values: [T, …] in the verify pass. The rest
# (state, block_table, inv_freq) are shared; next_token gets [T] (it is [1] in the decode step).
PER_TOKEN = ("residual", "xn", "q", "attn", "h", "logits", "part_val", "part_idx")


@dataclass
class VerifyPlan(DecodePlan):
    """The verify pass before any GPU memory exists (DecodePlan's fields, for T tokens).

    Attributes (besides DecodePlan's):
        n_tokens: T, tokens per pass (1..16).
        decode: the single-token plan it mirrors (plan_decode(attention="plain"), same occupancy).
    """

    n_tokens: int = 1
    decode: DecodePlan | None = None


def plan_verify(cfg: QwenConfig, max_context: int | None, n_tokens: int, *, occupancy: Occupancy | None = None,
                text_vocab: int | None = None, attention: str = "plain", prenorm: bool = True) -> VerifyPlan:
    """Plan the verify pass of `cfg` for `n_tokens` tokens (module doc): every launch, its grid and
    its buffers, for the INT4 model in the default formats.

    Args:
        cfg: the model.
        max_context: tokens the KV cache holds (default cfg.max_position).
        n_tokens: T = k + 1, 1..16.
        occupancy: blocks per SM and SM count for the grids (default the driver's, which needs a
            GPU; launchers.FixedOccupancy plans without one): the decode step's, so that the
            grids are its.
        text_vocab: as plan_decode's (the lm_head rows from it get −inf).
        attention: "plain" (the only kernel with T-token kernels).
        prenorm: each layer's two RMSNorms as launches of their own over the T rows, the GEMVs
            after them reading the normalised rows (layer_plan: the same bits, other launches;
            the default, as VerifyPass's), or False: inside the GEMVs, as the decode step's.
    Raises:
        DrvqwenError: n_tokens outside 1..16, another attention kernel, or plan_decode's errors.
        LaunchError: a shape the T-token kernels do not run (e.g. T tokens' x past a block's
            shared memory).
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 1 <= n_tokens <= MAX_TOKENS:
        raise DrvqwenError(f"verify pass: n_tokens={n_tokens!r} must be within 1..{MAX_TOKENS}")
    if attention not in VERIFY_ATTENTION:
        raise DrvqwenError(f"verify pass: attention={attention!r}: choose one of {', '.join(VERIFY_ATTENTION)}")
    T = n_tokens
    one = plan_decode(cfg, max_context, attention=attention, occupancy=occupancy, text_vocab=text_vocab)
    D, V, S = cfg.hidden_size, cfg.vocab_size, one.blocks_per_kv_head
    Hq, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    partials = attention_decode.partial_shapes(Hq, Dh, S, n_tokens=T)
    a = {n: one.buffers[n] for n in ("state", "block_table", "inv_freq")}
    a |= {n: BufferSpec(n, (T, *one.buffers[n].shape), one.buffers[n].dtype) for n in PER_TOKEN}
    a |= {n: BufferSpec(n, shape, np.float32) for n, shape in partials.items()}
    a |= {"ids": BufferSpec("ids", (T,), np.int32), "next_token": BufferSpec("next_token", (T,), np.int32)}
    weights, kv = one.weights, one.kv
    plan = VerifyPlan(cfg, one.max_context, one.n_pages, attention, S, a, weights, kv, n_tokens=T, decode=one)
    part = tuple(a[n] for n in partials)
    # The decode step's GEMV occupancy and defines (each launcher's own: decode.py passes none).
    gemv = dict(occupancy=occupancy)
    eps = cfg.rms_norm_eps

    steps = plan.steps
    steps.append(("embedding", EmbeddingRows(a["residual"], weights["model.embed_tokens.weight"], a["ids"],
                                             n_rows=T, vocab_size=V, dim=D)))
    for l in range(cfg.num_layers):
        k_l, v_l = layer_kv(kv, l)
        attn = AttentionDecode(a["attn"], a["q"], k_l, v_l, a["block_table"], a["state"], part, n_heads=Hq,
                               n_kv_heads=Hkv, head_dim=Dh, blocks_per_kv_head=S, n_tokens=T)
        steps += int4_layer_steps(cfg, l, LayerWeights.of(weights.__getitem__, l), a, (k_l, v_l), attn,
                                  gemv=gemv, n_tokens=T, prenorm=prenorm)
    lm = LmHead(a["logits"], a["part_val"], a["part_idx"], a["xn"], weights["lm_head.weight"], vocab_size=V, dim=D,
                text_vocab=text_vocab, n_tokens=T)
    steps += [
        ("norm", RmsNorm(a["xn"], a["residual"], weights["model.norm.weight"], dim=D, eps=eps, rows=T)),
        ("lm_head", lm),
        ("argmax", ArgmaxFinal(a["next_token"], a["part_val"], a["part_idx"], n_partials=lm.n_partials,
                               n_tokens=T)),
        ("advance_state", AdvanceState(a["state"], a["next_token"], n_tokens=T)),
    ]
    return plan
