"""Stop strings: cut streamed text where one of a set of strings first appears.

A stop string may span tokens ("\\ndef " arrives as "\\n", "def", " ") and a token may hold
text on both sides of it, so the match runs on text, not ids. Text is passed on as soon as it
can no longer be the start of a stop string: only a tail that is a prefix of some stop string is
held back, so a stream stays live and what it prints never has to be taken back. This is how
llama.cpp's server and the OpenAI API treat `stop`: the text ends just before the stop string,
which is not part of the output.

Used by `drvqwen run --stop`, `drvqwen chat` and `drvqwen serve` alike, so that all three cut the
same text at the same place.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import DrvqwenError


class StopStrings:
    """Incremental matcher over a stream of text pieces.

    >>> s = StopStrings(["\\ndef "])
    >>> s.push("x = 1\\n"), s.push("def"), s.push(" f")
    (('x = 1', False), ('', False), ('', True))

    After a stop, `matched` names the stop string and every later `push` returns ("", True).
    """

    def __init__(self, stops: Iterable[str] = ()):
        """Args:
            stops: the stop strings, each non-empty (duplicates are harmless).
        Raises:
            DrvqwenError: a stop string is empty or not a str.
        """
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        for s in self.stops:
            if not isinstance(s, str) or not s:
                raise DrvqwenError(f"stop string {s!r}: must be a non-empty string")
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> tuple[str, bool]:
        """Feed the next piece of text.

        Returns:
            (text that may be shown now, whether a stop string has been reached). On a stop, the
            text is everything before the stop string's first character.
        """
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        hit = self._earliest(buf)
        # A stop string that started earlier may still be arriving (" ba" vs "b" on "… b|a"):
        # the smallest j whose tail buf[j:] is a proper prefix of some stop string.
        lo = max(0, len(buf) - max(len(s) for s in self.stops) + 1)
        partial = next((j for j in range(lo, len(buf))
                        if any(len(s) > len(buf) - j and s.startswith(buf[j:]) for s in self.stops)),
                       None)
        if hit is not None and (partial is None or partial >= hit[0]):
            self.matched, self._held = hit[1], ""
            return buf[:hit[0]], True
        cut = len(buf) if partial is None else partial
        self._held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """End of the stream: the text held back, cut at a stop string it holds (then `matched`
        is set). The caller checks `stopped` after it."""
        buf, self._held = self._held, ""
        if self.matched is not None or not buf:
            return ""
        hit = self._earliest(buf)
        if hit is None:
            return buf
        self.matched = hit[1]
        return buf[:hit[0]]

    def _earliest(self, buf: str) -> tuple[int, str] | None:
        # The earliest start wins. (Stop strings starting at the same place cut the same text;
        # `matched` names one of those complete so far.)
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best


def cut_at_stop(text: str, stops: Iterable[str]) -> tuple[str, str | None]:
    """The whole-text form: `text` cut before the first stop string, and which one (or None)."""
    s = StopStrings(stops)
    out, _ = s.push(text)
    return (out + s.flush(), s.matched)
