"""Rich consoles that wrap only where a person reads them.

On a terminal, rich fits tables and messages to its width. Anywhere else — a pipe, a file, a
CI log — rich would assume 80 columns and wrap: `drvqwen info --tensors | grep q_proj` would
miss rows split over two lines, and long paths in logs would be cut mid-name. There the width
is made so large that nothing wraps, and text is soft-wrapped (left to whatever shows it).
"""

from __future__ import annotations

from rich.console import Console

# Wide enough that no table of drvqwen's or message reaches it; rich does not pad lines to the
# width unless asked (no `expand`, no justify), so nothing is printed wider than its content.
NO_WRAP_WIDTH = 1 << 16


def make_console(stderr: bool = False) -> Console:
    """A Console on stdout (or stderr): terminal width on a terminal, no wrapping elsewhere."""
    c = Console(stderr=stderr, highlight=False)
    if c.is_terminal:
        return c
    return Console(stderr=stderr, highlight=False, width=NO_WRAP_WIDTH, soft_wrap=True)
