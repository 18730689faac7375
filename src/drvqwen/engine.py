"""The GPU engine: prefill → decode on one stream, every token chosen on the GPU.

    GPUBackend.token_stream(prompt, n, params)
      prefill (prefill.py)          prompt → KV cache 0 … T-1, logits of the last position,
                                    token 0 chosen → decode state (T, token 0, T + 1)
      per token i ≥ 1: decode step  consume token i-1 at position T+i-1, choose token i
      after each token's choice     publish_token: ring[i % R] = token, on page-locked host memory

The token is chosen by the decode step's last kernels — argmax (greedy) or sample_token
(kernels/sampling.cu: exactly `sampler.sample` with u = uniform(seed, i), the step i read from
device memory); with a repeat penalty, penalize_logits before it and record_token after it, over
a history of the sequence's last 64 ids that lives in device memory (uploaded at the prefill,
appended on the GPU after every choice) — and fed to the next step on the GPU (advance_state), so the host is never on
the path from one token to the next. The host reads each token only to stream text: the
publish_token kernel writes it into a ring of page-locked host memory and an event recorded
after it says when it is there. While the host waits for token i, step i+1 is already queued
(one step of lookahead), so the Python launch overhead of the eager step overlaps the GPU.

Pages are taken from the free list as the sequence grows: the prompt's all at once by the
prefill (one block-table upload), then one every 16 decode steps, handed to the GPU by the
page-opening graph (graphs.py) with a 4-byte copy queued ahead of it — no step waits for it.

A sequence can be continued: `token_stream(…, reuse=True)` (and `prefill(…, reuse=True)`)
keeps the cached positions the new prompt starts with (generate.reused_prefix), rolls back the
positions after them when the cache holds more (a prompt that is shorter or parts from the
cached one: their pages go back to the free list, Sequence.keep) and prefills only the rest at
the position after them (Prefill.run(ids, start)); `drvqwen chat` sends each turn that way, the
server every request. The engine knows which ids its cache holds: the prompt, and every token
whose decode step was queued. A prompt that shares nothing, or reuse=False, starts at position
0 exactly as before any reuse existed.

Each way of choosing the token (greedy, sampled, sampled with a repeat penalty) is a launch list
of its own (`DecodeStep.sampler_variant`), built on first use; decode replays CUDA graphs of it
(graphs.py, one GraphDecoder per list; `use_graphs=False` launches it eagerly), and the prefill
runs its sampler step. The sequence's position and pages change only through `DecodeStep.seq`
(sequence.py).

Speculative decoding (`GPUBackend(speculative=True)`, what run, chat and serve build for
--lookup/--draft): `verify` runs the last token and the proposals — up to 16 — through the model
in one pass (verify_pass.py: the weights read once for all of them; replayed from a CUDA graph
per length with use_graphs, as decode), each row the decode step's
logits bit for bit; that holds against the decode step with the plain attention kernel, so such
a backend decodes with it (token_stream too: plain and speculative output are the same tokens).
A model in per-tensor formats, or a longer chunk, verifies with one decode step per token
(generate.DecodeVerify). Without speculative=True the decode step is the default one (TMA
attention) and `verify` is per token, exact all the same.

Speed is measured by `drvqwen bench` (bench.py), whose definition of TTFT and ITL is the one
every figure in drvqwen quotes.
"""

from __future__ import annotations

import functools
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Callable

import numpy as np

from .config import QwenConfig
from .launchers import sampling
from .launchers import FixedOccupancy, PenalizedSampleToken, PublishToken, SampleToken
from .cuda import DEFAULT_ALIGN_BYTES, Event, PinnedHostBuffer, Pool, get_device, load_kernel_module
from .cuda.nvrtc import compile_kernels
from .gpu_weights import check_gpu_formats
from .decode import DEFAULT_ATTENTION, DecodeStep, default_short_attention, plan_decode
from .format.tensor_set import in_per_tensor_formats
from .launch_list import LaunchList
from .graphs import GraphDecoder
from .errors import DrvqwenError
from .format.nanoqwen import NanoqwenFile
from .generate import DecodeVerify, check_rollback, reused_prefix
from .launchers.gemm_int4 import TILE_DEFINES as GEMM_INT4_TILE_DEFINES
from .launchers.gemv_int4 import QKV_ROPE_DEFINES
from .launchers.gemm_kquant import KQUANT_TILES as GEMM_KQUANT_TILES, Q4K_ID as GEMM_Q4K_ID, \
    Q5K_ID as GEMM_Q5K_ID, Q6K_ID as GEMM_Q6K_ID
