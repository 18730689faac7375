"""`drvqwen bench`: decode speed, eager launches against CUDA graphs — the one definition of
TTFT and ITL that every figure drvqwen quotes comes from.

    drvqwen bench [--preset 0.5b|1.5b|3b|7b|14b|32b] [--model FILE] [--prefill-reps N] [--kernels]
                  [--lookup N | --draft MODEL [--draft-max K]] [--json OUT.json]
    python -m drvqwen.bench ...            (the same)

Protocol: a 512-token prompt, then 128 greedy tokens with stop tokens ignored, GPU clocks
left as they are. Reported per mode:

- TTFT: prompt submitted → first token on the host, through the GPU prefill (drvqwen.prefill;
  it runs eagerly in both modes), timed for N prefills of the same prompt (--prefill-reps,
  default 10), each a new sequence on an idle GPU: the first (what the first prompt after the
  warm-up waits), the median, min and max. Where the prefill does not exist, or with
  --no-prefill, the prompt is fed once, one decode step per token, which is no TTFT, and TTFT
  is reported as not available.
- ITL: wall time between consecutive tokens on the host, each step synchronized and its token
  read back (what a user streaming tokens waits), median and p99 over the 127 decode steps
  after the first token; decode tok/s = 127 / their sum.
- effective bandwidth: bytes read per token ÷ median ITL. Bytes per token = every weight but
  the embedding (the embedding kernel reads one row; lm_head, norms, biases and scales are
  read whole) plus the K and V bytes attention reads at that length, averaged over the steps.
- its ratio to the copy bandwidth measured in the same run (`cuda.bandwidth`: a ≥ 2 GB
  cuMemcpyDtoD). Convention: the copy counts bytes read + written (2 × size), as the 4.3 TB/s
  H200 figure does; decode counts bytes read only (its writes are < 0.1 % of its traffic).

Eager (`DecodeStep.decode_token`, pre-packed launches) and graph (`graphs.GraphDecoder`) run the same
prompt from a fresh sequence; the table shows both and eager ITL ÷ graph ITL, and checks that
both generated the same tokens. Default model: the synthetic 7B (format/synthetic.py, seed 1),
written to /dev/shm on Linux (else the cache root) the first time.

With --lookup or --draft (options and checks as `run`'s, gen_options.py), a speculative row
follows on an edit prompt: plain and speculative greedy generation on one backend, their
tokens/s, proposals, acceptance, tokens per verify pass and whether their tokens agree
(bench_speculative.py, `speculative` in the JSON). It needs --model with real weights: on the
synthetic ones every proposer guesses right (they repeat one token), so it is refused there.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from .config import PRESETS
from .console import error_line, make_console, progress_bar
from .errors import DrvqwenError
from .format.tensor_set import bytes_per_token

PROMPT_TOKENS = 512
NEW_TOKENS = 128
# Before each measured run, a throw-away sequence of this many steps: it crosses two page
# boundaries (16, 32), so every kernel and both graphs have run once before timing starts.
WARMUP_TOKENS = 40
# Timed prefills of the prompt per mode: one alone is at the mercy of a clock ramp or a stray
# host stall; the median of 10 is not, and the first stays reported beside it.
PREFILL_REPS = 10
SYNTHETIC_SEED = 1
MODES = ("eager", "graph")

err = make_console(stderr=True)


# ---- the model ---------------------------------------------------------------------------------
def default_synthetic_path(preset: str) -> Path:
    """Where the synthetic model of `preset` is kept: /dev/shm on Linux (RAM: the 5.5 GB 7B is
    written in seconds and mapped without disk reads), else the cache root's models/."""
    name = f"drvqwen_syn_{preset}.nanoqwen"
    shm = Path("/dev/shm")
    if shm.is_dir():
        return shm / name
    from .paths import models_dir

    return models_dir() / name




def ensure_synthetic(preset: str, path: Path | None = None) -> Path:
    """The synthetic `.nanoqwen` of `preset` at `path` (default: `default_synthetic_path`),
    written from SYNTHETIC_SEED with a progress bar if it does not exist yet.

    Raises:
        DrvqwenError: unknown preset.
    """
    if preset not in PRESETS:
        raise DrvqwenError(f"--preset {preset}: choose one of {', '.join(sorted(PRESETS))}")
    path = path or default_synthetic_path(preset)
    if path.exists():
        return path
    from .format.synthetic import minimal_tokenizer_json, write_synthetic

    t0 = time.perf_counter()
    with progress_bar(transient=True, console=err) as p:
        task = p.add_task(f"writing synthetic {preset} → {path}", total=None)
        write_synthetic(path, PRESETS[preset], SYNTHETIC_SEED, minimal_tokenizer_json(),
                        progress=lambda name, i, n: p.update(task, completed=i, total=n))
    err.print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
    return path


def l2_prefetch_layer_bytes(steps, layer: int) -> int:
    """Bytes the L2 prefetches of decoder layer `layer` ask for (its "l2_prefetch" and
    "l2_prefetch_qkv" launches in a step list; 0 without them): what a --l2-prefetch-mb budget
    planned, which can be less than the budget (whole GEMVs, then whole tiles of every block)."""
    return sum(launcher.bytes_moved for name, launcher in steps
               if name.startswith(f"L{layer}.l2_prefetch"))


# ---- measuring one mode ------------------------------------------------------------------------
@dataclass
class ModeResult:
    """One mode's run of the protocol (times in ms, bandwidths in GB/s = 1e9 B/s)."""

    mode: str
    ttft_runs_ms: list[float] | None       # every timed prefill in order; None without the GPU prefill
    itl_ms: list[float]
    tokens: list[int]
    bytes_per_token: float                 # mean over the timed steps
    copy_gbps: float
    ttft_ms: float | None = field(init=False)          # the first timed prefill
    ttft_median_ms: float | None = field(init=False)
    ttft_min_ms: float | None = field(init=False)
    ttft_max_ms: float | None = field(init=False)
    itl_median_ms: float = field(init=False)
    itl_p99_ms: float = field(init=False)
    decode_tok_s: float = field(init=False)
    effective_gbps: float = field(init=False)
    fraction_of_copy: float = field(init=False)

    def __post_init__(self) -> None:
        runs = self.ttft_runs_ms
        self.ttft_ms = runs[0] if runs else None
        self.ttft_median_ms = float(np.median(runs)) if runs else None
        self.ttft_min_ms = min(runs) if runs else None
        self.ttft_max_ms = max(runs) if runs else None
        itl = np.asarray(self.itl_ms)
        self.itl_median_ms = float(np.median(itl))
        self.itl_p99_ms = float(np.percentile(itl, 99))
        self.decode_tok_s = float(len(itl) / (itl.sum() * 1e-3))
        self.effective_gbps = self.bytes_per_token / (self.itl_median_ms * 1e-3) / 1e9
        self.fraction_of_copy = self.effective_gbps / self.copy_gbps


