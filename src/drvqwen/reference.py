"""The Qwen2 forward pass in numpy: the readable maths, the oracle, and the CPU backend.

Every kernel test compares a GPU kernel against a function here, evaluated in float64 on the
kernel's exact FP16 inputs (docs/numerics.md#kernel-tests-against-the-reference). The functions are dtype-generic: they compute in
the dtype of their inputs (float32 for the CPU backend, float64 for tests). The whole model is
checked against Hugging Face `transformers` (Qwen2ForCausalLM) in tests/test_reference.py.

One decoder layer, for the hidden state x [T, D] of T tokens at positions pos [T]:

    h   = RMSNorm(x) * w_in                              # input_layernorm
    q   = h Wq^T + bq ; k = h Wk^T + bk ; v = h Wv^T + bv  # [T, Hq*Dh], [T, Hkv*Dh] ×2
    q,k = RoPE(q, pos), RoPE(k, pos)                     # rotate-half, theta from config
    KV cache[pos] = k, v                                 # paged: 16-token pages, block table
    a   = softmax(q K^T / sqrt(Dh) + causal mask) V      # GQA: head h reads KV head h // (Hq/Hkv)
    x   = x + a Wo^T
    h   = RMSNorm(x) * w_post                            # post_attention_layernorm
    x   = x + (silu(h Wg^T) * (h Wu^T)) Wd^T             # SwiGLU MLP
    
and after the last layer: logits = RMSNorm(x) * w_norm · lm_head^T.
Sources: HF transformers `models/qwen2/modeling_qwen2.py` (Qwen2RMSNorm, rotate_half,
apply_rotary_pos_emb, Qwen2Attention, Qwen2MLP) and Qwen2.5's config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .config import QwenConfig, RopeScaling
from .kv_cache import PAGE_TOKENS
from .format.nanoqwen import NanoqwenFile
from .format.tensor_set import proj_prefix


# ---------------------------------------------------------------------------------------------
# The operations
# ---------------------------------------------------------------------------------------------
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight.

    x: [..., D] (computed in x's dtype; HF computes in float32), weight: [D]. Returns x's dtype.
    """
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + x.dtype.type(eps))) * weight.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """inv_freq[i] = 1 / theta^(2i / head_dim), i < head_dim/2, computed in float32 as HF does
    (`1.0 / base ** (torch.arange(0, dim, 2).float() / dim)`). Returns float32 [head_dim/2].

    With YaRN `scaling`, transformers' `_compute_yarn_parameters` step for step in float32:
    the interpolated frequencies 1 / (factor · base^(2i/d)) and the extrapolated ones blended
    by a linear ramp between the correction dimensions of beta_fast and beta_slow (found in
    float64, as Python floats). The attention factor is applied by `rope_cos_sin`.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = np.float32(theta) ** exponent
    if scaling is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                        # transformers: no division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low),
                   np.float32(0), np.float32(1)).astype(np.float32)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(scaling.factor) * pos_freqs)
    extrapolation_factor = np.float32(1) - ramp
    inv = interpolation * (np.float32(1) - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv.astype(np.float32)


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float,
                 scaling: RopeScaling | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables for rotate-half RoPE at the given positions.

    The angle is float32(pos) * inv_freq in float32, duplicated over both halves
    (HF: `emb = cat(freqs, freqs)`), then cos/sin in float32 — times YaRN's attention factor
    when `scaling` is given (HF: `emb.cos() * attention_scaling`). Returns two float32 [T, head_dim].
    """
    pos = np.asarray(positions, dtype=np.float32).reshape(-1)
    freqs = pos[:, None] * rope_inv_freq(head_dim, theta, scaling)[None, :]      # [T, Dh/2] f32
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    if scaling is not None:
        af = np.float32(scaling.attention_factor)
        cos, sin = (cos * af).astype(np.float32), (sin * af).astype(np.float32)
    return cos, sin


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE: x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1].

    x: [T, H, Dh]; cos, sin: [T, Dh]. Computed in x's dtype. Returns [T, H, Dh].
    """
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c = cos[:, None, :].astype(x.dtype)
    s = sin[:, None, :].astype(x.dtype)
    return x * c + rot * s


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), overflow-safe for large |x|."""
    return x / (1 + np.exp(-np.clip(x, -80, 80)))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU: silu(gate) * up (Qwen2MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)))."""
    return silu(gate) * up


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


# Bytes of attention scores held at once: the queries are taken in blocks so that
# Hq × block × S scores fit here. A 32K-token prompt would otherwise need Hq × T × T scores at
# once (14 × 32768² × 4 B = 60 GB for the 0.5B); in blocks it needs O(T · block).
ATTENTION_BLOCK_BYTES = 64 << 20


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
              block_bytes: int | None = None) -> np.ndarray:
    """Causal GQA attention of T queries over S cached positions 0..S-1.

    q: [T, Hq, Dh] (rotated), k, v: [S, Hkv, Dh] (rotated keys), q_pos: [T] absolute positions
    (query t sees keys s <= q_pos[t]). Scale 1/sqrt(Dh); softmax in q's dtype.
    Returns [T, Hq, Dh].

    Memory: the queries are processed in blocks of at most `block_bytes` of scores
    (Hq × block × S' elements, S' the keys the block's last query sees), and query head h
    reads KV head h // (Hq/Hkv) through a reshape, never a copy of K and V per query head —
    so a prompt of T tokens needs O(T · block) memory, not O(T²). block_bytes defaults to
    ATTENTION_BLOCK_BYTES.
    """
    block_bytes = ATTENTION_BLOCK_BYTES if block_bytes is None else block_bytes
    T, Hq, Dh = q.shape
    S, Hkv, _ = k.shape
    g = Hq // Hkv
    q_pos = np.asarray(q_pos).reshape(-1)
    kt = k.transpose(1, 2, 0)                                           # [Hkv, Dh, S]
    vt = v.transpose(1, 0, 2)                                           # [Hkv, S, Dh]
    scale = q.dtype.type(1.0 / np.sqrt(Dh))
    out = np.empty((T, Hq, Dh), dtype=np.result_type(q.dtype, v.dtype))
    block = max(1, min(T, block_bytes // max(1, Hq * S * q.dtype.itemsize)))
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        n = t1 - t0
        s_end = int(min(S, q_pos[t0:t1].max() + 1))                    # keys past it are masked
        # Query head h = kv * g + j: group the g query heads of each KV head.
        qb = q[t0:t1].reshape(n, Hkv, g, Dh).transpose(1, 2, 0, 3).reshape(Hkv, g * n, Dh)
        scores = (qb @ kt[:, :, :s_end]) * scale                        # [Hkv, g*n, S']
        scores = scores.reshape(Hkv, g, n, s_end)
        mask = np.arange(s_end)[None, :] > q_pos[t0:t1, None]           # [n, S']
        scores = np.where(mask[None, None], -np.inf, scores)
        p = softmax(scores).reshape(Hkv, g * n, s_end)
        ob = (p @ vt[:, :s_end]).reshape(Hkv, g, n, Dh)                 # [Hkv, g, n, Dh]
        out[t0:t1] = ob.transpose(2, 0, 1, 3).reshape(n, Hq, Dh)
    return out


def gather_pages(cache_layer: np.ndarray, block_table: np.ndarray, seq_len: int) -> np.ndarray:
    """Read positions 0..seq_len-1 out of one layer's paged cache.

    cache_layer: [P, Hkv, PAGE_TOKENS, Dh]; block_table: [>= ceil(seq_len/16)] int (logical page →
    physical page). Returns [seq_len, Hkv, Dh]. Slots past seq_len are never read.
    """
    n_pages = -(-seq_len // PAGE_TOKENS)
    pages = cache_layer[np.asarray(block_table[:n_pages], dtype=np.int64)]   # [n, Hkv, 16, Dh]
    seq = pages.transpose(0, 2, 1, 3).reshape(n_pages * PAGE_TOKENS, *pages.shape[1:2], pages.shape[3])
    return seq[:seq_len]


def attention_decode(q: np.ndarray, k_cache_layer: np.ndarray, v_cache_layer: np.ndarray,
                     block_table: np.ndarray, seq_len: int) -> np.ndarray:
    """Decode attention of one query token at position seq_len-1 over a paged cache.

    q: [Hq, Dh]; k/v_cache_layer: [P, Hkv, 16, Dh]; block_table: int [pages]. Returns [Hq, Dh]
    in q's dtype (cache values are cast to it).
    """
    k = gather_pages(k_cache_layer, block_table, seq_len).astype(q.dtype)
    v = gather_pages(v_cache_layer, block_table, seq_len).astype(q.dtype)
    return attention(q[None], k, v, np.array([seq_len - 1]))[0]


def write_pages(cache_layer: np.ndarray, block_table: np.ndarray, positions: np.ndarray,
                values: np.ndarray) -> None:
    """Store values [T, Hkv, Dh] at positions [T] into cache_layer [P, Hkv, 16, Dh] in place."""
    positions = np.asarray(positions, dtype=np.int64)
    phys = np.asarray(block_table, dtype=np.int64)[positions // PAGE_TOKENS]
    cache_layer[phys, :, positions % PAGE_TOKENS, :] = values


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
@dataclass
class LayerWeights:
    """One decoder layer, dequantized. Projections are HF-shaped [out, in]."""

    input_layernorm: np.ndarray          # [D]
    post_attention_layernorm: np.ndarray  # [D]
    q_proj: np.ndarray                   # [Hq*Dh, D]
    k_proj: np.ndarray                   # [Hkv*Dh, D]
    v_proj: np.ndarray                   # [Hkv*Dh, D]
    o_proj: np.ndarray                   # [D, Hq*Dh]
    gate_proj: np.ndarray                # [F, D]
    up_proj: np.ndarray                  # [F, D]
    down_proj: np.ndarray                # [D, F]
    q_bias: np.ndarray                   # [Hq*Dh]
    k_bias: np.ndarray                   # [Hkv*Dh]
    v_bias: np.ndarray                   # [Hkv*Dh]


@dataclass
class Weights:
    """A whole model's weights as dense arrays of one dtype (quantized weights dequantized from
    their formats, format/weight_formats.py)."""

    config: QwenConfig
    embed_tokens: np.ndarray             # [V, D]
    layers: list[LayerWeights]
    norm: np.ndarray                     # [D]
    lm_head: np.ndarray                  # [V, D]

    @classmethod
    def from_nanoqwen(cls, f: NanoqwenFile, dtype=np.float32, num_layers: int | None = None,
                      progress=None) -> "Weights":
        """Dequantize a `.nanoqwen` file into `dtype` arrays (float32: ~4 bytes/parameter).

        num_layers: load only the first layers (tests at 7B widths); progress: callable(i, n).
        """
        cfg = f.config if num_layers is None else f.config.with_layers(num_layers)
        t = f.tensor

        def deq(layer: int, proj: str) -> np.ndarray:
            # Each weight in its own format (format/weight_formats.py), float32 products first.
            return f.weight(proj_prefix(layer, proj), np.float32).astype(dtype, copy=False)

        layers = []
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}"
            layers.append(LayerWeights(
                input_layernorm=t(f"{pre}.input_layernorm.weight").astype(dtype),
                post_attention_layernorm=t(f"{pre}.post_attention_layernorm.weight").astype(dtype),
                q_proj=deq(i, "q_proj"), k_proj=deq(i, "k_proj"), v_proj=deq(i, "v_proj"),
                o_proj=deq(i, "o_proj"), gate_proj=deq(i, "gate_proj"), up_proj=deq(i, "up_proj"),
                down_proj=deq(i, "down_proj"),
                q_bias=t(f"{proj_prefix(i, 'q_proj')}.bias").astype(dtype),
                k_bias=t(f"{proj_prefix(i, 'k_proj')}.bias").astype(dtype),
                v_bias=t(f"{proj_prefix(i, 'v_proj')}.bias").astype(dtype)))
            if progress:
                progress(i + 1, cfg.num_layers)
        return cls(cfg, f.weight("model.embed_tokens", np.float32).astype(dtype, copy=False), layers,
                   t("model.norm.weight").astype(dtype), f.weight("lm_head", np.float32).astype(dtype, copy=False))


    @classmethod
    def from_dense(cls, cfg: QwenConfig, get, dtype=np.float32) -> "Weights":
        """Build from unquantized tensors: get(hf_name) → array, HF names and shapes
        (`model.layers.0.self_attn.q_proj.weight` [N, K] …). Used to check the reference
        against `transformers` on exactly the same weights."""
        def g(name):
            return np.asarray(get(name), dtype=dtype)

        layers = []
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}"
            p = {proj: proj_prefix(i, proj) for proj in
                 ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
            layers.append(LayerWeights(
                input_layernorm=g(f"{pre}.input_layernorm.weight"),
                post_attention_layernorm=g(f"{pre}.post_attention_layernorm.weight"),
                **{proj: g(f"{pp}.weight") for proj, pp in p.items()},
                q_bias=g(f"{p['q_proj']}.bias"), k_bias=g(f"{p['k_proj']}.bias"),
                v_bias=g(f"{p['v_proj']}.bias")))
        return cls(cfg, g("model.embed_tokens.weight"), layers, g("model.norm.weight"),
                   g("lm_head.weight"))

    def state_dict(self) -> dict[str, np.ndarray]:
        """HF-named dense tensors (to load the same weights into `transformers`)."""
        sd = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm,
              "lm_head.weight": self.lm_head}
        for i, L in enumerate(self.layers):
            pre = f"model.layers.{i}"
            sd[f"{pre}.input_layernorm.weight"] = L.input_layernorm
            sd[f"{pre}.post_attention_layernorm.weight"] = L.post_attention_layernorm
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                sd[f"{proj_prefix(i, proj)}.weight"] = getattr(L, proj)
            for proj in ("q", "k", "v"):
                sd[f"{proj_prefix(i, proj + '_proj')}.bias"] = getattr(L, f"{proj}_bias")
        return sd


# ---------------------------------------------------------------------------------------------
# The paged KV cache (host side)
# ---------------------------------------------------------------------------------------------
@dataclass
class PagedKVCache:
    """K and V for every layer in 16-token pages, plus the block table of one sequence.

    k, v: [L, P, Hkv, PAGE_TOKENS, Dh]; block_table: logical page → physical page; free: the
    free list pages are taken from (tests shuffle it so that no code can assume page i == i).
    Unwritten slots hold NaN, so reading past the sequence shows up at once.
    """

    k: np.ndarray
    v: np.ndarray
    free: list[int]
    block_table: list[int] = field(default_factory=list)
    seq_len: int = 0

    @classmethod
    def allocate(cls, cfg: QwenConfig, max_tokens: int, dtype=np.float32,
                 rng: np.random.Generator | None = None) -> "PagedKVCache":
        n_pages = -(-max_tokens // PAGE_TOKENS)
        shape = (cfg.num_layers, n_pages, cfg.num_kv_heads, PAGE_TOKENS, cfg.head_dim)
        free = list(range(n_pages))
        if rng is not None:
            rng.shuffle(free)
        return cls(np.full(shape, np.nan, dtype), np.full(shape, np.nan, dtype), free)

    def reserve(self, new_len: int) -> None:
        """Make sure pages exist for positions < new_len (takes pages from the free list)."""
        need = -(-new_len // PAGE_TOKENS)
        while len(self.block_table) < need:
            if not self.free:
                raise MemoryError("KV cache out of pages")
            self.block_table.append(self.free.pop(0))

    def truncate(self, n: int) -> None:
        """Keep positions < n (a sequence continued after its first n tokens): the pages that
        hold none of them go back to the front of the free list (as the GPU's
        `Sequence.rollback` does), and every later slot is NaN again, as one never written."""
        if not 0 <= n <= self.seq_len:
            raise ValueError(f"truncate({n}): the cache holds {self.seq_len} positions")
        # Every slot of the held pages from n on: a forward that failed half way may have
        # written past seq_len.
        gone = np.arange(n, len(self.block_table) * PAGE_TOKENS)
        if len(gone):
            nan = np.full((len(gone), self.k.shape[2], self.k.shape[4]), np.nan, self.k.dtype)
            for layer in range(self.k.shape[0]):
                write_pages(self.k[layer], self.block_table, gone, nan)
                write_pages(self.v[layer], self.block_table, gone, nan)
        keep = -(-n // PAGE_TOKENS)
        self.free = self.block_table[keep:] + self.free
        self.block_table = self.block_table[:keep]
        self.seq_len = n

    def reset(self) -> None:
        """Return every page to the free list (the next sequence starts at position 0)."""
        self.truncate(0)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
# Tokens per pass through the layers (Model.forward): bounds the activations to a few
# chunk × intermediate_size arrays.
PREFILL_CHUNK = 512


class Model:
    """Qwen2 forward pass over a paged KV cache, in the dtype of its weights.

    `forward(ids)` appends len(ids) tokens after the cached sequence and returns their logits;
    prefill is forward(prompt), decode is forward([token]).
    """

    def __init__(self, weights: Weights, max_tokens: int | None = None,
                 rng: np.random.Generator | None = None, chunk: int | None = None,
                 activations=None, projection_inputs=None):
        """activations: None (every value in the weights' dtype), or np.float16 to round the
        values the GPU stores in FP16 — the normed inputs of the projections and the lm_head,
        q/k/v after bias and RoPE (so the K/V cache), the attention output and the SwiGLU
        output — at the same points (docs/numerics.md's table); the residual stream, RMSNorm,
        softmax and every sum stay in the weights' dtype, as the GPU keeps them in FP32.

        projection_inputs: None, or a function [T, K] → [T, K] applied to the input of every
        matrix product (the normed x of q/k/v, gate/up and the lm_head, the attention output
        into o_proj, the SwiGLU output into down_proj), after the FP16 rounding: the values a
        kernel that re-encodes its activations would multiply (tools/agree_int8_activations.py).
        """
        self.chunk = chunk or PREFILL_CHUNK
        self._act = (lambda a: a) if activations is None else \
            (lambda a, t=np.dtype(activations): a.astype(t).astype(weights.embed_tokens.dtype))
        self._inp = projection_inputs or (lambda a: a)
        self.w = weights
        self.cfg = weights.config
        self.dtype = weights.embed_tokens.dtype
        self.max_tokens = max_tokens or self.cfg.max_position
        self.cache = PagedKVCache.allocate(self.cfg, self.max_tokens, self.dtype, rng)

    def reset(self) -> None:
        self.cache.reset()

    def forward(self, ids, last_only: bool = False) -> np.ndarray:
        """Run len(ids) new tokens. Returns logits [T, V] (or [1, V] with last_only).

        The tokens go through the layers in chunks of `chunk` (PREFILL_CHUNK): each chunk
        attends to the cache the previous ones wrote, which is the same computation as one
        pass, with activations of O(chunk) rows instead of O(T) (a 32K prompt's MLP
        activations alone would be T × F × 4 B × 3 = 1.9 GB for the 0.5B).
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.cache.seq_len + len(ids) > self.max_tokens:
            raise ValueError(f"sequence of {self.cache.seq_len + len(ids)} tokens exceeds the cache "
                             f"({self.max_tokens})")
        chunks = [ids[i:i + self.chunk] for i in range(0, len(ids), self.chunk)] or [ids]
        outs = [self._forward_chunk(c, last_only) for c in chunks]
        return outs[-1] if last_only else np.concatenate(outs, axis=0)

    def _forward_chunk(self, ids: np.ndarray, last_only: bool) -> np.ndarray:
        cfg, w, c = self.cfg, self.w, self.cache
        T = len(ids)
        start = c.seq_len
        c.reserve(start + T)
        bt = np.asarray(c.block_table)
        pos = np.arange(start, start + T)
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        Hq, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        r = self._act                                                    # FP16 storage, or none
        p = self._inp                                                    # a projection's input
        x = w.embed_tokens[ids]                                          # [T, D] residual
        for li, L in enumerate(w.layers):
            h = p(r(rmsnorm(x, L.input_layernorm, cfg.rms_norm_eps)))
            q = (h @ L.q_proj.T + L.q_bias).reshape(T, Hq, Dh)
            k = (h @ L.k_proj.T + L.k_bias).reshape(T, Hkv, Dh)
            v = r((h @ L.v_proj.T + L.v_bias).reshape(T, Hkv, Dh))
            q, k = r(apply_rope(q, cos, sin)), r(apply_rope(k, cos, sin))
            write_pages(c.k[li], bt, pos, k)
            write_pages(c.v[li], bt, pos, v)
            ks = gather_pages(c.k[li], bt, start + T)
            vs = gather_pages(c.v[li], bt, start + T)
            a = p(r(attention(q, ks, vs, pos).reshape(T, Hq * Dh)))
            x = x + a @ L.o_proj.T
            h = p(r(rmsnorm(x, L.post_attention_layernorm, cfg.rms_norm_eps)))
            x = x + p(r(swiglu(h @ L.gate_proj.T, h @ L.up_proj.T))) @ L.down_proj.T
        c.seq_len = start + T
        if last_only:
            x = x[-1:]
        return p(r(rmsnorm(x, w.norm, cfg.rms_norm_eps))) @ w.lm_head.T  # [T, V]