from .launchers.gemm_q32 import FORMATS as GEMM_Q32_FORMATS, Q32_TILES as GEMM_Q32_TILES
from .prefill import KERNEL_FILES as PREFILL_KERNEL_FILES
from .prefill import KERNEL_FILES_FMT as PREFILL_KERNEL_FILES_FMT
from .prefill import ROW_BUCKET, DEFAULT_CHUNK_ROWS, Prefill, late_attention_builds
from .sampler import SamplingParams, scale_log2
from .stats import count, phase
from .verify_pass import VerifyPass, check_chunk
from .verify_plan import VERIFY_ATTENTION, plan_verify
from .launchers.gemv_int4 import MAX_TOKENS as MAX_VERIFY_TOKENS

# Slots of the host token ring. The host is at most one step behind the GPU (the lookahead), so
# two slots would do; a few more cost nothing.
TOKEN_RING = 8
# sampling.cu struct SamplerParams: seed, top_p, scale_log2, top_k, token_index, greedy, min_p,
# repeat_penalty, 8 reserved bytes.
_PARAMS_FORMAT = "<QdfiIiff8x"
assert struct.calcsize(_PARAMS_FORMAT) == sampling.PARAMS_BYTES
# Byte offset of token_index in SamplerParams (after seed, top_p, scale_log2, top_k).
_TOKEN_INDEX_BYTE = struct.calcsize("<Qdfi")


def pack_sampler_params(params: SamplingParams, token_index: int = 0) -> np.ndarray:
    """The 48 bytes of sampling.cu's SamplerParams for `params`, as uint8 [48].

    seed (already modulo 2^64: Philox's key, low word then high word) and top_k (already
    clamped to int32's range) are packed as `SamplingParams` normalized them, so this can
    neither fail nor differ from the CPU sampler; scale_log2 is float32(log2(e) /
    temperature), 0 for greedy parameters (never used then).
    """
    greedy = params.greedy
    scale = 0.0 if greedy else float(scale_log2(params.temperature))
    raw = struct.pack(_PARAMS_FORMAT, params.seed & (2**64 - 1), float(params.top_p), scale,
                      int(params.top_k), int(token_index) & 0xFFFFFFFF, int(greedy), float(params.min_p),
                      float(params.repeat_penalty))
    return np.frombuffer(raw, dtype=np.uint8).copy()


def _variant_name(params: SamplingParams) -> str:
    """The launch list `params` decode with: "greedy" (argmax), "sample", or "penalized" (the
    sampler after the repeat penalty, greedy or not)."""
    return "penalized" if params.penalized else "greedy" if params.greedy else "sample"


def check_stream_args(n_prompt: int, max_new_tokens: int, max_context: int) -> int:
    """Validate a generation request; return how many tokens will be generated.

    Raises:
        DrvqwenError: empty prompt, negative max_new_tokens, or a prompt that leaves no room
            in the context.
    """
    if n_prompt == 0:
        raise DrvqwenError("the prompt is empty (0 tokens)")
    if max_new_tokens < 0:
        raise DrvqwenError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if n_prompt >= max_context:
        raise DrvqwenError(f"prompt of {n_prompt} tokens does not fit the context of {max_context} "
                           f"tokens (--max-context)")
    return min(max_new_tokens, max_context - n_prompt)


def one_pass_verify(config: QwenConfig, formats: dict[str, int] | None, speculative: bool) -> bool:
    """Whether a GPUBackend(speculative=…) of this model verifies in one pass (verify_pass.py):
    it speculates and its weights are the INT4 model's (plan_verify covers only that model)."""
    return speculative and not in_per_tensor_formats(config, formats)


