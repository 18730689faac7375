"""From a `--model` argument to a ready backend: the one path of run, chat, step, serve, eval
and bench.

    open_model(model, device)     choose the device first (`choose_device`: --device, a usable
                                  Hopper GPU, the GPU engine importable), so that `--device cuda`
                                  without one fails before any model work
                                  → resolve (models.resolve_model: a .nanoqwen, an HF folder, a
                                  GGUF or a repo id, converted once, with progress; or a name
                                  `drvqwen list` shows: `model_argument`)
                                  → verify its tensor CRCs (once per file)
                                  → GPU or CPU fallback (engine.check_gpu_supports: a model the
                                  kernels cannot run goes to the CPU, with the reason; with
                                  --device cuda it is refused instead)
                                  → an OpenedModel: the file, the device, why not the GPU
    load_backend(opened, …)       the GPU engine or the CPU reference (`build_backend`), with a
                                  progress bar → a generate.Backend

    load_draft(model, target, …)  a speculative draft model (--draft): the same path, the
                                  target's device, its tokenizer checked against the target's

`drvqwen step` builds its own machine from the OpenedModel (step/), `drvqwen serve` builds the
backend on its worker thread (`build_backend`), `drvqwen bench` its decode step (bench.py).
Messages and progress bars go to stderr: stdout carries only what a command prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from . import startup
from .console import make_console, progress_bar
from .errors import DrvqwenError
from .format.nanoqwen import NanoqwenFile
from .stats import RunStats, phase

# The one-time CRC check of a model is reported when it took at least this long (a real
# model: ~0.5 s for 735 MB); a test model's milliseconds are not worth a line.
VERIFY_REPORT_MIN_S = 0.1
# Hashing a source shows a progress bar from this size on (a 15 GB checkpoint takes ~15 s).
HASH_PROGRESS_MIN_BYTES = 64 << 20


def _err():
    return make_console(stderr=True)


@dataclass
class OpenedModel:
    """A validated model file and where it runs.

    Attributes:
        file: the `.nanoqwen`, header, table and config validated (tensor CRCs too, unless
            skipped).
        device: "cuda" or "cpu".
        why_cpu: why the GPU is not used ("--device cpu", "no CUDA driver", a file the GPU
            kernels cannot run …); None on the GPU, or when no device was chosen.
    """

    file: NanoqwenFile
    device: str
    why_cpu: str | None = None

    def say_cpu(self, doing: str = "running the numpy reference backend", note: str = "") -> None:
        """`<doing> on the CPU (<why_cpu>)<note>`, in yellow on stderr."""
        _err().print(f"{doing} on the CPU ({self.why_cpu}){note}", style="yellow", soft_wrap=True)


def choose_device(requested: str) -> tuple[str, str | None]:
    """("cuda" | "cpu", the reason the GPU is not used or None) for --device `requested`.

    Raises:
        DrvqwenError: --device cuda, and no usable GPU (names the reason).
    """
    from .cuda import warmup

    if requested == "cpu":
        warmup.join_started()          # a warm-up the entry point began: no context held for a CPU run
        warmup.release()
        return "cpu", "--device cpu"

    warming = warmup.start_driver()    # cuInit and the primary context while numpy and the rest import
    # The GPU engine's imports (numpy, the launchers, ~100 ms) run while the driver starts in
    # its thread, before the wait for it, unless the measurement switch puts them after it
    # (startup.py). A run that finds no GPU pays them for nothing; one that finds it waits
    # that much less for the driver.
    overlapped = startup.switch(startup.ENGINE_IMPORT) == "overlapped"
    engine_error: ImportError | None = None
    try:
        with phase("import"):
            from .cuda.device import gpu_unavailable_reason
            if overlapped:
                engine_error = _import_engine()
        with phase("context"):         # what is left of the driver's start, and the probe of the device
            warming.join()
            reason = gpu_unavailable_reason()
    except ImportError as e:
        reason = f"GPU layer unavailable ({e})"
    finally:
        warming.join()
    if reason is None:
        if not overlapped:
            with phase("import"):
                engine_error = _import_engine()
        if engine_error is not None:
            reason = f"the GPU engine cannot be imported ({engine_error})"
    if reason is not None:
        warmup.release()               # a CPU run holds no GPU context
    if requested == "cuda" and reason is not None:
        raise DrvqwenError(f"--device cuda: {reason}")
    return ("cpu", reason) if reason else ("cuda", None)


def _import_engine() -> ImportError | None:
    """Import the GPU engine; the ImportError if it cannot be."""
    try:
        from . import engine  # noqa: F401
    except ImportError as e:
        return e
    return None


def _gpu_or_fallback(requested: str, device: str, why: str | None, f: NanoqwenFile) -> tuple[str, str | None]:
    """(device, why) once the model is open: a model the GPU kernels cannot run (a per-tensor
    weight format, YaRN) falls back to the CPU with the reason, unless --device cuda asked for
    the GPU, which then raises that DrvqwenError."""
    if device == "cuda":
        from .engine import check_gpu_supports

        try:
            check_gpu_supports(f)
        except DrvqwenError as e:
            if requested == "cuda":
                raise
            device, why = "cpu", str(e).split(": ", 1)[-1]
            from .cuda import warmup

            warmup.release()           # the run goes to the CPU: no GPU context held for it
    return device, why


def open_model(model: str | None, device: str | None = "auto", *, verify: bool = True,
               stats: RunStats | None = None) -> OpenedModel:
    """The model of a --model argument, validated, and the device it runs on (module doc).

    Args:
        model: the --model value (None: the default model).
        device: --device ("auto", "cpu", "cuda"); None: no device is chosen (the file alone,
            e.g. to count a prompt's tokens): device "cpu", why_cpu None.
        verify: check the tensor CRCs (once per file: models.verify_once).
        stats: adds the phases "read" (resolve, convert, validate) and "verify" (timed inside
            "read", counted apart: stats.RunStats.timed).
    Raises:
        DrvqwenError: --device cuda without a usable GPU, or for a model the GPU kernels cannot
            run; a bad or missing model (models.resolve_model).
    """
    from .models import resolve_model

    stats = RunStats() if stats is None else stats
    chosen, why = choose_device(device) if device is not None else ("cpu", None)

    def check(f: NanoqwenFile) -> None:
        with stats.timed("verify"):
            verify_with_progress(f)

    def convert_into_cache(src: Path, dst: Path) -> None:
        _err().print(f"converting {src} → {dst}", soft_wrap=True)
        convert_with_progress(src, dst)

    with stats.timed("read"):
        f = resolve_model(model_argument(model), on_convert=convert_into_cache, verify=check if verify else None,
                          say=lambda m: _err().print(m, style="yellow", soft_wrap=True),
                          hash_progress=hash_progress)
    if device is not None:
        chosen, why = _gpu_or_fallback(device, chosen, why, f)
    return OpenedModel(f, chosen, why)


def model_argument(model: str | None) -> str | None:
    """`model` as models.resolve_model takes it: a path that exists, a repo id `owner/name[:TAG]`
    and None stay as they are; a name `drvqwen list` shows (or the start of one naming only it,
    cache.select) becomes the path of that entry: the conversion, or the download to convert.

    Raises:
        DrvqwenError: the name selects several entries (names them); an empty name.
    """
    from . import cache, hub

    if model is not None and not model.strip():  # Path("") is the current folder
        raise DrvqwenError("--model is empty: give a file, a repo id or a name drvqwen list shows")
    if model is None or Path(model).expanduser().exists() or hub.parse_name(model) is not None:
        return model
    try:
        found = cache.entries()
    except DrvqwenError:        # no cache root can be made, so no name is in it
        return model
    entry = cache.select(model, found)
    return model if entry is None else str(cache.model_path(entry))


def build_backend(f: NanoqwenFile, device: str, max_context: int, *, cache_tokens: int | None = None,
                  eager: bool = False, progress=None, speculative: bool = False):
    """The GPU engine (device "cuda") or the CPU reference for `f`, on the calling thread.

    Args:
        max_context: the context in tokens (0 or None: the model's max_position).
        cache_tokens: CPU: KV positions to allocate, when fewer than max_context will be used.
        eager: GPU: launch the decode kernels one by one instead of replaying CUDA graphs.
        progress: progress(done, total): bytes uploaded (GPU) or layers dequantized (CPU).
        speculative: GPU: the backend will verify speculative proposals (--lookup, --draft):
            the verify pass and the decode step it matches bit for bit (engine.GPUBackend). The
            CPU backend is the same either way.
    Raises:
        DrvqwenError: the model and its cache do not fit (GPU memory, or the CPU's RAM).
    """
    if device == "cuda":  # pragma: no cover - needs a Hopper GPU (test_engine_gpu.py)
        from .engine import GPUBackend

        return GPUBackend(f, max_context, use_graphs=not eager, progress=progress, speculative=speculative)
    from .generate import CPUBackend

    return CPUBackend(f, max_context, progress=progress, cache_tokens=cache_tokens)


def load_backend(opened: OpenedModel, max_context: int, *, cache_tokens: int | None = None,
                 eager: bool = False, stats: RunStats | None = None, note: str = "", speculative: bool = False):
    """`build_backend` for `opened` with a progress bar on stderr, the CPU's reason said first
    (followed by `note`); stats gets the phase "load". Raises as `build_backend`."""
    f, stats = opened.file, RunStats() if stats is None else stats
    with stats.timed("load"):
        if opened.device == "cpu":
            opened.say_cpu(note=note)
            with progress_bar() as p:
                task = p.add_task("dequantizing weights", total=f.config.num_layers)
                return build_backend(f, "cpu", max_context, cache_tokens=cache_tokens, speculative=speculative,
                                     progress=lambda i, n: p.update(task, completed=i))
        with progress_bar(in_bytes=True) as p:  # pragma: no cover - needs a Hopper GPU
            task = p.add_task("uploading weights", total=sum(i.nbytes for i in f))
            return build_backend(f, "cuda", max_context, eager=eager, speculative=speculative,
                                 progress=lambda done, n: p.update(task, completed=done, total=n))


def check_same_tokenizer(target: NanoqwenFile, draft: NanoqwenFile) -> None:
    """Refuse a draft model whose token ids mean other text than the target's.

    Raises:
        DrvqwenError: the vocabularies (tokens and their ids, special tokens included) or the
            text vocabulary sizes differ (names the draft file).
    """
    same = target.tokenizer_json == draft.tokenizer_json
    if not same and target.text_vocab == draft.text_vocab:
        import tokenizers

        def vocab(f: NanoqwenFile) -> dict[str, int]:
            return tokenizers.Tokenizer.from_str(f.tokenizer_json).get_vocab(with_added_tokens=True)

        same = vocab(target) == vocab(draft)
    if not same or target.text_vocab != draft.text_vocab:
        raise DrvqwenError(f"{draft.path}: its tokenizer is not the one of {target.path} (a draft model must "
                           f"use the target's token ids)")


def load_draft(model: str, target: OpenedModel, max_context: int, *, cache_tokens: int | None = None,
               eager: bool = False, verify: bool = True, stats: RunStats | None = None):
    """The draft model of speculative decoding (`--draft MODEL`), loaded beside the target:
    resolved like --model (`open_model`), on the target's device, with a KV cache as long as
    the target's (capped at the draft's own max_position). Returns (backend, file name).

    Raises:
        DrvqwenError: as `open_model` and `load_backend`; a tokenizer that is not the target's
            (`check_same_tokenizer`).
    """
    opened = open_model(model, target.device, verify=verify, stats=stats)
    check_same_tokenizer(target.file, opened.file)
    f = opened.file
    backend = load_backend(opened, min(max_context, f.config.max_position), cache_tokens=cache_tokens,
                           eager=eager, stats=stats, note=" (draft model)")
    return backend, Path(f.path).name


# ---- what the path shows on the way -------------------------------------------------------------

def convert_with_progress(src: Path, dst: Path, weights: str | None = None, per_tensor: bool = False):
    """Convert `src` to `dst` (format.convert) with a progress bar, then the tables of weight
    formats and reconstruction errors (`print_quant_summary`); returns the report. weights:
    the policy (format.convert.WEIGHT_POLICIES), None for DEFAULT_WEIGHTS.

    Raises:
        DrvqwenError: a bad source (before the bar is drawn); a folder that cannot take the
            file or has no room for it.
    """
    from .format.convert import DEFAULT_WEIGHTS, check_destination, convert, open_source, plan_formats

    err = _err()
    weights = weights or DEFAULT_WEIGHTS
    src = open_source(src)          # bad input fails here, before a progress bar is drawn
    check_destination(src, dst, formats=plan_formats(src, src.config, weights))   # a full disk too
    with progress_bar(console=err) as p:
        task = p.add_task("quantizing", total=None)

        def cb(name, done, total):
            p.update(task, completed=done, total=total, description=f"{name[:48]:<48}")

        report = convert(src, dst, progress=cb, weights=weights)
    print_quant_summary(report, per_tensor)
    return report


# What each policy followed means for the source converted (format.weights_followed).
_POLICY_WORDS = {("source", "gguf"): "the GGUF's tensors in their own formats",
                 ("int4", "gguf"): "projections re-quantized to INT4 g128, embedding and lm_head FP16",
                 ("int4", "hf"): "projections INT4 g128, embedding and lm_head FP16: an HF checkpoint "
                                 "has no blocks to keep"}


def print_quant_summary(report, per_tensor: bool = False) -> None:
    """On stderr: the policy followed, source type → drvqwen format (how many weights, bits per
    weight, exact or re-quantized), the bytes one decode token reads, and the reconstruction
    error by projection (or of every tensor)."""
    err = _err()
    err.print(f"weights: {report.weights} ({_POLICY_WORDS[report.weights, report.source_kind]})", soft_wrap=True)
    t = Table(title="weight formats (source type → drvqwen format)")
    for c in ("source", "format", "weights", "bits/weight", "values"):
        t.add_column(c)
    for row in report.mapping.values():
        bpw = "16 (fp16)" if row.bits_per_weight is None else f"{row.bits_per_weight:g}"
        t.add_row(row.source_type, row.format_name, str(row.count), bpw,
                  "exact" if row.exact else "re-quantized")
    err.print(t)
    for tensor, ty, fmt in report.fallbacks:
        err.print(f"{tensor}: GGUF type {ty} has no exact drvqwen format: re-quantized to {fmt}", soft_wrap=True)
    err.print(f"weight bytes read per decode token: {report.bytes_per_token / 1e6:.1f} MB")
    t = Table(title="reconstruction error (‖W−Ŵ‖/‖W‖; 0 where the source's values are kept)", show_lines=False)
    if per_tensor:
        for c in ("tensor", "shape", "rel L2", "max |err|", "SNR dB"):
            t.add_column(c, justify="right" if c != "tensor" else "left")
        for e in report.errors:
            t.add_row(e.name, "×".join(map(str, e.shape)), f"{e.rel_l2:.4f}", f"{e.max_abs:.3g}", f"{e.snr_db:.1f}")
    else:
        for c in ("projection", "mean rel L2", "worst rel L2"):
            t.add_column(c)
        for proj, d in report.summary_by_projection().items():
            t.add_row(proj, f"{d['mean_rel_l2']:.4f}", f"{d['max_rel_l2']:.4f}")
    err.print(t)


def verify_with_progress(f: NanoqwenFile) -> None:
    """Check the tensor CRCs of `f` once per file (models.verify_once), showing the cost.

    Raises:
        FormatError: a tensor's data does not match its CRC (names the file and tensor).
    """
    from .models import is_verified, verify_once

    if is_verified(f.path):
        return
    err = _err()
    with progress_bar(in_bytes=True, transient=True, console=err) as p:
        task = p.add_task("verifying tensor CRC32s", total=None)
        secs = verify_once(f, progress=lambda done, total: p.update(task, completed=done, total=total))
    if secs is not None and secs >= VERIFY_REPORT_MIN_S:
        size = sum(i.nbytes for i in f)
        err.print(f"verified {size / 2**20:.0f} MiB of tensor data in {secs:.2f} s "
                  f"(once per file; --no-verify skips it)", style="dim", soft_wrap=True)


def hash_progress(path: Path):
    """A progress callback(done, total) for hashing `path` the first time, or None for a
    source smaller than HASH_PROGRESS_MIN_BYTES (or one that cannot be read)."""
    try:
        size = path.stat().st_size
    except OSError:
        return None
    if size < HASH_PROGRESS_MIN_BYTES:
        return None
    state = {}

    def cb(done: int, total: int) -> None:
        if "p" not in state:
            state["p"] = progress_bar(in_bytes=True, transient=True)
            state["p"].start()
            state["task"] = state["p"].add_task(f"hashing {path.name}", total=total)
        state["p"].update(state["task"], completed=done)
        if done >= total:
            state["p"].stop()

    return cb
