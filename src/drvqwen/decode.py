"""One decode step on the GPU as an ordered list of named launches.

    embedding                     residual fp32 [D] = embed[state.token]
    per layer l (6 launches):
      L{l}.qkv_rope               xn = rmsnorm(residual) · w_in;  [q; k; v] = [Wq; Wk; Wv] xn + b   (INT4 GEMV)
                                  q fp16 [Hq, Dh] = rope(q); K/V cache[pos] = rope(k), v
      (L{l}.l2_prefetch)          with plan_decode(l2_prefetch_bytes=…): L2 ← the first weights of
                                  o_proj, gate_up and down (kernels/l2_prefetch.cu; writes nothing)
      L{l}.attention (2 launches) attn fp16 [Hq·Dh] = softmax(q Kᵀ/√Dh) V over pos < seq_len
                                  (split-KV, then the combine; 1 launch with attention="cluster")
      L{l}.o_proj                 residual += Wo attn                                               (INT4 GEMV)
      L{l}.gate_up_swiglu         xn = rmsnorm(residual) · w_post;  h fp16 [F] = silu(Wg xn) · (Wu xn) (INT4 GEMV)
      L{l}.down_proj              residual += Wd h                                                  (INT4 GEMV)
      (L{l}.l2_prefetch_qkv)      with plan_decode(l2_prefetch_qkv=True), but in the last layer: L2 ←
                                  layer l+1's q/k/v weights, whole (launched early, under down_proj)
    norm                          xn fp16 [D] = rmsnorm(residual) · w_norm
    lm_head                         logits fp32 [V] = W_lm xn, + argmax partials
    argmax                          next_token int32 [1]
    advance_state                   state = (pos + 1, next_token, seq_len + 1)

The RMSNorms, the QKV bias, RoPE and the K/V cache write, the residual adds and SwiGLU run
inside the GEMVs (gemv_int4.cu): each launch costs the GPU ~2–3 µs of drain and ramp-up, as
much as a small GEMV's bytes. Every kernel of the step waits for its predecessor with
griddepcontrol.wait, and all but the attention launches are launched as programmatic
dependents (PDL, cuda/launch.py), so their first weight loads run under the previous kernel's
tail (launchers/attention_decode.py says why not attention, with the measurement).

Every per-step value — position, token, sequence length, block table — lives in device
memory, so this list is launch for launch what a CUDA graph captures (graphs.py). Eager mode
walks it with pre-packed parameters (`DecodeStep.decode_token`). The host changes that device
state only through the sequence's owner (sequence.py, `DecodeStep.seq`): to start a sequence
and to record a newly allocated page in the block table at a page boundary.

The step is made in three stages, each its own function:

    plan_decode(config, …)    the launch list with grids, shared memory and every buffer by
                              name, shape and dtype (`DecodePlan`); needs no GPU when given
                              an occupancy (launchers.FixedOccupancy)
    DecodeStep._allocate      weights uploaded, the KV cache (kv_cache.KVCache) and the
                              activation pool sized from the plan
    DecodeStep._build         every planned launch packed against the allocated buffers

The plan's list chooses the token by argmax (`DecodeStep.launch_list`). A sampler variant is
a launch list of its own (`DecodeStep.sampler_variant`): the same launches with another token
choice — the sampler (kernels/sampling.cu) — and "publish_token" (the token into page-locked
host memory) before advance_state; the engine (engine.py) builds one per way of choosing and
captures graphs from each. The prefill (prefill.py) reserves a whole prompt's pages at once,
runs a list's sampler step from lm_head on (`LaunchList.sampler_step`) and leaves the state at
the prompt's end.

Activations (`DecodePlan.buffers`; layers reuse one set):
    state        int32 [3]          pos, token, seq_len
    block_table  int32 [P]          logical page → physical page (P = max_context / 16)
    residual     fp32 [D]           xn fp16 [D] (the final norm's output, lm_head's input)
    q            fp16 [Nq]          attn fp16 [Nq]     h fp16 [F]
    logits       fp32 [V]           part_val fp32 / part_idx int32 [ceil(V/32)]
    next_token   int32 [1]          inv_freq fp32 [Dh/2]
    partial_out fp32 [NS, Hq, Dh], max_logits / exp_sums fp32 [NS, Hq]   (split-KV attention)
and the KV cache k_cache / v_cache fp16 [L, P, Hkv, 16, Dh] (kv_cache.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .config import QwenConfig
from .cuda import DEFAULT_ALIGN_BYTES, Pool, Stream, get_device
from .errors import DrvqwenError
from .format.nanoqwen import NanoqwenFile
from .gpu_weights import GPUWeights, gpu_tensors, layout_scratch_bytes
from .kv_cache import PAGE_TOKENS, KVCache, PageAllocator, cache_bytes, cache_shape, n_pages_for
from .kv_cache import tensor_map_shape
from .launchers import (AdvanceState, ArgmaxFinal, AttentionDecode, AttentionDecodeCluster, AttentionDecodeTma,
                        Embedding, Launcher,
                        LaunchError, LmHead, RmsNorm, attention_decode, attention_decode_cluster, attention_decode_tma,
                        lm_head_partials)
from .launchers.base import DEFAULT_OCCUPANCY, BufferSpec, LaunchSpec, Occupancy, TensorMapSpec, check_resolved
from .launchers.decode_persistent import CappedOccupancy, PersistentDecode, program_bytes
from .launchers.l2_prefetch import L2Prefetch, L2Span, gemv_spans, l2_prefetch_spans
from .launchers.gemv_fmt import (EmbeddingFmt, GemvFmtGateUpSwiglu, GemvFmtQkvRope, GemvFmtResidual, LmHeadFmt,
                                 DENSE_F16, DENSE_ID, fmt_weight, format_defines, lm_head_fmt_partials)
from .format import weight_formats as wf
from .format.tensor_set import EMBED, LM_HEAD, default_formats, in_per_tensor_formats, proj_prefix
from .layer_weights import LayerWeights
from .reference import rope_inv_freq
from .launch_list import LaunchList, NamedLaunch, time_launches
from .layer_plan import int4_layer_steps, layer_kv
from .sequence import Sequence
from .stats import phase

# Decode attention kernels (plan_decode(attention=...)): "tma" = attention_decode_tma.cu (producer
# warp + TMA + mbarriers), "plain" = attention_decode.cu (the reference kernel and fallback),
# "cluster" = attention_decode_cluster.cu (one launch, the splits merged in a thread block
# cluster: built for short contexts, where the step runs it by default, below).
ATTENTION_KERNELS = ("tma", "plain", "cluster")
DEFAULT_ATTENTION = "tma"
# Attentions for the steps of short contexts (DecodeStep(short_attention=, short_below=)): the
# step then runs a launch list for each band of lengths, each with its own pair of graphs
# (LaunchList.short, LaunchList.chain). "cluster" is attention_decode_cluster.cu in clusters of
# 8 blocks (64 splits a KV head), "cluster16" the same kernel in clusters of 16 (ACL_CLUSTER=16:
# 128 splits; past the portable cluster size, which the module loader opts in to).
SHORT_ATTENTION_KERNELS = ("cluster", "cluster16")
SHORT_CLUSTER_BLOCKS = {"cluster": attention_decode_cluster.CLUSTER, "cluster16": 16}
# By default the step runs the one-launch cluster attention while each split holds at most
# SHORT_PAGES_PER_SPLIT[Dh] pages — in clusters of 8 blocks (64 splits a KV head × 16 tokens a
# page: 1024 positions at Dh = 128, 2048 at Dh = 64), then in clusters of 16 (128 splits: 2048
# and 4096) — and the two-launch TMA kernel beyond. At short contexts the two launches are two
# latency chains for little K/V (1 MiB a 7B layer at 512 tokens); the cluster kernel is one,
# merged on chip, but its splits are the warps of a few SMs, so each page more a split is one
# more page latency in a row, and a cluster of 16 merges over twice the blocks. Measured inside
# the step (graph ITL, 128 tokens after the prompt, in turns; H100;
# docs/kernels.md#one-launch-for-short-contexts-the-cluster-version): the 7B after 512 tokens
# 2.1505 ms in clusters of 8 against 2.1928 in two launches, 2.147 / 2.148 in clusters of 16
# against 2.142 / 2.138 in 8; after 1024 (two pages a split of 64) 2.198 / 2.201 in clusters
# of 8, 2.168 / 2.176 in 16, against 2.159 / 2.157 and 2.191 / 2.205 in two launches — so one
# page a split at Dh = 128; the 0.5B after 512 0.599 in clusters of 8 against 0.640 in two
# launches and 0.627 / 0.625 in 16; after 2048 (two or three pages of 64-dim heads a split of
# 64) 0.674 / 0.679 in 8 against 0.696 / 0.695, 0.6669 / 0.6645 in 16 against 0.6994 / 0.6989;
# after 3072 0.713 / 0.714 in 8 against 0.707 / 0.701, 0.6749 / 0.6715 in 16 against 0.7085 /
# 0.7045 — so two at Dh = 64.
SHORT_PAGES_PER_SPLIT = {128: 1, 64: 2}
# The launches of a layer whose weights plan_decode(l2_prefetch_bytes=...) asks L2 for, in the
# order they run: after qkv_rope, attention leaves HBM idle while these wait (kernels/l2_prefetch.cu).
L2_PREFETCH_OF = ("o_proj", "gate_up_swiglu", "down_proj")


def default_short_attention(cfg: QwenConfig, attention: str, persistent: bool) -> tuple[tuple[str, int], ...]:
    """The short-context bands a DecodeStep runs when not told, ((kernel, longest length), …)
    shortest first: each SHORT_ATTENTION_KERNELS kernel up to SHORT_PAGES_PER_SPLIT pages a
    split, behind the default attention (DEFAULT_ATTENTION); none behind another attention (the
    plain kernel, which the verify pass's bits follow, or the cluster kernel itself), with the
    persistent step, or at a head dim not measured. DecodeStep keeps a band only where the GPU
    runs all Hkv of its clusters at once (AttentionDecodeCluster.clusters_at_once)."""
    pages = SHORT_PAGES_PER_SPLIT.get(cfg.head_dim)
    if persistent or attention != DEFAULT_ATTENTION or pages is None:
        return ()
    return tuple((kernel, pages * SHORT_CLUSTER_BLOCKS[kernel] * attention_decode_cluster.WARPS * PAGE_TOKENS)
                 for kernel in SHORT_ATTENTION_KERNELS)


@dataclass
class DecodePlan:
    """The decode step before any GPU memory exists: launchers over planned buffers.

    Attributes:
        config: the model (num_layers already cut for tests).
        max_context: tokens the KV cache holds; n_pages = ceil(max_context / 16).
        attention: "tma", "plain" or "cluster" (ATTENTION_KERNELS).
        blocks_per_kv_head: S of the split-KV attention grid (the cluster's blocks for "cluster").
        buffers: activation name → BufferSpec (the pool `_allocate` carves).
        weights: tensor name → BufferSpec (what the GPU holds, gpu_weights.gpu_tensors).
        kv: "k_cache"/"v_cache" → BufferSpec [L, P, Hkv, 16, Dh] fp16.
        steps: (name, launcher) in order.
        per_tensor: the weights are in per-tensor formats (gemv_fmt.cu), not the INT4 step's.
        formats: with per_tensor, weight prefix → format id (0 = dense FP16) of the planned layers.
        fmt_defines: with per_tensor, the defines that compile gemv_fmt.cu and gemm_fmt.cu for the
            model's formats (launchers.gemv_fmt.format_defines: of every layer, not only the
            planned ones), shared by the decode step and the prefill.
        persistent: with plan_decode(persistent=True), the steps before "norm" as one persistent
            kernel (kernels/decode_persistent.cu), over the same planned launches.
        short_attention: with plan_decode(short_attention=...), for each short-context kernel
            (SHORT_ATTENTION_KERNELS) each layer's attention entry name ("L{l}.attention") → its
            launcher over the same buffers, for the steps of short contexts (DecodeStep:
            LaunchList.short).
    """

    config: QwenConfig
    max_context: int
    n_pages: int
    attention: str
    blocks_per_kv_head: int
    buffers: dict[str, BufferSpec]
    weights: dict[str, BufferSpec]
    kv: dict[str, BufferSpec]
    steps: list[tuple[str, Launcher]] = field(default_factory=list)
    per_tensor: bool = False
    formats: dict[str, int] | None = None
    fmt_defines: tuple[tuple[str, int], ...] = ()
    persistent: PersistentDecode | None = None
    short_attention: dict[str, dict[str, Launcher]] = field(default_factory=dict)

    def named_specs(self) -> list[tuple[str, LaunchSpec]]:
        """Every planned kernel launch with its step name (".0", ".1" for multi-launch steps)."""
        out = []
        for name, launcher in self.steps:
            for i, spec in enumerate(launcher.specs):
                out.append((name if len(launcher.specs) == 1 else f"{name}.{i}", spec))
        return out

    @property
    def kv_bytes(self) -> int:
        return cache_bytes(self.config, self.n_pages)

    @property
    def activation_bytes(self) -> int:
        return sum(-(-b.nbytes // DEFAULT_ALIGN_BYTES) * DEFAULT_ALIGN_BYTES for b in self.buffers.values())


def _activation_specs(cfg: QwenConfig, n_pages: int, partials: dict[str, tuple[int, ...]],
                      lm_partials: int) -> dict[str, BufferSpec]:
    D, F, V, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    nq = cfg.q_dim
    shapes = {  # name: (shape, dtype)
        "state": ((3,), np.int32), "next_token": ((1,), np.int32),
        "block_table": ((n_pages,), np.int32), "inv_freq": ((Dh // 2,), np.float32),
        "residual": ((D,), np.float32), "xn": ((D,), np.float16), "q": ((nq,), np.float16),
        "attn": ((nq,), np.float16), "h": ((F,), np.float16), "logits": ((V,), np.float32),
        "part_val": ((lm_partials,), np.float32), "part_idx": ((lm_partials,), np.int32),
        **{name: (shape, np.float32) for name, shape in partials.items()},
    }
    return {name: BufferSpec(name, s, d) for name, (s, d) in shapes.items()}


def gpu_format_ids(formats: dict[str, int]) -> set[int]:
    """The format ids the per-tensor kernels read for a model of these formats (weight prefix →
    id, every layer): each quantized weight's id, and DENSE_ID for a dense FP16 projection (a
    dense embedding or lm_head has FP16 kernels of its own)."""
    return {DENSE_ID if fid == wf.PLAIN else fid for p, fid in formats.items()
            if fid != wf.PLAIN or p not in (EMBED, LM_HEAD)}


def plan_decode(cfg: QwenConfig, max_context: int | None = None, *, attention: str = DEFAULT_ATTENTION,
                occupancy: Occupancy | None = None, text_vocab: int | None = None,
                formats: dict[str, int] | None = None, persistent: bool = False,
                persistent_min_blocks: int = 1, persistent_stress: bool = False, persistent_trace: bool = False,
                persistent_defines: tuple[tuple[str, int], ...] = (),
                short_attention: str | tuple[str, ...] | None = None, l2_prefetch_bytes: int = 0,
                l2_prefetch_qkv: bool = False, l2_prefetch_blocks: int | None = None) -> DecodePlan:
    """Plan the decode step of `cfg`: every launch, its grid and its buffers (see the module doc).

    Args:
        cfg: the model.
        max_context: tokens the KV cache holds (default cfg.max_position).
        attention: "tma", "plain" or "cluster" (ATTENTION_KERNELS).
        occupancy: blocks per SM and SM count for the grids (default: the driver's, which needs
            a GPU; launchers.FixedOccupancy plans without one).
        text_vocab: ids below it have text (NanoqwenFile.text_vocab); the lm_head rows from it
            up to vocab_size get the logit −inf, so greedy and sampled choices skip them, as
            on the CPU (default: every row).
        formats: weight prefix → format id (NanoqwenFile.formats); default (or equal to)
            `default_formats`: the INT4 step (gemv_int4.cu, FP16 embedding and lm_head). Any
            other set runs every projection through gemv_fmt.cu in its own format, and the
            embedding and lm_head in theirs (FP16 where dense).
        persistent: also plan `DecodePlan.persistent`: the steps from "embedding" through the
            last layer as one persistent kernel (needs attention="plain"; the INT4 layers, or a
            model in per-tensor formats, whose ops its build for the model's formats runs);
            persistent_min_blocks (1 or 2: blocks per SM its registers are sized for),
            persistent_stress (the stress build) and persistent_defines (more of the kernel's
            compile-time choices) choose its build; persistent_trace plans the buffer
            "persistent_trace" for its per-item timestamps.
        short_attention: also plan `DecodePlan.short_attention`, each layer's attention by this
            kernel (SHORT_ATTENTION_KERNELS: "cluster", "cluster16"), or by each of these kernels,
            over the same buffers, for short contexts.
        l2_prefetch_bytes: > 0: after each layer's qkv_rope, "L{l}.l2_prefetch" asks L2 for up to
            that many bytes of the layer's o_proj, gate_up and down_proj weights, in that order
            (kernels/l2_prefetch.cu; launchers.l2_prefetch.l2_prefetch_spans picks them); 0: none.
            Any weight format; with persistent=True the persistent kernel runs them as ops of its
            program (kernels/decode_persistent.cu).
        l2_prefetch_qkv: after each layer's down_proj but the last, "L{l}.l2_prefetch_qkv" asks L2
            for the next layer's q/k/v weights whole (its qkv_rope is a latency chain over 8.5 MB at
            7B). Launched as a programmatic dependent, it starts once down_proj's blocks have all
            started — under down_proj, which leaves HBM time (54 % of copy bandwidth at 7B,
            gemv_int4.cu's table). With persistent=True likewise an op of its program.
        l2_prefetch_blocks: blocks of each L2 prefetch launch (default
            launchers.l2_prefetch.DEFAULT_BLOCKS), to measure.
    Raises:
        DrvqwenError: max_context out of [1, max_position], an unknown attention kernel, a
            persistent step for another attention kernel, or an L2
            prefetch budget that is negative or too small to plan any.
        LaunchError: a weight format the GPU kernels do not run, or one that does not fit its
            weight's shape there (naming the weight).
    """
    if attention not in ATTENTION_KERNELS:
        raise DrvqwenError(f"attention={attention!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
    shorts = (short_attention,) if isinstance(short_attention, str) else tuple(short_attention or ())
    if shorts and (any(k not in SHORT_ATTENTION_KERNELS or k == attention for k in shorts)
                   or len(set(shorts)) < len(shorts) or persistent):
        raise DrvqwenError(f"short_attention={short_attention!r}: one or more of {', '.join(SHORT_ATTENTION_KERNELS)}, "
                           f"each once, other than attention={attention!r}, and not with the persistent step")
    if l2_prefetch_bytes < 0:
        raise DrvqwenError(f"l2_prefetch_bytes={l2_prefetch_bytes}: want ≥ 0")
    if persistent and attention != "plain":
        raise DrvqwenError(f"the persistent decode step runs the plain attention kernel, not attention={attention!r}")
    if persistent:  # every launch planned for the persistent kernel's blocks (CappedOccupancy)
        occupancy = CappedOccupancy(occupancy or DEFAULT_OCCUPANCY, persistent_min_blocks)
    max_context = int(max_context or cfg.max_position)
    if not 1 <= max_context <= cfg.max_position:
        raise DrvqwenError(f"max_context={max_context}: must be in [1, {cfg.max_position}]")
    n_pages = n_pages_for(max_context)
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hq, Hkv, Dh, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    nq = cfg.q_dim

    if attention == "tma":
        S = attention_decode_tma.blocks_per_kv_head(Hkv, max_context, Dh, occupancy)
        partials = attention_decode.partial_shapes(Hq, Dh, S, attention_decode_tma.CONSUMERS)
    elif attention == "cluster":  # no partials in global memory: the cluster merges on chip
        S, partials = attention_decode_cluster.CLUSTER, {}
    else:
        S = attention_decode.blocks_per_kv_head(Hkv, max_context, Dh, occupancy)
        partials = attention_decode.partial_shapes(Hq, Dh, S)
    per_tensor = in_per_tensor_formats(cfg, formats)
    fm = {p: formats.get(p, wf.PLAIN) for p in default_formats(cfg)} if per_tensor else None
    lm_in_format = fm is not None and fm[LM_HEAD] != wf.PLAIN
    # Every layer's formats (the plan may cover fewer), and those of the planned ones as planned
    # (a projection the dict leaves out is dense FP16).
    fmt_defines = format_defines(gpu_format_ids(formats) | gpu_format_ids(fm)) if per_tensor else ()
    a = _activation_specs(cfg, n_pages, partials,
                          lm_head_fmt_partials(V, D, occupancy, fmt_defines) if lm_in_format else lm_head_partials(V))
    weights = {name: BufferSpec(name, shape, dtype) for name, (dtype, shape) in gpu_tensors(cfg, fm).items()}
    kv = {pool: BufferSpec(pool, cache_shape(cfg, n_pages), np.float16) for pool in ("k_cache", "v_cache")}
    plan = DecodePlan(cfg, max_context, n_pages, attention, S, a, weights, kv, per_tensor=bool(per_tensor),
                      formats=fm, fmt_defines=fmt_defines)
    part = tuple(a[n] for n in partials)
    maps = {pool: TensorMapSpec(kv[pool], tensor_map_shape(kv[pool].shape), (PAGE_TOKENS, Dh)) for pool in kv}
    gemv = dict(occupancy=occupancy)
    fmt_gemv = dict(occupancy=occupancy, defines=fmt_defines)
    eps = cfg.rms_norm_eps

    steps = plan.steps
    def fw(prefix: str, dense_ok: bool = False):
        """The FmtWeight of `prefix`; where it is dense FP16: None (embedding, lm_head: their
        FP16 kernels) or, with dense_ok, a DENSE_F16 FmtWeight (a projection)."""
        fid = fm[prefix] if fm else wf.PLAIN
        if fid == wf.PLAIN:
            return fmt_weight(weights.__getitem__, prefix, DENSE_F16) if dense_ok else None
        return fmt_weight(weights.__getitem__, prefix, wf.FORMATS[fid])

    emb = fw(EMBED)
    steps.append(("embedding", Embedding(a["residual"], weights["model.embed_tokens.weight"], a["state"],
                                         vocab_size=V, dim=D) if emb is None else
                  EmbeddingFmt(a["residual"], emb, a["state"], vocab_size=V, dim=D, defines=fmt_defines)))
    for l in range(L):
        w = LayerWeights.of(weights.__getitem__, l)
        k_l, v_l = layer_kv(kv, l)
        if attention == "cluster":
            attn = AttentionDecodeCluster(a["attn"], a["q"], k_l, v_l, a["block_table"], a["state"],
                                          n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh)
        elif attention == "tma":
            attn = AttentionDecodeTma(a["attn"], a["q"], maps["k_cache"], maps["v_cache"], a["block_table"],
                                      a["state"], part, n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh,
                                      blocks_per_kv_head=S, layer_page0=l * n_pages, k_cache=k_l, v_cache=v_l)
        else:
            attn = AttentionDecode(a["attn"], a["q"], k_l, v_l, a["block_table"], a["state"], part,
                                   n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, blocks_per_kv_head=S)
        for kernel in shorts:
            blocks = SHORT_CLUSTER_BLOCKS[kernel]
            plan.short_attention.setdefault(kernel, {})[f"L{l}.attention"] = AttentionDecodeCluster(
                a["attn"], a["q"], k_l, v_l, a["block_table"], a["state"], n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh,
                defines=() if blocks == attention_decode_cluster.CLUSTER else (("ACL_CLUSTER", blocks),))
        if fm is not None:
            q, k, v, o, g, u, d = (fw(proj_prefix(l, p), dense_ok=True)
                                   for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
            layer = [
                (f"L{l}.qkv_rope", GemvFmtQkvRope(a["q"], k_l, v_l, a["residual"], w.input_layernorm, q, k, v,
                                                  w.q_bias, w.k_bias, w.v_bias, a["inv_freq"], a["state"],
                                                  a["block_table"], n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, dim=D,
                                                  eps=eps, **fmt_gemv)),
                (f"L{l}.attention", attn),
                (f"L{l}.o_proj", GemvFmtResidual(a["residual"], a["attn"], o, n=D, k=nq, **fmt_gemv)),
                (f"L{l}.gate_up_swiglu", GemvFmtGateUpSwiglu(a["h"], a["residual"], w.post_attention_layernorm, g, u,
                                                             f=F, k=D, eps=eps, **fmt_gemv)),
                (f"L{l}.down_proj", GemvFmtResidual(a["residual"], a["h"], d, n=D, k=F, **fmt_gemv)),
            ]
        else:
            layer = int4_layer_steps(cfg, l, w, a, (k_l, v_l), attn, gemv=gemv)
        if l2_prefetch_bytes:
            ahead = [launcher for name, launcher in layer if name.split(".")[-1] in L2_PREFETCH_OF]
            spans = l2_prefetch_spans(ahead, l2_prefetch_bytes)
            if not spans:  # the same in every layer: the budget is below the first GEMV's share
                first = sum(s.n_bytes for s in gemv_spans(ahead[0], 1))
                raise DrvqwenError(f"l2_prefetch_bytes={l2_prefetch_bytes}: below what o_proj's blocks read first "
                                   f"({first} B, one tile each); nothing would be prefetched")
            layer.insert(1, (f"L{l}.l2_prefetch", L2Prefetch(spans, occupancy=occupancy, blocks=l2_prefetch_blocks)))
        if l2_prefetch_qkv and l + 1 < L:
            if fm is not None:
                nxt = [fw(proj_prefix(l + 1, p), dense_ok=True).buffers for p in ("q_proj", "k_proj", "v_proj")]
            else:
                n_w = LayerWeights.of(weights.__getitem__, l + 1)
                nxt = [n_w.q_proj, n_w.k_proj, n_w.v_proj]
            spans = [L2Span.whole(b) for proj in nxt for b in proj]
            layer.append((f"L{l}.l2_prefetch_qkv", L2Prefetch(spans, occupancy=occupancy,
                                                              blocks=l2_prefetch_blocks)))
        steps += layer
    head = fw(LM_HEAD)
    lm = (LmHead(a["logits"], a["part_val"], a["part_idx"], a["xn"], weights["lm_head.weight"],
                 vocab_size=V, dim=D, text_vocab=text_vocab) if head is None else
          LmHeadFmt(a["logits"], a["part_val"], a["part_idx"], a["xn"], head, vocab_size=V, dim=D,
                    text_vocab=text_vocab, **fmt_gemv))
    steps += [
        ("norm", RmsNorm(a["xn"], a["residual"], weights["model.norm.weight"], dim=D, eps=eps)),
        ("lm_head", lm),
        ("argmax", ArgmaxFinal(a["next_token"], a["part_val"], a["part_idx"], n_partials=lm.n_partials)),
        ("advance_state", AdvanceState(a["state"], a["next_token"])),
    ]
    if persistent:
        members = steps[:[n for n, _l in steps].index("norm")]
        specs = [s for _n, l in members for s in l.specs]
        a["persistent_program"] = BufferSpec("persistent_program", (program_bytes(specs),), np.uint8)
        a["persistent_counters"] = BufferSpec("persistent_counters", (len(specs) + 1,), np.uint32)
        plan.persistent = PersistentDecode(members, a["persistent_program"], a["persistent_counters"], head_dim=Dh,
                                           occupancy=occupancy, min_blocks=persistent_min_blocks,
                                           stress=persistent_stress, trace=persistent_trace,
                                           defines=persistent_defines, fmt_defines=fmt_defines)
        if plan.persistent.trace is not None:
            a["persistent_trace"] = plan.persistent.trace
    return plan


class DecodeStep:
    """The GPU decode step for one model: weights, KV cache, activations, and the launch list.

    Args:
        f: the validated `.nanoqwen` file.
        max_context: tokens the KV cache holds (default: the model's max_position).
        num_layers: run only the first layers (tests at 7B widths).
        rng: shuffles the page free list (tests).
        progress: weight upload progress callback (bytes_done, bytes_total).
        attention: "tma" (the warp-specialised TMA kernel; its tensor maps of the K/V pools are
            encoded once, at build) or "plain" (the reference kernel and fallback).
        pdl: launch the kernels as programmatic dependents (the default; False for the
            comparison, same results).
        persistent: also build the persistent step (plan_decode(persistent=True); the attention
            is then "plain" unless given): `persistent_variant` turns any of the step's launch
            lists into one that runs the embedding and the layers as one kernel.
        persistent_min_blocks, persistent_stress, persistent_trace, persistent_defines: its build
            and its trace buffer (plan_decode).
        short_attention, short_below: another attention kernel (SHORT_ATTENTION_KERNELS) for the
            steps whose attention covers at most short_below positions (its own included): every
            launch list of the step then carries that twin (LaunchList.short), which eager steps,
            GraphDecoder and the per-token prefill pick by length. None / 0: one attention at
            every length. The default ("auto", None): default_short_attention's bands — the
            cluster kernel in clusters of 8 up to 1024 positions at head dim 128 (2048 at 64),
            in clusters of 16 up to 2048 (4096), behind the default attention only; a band whose
            Hkv clusters the GPU cannot run at once is left out. DecodeStep.time_kernels times
            the step's own list, not the twins.
        l2_prefetch_bytes: > 0: each INT4 layer asks L2 for up to that many bytes of its
            o_proj, gate_up and down weights after qkv_rope (plan_decode); l2_prefetch_qkv: each
            layer but the last asks for the next one's q/k/v weights after down_proj;
            l2_prefetch_blocks: their launches' blocks. The same values.
    Attributes:
        plan: the DecodePlan it was built from.
        short_bands: the short-context bands kept, shortest first: (kernel, entry name →
            launcher, the longest attention length it runs); short_below: the last band's
            length, 0 without one.
        launch_list: the plan's step (greedy argmax) built: `launches` (NamedLaunch list of one
            step, in order) and `launchers` are its.
        buf: activation name → DeviceArray; kv: the KVCache; weights: the GPUWeights.
        seq: the Sequence (sequence.py): position, pages and block table of the cache's sequence.
        text_vocab: the lm_head rows from it on get −inf (the file's text_vocab, plan_decode's).
    Raises:
        DrvqwenError: no usable GPU, bad max_context or attention (or short_attention without
            short_below ≥ 1, or the reverse), or the model and its cache do not fit (checked
            before any upload).
    """

    def __init__(self, f: NanoqwenFile, max_context: int | None = None, num_layers: int | None = None,
                 rng: np.random.Generator | None = None, progress: Callable[[int, int], None] | None = None,
                 attention: str | None = None, pdl: bool = True, persistent: bool = False,
                 persistent_min_blocks: int = 1, persistent_stress: bool = False, persistent_trace: bool = False,
                 persistent_defines: tuple[tuple[str, int], ...] = (), short_attention: str | None = "auto",
                 short_below: int | None = None, l2_prefetch_bytes: int = 0, l2_prefetch_qkv: bool = False,
                 l2_prefetch_blocks: int | None = None):
        auto = short_attention == "auto" and short_below is None
        short_below = short_below or 0
        if not auto and (short_attention == "auto" or (short_attention is None) != (short_below == 0)
                         or short_below < 0):
            raise DrvqwenError(f"short_attention={short_attention!r} with short_below={short_below}: give both "
                               "(a kernel and a length ≥ 1) or neither")
        cfg = f.config if num_layers is None else f.config.with_layers(num_layers)
        attention = attention or ("plain" if persistent else DEFAULT_ATTENTION)
        # The bands, shortest first: (kernel, the longest attention length it runs).
        bands = (default_short_attention(cfg, attention, persistent) if auto
                 else ((short_attention, short_below),) if short_attention is not None else ())
        self.device = get_device()
        self.pdl = pdl
        self.config = cfg
        self.plan = plan_decode(cfg, max_context, attention=attention, text_vocab=f.text_vocab, formats=f.formats,
                                persistent=persistent, persistent_min_blocks=persistent_min_blocks,
                                persistent_stress=persistent_stress, persistent_trace=persistent_trace,
                                persistent_defines=tuple(persistent_defines),
                                short_attention=tuple(k for k, _below in bands) or None,
                                l2_prefetch_bytes=l2_prefetch_bytes,
                                l2_prefetch_qkv=l2_prefetch_qkv, l2_prefetch_blocks=l2_prefetch_blocks)
        self.attention, self.max_context, self.text_vocab = attention, self.plan.max_context, f.text_vocab
        self._bands, self._auto_bands = bands, auto
        self._check_fits(f)
        self.stream = Stream()
        self._allocate(f, progress, num_layers, rng)
        self._build()

    # ---- allocate ------------------------------------------------------------------------------
    def _check_fits(self, f: NanoqwenFile) -> None:
        """Size everything before uploading a byte: a model that does not fit fails here. The
        weights count with the scratch their tile-major planes borrow while the load rearranges
        them (gpu_weights.layout_scratch_bytes)."""
        weight_bytes = sum(i.nbytes for i in f) + layout_scratch_bytes(f)
        free, _total = self.device.memory_info()
        if self.plan.kv_bytes + weight_bytes > free:
            raise DrvqwenError(
                f"{f.path}: weights ({weight_bytes / 2**30:.2f} GiB) + KV cache for {self.max_context} "
                f"tokens ({self.plan.kv_bytes / 2**30:.2f} GiB) exceed free GPU memory ({free / 2**30:.2f} GiB); "
                f"lower --max-context")

    def _allocate(self, f: NanoqwenFile, progress, num_layers: int | None, rng) -> None:
        """Weights (uploaded), the KV cache, the activation pool, the sequence and its pages."""
        plan, cfg = self.plan, self.config
        with phase("upload"):
            self.weights = GPUWeights(f, progress=progress, num_layers=num_layers)
        self.kv = KVCache(cfg, plan.n_pages)
        self.k_cache, self.v_cache = self.kv.k, self.kv.v
        self.act_pool = Pool(plan.activation_bytes + DEFAULT_ALIGN_BYTES, name="activations")
        self.buf = {name: self.act_pool.alloc(name, b.shape, b.dtype) for name, b in plan.buffers.items()}
        self.buf["inv_freq"].upload(rope_inv_freq(cfg.head_dim, cfg.rope_theta))
        self.buf["block_table"].upload(np.zeros(plan.n_pages, np.int32))
        self.seq = Sequence(PageAllocator(plan.n_pages, rng), self.buf["state"], self.buf["block_table"],
                            plan.max_context, self.stream)

    def resolve(self, spec):
        """The device object behind a planned buffer or tensor map (launchers' build resolver).

        Raises:
            KeyError: the plan names a buffer that was not allocated.
            LaunchError: the allocated buffer's shape or dtype differs from the plan's.
        """
        if isinstance(spec, TensorMapSpec):
            return self.kv.tensor_map(spec.of.name)
        name = spec.name
        if name in self.buf:
            arr = self.buf[name]
        elif name in self.weights.arrays:
            arr = self.weights[name]
        elif name in ("k_cache", "v_cache"):
            arr = self.kv.k if name == "k_cache" else self.kv.v
        else:
            pool, layer = name.rstrip("]").split("[")
            arr = self.kv.layer_view(pool, int(layer))
        return check_resolved(spec, arr)

    # ---- build --------------------------------------------------------------------------------
    def _build(self) -> None:
        """Pack every planned launch against the allocated buffers, on the step's stream."""
        for _name, launcher in self.plan.steps:
            launcher.build(self.resolve, self.stream, pdl=self.pdl)
        if self.plan.persistent is not None:
            self.plan.persistent.build(self.resolve, self.stream)
        # The short-context bands (kernel, entry name → launcher, longest length), shortest
        # first; a default band only where the GPU runs every KV head's cluster at once (a
        # cluster's blocks share one GPC: a cluster of 16 may find no room on a smaller part).
        self.short_bands = []
        for kernel, below in self._bands:
            entries = self.plan.short_attention[kernel]
            for launcher in entries.values():
                launcher.build(self.resolve, self.stream, pdl=self.pdl)
            first = next(iter(entries.values()))
            if not self._auto_bands or first.clusters_at_once() >= self.config.num_kv_heads:
                self.short_bands.append((kernel, entries, below))
        self.short_below = self.short_bands[-1][2] if self.short_bands else 0
        self.launch_list = self._with_short("greedy", list(self.plan.steps))

    def _with_short(self, name: str, steps: list[tuple[str, Launcher]]) -> LaunchList:
        """The LaunchList of `steps`, with its short-context twins where the step has them
        (short_bands): the same entries, each layer's attention replaced by a band's kernel,
        each twin the `short` of the next longer band's (LaunchList.chain)."""
        twin, below = None, 0
        for kernel, entries, longest in self.short_bands:
            twin = LaunchList(f"{name}+{kernel}", [(n, entries.get(n, l)) for n, l in steps], short=twin,
                              short_below=below)
            below = longest
        return LaunchList(name, steps, short=twin, short_below=below)

    def persistent_variant(self, launch_list: LaunchList | None = None) -> LaunchList:
        """`launch_list` (default: the plan's) with its entries before "norm" — the embedding and
        every layer — replaced by the one persistent launch ("decode_layers"), which computes the
        same values bit for bit (kernels/decode_persistent.cu). Named "<name>+persistent".

        Raises:
            DrvqwenError: the step was built without persistent=True.
        """
        if self.plan.persistent is None:
            raise DrvqwenError("this decode step was built without the persistent kernel (persistent=True)")
        lst = launch_list or self.launch_list
        steps = lst.launchers
        return LaunchList(f"{lst.name}+persistent", [("decode_layers", self.plan.persistent)] + steps[lst.index("norm"):])

    @property
    def launches(self) -> list[NamedLaunch]:
        """The plan's step, one NamedLaunch per kernel launch in order (launch_list.launches)."""
        return self.launch_list.launches

    @property
    def launchers(self) -> list[tuple[str, Launcher]]:
        """The plan's step as (name, launcher) in order (launch_list.launchers)."""
        return self.launch_list.launchers

    def sampler_variant(self, name: str, chooser: tuple[str, Launcher] | None = None,
                        publish: Launcher | None = None) -> LaunchList:
        """A launch list of its own for another way of choosing the token (the plan's list is
        left as it is).

        chooser: (entry name, launcher writing buf["next_token"]), e.g. ("sample", SampleToken),
            in the place of the plan's ("argmax", ArgmaxFinal); None keeps the argmax.
        publish: a launcher that hands next_token to the host (PublishToken), as
            "publish_token" just before "advance_state"; None: no publishing.
        The other entries are the plan's, in its order, built once and shared by every list.
        """
        for launcher in (chooser[1] if chooser is not None else None, publish):
            if launcher is not None:
                launcher.build(stream=self.stream, pdl=self.pdl)  # no-op if built already
        steps = list(self.launch_list.launchers)
        if chooser is not None:
            steps[self.launch_list.index("argmax")] = chooser
        if publish is not None:
            steps.insert(self.launch_list.index("advance_state"), ("publish_token", publish))
        return self._with_short(name, steps)

    # ---- running ----------------------------------------------------------------------------
    def _open_page(self) -> None:
        """At a page boundary, take a page from the free list and record it in the device
        block table (4 bytes, queued on the stream before the step's kernels)."""
        page = self.seq.open_page()
        if page is not None:
            self.seq.write_block_table_entry(page)

    def decode_token(self, launch_list: LaunchList | None = None) -> None:
        """Queue one decode step eagerly (`launch_list`, default the plan's; its short-context
        twin where the step's attention covers at most short_below positions: for_length):
        consumes state.token at state.pos, leaves logits and next_token, and advances state on
        the GPU. Asynchronous; `sync()` waits.

        Raises:
            DrvqwenError: the context is full or no free page is left.
        """
        self._open_page()
        for nl in (launch_list or self.launch_list).for_length(self.seq.pos + 1).launches:
            nl.launch.launch()
        self.seq.advance()

    def sync(self) -> None:
        self.stream.synchronize()

    def logits(self) -> np.ndarray:
        """fp32 [V] logits of the last step (waits for the stream)."""
        return self.buf["logits"].download(self.stream)

    def next_token(self) -> int:
        return int(self.buf["next_token"].download(self.stream)[0])

    def time_kernels(self, n_steps: int = 10, hold_ms: float = 20.0) -> dict[str, float]:
        """Median GPU time in µs of each named launch over n_steps eager steps.

        Each step is queued behind `gpu_sleep(hold_ms)` (kernels/timing.cu), so the host has
        enqueued every launch and its event pair before the GPU starts: the kernels then run
        back to back and each event pair brackets the kernel alone, not the host's launch
        latency. Each figure still includes the event pair's own cost (~2 µs on the H200).
        """
        return time_launches(self.launches, self.stream, n_steps, before=self._open_page, after=self.seq.advance,
                             hold_ms=hold_ms)

    def close(self) -> None:
        """Release the device memory (weights, KV cache, activations) and the stream."""
        self.sync()
        self.weights.close()
        self.kv.close()
        self.act_pool.close()
        self.stream.close()