def engine_kernels(config: QwenConfig, formats: dict[str, int] | None = None,
                   speculative: bool = False) -> list[tuple[str, dict]]:
    """(kernel file, defines) of every kernel file the engine launches for `config` with the
    weight formats `formats` (NanoqwenFile.formats; default: the INT4 step's): the decode step's
    (its plan, made without a GPU for one layer: every layer launches the same kernel files),
    the prefill's (prefill.KERNEL_FILES, or KERNEL_FILES_FMT for per-tensor formats, gemv_fmt.cu
    and gemm_fmt.cu compiled for the model's formats, and gemm_int4.cu's tile builds where its
    projections have Q4_K, Q5_K, Q6_K, Q4_0, Q5_0 or Q8_0 weights) and the token choice's and hand-over's
    (sampling.cu), the range-scheduled prefill attention's build where late chunks take it
    (prefill.late_attention_builds), and for the INT4 model weight_layout.cu (its weights'
    rearrangement at load). With `speculative` (GPUBackend's) and the INT4 model: the decode step with
    the plain attention kernel, and the verify pass's (its plans for 1 and 16 tokens: the two
    builds of the T-token GEMVs). The decode step's short-context attention (decode.default_short_attention)
    where it runs one. Not timing or smoke (benchmarks and tests)."""
    one = config.with_layers(1)
    one_pass = one_pass_verify(config, formats, speculative)
    # qkv_rope's build follows the GPU's occupancy (launchers/gemv_int4.py: qkv_rope_defines), so
    # the plans are made twice: every block count alike (its default build), and its two-group
    # build fitting three blocks where the default fits one (that build).
    occupancies = (lambda _k: 1, lambda k: 3 if k.defines == QKV_ROPE_DEFINES else 1)
    attention = VERIFY_ATTENTION[0] if one_pass else DEFAULT_ATTENTION
    # The short-context attentions the step runs by default (DecodeStep's bands), compiled with the rest.
    short_attention = tuple(kernel for kernel, _below in default_short_attention(config, attention, persistent=False))
    wanted = set()
    for per_sm in occupancies:
        plan = plan_decode(one, occupancy=FixedOccupancy(1, lambda k, _t, _s: per_sm(k)), formats=formats,
                           attention=attention, short_attention=short_attention or None)
        wanted |= {(s.kernel.file, s.kernel.defines) for _name, s in plan.named_specs()}
        wanted |= {(s.kernel.file, s.kernel.defines) for entries in plan.short_attention.values()
                   for l in entries.values() for s in l.specs}
        for T in ((1, MAX_VERIFY_TOKENS) if one_pass else ()):
            # An H200's grid (132 SMs, 2 blocks each): with one SM a T-token GEMV block would hold
            # all of K in shared memory, which no GPU has. The kernel files and defines do not
            # depend on it otherwise.
            verify = plan_verify(one, None, T, occupancy=FixedOccupancy(132, lambda k, _t, _s: 2 * per_sm(k)))
            wanted |= {(s.kernel.file, s.kernel.defines) for _name, s in verify.named_specs()}
    prefill_files = PREFILL_KERNEL_FILES_FMT if plan.per_tensor else PREFILL_KERNEL_FILES
    # An INT4 model's weights are rearranged into the device layout as they load (gpu_weights.py).
    if not plan.per_tensor:
        wanted.add(("weight_layout", ()))
    # The per-tensor kernel files are compiled for the model's formats (plan.fmt_defines).
    wanted |= {(name, plan.fmt_defines if name in ("gemv_fmt", "gemm_fmt", "gemm_fmt_wgmma") else ())
               for name in (*prefill_files, "sampling")}
    # The range-scheduled attention of a long prompt's late chunks, a build of its own.
    wanted |= late_attention_builds(config)
    # gemm_int4.cu in each tile size's build: the prefill picks one per GEMM shape and row count.
    if "gemm_int4" in prefill_files:
        wanted |= {("gemm_int4", defines) for defines in GEMM_INT4_TILE_DEFINES.values()}
    # Per-tensor formats with Q4_K, Q5_K, Q6_K, Q4_0, Q5_0 or Q8_0 projections: gemm_int4.cu's
    # kernels for them (launchers/gemm_kquant.py, gemm_q32.py) in the builds they exist in. The
    # embedding and the lm_head never run on them (a row read, a GEMV), whatever their format.
    elif {GEMM_Q4K_ID, GEMM_Q5K_ID, GEMM_Q6K_ID, *GEMM_Q32_FORMATS} & {
            fid for name, fid in (formats or {}).items() if ".layers." in name}:
        wanted |= {("gemm_int4", GEMM_INT4_TILE_DEFINES[bm]) for bm in {*GEMM_KQUANT_TILES, *GEMM_Q32_TILES}}
    return [(name, dict(defines)) for name, defines in sorted(wanted)]