def weight_bytes_per_token(dec) -> int:
    """Weight bytes one decode step reads from the GPU's copy: every tensor but the embedding
    table (in whatever format), of which one row (format.tensor_set.bytes_per_token)."""
    return bytes_per_token(((n, a.nbytes) for n, a in dec.weights.arrays.items()), dec.config.vocab_size)


def kv_bytes_read(config, seq_len: int) -> int:
    """K and V bytes attention reads over all layers at `seq_len` tokens (fp16)."""
    return 2 * config.num_layers * seq_len * config.num_kv_heads * config.head_dim * 2


def load_prefill(dec, fmt_gemm: str = "wgmma", rope: str = "epilogue", attention: str | None = None,
                 last_layer: str = "last_row", attention_splits: bool = True, attention_late: bool = True,
                 kquant_gemm: bool = True, chunk_rows: int | None = None, q32_gemm: bool = True,
                 attention_defines: tuple[tuple[str, int], ...] = (), mixed_qkv: bool = True):
    """The GPU prefill sharing `dec`'s weights, cache and stream (`drvqwen.prefill.Prefill`, its
    per-tensor projections on `fmt_gemm`'s GEMMs; `rope` "apart" runs the INT4 prefill's RoPE and
    K/V writes as their own launch instead of in the QKV GEMM's epilogue; `attention` the
    attention engine, default the prefill's; `last_layer` prefill.LAST_LAYER_MODES; without
    `attention_splits` every attention query tile runs whole; without `attention_late` every chunk
    on the one engine, none switching to the range schedule late in a long prompt; without
    `kquant_gemm` Q4_K, Q5_K and Q6_K projections on gemm_fmt_wgmma.cu, without `q32_gemm` the
    Q4_0, Q5_0, Q8_0, Q4_1 and Q5_1 ones;
    `chunk_rows` the prompt rows per chunk, default the prefill's; `attention_defines` a compile-time
    build of the wgmma attention kernel, to measure; `mixed_qkv` Prefill's), or None where that
    module does not exist in this checkout."""
    try:
        from .prefill import ATTENTION_ENGINE, DEFAULT_CHUNK_ROWS, LATE_ATTENTION_FROM, Prefill
    except ImportError:
        return None
    return Prefill(dec, chunk_rows or DEFAULT_CHUNK_ROWS, fmt_gemm=fmt_gemm, qkv_rope=rope == "epilogue", attention_engine=attention or ATTENTION_ENGINE,
                   last_layer=last_layer, attention_splits=attention_splits,
                   late_attention_from=LATE_ATTENTION_FROM if attention_late else None, kquant_gemm=kquant_gemm,
                   q32_gemm=q32_gemm, **({"attention_defines": attention_defines} if attention_defines else {}),
                   mixed_qkv=mixed_qkv)


def _prompt_pass(decoder, prompt: list[int], prefill=None, reps: int = PREFILL_REPS) -> list[float] | None:
    """Put `prompt` into the KV cache and leave its first generated token in `next_token`,
    with the state ready to decode the next one.

    With a prefill, `reps` times: a new sequence (Prefill.run at start 0 gives every page of
    the previous one back and reserves the prompt's), its TTFT timed as host time from
    submitting the prompt to the first token read back, starting from an idle GPU. The last
    pass is the one decoding continues from. Without a prefill the prompt is fed once, one
    decode step per token (the decoder's own steps), which is no TTFT: None.

    Returns:
        The `reps` TTFTs in ms, in order, or None.
    """
    if prefill is not None:
        ttft_ms = []
        for _ in range(reps):
            decoder.sync()             # the previous sequence is done: its page slots are free
            t0 = time.perf_counter()
            prefill.run(prompt)        # start = 0: a new sequence, pages reserved for the prompt
            decoder.next_token()
            ttft_ms.append((time.perf_counter() - t0) * 1e3)
        return ttft_ms
    decoder.seq.start(prompt[0])
    for t in prompt[1:]:
        decoder.decode_token()
        decoder.seq.feed(t)
    decoder.decode_token()
    decoder.sync()
    return None


def run_mode(mode: str, decoder, dec, prompt: list[int], new_tokens: int, copy_gbps: float,
             prefill=None, prefill_reps: int = PREFILL_REPS) -> ModeResult:
    """The protocol on one decoder (DecodeStep for "eager", GraphDecoder for "graph"); the
    prompt goes through `prefill` when given (`load_prefill`), `prefill_reps` times, else
    once, one step per token."""
    decoder.seq.start(prompt[0])
    for _ in range(WARMUP_TOKENS):
        decoder.decode_token()
    decoder.sync()
    ttft_runs_ms = _prompt_pass(decoder, prompt, prefill, prefill_reps)
    tokens = [decoder.next_token()]
    itl_ms, kv = [], []
    t_prev = time.perf_counter()
    for _ in range(new_tokens - 1):
        kv.append(kv_bytes_read(dec.config, dec.seq.pos + 1))
        decoder.decode_token()
        tokens.append(decoder.next_token())   # waits for the step: the token is on the host
        t = time.perf_counter()
        itl_ms.append((t - t_prev) * 1e3)
        t_prev = t
    return ModeResult(mode, ttft_runs_ms, itl_ms, tokens,
                      weight_bytes_per_token(dec) + float(np.mean(kv)), copy_gbps)


