"""Rich consoles that wrap only where a person reads them and never read text as markup.

On a terminal, rich fits tables and messages to its width. Anywhere else — a pipe, a file, a
CI log — rich would assume 80 columns and wrap: `drvqwen info --tensors | grep q_proj` would
miss rows split over two lines, and long paths in logs would be cut mid-name. There the width
is made so large that nothing wraps, and text is soft-wrapped (left to whatever shows it).

What drvqwen prints is full of text the user chose: paths, model names, chat messages, tensor
names read from a file, error messages quoting a value. Read as rich markup, `[/x]` in a file
name raises rich's MarkupError and `[bold]` vanishes; read for emoji codes, `:smile:` turns into
a picture. So these consoles read neither, and neither do the progress bars' descriptions
(`progress_bar`): colour comes from `style=` and `rich.text.Text`, never from markup in a string.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TransferSpeedColumn)
from rich.text import Text

# Wide enough that no table of drvqwen's or message reaches it; rich does not pad lines to the
# width unless asked (no `expand`, no justify), so nothing is printed wider than its content.
NO_WRAP_WIDTH = 1 << 16


class _Console(Console):
    """rich's Console, but a closed stdout (`drvqwen info M | head -1`) raises BrokenPipeError:
    rich's own handling ends the process with SystemExit(1), past the CLI's handler, which
    ends quietly with status 141 as for every other write to a closed pipe (cli.main)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def make_console(stderr: bool = False) -> Console:
    """A Console on stdout (or stderr): terminal width on a terminal, no wrapping elsewhere;
    strings are printed as they are (no markup, no emoji codes). A closed pipe raises
    BrokenPipeError."""
    plain = dict(stderr=stderr, highlight=False, markup=False, emoji=False)
    c = _Console(**plain)
    if c.is_terminal:
        return c
    return _Console(**plain, width=NO_WRAP_WIDTH, soft_wrap=True)


def progress_bar(*, in_bytes: bool = False, transient: bool = False, console: Console | None = None) -> Progress:
    """A progress bar on stderr (or `console`): description, bar, then done/total and the time
    spent, or, `in_bytes`, bytes done/total, the rate and the time spent. `transient`: the bar
    is erased when it stops, and not shown at all where stderr is no terminal. Descriptions
    are shown as they are (module doc)."""
    label = TextColumn("{task.description}", style="bold", markup=False)
    counts = (DownloadColumn(), TransferSpeedColumn()) if in_bytes else (MofNCompleteColumn(),)
    console = console or make_console(stderr=True)
    # A transient bar written to a file or a pipe would leave only an empty line behind.
    return Progress(label, BarColumn(), *counts, TimeElapsedColumn(), console=console, transient=transient,
                    disable=transient and not console.is_terminal)


def error_line(message: str) -> Text:
    """`error: <message>` with the word in bold red and the message as it is."""
    return Text.assemble(("error:", "bold red"), " ", message)
