"""`drvqwen convert` and `drvqwen info`: writing a `.nanoqwen` file, and reading one.

    convert SOURCE -o OUT    an HF folder or a GGUF → OUT (format/convert.py), with a progress
                             bar and the tables of weight formats and reconstruction errors;
                             OUT's folder is checked before any work
    info FILE|NAME           the header, config and tensors of a file, or of a model that
                             `drvqwen list` names (cache.select: a conversion, or the newest
                             conversion of a download)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from rich.table import Table

from .console import make_console, progress_bar
from .errors import DrvqwenError


def cmd_convert(args) -> int:
    """`drvqwen convert`: write args.output from args.source; 0."""
    from .loading import convert_with_progress
    from .paths import atomic_write_bytes, check_output

    if not args.source.strip():  # Path("") is the current folder
        raise DrvqwenError("convert: SOURCE is empty: give a GGUF file or an HF checkpoint folder")
    out = check_output(args.output, "the converted model")
    _refuse_overwriting_the_source(Path(args.source), out)
    if args.report_json:
        rep = check_output(args.report_json, "the report", inputs={"the source": args.source})
        if rep.resolve() == out.resolve():
            raise DrvqwenError(f"{args.report_json}: is the converted model's file too; give another file for the report")
    report = convert_with_progress(Path(args.source), out, weights=args.weights, per_tensor=args.per_tensor)
    make_console(stderr=True).print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)", soft_wrap=True)
    if args.report_json:
        atomic_write_bytes(Path(args.report_json), json.dumps(   # whole or not at all
            [e.__dict__ | {"shape": list(e.shape)} for e in report.errors], indent=1).encode())
    return 0


def _refuse_overwriting_the_source(src: Path, out: Path) -> None:
    """Raise DrvqwenError when `out` is `src` or one of the files a conversion of `src` reads
    (a path to it, a link to it, a hard link of it): the conversion would replace its own
    input."""
    from .models import source_files

    if not src.exists():
        return  # the converter names a missing source
    try:
        inputs = source_files(src)
    except DrvqwenError:
        return  # not a source the converter takes: it says so
    out_r = out.resolve()
    for p in inputs:
        if p.resolve() == out_r or (out.exists() and p.exists() and os.path.samefile(p, out)):
            raise DrvqwenError(f"{out}: is the source {p} itself; write the conversion to another file")


def _shown_float(v: float) -> float:
    """A config float as people wrote it: a value that is a float32 widened to a double (a
    GGUF stores its floats as float32: rms_norm_eps 1e-06 arrives as 9.999999974752427e-07) by
    the shortest decimal of that float32; any other double as it is."""
    f32 = np.float32(v)
    return float(str(f32)) if float(f32) == v else v


def _quantization(f) -> str:
    """The file's quantization line: the INT4 layout of the default conversion, or, for a file
    of per-tensor formats, that (and the INT4 layout only where some weight uses it)."""
    from .format import weight_formats as wf

    h = f.header
    int4 = f"INT{h.quant_bits} symmetric, group {h.quant_group}, layout id {h.layout_id}"
    if f.has_default_formats:
        return int4
    uses_int4 = any(fid != wf.PLAIN and wf.FORMATS[fid].name == "int4_g128" for fid in f.formats.values())
    return "each weight in its own format (below)" + (f"; int4_g128: {int4}" if uses_int4 else "")


def _format_counts(f) -> str:
    """`int4_g128 ×168, dense ×2`: how many weights of the file are in each format."""
    from .format import weight_formats as wf

    counts: dict[str, int] = {}
    for fid in f.formats.values():
        name = "dense" if fid == wf.PLAIN else wf.FORMATS[fid].name
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items()))


def _bytes_per_token(f) -> str:
    """The weight bytes one decode token reads (every layer's weights, norms and biases,
    lm_head, one embedding row: format.tensor_set.bytes_per_token), next to the file size."""
    from .format.tensor_set import bytes_per_token

    b = bytes_per_token(((i.name, i.nbytes) for i in f.tensors.values()), f.config.vocab_size)
    return f"{b:,} B ({b / 1e6:.1f} MB; the file is {f.header.file_size / 1e6:.1f} MB)"


def cmd_info(args) -> int:
    """`drvqwen info`: the file's tables on stdout (--verify: its CRCs checked); 0.

    Raises:
        DrvqwenError: no such file or cache name, a name naming several entries or a download
            not converted yet, a bad file.
    """
    from . import cache
    from .format.nanoqwen import NanoqwenFile

    if not args.file.strip():  # Path("") is the current folder
        raise DrvqwenError("info: FILE is empty: give a .nanoqwen file or a name drvqwen list shows")
    path = Path(args.file)
    if not path.exists():
        entry = cache.select(args.file)
        if entry is None:
            raise DrvqwenError(f"{args.file}: no such file, and no model of that name in the cache (drvqwen "
                               f"list shows them; drvqwen pull NAME fetches one)")
        path = cache.nanoqwen_path(entry)
    f = NanoqwenFile(path)
    h = f.header
    c = f.config
    t = Table(title=f.path.name, caption=str(f.path), show_header=False)
    rows = [("format version", h.version), ("file size", f"{h.file_size:,} B"),
            ("quantization", _quantization(f)),
            ("weight formats", _format_counts(f)),
            ("weight bytes per decode token", _bytes_per_token(f)),
            ("tensors", h.n_tensors), ("tokenizer", f"{h.tokenizer_size:,} B (tokenizer.json)"),
            ("text vocabulary", f"ids 0..{f.text_vocab - 1} (rows from {f.text_vocab} on are never chosen)"
             if f.text_vocab < c.vocab_size else f"all {c.vocab_size} ids"),
            ("end of generation", " ".join(map(str, sorted(f.eog_ids))) or "none")]
    rows += [(k, _shown_float(v) if isinstance(v, float) else v) for k, v in c.to_dict().items()]
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
        err = make_console(stderr=True)
        with progress_bar(console=err) as p:
            task = p.add_task("verifying CRC32", total=h.n_tensors)
            f.verify_data(progress=lambda info: p.advance(task))
        from .models import remember_verified

        remember_verified(f.path)   # `drvqwen run` need not check this file again
        err.print("all tensor checksums match", style="green")
    return 0


def register(sub) -> None:
    """Add `convert` and `info` to the CLI's subcommands."""
    c = sub.add_parser("convert", help="HF folder or GGUF → .nanoqwen (a GGUF's own formats, or INT4 g128)")
    c.add_argument("source", help="HF checkpoint folder (config.json, *.safetensors, tokenizer.json) or GGUF file")
    c.add_argument("-o", "--output", required=True, help="the .nanoqwen file to write")
    from .format import DEFAULT_WEIGHTS, WEIGHT_POLICIES

    c.add_argument("--weights", choices=WEIGHT_POLICIES, default=DEFAULT_WEIGHTS,
                   help=f"source: a GGUF's tensors kept in formats that hold their values exactly, so the "
                        f"model answers as the file does; int4: every projection re-quantized to INT4 g128, "
                        f"embedding and lm_head FP16 (faster on the GPU today). An HF checkpoint becomes "
                        f"INT4 g128 under either (docs/quantization.md). Default: {DEFAULT_WEIGHTS}")
    c.add_argument("--per-tensor", action="store_true", help="print the error of every tensor")
    c.add_argument("--report-json", help="write per-tensor quantization errors as JSON")
    c.set_defaults(fn=cmd_convert)

    i = sub.add_parser("info", help="print a .nanoqwen file's header, config and tensors")
    i.add_argument("file", metavar="FILE|NAME",
                   help="a .nanoqwen file, or a model drvqwen list shows (a download: its conversion)")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument("--verify", action="store_true", help="check every tensor's CRC32")
    i.set_defaults(fn=cmd_info)

