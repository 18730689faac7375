"""How `drvqwen step` shows things: rich tables and colour on a terminal, plain text elsewhere.

Every function here returns something a rich Console prints: on a terminal with colour, in a
pipe or a file as plain aligned text without escape codes (console.make_console: no colour, no
wrapping). Tables use a box with no vertical rules, so scripted transcripts split on runs of
spaces.
"""

from __future__ import annotations

import numpy as np
from rich import box
from rich.table import Table
from rich.text import Text

from ..reference_steps import Comparison
from .machine import LaunchReport

STATUS_STYLE = {"ok": "green", "MISMATCH": "bold red", "reference": "cyan", "no reference": "yellow",
                "later": "dim"}


def table(*columns: str, title: str | None = None, right: tuple[str, ...] = ()) -> Table:
    """A table with the given column headers (those in `right` right-aligned)."""
    t = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False, highlight=False)
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", no_wrap=True)
    return t


def fmt_bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / 2**20:.2f} MiB"
    if n >= 1 << 10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n} B"


def fmt_dims(d) -> str:
    return "×".join(str(x) for x in d)


def gbps(nbytes: int, us: float) -> str:
    return f"{nbytes / us / 1e3:.1f} GB/s" if nbytes and us > 0 else "—"


def token_text(text: str) -> str:
    """A token's text as a Python literal (spaces, newlines and control bytes visible)."""
    return repr(text)


def status_of(r: LaunchReport, device: str) -> str:
    """The launch's status word: ok / MISMATCH (GPU), reference (CPU), later, no reference."""
    if not r.checked:
        return "no reference"
    if r.later and not r.comparisons:
        return "later"
    if device == "cpu":
        return "reference"
    return "ok" if r.ok else "MISMATCH"


def styled(word: str) -> Text:
    return Text(word, style=STATUS_STYLE.get(word, ""))


def comparison_line(c: Comparison) -> Text:
    """`name  rel L2 …  max abs …  first diff …  ok|MISMATCH  (note)` for one written buffer."""
    t = Text(f"      {c.name:<14} ")
    if c.exact:
        t.append("exact: " + ("equal" if c.ok else f"{c.n_bad} differ, first at {list(c.first_diff)}") + "  ")
    else:
        first = "—" if c.first_diff is None else str(list(c.first_diff))
        t.append(f"rel L2 {c.rel_l2:.2e}  max abs {c.max_abs:.2e}  first diff {first}  ")
        if c.n_bad:
            t.append(f"{c.n_bad} NaN/inf wrong  ")
    t.append_text(styled("ok" if c.ok else "MISMATCH"))
    if c.note:
        t.append(f"  ({c.note})", style="dim")
    return t


def launch_header(r: LaunchReport, total: int) -> Text:
    """`[  12/149] L1.qkv_rope  gemv_int4_qkv_rope  12.3 µs  1.23 MiB  100.0 GB/s`."""
    e = r.entry
    t = Text(f"[{e.index:>3}/{total}] ")
    t.append(f"{e.name:<22}", style="bold")
    t.append(f" {e.spec.kernel.kernel:<28} {r.time_us:9.1f} µs  {fmt_bytes(r.bytes):>10}  {gbps(r.bytes, r.time_us):>11}")
    return t


def launch_detail(r: LaunchReport, total: int, device: str) -> list[Text]:
    """The lines `next` prints for one launch: header, what it computes, its comparisons."""
    lines = [launch_header(r, total), Text(f"      {r.what}", style="dim")]
    e = r.entry
    if r.later:
        lines.append(Text(f"      {', '.join(r.later)}: the kernel's own scratch, checked through what "
                          f"{e.group.launch_names()[-1]} makes of it"))
    elif not r.checked:
        lines.append(Text("      ") + styled("no reference") + Text(" for this kernel: run and timed only"))
    elif device == "cpu":
        for name in e.group.outputs if e.last else ():
            lines.append(Text(f"      {name:<14} ") + styled("reference") + Text(" (the CPU runs the reference itself)"))
    for c in r.comparisons:
        lines.append(comparison_line(c))
    return lines


def launch_line(r: LaunchReport, total: int, device: str) -> Text:
    """One compact line per launch (`until`, `token`): header and status."""
    t = launch_header(r, total)
    t.append("  ")
    t.append_text(styled(status_of(r, device)))
    return t


def stats(a: np.ndarray) -> str:
    """min / max / mean / std over the finite values, and the NaN (and inf) count."""
    x = np.asarray(a, np.float64).reshape(-1)
    fin = x[np.isfinite(x)]
    nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    if fin.size == 0:
        body = "no finite values"
    else:
        body = f"min {fin.min():.4g}  max {fin.max():.4g}  mean {fin.mean():.4g}  std {fin.std():.4g}"
    return f"{body}  NaN {nan}" + (f"  inf {inf}" if inf else "")


def top_candidates(tok, logits: np.ndarray, k: int = 5) -> tuple[Table, list[tuple[int, float]]]:
    """The k largest logits as a table (rank, id, text, logit, probability) and [(id, p)].

    Probabilities are the softmax over every finite logit (the rows without text are −inf and
    get 0), in float64.
    """
    l = np.asarray(logits, np.float64)
    fin = np.isfinite(l)
    m = l[fin].max()
    p = np.where(fin, np.exp(np.where(fin, l - m, 0.0)), 0.0)
    p /= p.sum()
    order = np.argsort(-np.where(fin, l, -np.inf), kind="stable")[:k]
    t = table("#", "id", "text", "logit", "probability", right=("#", "id", "logit", "probability"))
    out = []
    for rank, i in enumerate(order, 1):
        t.add_row(str(rank), str(int(i)), token_text(tok.decode([int(i)])), f"{l[i]:.4f}", f"{p[i]:.4f}")
        out.append((int(i), float(p[i])))
    return t, out