def persistent_trace(dec, graph) -> dict:
    """One graph step of the persistent kernel, traced (launchers.decode_persistent.trace_summary):
    per op role (the step names without their layer), medians over the layers of the op's span
    (from the previous op's last release to its own), the hand-off (from that release to the
    first of its waits to end), its items' median and slowest time after their wait, and the
    most of them on one SM at once in any layer; and the whole step."""
    from .launchers.decode_persistent import trace_summary

    graph.decode_token()
    dec.sync()
    ops = trace_summary(dec.buf["persistent_trace"].download(), len(dec.plan.persistent.ops))
    # The persistent kernel's ops are the plan's launches before "norm", in order.
    names = [n for n, _s in dec.plan.named_specs()[:len(dec.plan.persistent.ops)]]
    roles: dict[str, dict[str, list[float]]] = {}
    prev_end = 0.0
    for o in ops:
        role = names[o["op"]].split(".", 1)[1] if names[o["op"]].startswith("L") else names[o["op"]]
        r = roles.setdefault(role, {"span_us": [], "handoff_us": [], "item_us": [], "item_max_us": [], "items": [],
                                    "most_on_one_sm": []})
        r["span_us"].append(o["end_us"] - prev_end)
        r["handoff_us"].append(o["wait_first_us"] - prev_end)
        r["item_us"].append(o["item_median_us"])
        r["item_max_us"].append(o["item_max_us"])
        r["items"].append(o["items"])
        r["most_on_one_sm"].append(o["most_on_one_sm"])
        prev_end = o["end_us"]
    # Medians over the layers, but the most items of the op on one SM at once: the most of any layer.
    return {"step_us": prev_end, "ops": ops,
            "roles": {k: {m: float(np.max(v) if m == "most_on_one_sm" else np.median(v)) for m, v in r.items()}
                      | {"count": len(r["span_us"])} for k, r in roles.items()}}


