"""The `drvqwen` command line: run, pull, convert, info.

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

    path = pull(progress=True)
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


def cmd_run(args) -> int:
    from .generate import CPUBackend, generate
    from .models import resolve_model
    from .sampler import SamplingParams
    from .tokenizer import DEFAULT_SYSTEM, StreamDecoder, Tokenizer

    if args.prompt is None and args.prompt_file is None and args.fim_prefix is None:
        raise DrvqwenError("give --prompt TEXT, --prompt-file FILE or --fim-prefix/--fim-suffix")
    if args.max_new_tokens < 0:
        raise DrvqwenError(f"--max-new-tokens={args.max_new_tokens}: must be >= 0")
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise DrvqwenError(str(e)) from None
    from .text_input import checked_arg, read_text_file

    # Every piece of user text passes the same UTF-8 check, whichever way it came in.
    for opt in ("prompt", "system", "fim_prefix", "fim_suffix"):
        v = getattr(args, opt)
        if v is not None:
            setattr(args, opt, checked_arg(v, "--" + opt.replace("_", "-")))
    text = read_text_file(args.prompt_file) if args.prompt_file else args.prompt
    generating = args.max_new_tokens > 0
    # The device first: `--device cuda` without a GPU fails before any model work.
    device, why = _choose_device(args.device) if generating else ("cpu", None)
    f = resolve_model(args.model, on_convert=_convert_with_progress,
                      verify=_verify_with_progress if generating and not args.no_verify else None,
                      say=lambda m: err.print(f"[yellow]{m}", soft_wrap=True),
                      hash_progress=_hash_progress)
    tok = Tokenizer.from_json(f.tokenizer_json, source=str(f.path))
    # User text is plain text: only the template's own markers become control ids. --raw
    # is the one place where special tokens written in the prompt are parsed, on purpose.
    if args.fim_prefix is not None or args.fim_suffix is not None:
        ids = tok.fim(args.fim_prefix or "", args.fim_suffix or "")
    elif args.raw:
        ids = tok.encode(text, special=True)
    else:
        # `is None`, not truthiness: --system "" asks for an empty system turn.
        ids = tok.chat(text, system=DEFAULT_SYSTEM if args.system is None else args.system)
    from .generate import GenerationResult, check_prompt_fits, check_prompt_ids, resolve_max_context

    # One rule for both devices: the context is the model's, or less, never silently capped.
    max_context = resolve_max_context(args.max_context, f.config.max_position)
    check_prompt_fits(len(ids), max_context, str(f.path), f.config.max_position)
    check_prompt_ids(ids, f.config.vocab_size, str(f.path))
    if not generating:
        # Nothing to generate: the prompt's length is the whole answer; no weights are loaded.
        err.print(f"[dim]{GenerationResult(prompt_tokens=len(ids)).summary()}")
        return 0

    if device == "cuda":
        from .engine import check_gpu_supports

        try:
            check_gpu_supports(f)
        except DrvqwenError as e:
            if args.device == "cuda":
                raise
            device, why = "cpu", str(e).split(": ", 1)[-1]
    if device == "cpu":
        err.print(f"[yellow]running the numpy reference backend on the CPU ({why})")
        with _progress() as p:
            task = p.add_task("dequantizing weights", total=f.config.num_layers)
            # The CPU cache holds only what this run can use: prompt + new tokens.
            backend = CPUBackend(f, max_context, progress=lambda i, n: p.update(task, completed=i),
                                 cache_tokens=len(ids) + args.max_new_tokens)
    else:  # pragma: no cover - needs a Hopper GPU (tests/test_engine_gpu.py covers the backend)
        from .engine import GPUBackend

        total = sum(i.nbytes for i in f)
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeElapsedColumn(), console=err) as p:
            task = p.add_task("uploading weights", total=total)
            backend = GPUBackend(f, max_context, use_graphs=not args.eager,
                                 progress=lambda done, n: p.update(task, completed=done, total=n))

    stream = StreamDecoder(tok)
    out = sys.stdout

    def on_token(t: int) -> None:
        s = stream.push(t)
        if s:
            out.write(s)
            out.flush()

    try:
        res = generate(backend, ids, args.max_new_tokens, params, f.eog_ids, on_token,
                       ignore_stop=args.ignore_eos)
        mode = getattr(backend, "decode_mode", None)   # read before close(): graph or eager
    finally:
        if hasattr(backend, "close"):
            backend.close()
    tail = stream.flush()
    out.write(tail + "\n")
    out.flush()
    if res.stopped_by == "context full":
        err.print(f"[yellow]warning: the context of {max_context} tokens is full: generation ended "
                  f"after {len(res.tokens)} of --max-new-tokens={args.max_new_tokens} "
                  f"(raise --max-context; the model allows {f.config.max_position})", soft_wrap=True)
    name = f"{backend.name}, {mode} decode" if mode else backend.name
    err.print(f"[dim]{name}: {res.summary()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="drvqwen", description="Qwen2.5-Coder inference on NVIDIA Hopper, annotated.",
        epilog="Models, converted files and compiled kernels are cached under $DRVQWEN_CACHE "
               "(default ~/.cache/drvqwen).")
    ap.add_argument("--version", action="version", version=f"drvqwen {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")

    r = sub.add_parser("run", help="generate text (GPU when a Hopper GPU is present, else the CPU reference)")
    r.add_argument("--model", help=".nanoqwen file, HF folder or GGUF (default: the real Qwen2.5-Coder-0.5B-Instruct)")
    r.add_argument("--prompt", help="the user message (chat template; encoded as plain text) or the "
                                    "whole prompt with --raw")
    r.add_argument("--prompt-file", help="read the prompt from a file (UTF-8, bytes as they are)")
    r.add_argument("--system", help="system message for the chat template (plain text; \"\" = an "
                                    "empty system turn; default: Qwen's)")
    r.add_argument("--raw", action="store_true",
                   help="plain completion, no chat template; special tokens written in the prompt "
                        "(<|im_start|> …) ARE parsed as control ids, so you can write your own template")
    r.add_argument("--fim-prefix", help="fill-in-the-middle: the code before the hole (plain text)")
    r.add_argument("--fim-suffix", help="fill-in-the-middle: the code after the hole (plain text)")
    r.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=0, help="0 = off")
    r.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    r.add_argument("--seed", type=int, default=0, help="seed of the sampler's Philox stream (default: 0)")
    r.add_argument("--max-context", type=int, default=0,
                   help="context length in tokens, at most the model's max_position (default 0: all of it)")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: a Hopper GPU when present, else the numpy reference on the CPU")
    r.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's end-of-generation tokens (drvqwen info lists them)")
    r.add_argument("--no-verify", action="store_true",
                   help="skip the one-time CRC32 check of the model's tensor data (faster first "
                        "start; a damaged file then gives garbage instead of an error)")
    r.add_argument("--eager", action="store_true",
                   help="GPU: launch the decode kernels one by one instead of replaying CUDA graphs")
    r.set_defaults(fn=cmd_run)

    p = sub.add_parser("pull", help="download the real Qwen2.5-Coder-0.5B-Instruct GGUF into the cache")
    p.set_defaults(fn=cmd_pull)

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
