"""One decode step on the GPU as an ordered list of named launches (DESIGN.md §3, §7).

    embedding                       residual fp32 [D] = embed[state.token]
    per layer l:
      L{l}.input_layernorm          xn   fp16 [D]        = rmsnorm(residual) · w
      L{l}.qkv_proj                 qkv  fp32 [Nq+2Nkv]  = [Wq; Wk; Wv] xn          (INT4 GEMV)
      L{l}.rope_kv                  q    fp16 [Hq, Dh]   = rope(q + bq); K/V cache[pos] = rope(k + bk), v + bv
      L{l}.attention (2 launches)   attn fp16 [Hq·Dh]    = softmax(q Kᵀ/√Dh) V over pos < seq_len
      L{l}.o_proj                   residual += Wo attn                              (INT4 GEMV)
      L{l}.post_attention_layernorm xn   fp16 [D]
      L{l}.gate_up_swiglu           h    fp16 [F]        = silu(Wg xn) · (Wu xn)     (INT4 GEMV)
      L{l}.down_proj                residual += Wd h                                 (INT4 GEMV)
    norm                            xn fp16 [D] = rmsnorm(residual) · w_norm
    lm_head                         logits fp32 [V] = W_lm xn, + argmax partials
    argmax                          next_token int32 [1]
    advance_state                   state = (pos + 1, next_token, seq_len + 1)

Every per-step value — position, token, sequence length, block table — lives in device
memory, so this list is launch-for-launch what a CUDA graph captures (issue: CUDA graphs).
Eager mode walks it with pre-packed parameters. The host only touches device state to start
a sequence (`start`) and to record a newly allocated page in the block table at a page
boundary (`_ensure_page`).

The engine (engine.py) swaps the token choice — argmax, or the sampler (kernels/sampling.cu)
— and inserts "publish_token" (the token into page-locked host memory) before advance_state
with `set_token_tail`; the prefill (prefill.py) reserves a whole prompt's pages at once
(`reserve`), runs the tail from lm_head on (`token_tail`) and leaves the state at the prompt's
end (`resume`).

Buffers (the activation pool; per layer nothing is allocated, layers reuse one set):
    state        int32 [3]          pos, token, seq_len
    block_table  int32 [P]          logical page → physical page (P = max_context / 16)
    k_cache      fp16 [L, P, Hkv, 16, Dh]   v_cache likewise (the KV pool, 16 KiB-aligned)
    residual     fp32 [D]           xn fp16 [D]        qkv fp32 [Nq + 2 Nkv]
    q            fp16 [Nq]          attn fp16 [Nq]     h fp16 [F]
    logits       fp32 [V]           part_val fp32 / part_idx int32 [ceil(V/32)]
    next_token   int32 [1]          inv_freq fp32 [Dh/2]     o/m/l partials fp32 (attention)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import kernels as K
from .config import PAGE_SIZE
from .cuda import (DEFAULT_ALIGN_BYTES, KV_PAGE_ALIGN_BYTES, DeviceArray, Event, KernelLaunch, Pool,
                   Stream, get_device)
from .errors import DrvqwenError
from .format.nanoqwen import NanoqwenFile
from .gpu_weights import GPUWeights
from .reference import rope_inv_freq


# Decode attention kernels (DecodeStep(attention=...)): "tma" = attention_decode_tma.cu (producer
# warp + TMA + mbarriers), "plain" = attention_decode.cu (the reference kernel and fallback).
ATTENTION_KERNELS = ("tma", "plain")
DEFAULT_ATTENTION = "tma"


@dataclass
class NamedLaunch:
    """One entry of the decode step: a name, the pre-packed launch, the buffer it writes."""

    name: str
    launch: KernelLaunch
    writes: DeviceArray | None


class PageAllocator:
    """The host-owned free list of physical KV pages and one sequence's block table.

    `rng` shuffles the free list (tests do, so no kernel can get away with assuming that
    logical page i is physical page i).
    """

    def __init__(self, n_pages: int, rng: np.random.Generator | None = None):
        self.n_pages = n_pages
        self.free = list(range(n_pages))
        if rng is not None:
            rng.shuffle(self.free)
        self.block_table: list[int] = []

    def page_for(self, pos: int) -> tuple[int, bool]:
        """(physical page holding position pos, whether it was newly allocated)."""
        logical = pos // PAGE_SIZE
        if logical < len(self.block_table):
            return self.block_table[logical], False
        if logical != len(self.block_table):
            raise ValueError(f"position {pos} skips pages (block table has {len(self.block_table)})")
        if not self.free:
            raise DrvqwenError(f"KV cache full: no page left for position {pos}")
        p = self.free.pop(0)
        self.block_table.append(p)
        return p, True

    def release_all(self) -> None:
        self.free = self.block_table + self.free
        self.block_table = []


class DecodeStep:
    """The GPU decode step for one model: weights, KV cache, activations, and the launch list.

    Args:
        f: the validated `.nanoqwen` file.
        max_context: tokens the KV cache holds (default: the model's max_position).
        num_layers: run only the first layers (tests at 7B widths).
        rng: shuffles the page free list (tests).
        progress: weight upload progress callback (bytes_done, bytes_total).
        attention: "tma" (the warp-specialised TMA kernel, attention_decode_tma.cu; its tensor
            maps of the K/V pools are encoded here, once) or "plain" (attention_decode.cu, the
            reference kernel and fallback).
    Raises:
        DrvqwenError: no usable GPU, or the model + cache do not fit (before any upload).
    """

    def __init__(self, f: NanoqwenFile, max_context: int | None = None, num_layers: int | None = None,
                 rng: np.random.Generator | None = None, progress: Callable[[int, int], None] | None = None,
                 attention: str = DEFAULT_ATTENTION):
        if attention not in ATTENTION_KERNELS:
            raise DrvqwenError(f"attention={attention!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
        self.attention = attention
        self.device = get_device()
        cfg = f.config if num_layers is None else f.config.with_layers(num_layers)
        self.config = cfg
        self.max_context = int(max_context or cfg.max_position)
        if not 1 <= self.max_context <= cfg.max_position:
            raise DrvqwenError(f"max_context={self.max_context}: must be in [1, {cfg.max_position}]")
        n_pages = -(-self.max_context // PAGE_SIZE)
        D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        Hq, Hkv, Dh, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
        nq, nkv = cfg.q_dim, cfg.kv_dim

        # Size everything before uploading a byte: a model that does not fit fails here.
        kv_bytes = 2 * L * n_pages * Hkv * PAGE_SIZE * Dh * 2
        weight_bytes = sum(i.nbytes for i in f)
        free, _total = self.device.memory_info()
        if kv_bytes + weight_bytes > free:
            raise DrvqwenError(
                f"{f.path}: weights ({weight_bytes / 2**30:.2f} GiB) + KV cache for {self.max_context} "
                f"tokens ({kv_bytes / 2**30:.2f} GiB) exceed free GPU memory ({free / 2**30:.2f} GiB); "
                f"lower --max-context")

        self.stream = Stream()
        self.weights = GPUWeights(f, progress=progress, num_layers=num_layers)
        w = self.weights
        self.kv_pool = Pool(kv_bytes + 2 * KV_PAGE_ALIGN_BYTES, name="kv")
        kv_shape = (L, n_pages, Hkv, PAGE_SIZE, Dh)
        self.k_cache = self.kv_pool.alloc("k_cache", kv_shape, np.float16, align=KV_PAGE_ALIGN_BYTES)
        self.v_cache = self.kv_pool.alloc("v_cache", kv_shape, np.float16, align=KV_PAGE_ALIGN_BYTES)

        sm_count = self.device.info.sm_count
        if attention == "tma":
            S = K.attention_tma_blocks_per_kv_head(Hkv, self.max_context, Dh, sm_count)
            parts = K.attention_partial_shapes(Hq, Dh, S, K.ATMA_CONSUMERS)
            # TMA descriptors of the whole pools, encoded once for the engine's life (~60 µs each).
            self.k_map, self.v_map = K.kv_tensor_map(self.k_cache), K.kv_tensor_map(self.v_cache)
        else:
            S = K.attention_blocks_per_kv_head(Hkv, self.max_context, sm_count, head_dim=Dh)
            parts = K.attention_partial_shapes(Hq, Dh, S)
        n_lm = K.lm_head_partials(V)
        act = {  # name: (shape, dtype)
            "state": ((3,), np.int32), "next_token": ((1,), np.int32),
            "block_table": ((n_pages,), np.int32), "inv_freq": ((Dh // 2,), np.float32),
            "residual": ((D,), np.float32), "xn": ((D,), np.float16),
            "qkv": ((nq + 2 * nkv,), np.float32), "q": ((nq,), np.float16),
            "attn": ((nq,), np.float16), "h": ((F,), np.float16), "logits": ((V,), np.float32),
            "part_val": ((n_lm,), np.float32), "part_idx": ((n_lm,), np.int32),
            "o_part": (parts["o_part"], np.float32), "m_part": (parts["m_part"], np.float32),
            "l_part": (parts["l_part"], np.float32),
        }
        size = sum(-(-int(np.prod(s)) * np.dtype(d).itemsize // DEFAULT_ALIGN_BYTES) * DEFAULT_ALIGN_BYTES
                   for s, d in act.values()) + DEFAULT_ALIGN_BYTES
        self.act_pool = Pool(size, name="activations")
        a = {name: self.act_pool.alloc(name, s, d) for name, (s, d) in act.items()}
        self.buf = a
        a["inv_freq"].upload(rope_inv_freq(Dh, cfg.rope_theta))
        a["block_table"].upload(np.zeros(n_pages, np.int32))
        self.pages = PageAllocator(n_pages, rng)

        st = self.stream
        eps = cfg.rms_norm_eps
        steps: list[tuple[str, K.Launcher, DeviceArray | None]] = []
        steps.append(("embedding", K.Embedding(a["residual"], w["model.embed_tokens.weight"], a["state"],
                                               vocab_size=V, dim=D, stream=st), a["residual"]))
        for l in range(L):
            pre = f"model.layers.{l}"
            k_l, v_l = K.kv_layer_view(self.k_cache, l), K.kv_layer_view(self.v_cache, l)
            (qw, qs), (kw, ks), (vw, vs) = w.proj(l, "q_proj"), w.proj(l, "k_proj"), w.proj(l, "v_proj")
            steps += [
                (f"L{l}.input_layernorm", K.RmsNorm(a["xn"], a["residual"], w[f"{pre}.input_layernorm.weight"],
                                                    dim=D, eps=eps, stream=st), a["xn"]),
                (f"L{l}.qkv_proj", K.GemvInt4Qkv(a["qkv"], a["xn"], qw, qs, kw, ks, vw, vs,
                                                 n_q=nq, n_kv=nkv, k=D, stream=st), a["qkv"]),
                (f"L{l}.rope_kv", K.RopeKv(a["q"], k_l, v_l, a["qkv"], w[f"{pre}.self_attn.q_proj.bias"],
                                           w[f"{pre}.self_attn.k_proj.bias"], w[f"{pre}.self_attn.v_proj.bias"],
                                           a["inv_freq"], a["state"], a["block_table"], n_heads=Hq,
                                           n_kv_heads=Hkv, head_dim=Dh, stream=st), a["q"]),
                (f"L{l}.attention", self._attention(a, k_l, v_l, l * n_pages, S, stream=st), a["attn"]),
                (f"L{l}.o_proj", K.GemvInt4Residual(a["residual"], a["attn"], *w.proj(l, "o_proj"),
                                                    n=D, k=nq, stream=st), a["residual"]),
                (f"L{l}.post_attention_layernorm", K.RmsNorm(a["xn"], a["residual"],
                                                             w[f"{pre}.post_attention_layernorm.weight"],
                                                             dim=D, eps=eps, stream=st), a["xn"]),
                (f"L{l}.gate_up_swiglu", K.GemvInt4GateUpSwiglu(a["h"], a["xn"], *w.proj(l, "gate_proj"),
                                                                *w.proj(l, "up_proj"), f=F, k=D, stream=st), a["h"]),
                (f"L{l}.down_proj", K.GemvInt4Residual(a["residual"], a["h"], *w.proj(l, "down_proj"),
                                                       n=D, k=F, stream=st), a["residual"]),
            ]
        lm = K.LmHead(a["logits"], a["part_val"], a["part_idx"], a["xn"], w["lm_head.weight"],
                      vocab_size=V, dim=D, stream=st)
        steps += [
            ("norm", K.RmsNorm(a["xn"], a["residual"], w["model.norm.weight"], dim=D, eps=eps, stream=st), a["xn"]),
            ("lm_head", lm, a["logits"]),
            ("argmax", K.ArgmaxFinal(a["next_token"], a["part_val"], a["part_idx"],
                                     n_partials=lm.n_partials, stream=st), a["next_token"]),
            ("advance_state", K.AdvanceState(a["state"], a["next_token"], stream=st), a["state"]),
        ]
        self.launchers = steps
        self._greedy_choice = steps[-2]  # ("argmax", ArgmaxFinal, next_token): set_token_tail restores it
        self.launches: list[NamedLaunch] = []
        self._flatten()
        self.pos = 0                     # host mirror of state[0] (the next position to decode)
        self._h_block = np.zeros(1, np.int32)

    def _attention(self, a: dict[str, DeviceArray], k_l: DeviceArray, v_l: DeviceArray, layer_page0: int,
                   S: int, *, stream: Stream) -> K.Launcher:
        """One layer's attention launcher: TMA (tensor maps of the whole pool + the layer's first
        page) or plain (the layer's [P, Hkv, 16, Dh] views)."""
        cfg = self.config
        shape = dict(n_heads=cfg.num_heads, n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     blocks_per_kv_head=S, stream=stream)
        if self.attention == "tma":
            return K.AttentionDecodeTma(a["attn"], a["q"], self.k_map, self.v_map, a["block_table"], a["state"],
                                        a["o_part"], a["m_part"], a["l_part"], layer_page0=layer_page0, **shape)
        return K.AttentionDecode(a["attn"], a["q"], k_l, v_l, a["block_table"], a["state"],
                                 a["o_part"], a["m_part"], a["l_part"], **shape)

    def _flatten(self) -> None:
        """Rebuild `launches` from `launchers` (one NamedLaunch per kernel launch)."""
        self.launches = []
        for name, launcher, out in self.launchers:
            for i, ln in enumerate(launcher.launches):
                suffix = "" if len(launcher.launches) == 1 else f".{i}"
                self.launches.append(NamedLaunch(name + suffix, ln, out))

    def _index(self, name: str) -> int:
        for i, (n, _l, _o) in enumerate(self.launchers):
            if n == name:
                return i
        raise KeyError(name)

    # ---- the token tail (engine.py): how the next token is chosen and handed to the host ----
    def set_token_tail(self, chooser: tuple[str, K.Launcher] | None = None,
                       publish: K.Launcher | None = None) -> None:
        """Replace the step's token choice and add (or drop) the publishing of each token.

        chooser: (name, launcher writing buf["next_token"]), e.g. ("sample", SampleToken); None
            restores the greedy ("argmax", ArgmaxFinal) of the constructor.
        publish: a launcher that hands next_token to the host (PublishToken), inserted as
            "publish_token" just before "advance_state"; None removes it.
        The launch list keeps its order and names otherwise; call this before a CUDA graph is
        captured from `launches` (a graph holds the launches it recorded).
        """
        name, launcher, out = self._greedy_choice if chooser is None else (*chooser, self.buf["next_token"])
        i = next(j for j, (n, _l, _o) in enumerate(self.launchers) if n in ("argmax", "sample"))
        self.launchers[i] = (name, launcher, out)
        self.launchers = [e for e in self.launchers if e[0] != "publish_token"]
        if publish is not None:
            self.launchers.insert(self._index("advance_state"), ("publish_token", publish, None))
        self._flatten()

    def token_tail(self) -> list[K.Launcher]:
        """The launchers from "lm_head" up to (not including) "advance_state": logits, the token
        choice and its publishing. Prefill runs them after its own final norm (prefill.py)."""
        return [l for _n, l, _o in self.launchers[self._index("lm_head"):self._index("advance_state")]]

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
        for pos in range(before * PAGE_SIZE, n_tokens, PAGE_SIZE):
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
            self.buf["block_table"].upload_at(self.pos // PAGE_SIZE, self._h_block, self.stream)

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
        latency. The sum is the step's GPU time without launch gaps.
        """
        import ctypes

        from .cuda import load_kernel_module

        hold = KernelLaunch(load_kernel_module("timing").function("gpu_sleep"), (1,), (1,),
                            [ctypes.c_uint64(int(hold_ms * 1e6))], stream=self.stream)
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
        self.kv_pool.close()
        self.act_pool.close()
        self.stream.close()