# ---- the whole benchmark -----------------------------------------------------------------------
def run_bench(model_path: Path, *, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS,
              max_context: int | None = None, modes: tuple[str, ...] = MODES, seed: int = 0,
              copy_bytes: int | None = None, use_prefill: bool = True, prefill_reps: int = PREFILL_REPS,
              kernels: bool = False, prefill_gemm: str = "wgmma", prefill_rope: str = "epilogue",
              prefill_attention: str | None = None, prefill_last_layer: str = "last_row",
              prefill_attention_splits: bool = True, prefill_attention_late: bool = True,
              prefill_kquant: str = "registers", prefill_q32: str = "registers", prefill_chunk_rows: int | None = None,
              prefill_mixed_qkv: str = "one",
              prefill_attention_defines: tuple[tuple[str, int], ...] = (), decode: str = "per-launch",
              persistent_blocks: int = 1, persistent_defines: tuple[tuple[str, int], ...] = (),
              trace: bool = False, decode_attention: str | None = None, short_attention_below: int | None = None,
              l2_prefetch_mb: float = 0.0, l2_prefetch_qkv: bool = False) -> dict:
    """Run the benchmark on the `.nanoqwen` at `model_path`; return the JSON-ready result.

    Args:
        model_path: the model (synthetic or converted).
        prompt_tokens, new_tokens: the protocol's 512 and 128.
        max_context: KV cache size in tokens (default: the model's max_position, as `run`).
        modes: a subset of ("eager", "graph").
        seed: the random prompt's seed.
        copy_bytes: bytes per copy of the bandwidth measurement (default 2 GiB).
        use_prefill: run the prompt through the GPU prefill where it exists (TTFT); False
            feeds it one decode step per token (no TTFT).
        prefill_reps: timed prefills of the prompt per mode (>= 1), each a new sequence.
        kernels: also time every launch of the step (`kernel_breakdown`) and, where the prompt
            fits one prefill chunk, of the prefill (`prefill_breakdown`).
        prefill_gemm: which GEMMs the prefill runs (prefill.FMT_GEMMS), to compare them.
        prefill_rope: "epilogue" (the INT4 QKV GEMM adds the bias, rotates and writes the cache)
            or "apart" (rope_kv_rows after an FP32 QKV GEMM), to compare them.
        prefill_attention: the prefill's attention engine ("mma" or "wgmma"; None: its default).
        prefill_last_layer: "last_row" (the last layer past its K/V on the prompt's last row) or
            "all_rows" (prefill.LAST_LAYER_MODES), to compare them.
        prefill_attention_splits: let the prefill's attention cut its query tiles' positions over
            blocks (the prefill's KV splits); False runs every tile whole, to compare.
        prefill_kquant: Q4_K, Q5_K and Q6_K projections on the register-unpack GEMMs ("registers") or on
            gemm_fmt_wgmma.cu as the other formats ("fmt"), to compare.
        prefill_q32: Q4_0, Q5_0, Q8_0, Q4_1 and Q5_1 projections likewise ("registers": gemm_int4.cu's
            kernels for them; "fmt").
        prefill_mixed_qkv: a layer with q, k in Q4_K or Q5_K and v in Q6_K: its QKV as one launch
            (Prefill's mixed_qkv: "one", the default) or three ("apart"), to compare.
        prefill_attention_late: let a long prompt's chunks from prefill.LATE_ATTENTION_FROM on take
            the range-scheduled attention (the prefill's choice); False keeps one engine, to compare.
        prefill_chunk_rows: prompt rows per prefill chunk (None: prefill.DEFAULT_CHUNK_ROWS): a
            long prompt's GEMMs run at M = that many rows.
        decode: "per-launch" (the step as its launch list) or "persistent": the graph mode runs
            the embedding and the layers as one persistent kernel (kernels/decode_persistent.cu)
            and the eager mode the same step launch by launch — both with the plain attention
            kernel, so "same_tokens" compares the two bit for bit.
        persistent_blocks: blocks per SM the persistent kernel is compiled for (1 or 2).
        persistent_defines: more compile-time choices of the persistent kernel (its header).
        prefill_attention_defines: defines replacing or added to the builds of the prefill's wgmma
            attention kernel (kernels/attention_prefill_wgmma.cu's header; ENGINE_BUILDS in
            launchers/attention_prefill.py), to measure.
        trace: with decode="persistent", also trace one graph step (`persistent_trace`).
        decode_attention: the decode step's attention kernel (decode.ATTENTION_KERNELS: "tma",
            "plain", "cluster"), to compare them; None: the step's own (the plain one with
            decode="persistent").
        short_attention_below: > 0: the steps whose attention covers at most that many positions
            run the one-launch cluster attention (DecodeStep(short_attention="cluster")), the
            others decode_attention's; 0: one attention throughout; None: the step's default
            (decode.default_short_attention: the cluster kernel in clusters of 8 up to 1024
            positions at head dim 128 and 2048 at 64, in clusters of 16 up to 2048 and 4096,
            behind the default attention).
        l2_prefetch_mb: > 0: each layer asks L2 for up to that many MB (10^6 bytes) of its
            o_proj, gate_up and down weights after qkv_rope (DecodeStep(l2_prefetch_bytes=...),
            kernels/l2_prefetch.cu); 0: off. l2_prefetch_qkv: each layer but the last also asks
            for the next layer's q/k/v weights after down_proj (DecodeStep(l2_prefetch_qkv=True)).

    Raises:
        DrvqwenError: no usable GPU, a bad argument, or a model that does not fit.
    """
    from .cuda import gpu_unavailable_reason
    from .cuda.bandwidth import DEFAULT_COPY_BYTES, measure_copy_bandwidth
    from .decode import DecodeStep
    from .format.nanoqwen import NanoqwenFile
    from .graphs import GraphDecoder

    check_bench_values(prompt_tokens=prompt_tokens, new_tokens=new_tokens, max_context=max_context or 0,
                       seed=seed, prefill_reps=prefill_reps, prefill_chunk_rows=prefill_chunk_rows,
                       short_attention_below=short_attention_below)   # before the minutes of loading
    l2_prefetch_bytes = l2_prefetch_budget_bytes(l2_prefetch_mb)
    check_prefill_attention_defines(prefill_attention_defines)
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise DrvqwenError(f"drvqwen bench needs a Hopper GPU: {reason}")
    f = NanoqwenFile(model_path)
    cfg = f.config
    ctx = max_context or cfg.max_position
    need = max(prompt_tokens + new_tokens, WARMUP_TOKENS + 1)
    if need > ctx:
        raise DrvqwenError(f"--max-context {ctx}: the protocol needs {need} tokens")

    copy = measure_copy_bandwidth(copy_bytes or DEFAULT_COPY_BYTES)
    err.print(f"copy bandwidth: {copy.gbps:.0f} GB/s (cuMemcpyDtoD of {copy.copy_bytes / 1e9:.2f} GB, "
              f"read + write counted)")
    total = sum(i.nbytes for i in f)
    with progress_bar(transient=True, console=err) as p:
        task = p.add_task("uploading weights", total=total)
        dec = DecodeStep(f, max_context=ctx, progress=lambda done, _n: p.update(task, completed=done),
                         attention=decode_attention, persistent=decode == "persistent",
                         **short_attention_args(short_attention_below), persistent_min_blocks=persistent_blocks,
                         persistent_defines=persistent_defines, persistent_trace=trace and decode == "persistent",
                         l2_prefetch_bytes=l2_prefetch_bytes, l2_prefetch_qkv=l2_prefetch_qkv)
    graph = prefill = None
    try:
        t0 = time.perf_counter()
        graph_list = dec.persistent_variant() if decode == "persistent" else None
        graph = GraphDecoder(dec, graph_list) if "graph" in modes else None
        capture_ms = (time.perf_counter() - t0) * 1e3
        prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, prompt_tokens).tolist()
        prefill = (load_prefill(dec, prefill_gemm, prefill_rope, prefill_attention, prefill_last_layer,
                                prefill_attention_splits, prefill_attention_late, prefill_kquant == "registers",
                                prefill_chunk_rows, prefill_q32 == "registers", prefill_attention_defines,
                                prefill_mixed_qkv == "one")
                   if use_prefill else None)
        if prefill is not None:
            prefill.run(prompt)        # untimed: builds its launch list, first launches
            dec.sync()
        results: dict[str, ModeResult] = {}
        for mode in modes:
            how = f"GPU prefill × {prefill_reps}" if prefill is not None else "one step per token"
            err.print(f"{mode}: {WARMUP_TOKENS} warm-up steps, {prompt_tokens}-token prompt ({how}), "
                      f"{new_tokens} tokens …")
            results[mode] = run_mode(mode, dec if mode == "eager" else graph, dec, prompt, new_tokens,
                                     copy.gbps, prefill, prefill_reps)
        out = {
            "device": dec.device.info.summary(),
            "model": Path(model_path).name,       # the file's name: no path of the machine it ran on
            "config": cfg.to_dict(),
            "protocol": {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "greedy": True,
                         "stop_tokens_ignored": True, "clocks": "untouched", "max_context": ctx,
                         "prompt_seed": seed, "warmup_steps": WARMUP_TOKENS, "decode": decode,
                         "attention": dec.attention,
                         "short_attention_below": dec.short_below or None,
                         "short_attention_bands": [[k, below] for k, _e, below in dec.short_bands] or None,
                         "l2_prefetch_mb": l2_prefetch_mb or None, "l2_prefetch_qkv": l2_prefetch_qkv or None,
                         "l2_prefetch_layer0_bytes": l2_prefetch_layer_bytes(dec.plan.steps, 0) or None,
                         "persistent_blocks": persistent_blocks if decode == "persistent" else None,
                         "persistent_defines": [list(d) for d in persistent_defines] if decode == "persistent" else None,
                         "prefill_reps": prefill_reps if prefill is not None else None,
                         "prefill_gemm": prefill_gemm if prefill is not None else None,
                         "prefill_rope": ("epilogue" if prefill.qkv_rope else "apart") if prefill is not None else None,
                         "prefill_attention": getattr(prefill, "attention_engine", None),
                         "prefill_attention_defines": ([list(d) for d in prefill_attention_defines]
                                                       if prefill is not None and prefill_attention_defines else None),
                         "prefill_attention_splits": ("auto" if prefill_attention_splits else "none")
                                                     if prefill is not None else None,
                         "prefill_attention_late_from": getattr(prefill, "late_from", None),
                         "prefill_kquant": prefill_kquant if prefill is not None else None,
                         "prefill_q32": prefill_q32 if prefill is not None else None,
                         "prefill_mixed_qkv": prefill_mixed_qkv if prefill is not None else None,
                         "prefill_chunk_rows": prefill.chunk_rows if prefill is not None else None,
                         "prefill_last_layer": (("last_row" if prefill.last_row else "all_rows")
                                                if prefill is not None else None),
                         "ttft": "GPU prefill (drvqwen.prefill): host time from submitting the prompt to "
                                 "the first token read back, per prefill; prefill_reps prefills of the "
                                 "prompt, each a new sequence: ttft_ms the first, ttft_median_ms their "
                                 "median" if prefill is not None
                         else "not available: no GPU prefill used (prompt fed one decode step per token)",
                         "itl": "host wall time between consecutive tokens read back, per step"},
            "copy_bandwidth": {"GBps": copy.gbps, "copy_bytes": copy.copy_bytes, "times_ms": list(copy.times_ms),
                               "convention": "bytes read + bytes written (2 x copy_bytes) per copy"},
            "bytes_read_per_token": {"weights": weight_bytes_per_token(dec),
                                     "convention": "decode counts bytes read (weights but the embedding, "
                                                   "of which one row, plus KV at each step's length)"},
            "launches_per_step": len(dec.launches),
            "graph_launches_per_step": len(graph.launch_list.launches) if graph is not None else None,
            "modes": {m: asdict(r) for m, r in results.items()},
        }
        if graph is not None:
            out["graph"] = {"mode": graph.mode, "fallback_reason": graph.fallback_reason,
                            "num_nodes": graph.num_nodes, "capture_ms": capture_ms,
                            "steps_by_graph": graph.steps_by_graph}
        if "eager" in results and "graph" in results:
            e, g = results["eager"], results["graph"]
            out["eager_over_graph_itl"] = e.itl_median_ms / g.itl_median_ms
            out["same_tokens"] = e.tokens == g.tokens
        if kernels:
            out["kernels"] = kernel_breakdown(dec)
            if prefill is not None and prompt_tokens <= prefill.chunk_rows:
                out["prefill_kernels"] = prefill_breakdown(prefill, prompt)
        if trace and graph is not None and dec.plan.persistent is not None:
            out["persistent_trace"] = persistent_trace(dec, graph)
        return out
    finally:
        if graph is not None:
            graph.close()
        if prefill is not None:
            prefill.close()
        dec.close()
        f.close()


