"""The text of one answer as its tokens arrive: detokenized, cut at the first stop string, and —
for an editor's suggestion — ended at the first line indented less than `n_indent`.

Each step passes on only text that is final, so a stream and a whole answer are the same text:
the detokenizer holds a split multi-byte character, the stop-string matcher a tail that may
begin a stop string (stop_strings.py), and the indentation limit the whitespace that begins a
line until the line's first other character says how deep it is.

`n_indent` is llama.cpp's server field (its README: "the minimum line indentation for the
generated text in number of whitespace characters"); editors (llama.vim, llama.vscode) send the
indentation of the cursor's line, so that a suggestion stays inside the current block instead
of going on into the next function. The first line — the rest of the cursor's line — is not
checked. Spaces and tabs count one each. A blank line (only spaces, tabs or a carriage return)
does not end the block: it is held and passed on with the line after it if that line is deep
enough; at a line that is not, the answer ends after the newline that closes the block's last
line, and the held blank lines are dropped with the shallow line.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..stop_strings import StopStrings
from ..stream_decoder import StreamDecoder
from ..tokenizer import Tokenizer

_INDENT = " \t"
_BLANK = " \t\r"


class IndentLimit:
    """Ends text at the first line, after the first, indented less than `n_indent` columns.

    >>> lim = IndentLimit(4)
    >>> lim.push("x = 1\\n\\n    y = 2\\n"), lim.push("def f():\\n")
    (('x = 1\\n\\n    y = 2\\n', False), ('', True))

    n_indent ≤ 0: no limit (push passes everything on).
    """

    def __init__(self, n_indent: int):
        self.n_indent = n_indent
        self._held = ""              # blank lines and the indentation of the line being started
        self._at_line_start = False  # after a newline, before the line's first other character
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Feed the next piece of text.

        Returns:
            (the text that is final now, whether a line under the limit ended the answer here).
        """
        if self.stopped:
            return "", True
        if self.n_indent <= 0:
            return text, False
        out: list[str] = []
        for c in text:
            if not self._at_line_start:
                out.append(c)
                self._at_line_start = c == "\n"
            elif c == "\n" or c in _BLANK:
                self._held += c
            else:
                line = self._held.rsplit("\n", 1)[-1]
                depth = len(line) - len(line.lstrip(_INDENT))
                if depth < self.n_indent:
                    self.stopped, self._held = True, ""
                    return "".join(out), True
                out += [self._held, c]
                self._held, self._at_line_start = "", False
        return "".join(out), False

    def flush(self) -> str:
        """End of the text: what is held (blank lines, a last line's indentation) is passed on."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


class AnswerText:
    """One answer's text, token by token: StreamDecoder → StopStrings → IndentLimit.

    After each `push`, `newline` says whether that token's text held a newline (llama.cpp's
    `t_max_predict_ms` ends an answer only there); when the answer has ended, `ended_by` is
    "stop string" or "indent", and `stopping_word` the stop string.
    """

    def __init__(self, tok: Tokenizer, stops: Sequence[str] = (), n_indent: int = 0):
        self._decoder = StreamDecoder(tok)
        self._stops = StopStrings(stops)
        self._indent = IndentLimit(n_indent)
        self.newline = False
        self.ended_by: str | None = None

    @property
    def stopping_word(self) -> str:
        return self._stops.matched or ""

    def push(self, token: int) -> tuple[str, bool]:
        """Returns (text final now, whether the answer ends at this token)."""
        piece = self._decoder.push(token)
        self.newline = "\n" in piece
        return self._through(piece, flush=False)

    def finish(self) -> str:
        """Generation ended (end-of-generation token, max_tokens, the context, a time limit):
        the text still held, cut where a stop string or the indentation limit says."""
        if self.ended_by is not None:
            return ""
        return self._through(self._decoder.flush(), flush=True)[0]

    def _through(self, piece: str, flush: bool) -> tuple[str, bool]:
        kept, hit = self._stops.push(piece)
        if flush and not hit:
            kept += self._stops.flush()
            hit = self._stops.stopped
        out, shallow = self._indent.push(kept)
        if shallow:
            self.ended_by = "indent"
            return out, True
        if hit:
            self.ended_by = "stop string"
        if hit or flush:
            out += self._indent.flush()
        return out, hit
