"""`drvqwen convert`: an HF checkpoint folder or a GGUF file → one `.nanoqwen` file.

Two weight policies (docs/quantization.md); DEFAULT_WEIGHTS (`source`) is the one used when
none is named:
- `int4`: the seven projections of every layer are quantized to INT4 g128
  (format/quant.py); embedding, norms, biases and lm_head are stored as FP16. The GPU's
  fastest formats today.
- `source` (a GGUF): every quantized tensor keeps its GGUF blocks' values in the format that
  holds them exactly (format/weight_formats.py, gguf_blocks.py) — projections, embedding and
  lm_head alike; F16 matrices stay dense FP16 and F32 vectors stay F32. Types without such a
  format are re-quantized (F32/BF16 projections to INT4 g128, other quantized types to 8 bits,
  group 32) and reported so, by tensor and type (ConvertReport.fallbacks).
  From an HF folder `source` is `int4` (format.weights_followed): a bf16 checkpoint has no
  blocks to keep; the report says `int4`.
Tensors are streamed one at a time, so peak host memory is one source tensor in float32 plus
its packed copy, not the model twice.

Sources (HF folder, GGUF file) are in sources.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import QwenConfig
from ..errors import DrvqwenError, FormatError
from ..paths import ensure_free_space, ensure_writable
from . import DEFAULT_WEIGHTS, WEIGHT_POLICIES, gguf_blocks, quant, weights_followed
from . import weight_formats as wf
from .sources import _PLAIN_FLOAT_TYPES, GGUFSource, HFSource, gguf_name, hf_source_files, open_source  # noqa: F401
from .nanoqwen import vocab_facts
from .tensor_set import (ATTN_PROJ, EMBED, LM_HEAD, MLP_PROJ, bytes_per_token, default_formats, expected_tensors,
                         weight_shapes)
from .nanoqwen_writer import NanoqwenWriter, estimated_file_size


FP16_MAX = 65504.0
# Rows of a weight checked against its source at a time (_write_weight): 8192 rows of the 7B's
# 3584 inputs are 235 MB in float64.
CHECK_ROWS = 8192


@dataclass
class TensorError:
    """Reconstruction error of one quantized projection (quant.reconstruction_error)."""

    name: str
    shape: tuple[int, int]
    rel_l2: float
    max_abs: float
    snr_db: float


@dataclass
class MappingRow:
    """How many weights of one source type went into one format, and whether exactly."""

    source_type: str
    format_name: str
    count: int
    exact: bool
    bits_per_weight: float | None      # None: dense


@dataclass
class ConvertReport:
    path: Path
    config: QwenConfig
    source_kind: str
    weights: str                       # the policy followed (format.weights_followed): "int4" or "source"
    errors: list[TensorError] = field(default_factory=list)
    mapping: dict[tuple[str, str], MappingRow] = field(default_factory=dict)
    # Weight bytes one decode token reads: every layer's weights, norms, biases, lm_head, and
    # one embedding row (the file's own sizes; tensor_set.bytes_per_token).
    bytes_per_token: int = 0
    # Weights of the `source` policy whose GGUF type has no exact format: (GGUF tensor name,
    # its type, the format it was re-quantized to).
    fallbacks: list[tuple[str, str, str]] = field(default_factory=list)

    def note(self, source_type: str, fmt: wf.WeightFormat | None, exact: bool) -> None:
        key = (source_type, fmt.name if fmt else "dense")
        row = self.mapping.setdefault(key, MappingRow(source_type, key[1], 0, exact,
                                                      fmt.bits_per_weight if fmt else None))
        row.count += 1

    def summary_by_projection(self) -> dict[str, dict[str, float]]:
        """Mean and worst relative L2 error per projection type across layers."""
        out: dict[str, dict[str, float]] = {}
        for proj in ATTN_PROJ + MLP_PROJ:
            rel = [e.rel_l2 for e in self.errors if e.name.endswith(f".{proj}")]
            if rel:
                out[proj] = {"mean_rel_l2": float(np.mean(rel)), "max_rel_l2": float(np.max(rel))}
        return out


# ---------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------
def source_name(source) -> str:
    """The path a source reads (GGUF file or HF folder), for messages."""
    return str(getattr(source, "path", None) or getattr(source, "folder", None) or source)


def _fp16(name: str, a: np.ndarray, src) -> np.ndarray:
    m = float(np.max(np.abs(a))) if a.size else 0.0
    if not np.isfinite(m) or m > FP16_MAX:
        raise FormatError(f"{source_name(src)}: tensor {name} has "
                          f"values (max |x| = {m:g}) that FP16 cannot hold")
    return a.astype(np.float16)


def check_tokenizer_fits(source, cfg: QwenConfig) -> None:
    """Refuse a tokenizer with ids past the model's rows: those ids would index no embedding.

    Raises:
        FormatError: names the source, the largest id and the row count.
    """
    from ..tokenizer import Tokenizer

    n = Tokenizer.from_json(source.tokenizer_json, source=source_name(source)).text_vocab_size
    if n > cfg.vocab_size:
        raise FormatError(f"{source_name(source)}: the tokenizer has ids up to {n - 1}, the model's "
                          f"embedding only {cfg.vocab_size} rows")


def check_destination(source, out: Path, cfg: QwenConfig | None = None,
                      formats: dict[str, int] | None = None) -> None:
    """What can be known before the first tensor is quantized: `out`'s folder takes files and
    has room for the converted model (format.nanoqwen_writer.estimated_file_size).

    Raises:
        DrvqwenError: it does not (names the folder and what is needed).
    """
    cfg = source.config if cfg is None else cfg
    folder = out.parent if str(out.parent) else Path(".")
    ensure_writable(folder, "the converted model")
    ensure_free_space(folder, estimated_file_size(cfg, len(source.tokenizer_json.encode("utf-8")), formats),
                      f"converting to {out.name}")


def plan_formats(source, cfg: QwenConfig, weights: str = DEFAULT_WEIGHTS) -> dict[str, int]:
    """Weight prefix → format id for converting `source` under the policy `weights` (module doc).

    Raises:
        DrvqwenError: an unknown policy.
    """
    if weights not in WEIGHT_POLICIES:
        raise DrvqwenError(f"--weights {weights!r}: choose one of {', '.join(WEIGHT_POLICIES)}")
    formats = default_formats(cfg)
    if weights_followed(weights, source.kind) == "int4":
        return formats
    for prefix, (_, k) in weight_shapes(cfg).items():
        ty = source.type_name(prefix + ".weight")
        exact = gguf_blocks.exact_format(ty)
        if exact is not None and exact.fits(k):
            formats[prefix] = exact.id
        elif ty == "F16":
            formats[prefix] = wf.PLAIN              # kept as it is: dense FP16, the GPU reads it so too
        elif ty not in _PLAIN_FLOAT_TYPES + ("BF16",):
            formats[prefix] = wf.Q8_G32.id          # blocks of their own: re-quantized at 8 bits
    return formats


def _dense_dtype(source, name: str, weights: str) -> np.dtype:
    """FP32 for an F32 GGUF vector under the `source` policy followed (kept exactly), else FP16."""
    if weights == "source" and source.type_name(name) == "F32" \
            and not name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return wf.F32
    return wf.F16


def _source_type(source, name: str) -> str:
    return source.type_name(name) if source.kind == "gguf" else "HF"


def _write_weight(w: NanoqwenWriter, source, prefix: str, fid: int, report: ConvertReport, weights: str) -> None:
    """Convert one quantized weight into format `fid`, write its parts, record error and mapping
    (`weights`: the policy followed)."""
    fmt = wf.FORMATS[fid]
    ty = _source_type(source, prefix + ".weight")
    wf32 = source.get(prefix + ".weight")
    if not np.isfinite(wf32).all():
        raise FormatError(f"{source_name(source)}: tensor {prefix}.weight has NaN/Inf values")
    exact = source.kind == "gguf" and gguf_blocks.exact_format(ty) is fmt
    if weights == "source" and not exact and ty not in _PLAIN_FLOAT_TYPES + ("BF16",):
        report.fallbacks.append((gguf_name(prefix + ".weight"), ty, fmt.name))
    if exact:
        _, p = source.blocks(prefix)
        parts = wf.pack_codes(fmt, p.pop("codes")) | p
    else:
        parts = wf.quantize_dense(fmt, wf32)
    for part, arr in parts.items():
        w.add(f"{prefix}.{part}", arr, format_id=fid)
    # Compared a block of rows at a time (every part is [N, …]): a whole embedding dequantized
    # again, and its float64 difference, would more than double the conversion's peak memory.
    e = quant.reconstruction_error_rows(
        (wf32[r:r + CHECK_ROWS], wf.dequantize_weight(fmt, lambda n: parts[n.rsplit(".", 1)[1]][r:r + CHECK_ROWS], prefix))
        for r in range(0, wf32.shape[0], CHECK_ROWS))
    if exact and e["max_abs"] != 0.0:
        raise FormatError(f"{source_name(source)}: tensor {prefix}.weight: the {fmt.name} copy of its "
                          f"{ty} blocks differs from gguf's dequantization (max |err| {e['max_abs']:g})")
    report.errors.append(TensorError(prefix, tuple(wf32.shape), **e))
    report.note(ty, fmt, exact)


def convert(src: str | Path, out: str | Path, progress: Callable[[str, int, int], None] | None = None,
            num_layers: int | None = None, weights: str = DEFAULT_WEIGHTS) -> ConvertReport:
    """Convert `src` (HF folder or GGUF file, or a source from `open_source`) into the
    `.nanoqwen` file `out`.

    progress: called as progress(tensor_name, done, total) after each tensor.
    num_layers: convert only the first layers (for tests).
    weights: "source" (the default: a GGUF's tensors kept in the formats that hold them
        exactly; plan_formats) or "int4" (every projection INT4 g128, the rest FP16). An HF
        checkpoint becomes INT4 under either; ConvertReport.weights says which was followed.
    Raises DrvqwenError subclasses (FormatError, ConfigError) naming the file and field;
    on any error `out` is left untouched (the writer renames a temp file at the very end).
    """
    source = open_source(src) if isinstance(src, (str, Path)) else src
    cfg = source.config if num_layers is None else source.config.with_layers(num_layers)
    out = Path(out)
    formats = plan_formats(source, cfg, weights)
    weights = weights_followed(weights, source.kind)
    check_destination(source, out, cfg, formats)
    report = ConvertReport(out, cfg, source.kind, weights)
    want = expected_tensors(cfg, formats)
    # One step per dense tensor and per quantized weight (its parts are written together).
    steps = [n for n in want if wf.weight_prefix(n) is None or n.endswith(".qweight")]
    text_vocab, eog = vocab_facts(source.tokenizer_json, cfg.vocab_size, getattr(source, "eos_ids", ()))
    check_tokenizer_fits(source, cfg)
    with NanoqwenWriter(out, cfg, source.tokenizer_json, eog_ids=eog, text_vocab=text_vocab) as w:
        for n_done, name in enumerate(steps, 1):
            prefix = wf.weight_prefix(name)
            if prefix is not None:
                _write_weight(w, source, prefix, formats[prefix], report, weights)
            else:
                dt = _dense_dtype(source, name, weights)
                a = source.get(name)
                w.add(name, a.astype(np.float32) if dt == wf.F32 else _fp16(name, a, source))
                if name.endswith(".weight") and name[:-7] in (EMBED, LM_HEAD):
                    report.note(_source_type(source, name), None, _source_type(source, name) == "F16")
            if progress:
                progress(name, n_done, len(steps))
    report.bytes_per_token = bytes_per_token(((i.name, i.nbytes) for i in w._infos), cfg.vocab_size)
    return report