def load_kernels(requests: list[tuple[str, dict]]) -> None:
    """Compile the kernel files of `requests` in parallel through the cubin cache (phase
    "compile"), then load each module (phase "modules"), so that building the launch lists later
    finds every kernel loaded. The counts go to the run's statistics."""
    with phase("compile"):
        compiled = compile_kernels(requests)
    fresh = sum(not c.cache_hit for c in compiled)
    count("kernels_compiled", fresh)
    count("kernels_cached", len(compiled) - fresh)
    with phase("modules"):
        for (name, defines), c in zip(requests, compiled):
            load_kernel_module(name, defines=defines, compiled=c)
    count("modules_loaded", len(compiled))


def check_gpu_supports(f: NanoqwenFile) -> None:
    """Refuse, before anything is allocated, a model the GPU kernels would run wrongly.

    YaRN RoPE scaling: the RoPE kernels take the inverse frequencies from a buffer, but not
    YaRN's attention factor on cos and sin; until they do, such a model runs on the CPU.

    Weight formats: every format of format/weight_formats.py runs on the GPU
    (kernels/weight_formats.cuh); a weight the kernels cannot take (gpu_weights.check_gpu_formats)
    is named.

    Raises:
        DrvqwenError: the model uses YaRN, or a weight the GPU kernels do not run.
    """
    unsupported = check_gpu_formats(f)
    if unsupported:
        raise DrvqwenError(f"{unsupported} (--device cpu runs it)")
    if f.config.rope_scaling is not None:
        raise DrvqwenError(f"{f.path}: YaRN RoPE scaling (factor {f.config.rope_scaling.factor:g}) runs "
                           f"on the CPU backend only (--device cpu)")


