"""Generated ids → text as it streams: multi-byte characters split over tokens held back until
they are whole.

It lives apart from tokenizer.py, which imports the `tokenizers` library: `drvqwen run` on the
GPU decodes its answer from the cached token bytes table (token_bytes_table.py) while its
prompt is encoded in another process, and then needs no `tokenizers` before its first token.
"""

from __future__ import annotations

import codecs
from typing import Protocol


class TokenBytes(Protocol):
    """What a StreamDecoder reads: tokenizer.Tokenizer, or token_bytes_table.TokenBytesTable."""

    special_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of `token_id` (b"" for an id without text)."""


class StreamDecoder:
    """Incremental detokenization for streaming generated tokens to a terminal.

    One token may end in the middle of a multi-byte UTF-8 character (emoji and CJK are often
    split over two or three byte-level tokens). Decoding each token on its own would print
    U+FFFD for each fragment; instead the bytes are fed to an incremental UTF-8 decoder, which
    holds back an incomplete tail until the next token completes it. Concatenating every
    `push` and the final `flush` equals `Tokenizer.decode` of all the ids.
    """

    def __init__(self, tokenizer: TokenBytes, skip_special: bool = False):
        self._bytes = tokenizer.token_bytes
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        # errors="replace" matches tokenizers' lossy decode for truly invalid bytes; an
        # incomplete sequence at the end of the buffer is held, not replaced.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one id; return the text it completes (possibly "").

        An id the tokenizer has no token for (the lm_head's padded rows, 151665… for Qwen2.5)
        is no text: it gives "" and changes nothing, as `Tokenizer.decode` and Qwen2's own
        tokenizer do. Never raises for an id.
        """
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._bytes(int(token_id)))

    def flush(self) -> str:
        """End of stream: return what is held back (U+FFFD if it is an incomplete character)."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