def print_table(res: dict, console: Console | None = None) -> None:
    """The result as a rich table (one row per mode, plus eager ÷ graph)."""
    console = console or make_console()
    cfg = res["config"]
    t = Table(title=f"decode, {Path(res['model']).name} ({cfg['num_layers']} layers, d={cfg['hidden_size']}): "
                    f"{res['protocol']['prompt_tokens']}-token prompt, {res['protocol']['new_tokens']} greedy tokens",
              caption=f"{res['device']}; copy bandwidth {res['copy_bandwidth']['GBps']:.0f} GB/s (read + write); "
                      f"{res['launches_per_step']} launches per step"
                      + (f"; TTFT over {reps} GPU prefills of the prompt"
                         if (reps := res["protocol"].get("prefill_reps")) else ""))
    for c in ("mode", "TTFT first ms", "TTFT median ms", "ITL median ms", "ITL p99 ms", "tok/s", "effective GB/s",
              "of copy BW"):
        t.add_column(c, justify="left" if c == "mode" else "right")
    modes = res["modes"]
    for m, r in modes.items():
        first, median = ("n/a" if r[k] is None else f"{r[k]:.1f}" for k in ("ttft_ms", "ttft_median_ms"))
        t.add_row(m, first, median, f"{r['itl_median_ms']:.3f}", f"{r['itl_p99_ms']:.3f}", f"{r['decode_tok_s']:.1f}",
                  f"{r['effective_gbps']:.0f}", f"{r['fraction_of_copy']:.1%}")
    if "eager_over_graph_itl" in res:
        e, g = modes["eager"], modes["graph"]
        # Every ratio is the graph's gain: eager time ÷ graph time, graph rate ÷ eager rate.
        t.add_row("graph gain", "", "", f"{res['eager_over_graph_itl']:.2f}×",
                  f"{e['itl_p99_ms'] / g['itl_p99_ms']:.2f}×", f"{g['decode_tok_s'] / e['decode_tok_s']:.2f}×",
                  f"{g['effective_gbps'] / e['effective_gbps']:.2f}×", "")
    console.print(t)
    if "same_tokens" in res:
        if res["same_tokens"]:
            console.print("eager and graph generated the same tokens")
        else:
            console.print("eager and graph generated DIFFERENT tokens", style="bold red")
    if res.get("graph", {}).get("mode") == "eager":
        console.print(f"graph capture failed, the graph row ran eagerly: {res['graph']['fallback_reason']}",
                      style="yellow", soft_wrap=True)
    if "speculative" in res:
        from .bench_speculative import print_speculative

        print_speculative(res["speculative"], console)


def by_role(per_launch_us: dict[str, float]) -> dict[str, float]:
    """Per-launch times summed by role over the layers: "L3.o_proj" counts as "o_proj" (a
    launcher's ".0"/".1" launches stay apart); entries outside the layers keep their names."""
    roles: dict[str, float] = {}
    for name, us in per_launch_us.items():
        role = name.split(".", 1)[1] if name.startswith("L") and "." in name else name
        roles[role] = roles.get(role, 0.0) + us
    return roles