class GPUBackend(DecodeVerify):
    """A `.nanoqwen` model on the GPU, generating with `token_stream` (generate.py's token backend).

    `verify` (speculative decoding) runs up to 16 tokens in one pass (verify_pass.py) when the
    backend was built with speculative=True for the INT4 model; otherwise DecodeVerify's, one
    `decode` per token.

    Args:
        f: the validated model file.
        max_context: tokens the KV cache holds (default: the model's max_position).
        num_layers: run only the first layers (tests at 7B widths).
        rng: shuffles the KV page free list (tests).
        progress: weight upload progress, called with (bytes_done, bytes_total).
        chunk_rows: prompt rows per prefill chunk.
        use_graphs: decode and verify by replaying CUDA graphs (the default; graphs.py, one
            graph per verify-pass length: verify_pass.py), or eagerly.
        speculative: the backend will verify speculative proposals: for the INT4 model the
            decode step runs the plain attention kernel — the one whose logits the verify pass
            reproduces bit for bit — and `verify` runs one pass; for per-tensor formats nothing
            changes (their verify is one decode per token). False (the default): the decode
            step as it is without speculation (TMA attention).
    Attributes:
        decode_step: the DecodeStep (weights, KV cache, the sequence, stream, the decode launch lists).
        prefill_pass: the Prefill sharing them.
        verify_pass: the VerifyPass sharing them, or None (verify is one decode per token).
        launch_list: the decode launch list of the last sampling parameters (launch_list.LaunchList:
            greedy, sample or penalized, with publish_token): what `decode()` runs.
        sampler_params: uint8 [48] device SamplerParams (sampling.cu), token_index included.
        history: int32 [1 + 64] device token history of the repeat penalty (count, ring).
        sample_info: int32 [4] device (token, Philox bits, kept count, token_index) of the last sample.
    Raises:
        DrvqwenError: no usable Hopper GPU, or the model and its cache do not fit.
    """

    def __init__(self, f: NanoqwenFile, max_context: int | None = None, *, num_layers: int | None = None,
                 rng: np.random.Generator | None = None, progress: Callable[[int, int], None] | None = None,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS, use_graphs: bool = True, speculative: bool = False):
        check_gpu_supports(f)
        with phase("context"):
            get_device()
        load_kernels(engine_kernels(f.config, f.formats, speculative))
        one_pass = one_pass_verify(f.config, f.formats, speculative)
        self.decode_step = DecodeStep(f, max_context, num_layers=num_layers, rng=rng, progress=progress,
                                      attention=VERIFY_ATTENTION[0] if one_pass else None)
        self.use_graphs = use_graphs
        # One launch list per way of choosing the token (greedy argmax, the sampler, the sampler
        # after the repeat penalty), built on first use, and one GraphDecoder per list: a graph
        # holds the launches it recorded, so each list gets its own pair of graphs, captured on
        # first use and reused for every later prompt. Sampling parameters and the token counter
        # live in device memory (sampler_params), so one "sample" graph serves every
        # temperature/seed.
        self._variants: dict[str, LaunchList] = {}
        self.launch_list: LaunchList | None = None    # set by _configure below
        self._graphs: dict[str, GraphDecoder] = {}
        step = self.decode_step
        self.config = step.config
        self.max_context = step.max_context
        self.name = f"cuda ({step.device.info.name})"
        self.prefill_pass = Prefill(step, chunk_rows)
        # Load time, not prompt time: the smallest chunk's launch list now, which loads every
        # prefill kernel module (cubins from the cache) and encodes the GEMMs' tensor maps; a
        # longer prompt's first chunk then only packs its launches.
        self.prefill_pass.launches(ROW_BUCKET)
        # Its launch lists are built per T on first use (a few ms of Python each, once), and with
        # use_graphs each T's list is captured into a CUDA graph then too (verify_pass.py).
        self.verify_pass = VerifyPass(step, graphs=use_graphs) if one_pass else None
        size = 3 * DEFAULT_ALIGN_BYTES + sampling.PARAMS_BYTES + 4 * sampling.INFO_INTS + 4 * sampling.HISTORY_INTS
        self.pool = Pool(size + DEFAULT_ALIGN_BYTES, name="sampler")
        self.sampler_params = self.pool.alloc("sampler_params", (sampling.PARAMS_BYTES,), np.uint8)
        self.sample_info = self.pool.alloc("sample_info", (sampling.INFO_INTS,), np.int32)
        self.history = self.pool.alloc("penalty_history", (sampling.HISTORY_INTS,), np.int32)
        self._ring = PinnedHostBuffer(4 * TOKEN_RING)
        self._ring_view = self._ring.view(np.int32, TOKEN_RING)
        self._events = [Event() for _ in range(TOKEN_RING)]
        st = step.stream
        self._sample = SampleToken(step.buf["next_token"], self.sample_info, self.sampler_params,
                                     step.buf["logits"], vocab_size=self.config.vocab_size, stream=st)
        self._penalized = PenalizedSampleToken(step.buf["next_token"], self.sample_info, self.sampler_params,
                                               step.buf["logits"], self.history, vocab_size=self.config.vocab_size,
                                               stream=st)
        self._cached: list[int] = []    # ids whose K/V the cache holds (positions 0 … len-1)
        # queue_greedy's steps not yet taken, oldest first: [ring slot, choice consumed by the
        # step queued after it]; and the token_index of the next one.
        self._queued: deque[list] = deque()
        self._queued_index = 0
        self.last_reused = 0
        self._publish = PublishToken(self._ring, self.sampler_params, step.buf["next_token"],
                                       ring_size=TOKEN_RING, stream=st)
        self._configure(SamplingParams())

    def _configure(self, params: SamplingParams) -> LaunchList:
        """The launch list for `params` (argmax or sample_token, then publish_token; built on
        first use) and the device sampler parameters with the step counter at 0. Synchronous
        (one 48-byte upload)."""
        name = _variant_name(params)
        if name not in self._variants:
            # sample_token's greedy branch takes the penalized argmax
            chooser = {"greedy": None, "sample": ("sample", self._sample),
                       "penalized": ("sample", self._penalized)}[name]
            self._variants[name] = self.decode_step.sampler_variant(name, chooser, self._publish)
        self.launch_list = self._variants[name]
        self.sampler_params.upload(pack_sampler_params(params))
        return self.launch_list

    # ---- generate.py's token backend ------------------------------------------------------------
    def token_stream(self, prompt_ids: Sequence[int], max_new_tokens: int,
                     params: SamplingParams = SamplingParams(), reuse: bool = False) -> Iterator[int]:
        """Prefill `prompt_ids` and yield up to max_new_tokens tokens as the GPU chooses them.

        Token i is the one `sampler.sample` picks from this model's logits, penalized over the
        last 64 ids of the sequence (sampler.penalize), with uniform(params.seed, i). Stop
        tokens are not handled here (generate.py does it and closes the stream).
        reuse: keep the cached positions `prompt_ids` starts with and prefill only the rest
        (`last_reused` says how many). Raises DrvqwenError as `check_stream_args`.
        """
        budget = check_stream_args(len(prompt_ids), max_new_tokens, self.max_context)
        return self._tokens(list(prompt_ids), budget, params, reuse)

    def cached_ids(self) -> list[int]:
        """The ids whose K/V the cache holds, positions 0 … len-1."""
        return list(self._cached)

    def kv_pages(self) -> tuple[int, int]:
        """(free, total) pages of the KV cache's PageAllocator."""
        pages = self.decode_step.seq.pages
        return len(pages.free), pages.n_pages

    def _decoder(self, launch_list: LaunchList) -> Callable[[], object]:
        """What queues one decode step of `launch_list`: its GraphDecoder's decode_token
        (captured now if new), or the eager DecodeStep's."""
        if not self.use_graphs:
            return functools.partial(self.decode_step.decode_token, launch_list)
        if launch_list.name not in self._graphs:
            self._graphs[launch_list.name] = GraphDecoder(self.decode_step, launch_list)
        return self._graphs[launch_list.name].decode_token

    @property
    def decode_mode(self) -> str:
        """"graph" or "eager": how token_stream decodes (eager after a capture fallback too)."""
        if not self.use_graphs:
            return "eager"
        return "graph" if all(g.mode == "graph" for g in self._graphs.values()) else "eager"

    def _tokens(self, prompt_ids: list[int], budget: int, params: SamplingParams,
                reuse: bool = False) -> Iterator[int]:
        step, ring, ev, R = self.decode_step, self._ring_view, self._events, TOKEN_RING
        if budget == 0:
            return
        try:
            with phase("prefill"):                 # queued: the GPU runs it while we wait below
                launch_list = self._configure(params)
                if params.penalized:               # the sequence's last ids, in ring order
                    window = prompt_ids[-sampling.WINDOW:]
                    hist = np.zeros(sampling.HISTORY_INTS, np.int32)
                    hist[0], hist[1:1 + len(window)] = len(window), window
                    self.history.upload(hist)
                self._prefill(prompt_ids, reuse, launch_list)              # token 0 → ring[0]
                ev[0].record(step.stream)
            with phase("first token"):
                ev[0].synchronize()
                first = int(ring[0])
            yield first
            if budget == 1:
                return
            self._cached.append(first)             # the step queued below consumes it
            # The decode graphs are captured on first use only now, after the first token is out:
            # a capture costs tens of milliseconds that would otherwise sit inside the TTFT.
            with phase("graph capture"):
                decode_token = self._decoder(launch_list)
            with phase("decode"):
                decode_token()                     # token 1 → ring[1]
                ev[1 % R].record(step.stream)
            for i in range(1, budget):
                with phase("decode"):
                    if i + 1 < budget:
                        decode_token()             # token i+1 → ring[(i+1) % R], queued before we wait
                        ev[(i + 1) % R].record(step.stream)
                    ev[i % R].synchronize()
                    tok = int(ring[i % R])
                if i + 1 < budget:
                    self._cached.append(tok)       # the step queued above consumes it
                yield tok
        except GeneratorExit:
            raise
        except BaseException:
            self._cached = []                      # unknown: the next prompt is prefilled whole
            raise
        finally:
            step.sync()  # a closed stream leaves no step running into the next generation

    def _prefill(self, ids: list[int], reuse: bool, launch_list: LaunchList) -> None:
        """Queue the prefill of `ids` and the choice of the next token by `launch_list`: from
        position 0, or with `reuse` after the longest common prefix with the cached ids (the
        positions after it rolled back by Prefill.run). Sets last_reused."""
        if self._queued:
            # Greedy steps queued and never taken (a stream left by an exception): which ids
            # they consumed is unknown, so nothing of the cache is reused.
            self.decode_step.sync()
            self._queued.clear()
            self._cached = []
        self.drop_greedy_queue()          # DecodeVerify's, where there is no verify pass
        n = reused_prefix(self._cached, ids) if reuse else 0
        self._cached = ids[:n]                     # all the cache is known to hold until it ran
        self.last_reused = n
        self.prefill_pass.run(ids[n:], start=n, launch_list=launch_list)
        self._cached = list(ids)

    # ---- generate.py's logits backend (tests, tools, the server's n_predict 0) ---------------
    def prefill(self, ids: list[int], reuse: bool = False) -> np.ndarray:
        """Greedy prefill of `ids`, from position 0 or, with `reuse`, after the cached positions
        it starts with (as token_stream); returns the last position's logits fp32 [V]."""
        launch_list = self._configure(SamplingParams())
        self._prefill(list(ids), reuse, launch_list)
        return self.decode_step.logits()

    def decode(self, token: int) -> np.ndarray:
        """Decode `token` at the next position (instead of the GPU's choice); returns logits [V]."""
        self._check_nothing_queued("decode")
        step, seq = self.decode_step, self.decode_step.seq
        seq.reserve(seq.pos + 1)
        seq.feed(token)
        step.decode_token(self.launch_list)
        self._cached.append(int(token))
        return step.logits()

    def verify(self, tokens: list[int]) -> np.ndarray:
        """`Backend.verify`: logits fp32 [len(tokens), V], row i what `decode(tokens[i])` gives at
        the next positions — in one pass (verify_pass.py) when the backend has one and there are
        at most 16 tokens, else one decode per token (DecodeVerify). The K/V of every token stay
        in the cache and the sequence is at the position after the last, as after decode calls.

        Raises:
            ValueError: no tokens.
            DrvqwenError: a token id outside the vocabulary, or positions past the context.
        """
        if self.verify_pass is None or not 1 <= len(tokens) <= MAX_VERIFY_TOKENS:
            return DecodeVerify.verify(self, tokens)
        self._check_nothing_queued("verify")
        rows = self.verify_pass.run(tokens)
        self._cached.extend(int(t) for t in tokens)
        return rows

    def verify_greedy(self, tokens: list[int]) -> list[int]:
        """`Backend.verify_greedy`: each position's greedy token, from the pass's own argmax
        (argmax_final_tokens: the decode step's choice, `sampler.argmax`'s order) — T ids come
        back instead of T rows of logits; per token through `verify` where there is no pass.

        Raises:
            as `verify`.
        """
        if self.verify_pass is None or not 1 <= len(tokens) <= MAX_VERIFY_TOKENS:
            return DecodeVerify.verify_greedy(self, tokens)
        self._check_nothing_queued("verify_greedy")
        if len(tokens) == 1:
            # One token is one decode step: its graph with a 4-byte read-back costs less than
            # the one-token verify pass (the same logits bit for bit: verify_pass.py), which
            # launches lists of its own.
            self.queue_greedy(int(tokens[0]))
            return [self.take_greedy()]
        ids = self.verify_pass.run(tokens, ids_only=True)
        self._cached.extend(int(t) for t in tokens)
        return [int(t) for t in ids]

    def queue_greedy(self, token: int | None = None) -> None:
        """`Backend.queue_greedy`: one greedy decode step (its CUDA graph when graphs are on),
        queued on the stream without waiting for it.

        Each step's publish_token writes its choice into the host token ring at the device's
        token_index % TOKEN_RING, and the event recorded after it says when it is there — the
        plain token stream's hand-over. When nothing is queued, token_index is set back to 0
        (4 bytes queued before the step: the stream is idle then), so the host knows each
        step's slot without reading the device. With token None the step consumes what the
        step before it chose, which advance_state left in the device state: nothing goes
        through the host. Where the backend has no verify pass, DecodeVerify's (at once).

        Raises:
            RuntimeError: token None with no step queued, or TOKEN_RING steps already queued.
            DrvqwenError: an id outside the vocabulary or a position past the context; nothing
                was queued then.
        """
        if self.verify_pass is None:
            return DecodeVerify.queue_greedy(self, token)
        step, queued = self.decode_step, self._queued
        if len(queued) == TOKEN_RING:
            raise RuntimeError(f"queue_greedy(): {TOKEN_RING} steps queued and none taken")
        if token is None:
            if not queued:
                raise RuntimeError("queue_greedy(None) consumes the choice of a step queued before it; none is")
            check_chunk([0], self.config.vocab_size, step.seq.pos, self.max_context)
        else:
            check_chunk([token], self.config.vocab_size, step.seq.pos, self.max_context)  # before any effect
            if not queued:
                self.sampler_params.upload_at(_TOKEN_INDEX_BYTE, np.zeros(4, np.uint8), step.stream)
                self._queued_index = 0
            step.seq.feed(token)
        self._decoder(self._variants["greedy"])()
        slot = self._queued_index % TOKEN_RING
        self._events[slot].record(step.stream)
        self._queued_index += 1
        if token is None:
            queued[-1][1] = True          # the choice taken next is in the cache: cached when taken
        else:
            self._cached.append(int(token))
        queued.append([slot, False])

    def take_greedy(self) -> int:
        """`Backend.take_greedy`: waits for the oldest queued step's event and reads its token
        from the ring."""
        if self.verify_pass is None:
            return DecodeVerify.take_greedy(self)
        if not self._queued:
            raise RuntimeError("take_greedy() with no step queued")
        slot, consumed = self._queued.popleft()
        self._events[slot].synchronize()
        token = int(self._ring_view[slot])
        if consumed:
            self._cached.append(token)
        return token

    def _check_nothing_queued(self, what: str) -> None:
        """Raise RuntimeError if a queue_greedy step is not taken yet: the cached ids and the
        device state are the queue's until then."""
        if self._queued:
            raise RuntimeError(f"{what}() with {len(self._queued)} queued greedy steps not taken (take_greedy)")

    @property
    def verify_implementation(self) -> str:
        """What `verify` runs for up to 16 tokens: "VerifyPass.run" (one pass) or
        "DecodeVerify.verify" (one decode per token)."""
        return "VerifyPass.run" if self.verify_pass is not None else DecodeVerify.verify_implementation

    def rollback(self, n_positions: int) -> None:
        """Keep positions < n_positions and drop the rest (`Backend.rollback`): the next
        `decode` runs at position n_positions.

        Through the sequence owner: `Sequence.rollback` waits for the stream, gives back the
        pages that hold no kept position and sets the device state to (n, 0, n + 1) — `decode`
        then feeds its token into that state and `reserve` opens the page of position n again
        if it was given back. (`Sequence.keep` does the same for 0 < n < pos, but keep(0)
        leaves the device state to the prefill that follows it; here a decode follows.)

        Raises:
            DrvqwenError: n_positions outside [0, len(cached_ids())].
        """
        self._check_nothing_queued("rollback")
        check_rollback(n_positions, len(self._cached))
        if n_positions == len(self._cached):
            return
        self.decode_step.seq.rollback(n_positions, 0)
        del self._cached[n_positions:]

    def reset(self) -> None:
        """Forget the sequence (the next prefill starts at position 0)."""
        self.decode_step.sync()
        self.decode_step.seq.reset()
        self._cached = []
        self._queued.clear()
        self.drop_greedy_queue()          # DecodeVerify's, where there is no verify pass

    def close(self) -> None:
        """Release everything on the GPU (weights, cache, activations) and the host ring."""
        self.decode_step.sync()
        for g in self._graphs.values():   # graphs first: they replay the step's buffers
            g.close()
        self._graphs.clear()
        for e in self._events:
            e.close()
        self._ring.free()
        self.pool.close()
        self.prefill_pass.close()
        if self.verify_pass is not None:
            self.verify_pass.close()
        self.decode_step.close()
