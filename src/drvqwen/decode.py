"""One decode step on the GPU as an ordered list of named launches.

    embedding                     residual fp32 [D] = embed[state.token]
    per layer l (6 launches):
      L{l}.qkv_rope               xn = rmsnorm(residual) · w_in;  [q; k; v] = [Wq; Wk; Wv] xn + b   (INT4 GEMV)
                                  q fp16 [Hq, Dh] = rope(q); K/V cache[pos] = rope(k), v
      L{l}.attention (2 launches) attn fp16 [Hq·Dh] = softmax(q Kᵀ/√Dh) V over pos < seq_len
      L{l}.o_proj                 residual += Wo attn                                               (INT4 GEMV)
      L{l}.gate_up_swiglu         xn = rmsnorm(residual) · w_post;  h fp16 [F] = silu(Wg xn) · (Wu xn) (INT4 GEMV)
      L{l}.down_proj              residual += Wd h                                                  (INT4 GEMV)
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
walks it with pre-packed parameters. The host only touches device state to start a sequence
(`start`) and to record a newly allocated page in the block table at a page boundary
(`_ensure_page`).

The step is made in three stages, each its own function:

    plan_decode(config, …)    the launch list with grids, shared memory and every buffer by
                              name, shape and dtype (`DecodePlan`); needs no GPU when given
                              an occupancy (launchers.FixedOccupancy)
    DecodeStep._allocate      weights uploaded, the KV cache (kv_cache.KVCache) and the
                              activation pool sized from the plan
    DecodeStep._build         every planned launch packed against the allocated buffers

The engine (engine.py) swaps the token choice — argmax, or the sampler (kernels/sampling.cu)
— and inserts "publish_token" (the token into page-locked host memory) before advance_state
with `set_sampler`; the prefill (prefill.py) reserves a whole prompt's pages at once
(`reserve`), runs the sampler step from lm_head on (`sampler_step`) and leaves the state at
the prompt's end (`resume`).

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

from . import launchers as K
from .config import QwenConfig
from .cuda import DEFAULT_ALIGN_BYTES, Event, KernelLaunch, Pool, Stream, get_device
from .errors import DrvqwenError
from .format.nanoqwen import NanoqwenFile, expected_tensors
from .gpu_weights import GPUWeights
from .kv_cache import PAGE_TOKENS, KVCache, PageAllocator, cache_bytes, cache_shape, layer_view_name, n_pages_for
from .kv_cache import tensor_map_shape
from .launchers import attention_decode, attention_decode_tma
from .launchers.base import BufferSpec, LaunchSpec, Occupancy, TensorMapSpec
from .layer_weights import LayerWeights
from .reference import rope_inv_freq

# Decode attention kernels (plan_decode(attention=...)): "tma" = attention_decode_tma.cu (producer
# warp + TMA + mbarriers), "plain" = attention_decode.cu (the reference kernel and fallback).
ATTENTION_KERNELS = ("tma", "plain")
DEFAULT_ATTENTION = "tma"


@dataclass
class NamedLaunch:
    """One entry of the decode step: a name, the pre-packed launch, and what it was planned as.

    Attributes:
        name: e.g. "L3.qkv_proj" (a launcher of two kernels gets ".0", ".1").
        launch: the KernelLaunch.
        spec: the LaunchSpec it was built from (kernel, grid, buffers read and written).
    """

    name: str
    launch: KernelLaunch
    spec: LaunchSpec | None = None

    @property
    def writes(self) -> tuple[str, ...]:
        """Names of every buffer the launch writes."""
        return self.spec.writes if self.spec is not None else ()


@dataclass
class DecodePlan:
    """The decode step before any GPU memory exists: launchers over planned buffers.

    Attributes:
        config: the model (num_layers already cut for tests).
        max_context: tokens the KV cache holds; n_pages = ceil(max_context / 16).
        attention: "tma" or "plain".
        blocks_per_kv_head: S of the split-KV attention grid.
        buffers: activation name → BufferSpec (the pool `_allocate` carves).
        weights: tensor name → BufferSpec (what the file holds, expected_tensors).
        kv: "k_cache"/"v_cache" → BufferSpec [L, P, Hkv, 16, Dh] fp16.
        steps: (name, launcher) in order.
    """

    config: QwenConfig
    max_context: int
    n_pages: int
    attention: str
    blocks_per_kv_head: int
    buffers: dict[str, BufferSpec]
    weights: dict[str, BufferSpec]
    kv: dict[str, BufferSpec]
    steps: list[tuple[str, K.Launcher]] = field(default_factory=list)

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


def _activation_specs(cfg: QwenConfig, n_pages: int, partials: dict[str, tuple[int, ...]]) -> dict[str, BufferSpec]:
    D, F, V, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    nq = cfg.q_dim
    shapes = {  # name: (shape, dtype)
        "state": ((3,), np.int32), "next_token": ((1,), np.int32),
        "block_table": ((n_pages,), np.int32), "inv_freq": ((Dh // 2,), np.float32),
        "residual": ((D,), np.float32), "xn": ((D,), np.float16), "q": ((nq,), np.float16),
        "attn": ((nq,), np.float16), "h": ((F,), np.float16), "logits": ((V,), np.float32),
        "part_val": ((K.lm_head_partials(V),), np.float32), "part_idx": ((K.lm_head_partials(V),), np.int32),
        **{name: (shape, np.float32) for name, shape in partials.items()},
    }
    return {name: BufferSpec(name, s, d) for name, (s, d) in shapes.items()}


def plan_decode(cfg: QwenConfig, max_context: int | None = None, *, attention: str = DEFAULT_ATTENTION,
                occupancy: Occupancy | None = None, text_vocab: int | None = None) -> DecodePlan:
    """Plan the decode step of `cfg`: every launch, its grid and its buffers (see the module doc).

    Args:
        cfg: the model.
        max_context: tokens the KV cache holds (default cfg.max_position).
        attention: "tma" or "plain" (ATTENTION_KERNELS).
        occupancy: blocks per SM and SM count for the grids (default: the driver's, which needs
            a GPU; launchers.FixedOccupancy plans without one).
        text_vocab: ids below it have text (NanoqwenFile.text_vocab); the lm_head rows from it
            up to vocab_size get the logit −inf, so greedy and sampled choices skip them, as
            on the CPU (default: every row).
    Raises:
        DrvqwenError: max_context out of [1, max_position], or an unknown attention kernel.
    """
    if attention not in ATTENTION_KERNELS:
        raise DrvqwenError(f"attention={attention!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
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
    else:
        S = attention_decode.blocks_per_kv_head(Hkv, max_context, Dh, occupancy)
        partials = attention_decode.partial_shapes(Hq, Dh, S)
    a = _activation_specs(cfg, n_pages, partials)
    weights = {name: BufferSpec(name, shape, dtype) for name, (dtype, shape) in expected_tensors(cfg).items()}
    kv = {pool: BufferSpec(pool, cache_shape(cfg, n_pages), np.float16) for pool in ("k_cache", "v_cache")}
    plan = DecodePlan(cfg, max_context, n_pages, attention, S, a, weights, kv)
    part = tuple(a[n] for n in partials)
    maps = {pool: TensorMapSpec(kv[pool], tensor_map_shape(kv[pool].shape), (PAGE_TOKENS, Dh)) for pool in kv}
    gemv = dict(occupancy=occupancy)
    eps = cfg.rms_norm_eps

    steps = plan.steps
    steps.append(("embedding", K.Embedding(a["residual"], weights["model.embed_tokens.weight"], a["state"],
                                           vocab_size=V, dim=D)))
    for l in range(L):
        w = LayerWeights.of(weights.__getitem__, l)
        k_l, v_l = (BufferSpec(layer_view_name(p, l), kv[p].shape[1:], np.float16) for p in ("k_cache", "v_cache"))
        if attention == "tma":
            attn = K.AttentionDecodeTma(a["attn"], a["q"], maps["k_cache"], maps["v_cache"], a["block_table"],
                                        a["state"], part, n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh,
                                        blocks_per_kv_head=S, layer_page0=l * n_pages, k_cache=k_l, v_cache=v_l)
        else:
            attn = K.AttentionDecode(a["attn"], a["q"], k_l, v_l, a["block_table"], a["state"], part,
                                     n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, blocks_per_kv_head=S)
        steps += [
            (f"L{l}.qkv_rope", K.GemvInt4QkvRope(a["q"], k_l, v_l, a["residual"], w.input_layernorm, *w.q_proj,
                                                 *w.k_proj, *w.v_proj, w.q_bias, w.k_bias, w.v_bias, a["inv_freq"],
                                                 a["state"], a["block_table"], n_heads=Hq, n_kv_heads=Hkv,
                                                 head_dim=Dh, dim=D, eps=eps, **gemv)),
            (f"L{l}.attention", attn),
            (f"L{l}.o_proj", K.GemvInt4Residual(a["residual"], a["attn"], *w.o_proj, n=D, k=nq, **gemv)),
            (f"L{l}.gate_up_swiglu", K.GemvInt4GateUpSwiglu(a["h"], a["residual"], w.post_attention_layernorm,
                                                            *w.gate_proj, *w.up_proj, f=F, k=D, eps=eps, **gemv)),
            (f"L{l}.down_proj", K.GemvInt4Residual(a["residual"], a["h"], *w.down_proj, n=D, k=F, **gemv)),
        ]
    lm = K.LmHead(a["logits"], a["part_val"], a["part_idx"], a["xn"], weights["lm_head.weight"],
                  vocab_size=V, dim=D, text_vocab=text_vocab)
    steps += [
        ("norm", K.RmsNorm(a["xn"], a["residual"], weights["model.norm.weight"], dim=D, eps=eps)),
        ("lm_head", lm),
        ("argmax", K.ArgmaxFinal(a["next_token"], a["part_val"], a["part_idx"], n_partials=lm.n_partials)),
        ("advance_state", K.AdvanceState(a["state"], a["next_token"])),
    ]
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
    Attributes:
        plan: the DecodePlan it was built from.
        launches: NamedLaunch list of one step, in order.
        buf: activation name → DeviceArray; kv: the KVCache; weights: the GPUWeights.
        pages: the PageAllocator; pos: host mirror of state[0] (the next position to decode).
    Raises:
        DrvqwenError: no usable GPU, bad max_context or attention, or the model and its cache
            do not fit (checked before any upload).
    """

    def __init__(self, f: NanoqwenFile, max_context: int | None = None, num_layers: int | None = None,
                 rng: np.random.Generator | None = None, progress: Callable[[int, int], None] | None = None,
                 attention: str = DEFAULT_ATTENTION, pdl: bool = True):
        self.device = get_device()
        self.pdl = pdl
        cfg = f.config if num_layers is None else f.config.with_layers(num_layers)
        self.config = cfg
        self.plan = plan_decode(cfg, max_context, attention=attention, text_vocab=f.text_vocab)
        self.attention, self.max_context = attention, self.plan.max_context
        self._check_fits(f)
        self.stream = Stream()
        self._allocate(f, progress, num_layers, rng)
        self._build()
        self.pos = 0                     # host mirror of state[0] (the next position to decode)
        self._h_block = np.zeros(1, np.int32)

    # ---- allocate ------------------------------------------------------------------------------
    def _check_fits(self, f: NanoqwenFile) -> None:
        """Size everything before uploading a byte: a model that does not fit fails here."""
        weight_bytes = sum(i.nbytes for i in f)
        free, _total = self.device.memory_info()
        if self.plan.kv_bytes + weight_bytes > free:
            raise DrvqwenError(
                f"{f.path}: weights ({weight_bytes / 2**30:.2f} GiB) + KV cache for {self.max_context} "
                f"tokens ({self.plan.kv_bytes / 2**30:.2f} GiB) exceed free GPU memory ({free / 2**30:.2f} GiB); "
                f"lower --max-context")

    def _allocate(self, f: NanoqwenFile, progress, num_layers: int | None, rng) -> None:
        """Weights (uploaded), the KV cache, the activation pool, the page allocator."""
        plan, cfg = self.plan, self.config
        self.weights = GPUWeights(f, progress=progress, num_layers=num_layers)
        self.kv = KVCache(cfg, plan.n_pages)
        self.k_cache, self.v_cache = self.kv.k, self.kv.v
        self.act_pool = Pool(plan.activation_bytes + DEFAULT_ALIGN_BYTES, name="activations")
        self.buf = {name: self.act_pool.alloc(name, b.shape, b.dtype) for name, b in plan.buffers.items()}
        self.buf["inv_freq"].upload(rope_inv_freq(cfg.head_dim, cfg.rope_theta))
        self.buf["block_table"].upload(np.zeros(plan.n_pages, np.int32))
        self.pages = PageAllocator(plan.n_pages, rng)

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
        if tuple(arr.shape) != spec.shape or arr.dtype != spec.dtype:
            raise K.LaunchError(f"{name}: planned {spec.dtype}{list(spec.shape)}, allocated {arr.dtype}{list(arr.shape)}")
        return arr

    # ---- build --------------------------------------------------------------------------------
    def _build(self) -> None:
        """Pack every planned launch against the allocated buffers, on the step's stream."""
        for _name, launcher in self.plan.steps:
            launcher.build(self.resolve, self.stream, pdl=self.pdl)
        self.launchers = list(self.plan.steps)
        self._greedy_choice = self.launchers[self._index("argmax")]  # set_sampler(None) restores it
        self._flatten()

    def _flatten(self) -> None:
        """Rebuild `launches` from `launchers` (one NamedLaunch per kernel launch)."""
        self.launches: list[NamedLaunch] = []
        for name, launcher in self.launchers:
            for i, (ln, spec) in enumerate(zip(launcher.launches, launcher.specs)):
                suffix = "" if len(launcher.launches) == 1 else f".{i}"
                self.launches.append(NamedLaunch(name + suffix, ln, spec))

    def _index(self, name: str) -> int:
        for i, (n, _l) in enumerate(self.launchers):
            if n == name:
                return i
        raise KeyError(name)

    # ---- the sampler step (engine.py): how the next token is chosen and handed to the host ----
    def set_sampler(self, chooser: tuple[str, K.Launcher] | None = None, publish: K.Launcher | None = None) -> None:
        """Replace the step's token choice and add (or drop) the publishing of each token.

        chooser: (name, launcher writing buf["next_token"]), e.g. ("sample", SampleToken); None
            restores the greedy ("argmax", ArgmaxFinal) of the plan.
        publish: a launcher that hands next_token to the host (PublishToken), inserted as
            "publish_token" just before "advance_state"; None removes it.
        The launch list keeps its order and names otherwise; call this before a CUDA graph is
        captured from `launches` (a graph holds the launches it recorded).
        """
        entry = self._greedy_choice if chooser is None else chooser
        for launcher in (entry[1], publish):
            if launcher is not None:
                launcher.build(stream=self.stream, pdl=self.pdl)  # no-op if built already
        i = next(j for j, (n, _l) in enumerate(self.launchers) if n in ("argmax", "sample"))
        self.launchers[i] = entry
        self.launchers = [e for e in self.launchers if e[0] != "publish_token"]
        if publish is not None:
            self.launchers.insert(self._index("advance_state"), ("publish_token", publish))
        self._flatten()

    def sampler_step(self) -> list[K.Launcher]:
        """The launchers from "lm_head" up to (not including) "advance_state": logits, the token
        choice and its publishing. Prefill runs them after its own final norm (prefill.py)."""
        return [l for _n, l in self.launchers[self._index("lm_head"):self._index("advance_state")]]

    # ---- pages for a whole sequence at once -------------------------------------------------
    def reset_sequence(self) -> None:
        """Forget the sequence: every page back to the free list, the next position is 0."""
        self.pages.release_all()
        self.pos = 0

    def reserve(self, n_tokens: int) -> None:
        """Make sure positions < n_tokens have pages, recording new ones in the device block
        table with one synchronous copy (so no step or prefill chunk has to stop for it).

        Raises:
            DrvqwenError: n_tokens exceeds max_context or the pages run out.
        """
        if n_tokens > self.max_context:
            raise DrvqwenError(f"{n_tokens} tokens exceed the KV cache of {self.max_context} (--max-context)")
        before = len(self.pages.block_table)
        for pos in range(before * PAGE_TOKENS, n_tokens, PAGE_TOKENS):
            self.pages.page_for(pos)
        if len(self.pages.block_table) > before:
            table = np.asarray(self.pages.block_table, np.int32)
            self.buf["block_table"].upload_at(0, table)

    def resume(self, pos: int) -> None:
        """Host bookkeeping after a prefill that queued DecodeResume(pos): the next step decodes
        the device's next_token at `pos`."""
        self.pos = pos

    # ---- host-side sequence bookkeeping ------------------------------------------------------
    def start(self, token: int, pos: int = 0) -> None:
        """Begin decoding `token` at position `pos` (the cache must already hold 0..pos-1)."""
        if pos == 0:
            self.pages.release_all()
        self.buf["state"].upload(np.array([pos, token, pos + 1], np.int32))
        self.pos = pos

    def feed(self, token: int) -> None:
        """Make the next step consume `token` instead of the previous step's argmax (prompt
        tokens fed one at a time; a sampled token)."""
        self.buf["state"].upload_at(1, np.array([token], np.int32), self.stream)

    def _ensure_page(self) -> None:
        """At a page boundary, take a page from the free list and record it in the device
        block table (4 bytes, queued on the stream before the step's kernels)."""
        if self.pos >= self.max_context:
            raise DrvqwenError(f"context full: position {self.pos} >= max_context {self.max_context}")
        page, new = self.pages.page_for(self.pos)
        if new:
            self._h_block[0] = page
            self.buf["block_table"].upload_at(self.pos // PAGE_TOKENS, self._h_block, self.stream)

    # ---- running ----------------------------------------------------------------------------
    def step(self) -> None:
        """Queue one decode step (eager): consumes state.token at state.pos, leaves logits and
        next_token, and advances state on the GPU. Asynchronous; `sync()` waits."""
        self._ensure_page()
        for nl in self.launches:
            nl.launch.launch()
        self.pos += 1

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
        hold = K.GpuSleep(hold_ms, stream=self.stream)
        ev = [(Event(), Event()) for _ in self.launches]
        times: dict[str, list[float]] = {nl.name: [] for nl in self.launches}
        for _ in range(n_steps):
            self._ensure_page()
            hold.launch()
            for (e0, e1), nl in zip(ev, self.launches):
                e0.record(self.stream)
                nl.launch.launch()
                e1.record(self.stream)
            self.pos += 1
            self.sync()
            for (e0, e1), nl in zip(ev, self.launches):
                times[nl.name].append(e0.elapsed_ms(e1) * 1e3)
        for e0, e1 in ev:
            e0.close()
            e1.close()
        return {k: float(np.median(v)) for k, v in times.items()}

    def close(self) -> None:
        """Release the device memory (weights, KV cache, activations) and the stream."""
        self.sync()
        self.weights.close()
        self.kv.close()
        self.act_pool.close()
        self.stream.close()