def kernel_breakdown(dec, steps: int = 10) -> dict:
    """GPU time of every launch of the decode step, grouped by role over the layers
    (DecodeStep.time_kernels: the step queued behind gpu_sleep, one event pair per launch).

    Returns {"per_launch_us": {name: µs}, "by_role_us": {role: µs summed over layers},
    "sum_ms": the sum, "method": how it was measured}. Each figure includes its event pair's
    own cost, so the sum exceeds the step's GPU time by roughly that much per launch.
    """
    per = dec.time_kernels(steps)
    return {"per_launch_us": per, "by_role_us": by_role(per), "sum_ms": sum(per.values()) / 1e3,
            "method": f"eager step queued behind gpu_sleep, an event pair around each launch, median of {steps}"}


def prefill_breakdown(prefill, prompt: list[int]) -> dict:
    """GPU time of every launch of a one-chunk prefill of `prompt` from position 0, grouped by
    role over the layers (Prefill.time_kernels: the chunk queued behind gpu_sleep, one event pair
    per launch); the same fields and caveat as kernel_breakdown. Leaves the cache holding `prompt`.
    """
    per = prefill.time_kernels(prompt)
    return {"per_launch_us": per, "by_role_us": by_role(per), "sum_ms": sum(per.values()) / 1e3,
            "method": "one eager prefill queued behind gpu_sleep, an event pair around each launch"}


def print_kernels(res: dict, console: Console | None = None, key: str = "kernels", what: str = "decode step") -> None:
    """The per-role kernel table of `res[key]` (see kernel_breakdown, prefill_breakdown)."""
    console = console or make_console()
    k = res[key]
    t = Table(title=f"{what} by kernel role ({len(k['per_launch_us'])} launches)", caption=k["method"])
    for c in ("role", "µs per step", "share"):
        t.add_column(c, justify="right")
    for role, us in sorted(k["by_role_us"].items(), key=lambda kv: -kv[1]):
        t.add_row(role, f"{us:.1f}", f"{us / 1e3 / k['sum_ms']:.1%}")
    t.add_row("sum", f"{k['sum_ms'] * 1e3:.1f}", "")
    console.print(t)


# ---- command line ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench options (shared by `drvqwen bench` and `python -m drvqwen.bench`)."""
    from .gen_options import MODEL_SOURCES

    p.add_argument("--model", help=f"{MODEL_SOURCES} (default: the synthetic --preset model, written on first use)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="synthetic model shape (default: 7b); beside --model it must be the model's shape")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help=f"default: {PROMPT_TOKENS}")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help=f"default: {NEW_TOKENS}")
    p.add_argument("--max-context", type=int, default=0, help="KV cache size in tokens (default: the model's)")
    p.add_argument("--mode", choices=(*MODES, "both"), default="both", help="default: both, side by side")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default: 0)")
    p.add_argument("--no-prefill", action="store_true",
                   help="feed the prompt one decode step per token even where a GPU prefill exists (no TTFT)")
    p.add_argument("--prefill-gemm", choices=("wgmma", "mma"), default="wgmma",
                   help="the prefill GEMMs of per-tensor formats, to compare them (prefill.FMT_GEMMS): wgmma "
                        "(default: gemm_fmt_wgmma.cu) or mma (gemm_fmt.cu); an INT4 model runs gemm_int4.cu")
    p.add_argument("--prefill-rope", choices=("epilogue", "apart"), default="epilogue",
                   help="INT4 prefill: the QKV bias, RoPE and K/V cache writes in the QKV GEMM's epilogue (default) "
                        "or apart, as rope_kv_rows after an FP32 QKV GEMM (to compare: the same bits)")
    p.add_argument("--prefill-attention", choices=("mma", "wgmma", "wgmma-ranges"), default=None,
                   help="the prefill's attention kernel: mma (attention_prefill.cu), wgmma "
                        "(attention_prefill_wgmma.cu) or wgmma-ranges (the same kernel's blocks on every SM, each "
                        "a run of the launch's KV steps); default: the prefill's own")
    p.add_argument("--prefill-last-layer", choices=("last_row", "all_rows"), default="last_row",
                   help="what the prefill's last layer runs past its K/V: the prompt's last row only, through the "
                        "decode GEMVs (default), or every row as the other layers (to compare)")
    p.add_argument("--prefill-attention-splits", choices=("auto", "none"), default="auto",
                   help="the prefill's attention: KV splits where its launch's balance needs them (default) or "
                        "every query tile whole (to compare)")
    p.add_argument("--prefill-attention-late", choices=("auto", "none"), default="auto",
                   help="a long prompt's chunks from the prefill's switch position on: the range-scheduled "
                        "attention where the prefill picks it (default), or none (to compare)")
    p.add_argument("--prefill-kquant", choices=("registers", "fmt"), default="registers",
                   help="Q4_K, Q5_K and Q6_K projections: unpacked in the GEMM's registers (gemm_int4.cu's K-quant "
                        "kernels, default) "
                        "or on gemm_fmt_wgmma.cu as the other formats (to compare)")
    p.add_argument("--prefill-q32", choices=("registers", "fmt"), default="registers",
                   help="Q4_0, Q5_0, Q8_0, Q4_1 and Q5_1 projections: unpacked in the GEMM's registers (gemm_int4.cu's kernels for them, "
                        "default) "
                        "or on gemm_fmt_wgmma.cu as the other formats (to compare)")
    p.add_argument("--prefill-mixed-qkv", choices=("apart", "one"), default="one",
                   help="a layer whose q and k are Q4_K or Q5_K and v Q6_K (llama.cpp's *_K_M recipes): its QKV as "
                        "one launch in two parts (gemm_q4k_q6k_qkv_rope, gemm_q5k_q6k_qkv_rope; default) or three (to compare)")
    p.add_argument("--prefill-chunk-rows", type=int, default=None, metavar="ROWS",
                   help="prompt rows per prefill chunk (rounded up to a multiple of 64; default: the prefill's, 1024): a long "
                        "prompt's GEMMs and attention launches then take that many rows at once")
    p.add_argument("--prefill-reps", type=int, default=PREFILL_REPS,
                   help=f"timed GPU prefills of the prompt per mode, each a new sequence; TTFT is reported as "
                        f"the first and the median (default: {PREFILL_REPS})")
    p.add_argument("--kernels", action="store_true",
                   help="also time every launch of the decode step and of the prompt's prefill, by role")
    p.add_argument("--decode", choices=("per-launch", "persistent"), default="per-launch",
                   help="persistent: the graph mode runs the embedding and the layers as one persistent kernel, the "
                        "eager mode the same step launch by launch (both with the plain attention kernel)")
    p.add_argument("--decode-attention", choices=("tma", "plain", "cluster"), default=None,
                   help="the decode step's attention kernel: tma (default), plain, or cluster (one launch, the "
                        "splits merged in a thread block cluster: for short contexts), to compare them")
    p.add_argument("--short-attention-below", type=int, default=None, metavar="POSITIONS",
                   help="the decode steps whose attention covers at most this many positions run the one-launch "
                        "cluster attention, the others --decode-attention's (their own pair of graphs); 0: off "
                        "(default: the step's own bands, clusters of 8 up to 1024 positions at head dim 128 (2048 at "
                        "64) and of 16 up to 2048 (4096), behind the TMA attention). Given, it must exceed "
                        "--prompt-tokens: the timed steps start after the prompt"),
    p.add_argument("--l2-prefetch-mb", type=float, default=0.0, metavar="MB",
                   help="after each layer's qkv_rope, ask L2 for up to this many MB of the layer's o_proj, gate_up "
                        "and down weights (the first tiles of every GEMV block), to measure; 0: off")
    p.add_argument("--l2-prefetch-qkv", action="store_true",
                   help="after each layer's down_proj, ask L2 for the next layer's q/k/v weights, to measure")
    p.add_argument("--persistent-blocks", type=int, choices=(1, 2), default=1,
                   help="blocks per SM the persistent kernel's registers are sized for (default: 1)")
    p.add_argument("--persistent-define", action="append", default=[], metavar="NAME=VALUE",
                   help="a compile-time choice of the persistent kernel (kernels/decode_persistent.cu), to measure")
    p.add_argument("--prefill-attention-define", action="append", default=[], metavar="NAME=VALUE",
                   help="a define replacing or added to the builds of the prefill's wgmma attention "
                        "(kernels/attention_prefill_wgmma.cu; e.g. APW_WARPGROUPS=2), to measure")
    p.add_argument("--trace", action="store_true",
                   help="with --decode persistent: also trace one step (per-op times from %%globaltimer stamps)")
    from .gen_options import add_speculation_arguments

    add_speculation_arguments(p)    # the speculative row (bench_speculative.py; needs --model)
    p.add_argument("--json", help="also write the result as JSON to this file")


def check_bench_values(*, prompt_tokens: int, new_tokens: int, max_context: int, seed: int, prefill_reps: int,
                       prefill_chunk_rows: int | None, short_attention_below: int | None) -> None:
    """The bench's numbers that are wrong whatever the GPU and the model: checked before either
    is looked at, so a mistyped value is named first.

    Raises:
        DrvqwenError: names the option, its value and what it must be.
    """
    if prompt_tokens < 1:
        raise DrvqwenError(f"--prompt-tokens {prompt_tokens}: need >= 1")
    if new_tokens < 2:
        raise DrvqwenError(f"--new-tokens {new_tokens}: need >= 2 (ITL is the time between two tokens)")
    if max_context < 0:
        raise DrvqwenError(f"--max-context {max_context}: need >= 0 (0: the model's)")
    if seed < 0:
        raise DrvqwenError(f"--seed {seed}: need >= 0 (the random prompt's seed)")
    if prefill_reps < 1:
        raise DrvqwenError(f"--prefill-reps {prefill_reps}: need >= 1")
    if prefill_chunk_rows is not None and prefill_chunk_rows < 1:
        raise DrvqwenError(f"--prefill-chunk-rows {prefill_chunk_rows}: need >= 1")
    if short_attention_below is None:
        return
    if short_attention_below < 0:
        raise DrvqwenError(f"--short-attention-below {short_attention_below}: need >= 0 (0: off)")
    if 0 < short_attention_below <= prompt_tokens:
        raise DrvqwenError(f"--short-attention-below {short_attention_below}: the timed steps start at position "
                           f"{prompt_tokens} (the prompt's length), past it; give more than --prompt-tokens")


def short_attention_args(below: int | None) -> dict:
    """DecodeStep's short-context arguments for --short-attention-below POSITIONS: None, the
    step's default (decode.default_short_attention); 0, one attention at every length; N > 0, the
    cluster kernel up to N positions."""
    if below is None:
        return {}
    return dict(short_attention="cluster" if below > 0 else None, short_below=below)


def l2_prefetch_budget_bytes(mb: float, option: str = "--l2-prefetch-mb") -> int:
    """An L2 prefetch budget of `mb` MB (10^6 bytes) a layer in bytes; 0: off.

    Raises:
        DrvqwenError: a budget that is not a finite number ≥ 0, or one below a byte (it would be
            recorded as given and plan nothing).
    """
    if not math.isfinite(mb) or mb < 0 or 0 < mb * 1e6 < 1:
        raise DrvqwenError(f"{option} {mb}: need 0 (off) or a finite budget of at least a byte (1e-6 MB)")
    return int(mb * 1e6)


SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def check_preset_matches(preset: str | None, config, model: str) -> None:
    """Refuse `--preset` beside `--model` where the preset's shape (SHAPE_FIELDS of
    config.PRESETS[preset]) is not the model's: the bench measures the model, so a preset that
    names another shape would be ignored while its name suggested otherwise. None (not given)
    passes.

    Raises:
        DrvqwenError: naming the preset, the model and the model's shape.
    """
    if preset is None:
        return
    want = PRESETS[preset]
    if any(getattr(want, f) != getattr(config, f) for f in SHAPE_FIELDS):
        match = next((name for name, c in PRESETS.items()
                      if all(getattr(c, f) == getattr(config, f) for f in SHAPE_FIELDS)), None)
        shape = (f"hidden {config.hidden_size}, {config.num_layers} layers"
                 + (f": the {match} shape" if match else ""))
        raise DrvqwenError(f"--preset {preset}: --model {model} is not that shape ({shape}); "
                           f"the bench measures the model, leave --preset out")


def check_prefill_attention_defines(defines: tuple[tuple[str, int], ...]) -> None:
    """Refuse, before any model is loaded, --prefill-attention-define builds the wgmma attention
    kernel cannot be (launchers/attention_prefill.py: build_refusal).

    Raises:
        DrvqwenError: naming the defines and why.
    """
    from .launchers.attention_prefill import build_refusal

    why = build_refusal(defines) if defines else None
    if why is not None:
        raise DrvqwenError(f"--prefill-attention-define: {why}")


def parse_defines(items: list[str], option: str = "--persistent-define") -> tuple[tuple[str, int], ...]:
    """NAME=VALUE strings (of `option`) → (name, int value) pairs.

    Raises:
        DrvqwenError: an item without "=", a name that is not an identifier or a value that is
            not an integer.
    """
    out = []
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier() or not value.lstrip("-").isdigit():
            raise DrvqwenError(f"{option} {item!r}: expected NAME=INTEGER")
        out.append((name, int(value)))
    return tuple(out)


def cmd_bench(args) -> int:
    """Run the benchmark for parsed `args`; print the table, write --json. Returns 0.

    Raises:
        DrvqwenError: conflicting options, --lookup/--draft without --model (or with synthetic
            weights), no usable GPU, or as `run_bench` and bench_speculative.run_speculative_row.
    """
    from .bench_speculative import check_speculative_options
    from .cuda import gpu_unavailable_reason

    speculative = check_speculative_options(args)
    check_bench_values(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, max_context=args.max_context,
                       seed=args.seed, prefill_reps=args.prefill_reps, prefill_chunk_rows=args.prefill_chunk_rows,
                       short_attention_below=args.short_attention_below)
    if args.trace and args.decode != "persistent":
        raise DrvqwenError("--trace traces the persistent kernel's ops: give --decode persistent too")
    if args.json:
        from .paths import check_output
        from .provenance import claimed_commit

        check_output(args.json, "the results", inputs={"the model": args.model})
        claimed_commit()  # the JSON names its commit: a malformed $DRVQWEN_SOURCE_COMMIT stops it now, not after the run
    prefill_attention_defines = parse_defines(args.prefill_attention_define, "--prefill-attention-define")
    check_prefill_attention_defines(prefill_attention_defines)
    persistent_defines = parse_defines(args.persistent_define)
    l2_prefetch_budget_bytes(args.l2_prefetch_mb)
    reason = gpu_unavailable_reason()   # before minutes of writing a synthetic model
    if reason is not None:
        raise DrvqwenError(f"drvqwen bench needs a Hopper GPU: {reason}")
    opened = None
    try:
        if args.model:
            from .loading import open_model

            opened = open_model(args.model, "cuda")     # as run opens it: converted, verified, GPU-ready
            path = opened.file.path
            check_preset_matches(args.preset, opened.file.config, args.model)
            if speculative:
                from .bench_speculative import check_real_weights

                check_real_weights(opened.file)         # before the plain modes' minutes
        else:
            path = ensure_synthetic(args.preset or "7b")
        modes = MODES if args.mode == "both" else (args.mode,)
        res = run_bench(path, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                        max_context=args.max_context or None, modes=modes, seed=args.seed,
                        use_prefill=not args.no_prefill, prefill_reps=args.prefill_reps, kernels=args.kernels,
                        prefill_gemm=args.prefill_gemm, prefill_rope=args.prefill_rope,
                        prefill_attention=args.prefill_attention, prefill_last_layer=args.prefill_last_layer,
                        prefill_attention_splits=args.prefill_attention_splits == "auto",
                        prefill_attention_late=args.prefill_attention_late == "auto",
                        prefill_kquant=args.prefill_kquant, prefill_q32=args.prefill_q32,
                        prefill_chunk_rows=args.prefill_chunk_rows, prefill_mixed_qkv=args.prefill_mixed_qkv,
                        prefill_attention_defines=prefill_attention_defines,
                        decode=args.decode, decode_attention=args.decode_attention,
                        short_attention_below=args.short_attention_below, l2_prefetch_mb=args.l2_prefetch_mb,
                        l2_prefetch_qkv=args.l2_prefetch_qkv,
                        persistent_blocks=args.persistent_blocks,
                        persistent_defines=persistent_defines, trace=args.trace)
        if speculative:
            from .bench_speculative import run_speculative_row

            err.print(f"speculative: {args.new_tokens} tokens of an edit prompt, plain then speculative …")
            res["speculative"] = run_speculative_row(opened, args, res["protocol"]["max_context"],
                                                     args.new_tokens)
    finally:
        if opened is not None:
            opened.file.close()
    print_table(res)
    if "kernels" in res:
        print_kernels(res)
    if "prefill_kernels" in res:
        print_kernels(res, key="prefill_kernels", what=f"{res['protocol']['prompt_tokens']}-token prefill")
    if "persistent_trace" in res:
        tr = res["persistent_trace"]
        err.print(f"persistent step, traced: {tr['step_us']:.1f} µs from the first item's start to the last release")
        for role, r in tr["roles"].items():
            err.print(f"  {role:<18} ×{r['count']:<3} span {r['span_us']:6.2f} µs  hand-off {r['handoff_us']:5.2f} µs  "
                      f"item {r['item_us']:5.2f} µs (slowest {r['item_max_us']:5.2f})  items {r['items']:.0f} "
                      f"(at most {r['most_on_one_sm']:.0f} on an SM at once)")
    if args.json:
        from .provenance import source_record

        res["source"] = source_record()
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        from .paths import atomic_write_bytes

        atomic_write_bytes(Path(args.json), json.dumps(res, indent=1).encode())  # a temp name, then renamed
        err.print(f"wrote {args.json}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` command to the CLI's subparsers (cli.build_parser)."""
    p = subparsers.add_parser("bench", help="decode speed: TTFT and ITL, eager vs CUDA graphs",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m drvqwen.bench`: user errors print one line and exit with status 2."""
    from .arg_parser import ArgumentParser

    ap = ArgumentParser(prog="python -m drvqwen.bench", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    try:
        return cmd_bench(ap.parse_args(argv))
    except DrvqwenError as e:
        err.print(error_line(str(e)), soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
