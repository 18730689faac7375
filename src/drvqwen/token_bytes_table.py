"""Every token id's raw bytes and the special ids, kept in the cache: what `StreamDecoder` needs
to turn generated ids into text, without building the tokenizer.

Building the `tokenizers` tokenizer takes a few hundred milliseconds of Python's GIL even from its cached form
(tokenizer_cache.py); `drvqwen run` on the GPU encodes its prompt in another process instead
(tokenizer_process.py), and then needs, in its own process, only the bytes of the ids it
generates. This table holds them for all ids: built once per tokenizer from
`Tokenizer.token_bytes` (the same bytes, id by id, once, after a run's answer), loaded in a
few milliseconds afterwards.

File (paths.tokenizer_dir(), named by the tokenizer.json's sha256): one line with the sha256 of
what follows, then little-endian uint32 N (ids), S (special ids), N + 1 offsets into the blob,
the S special ids, the blob (id i's bytes at offsets[i] … offsets[i+1]). A damaged file is
noticed by its sha256 and rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from pathlib import Path

from . import paths
from .errors import DrvqwenError

FORM = "token-bytes-2"  # 2: every id up to the highest with text (1 stopped at the token count)


def table_path(digest: str) -> Path:
    """The cache file of the tokenizer.json whose sha256 is `digest` (tokenizer_cache.text_digest).
    Raises DrvqwenError when the cache root cannot be made."""
    return paths.tokenizer_dir() / f"{digest[:32]}-{FORM}.bin"


class TokenBytesTable:
    """The raw bytes of ids 0 … N-1 and the special ids (`Tokenizer.token_bytes`,
    `Tokenizer.special_ids`); an id outside 0 … N-1 is b"" (no text), as there."""

    def __init__(self, offsets: array, blob: bytes, special_ids: frozenset[int]):
        self._offsets, self._blob = offsets, blob
        self.special_ids = special_ids

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self):
            return b""
        return self._blob[self._offsets[token_id]:self._offsets[token_id + 1]]

    @classmethod
    def of_tokenizer(cls, tok) -> "TokenBytesTable":
        """The table of a `Tokenizer`, id by id, up to its highest id with text
        (`text_vocab_size`): a vocabulary's ids may leave gaps, so the count of its tokens
        (`vocab_size`) can stop short of ids it has."""
        pieces = [tok.token_bytes(i) for i in range(tok.text_vocab_size)]
        offsets = array("I", [0])
        at = 0
        for p in pieces:
            at += len(p)
            offsets.append(at)
        return cls(offsets, b"".join(pieces), frozenset(tok.special_ids))

    def to_bytes(self) -> bytes:
        specials = array("I", sorted(self.special_ids))
        offsets = self._offsets
        if sys.byteorder != "little":
            specials, offsets = array("I", specials), array("I", offsets)
            specials.byteswap()
            offsets.byteswap()
        return struct.pack("<II", len(self), len(specials)) + offsets.tobytes() + specials.tobytes() + self._blob

    @classmethod
    def from_bytes(cls, body: bytes) -> "TokenBytesTable":
        """Raises ValueError (struct.error) on a body that is not a table."""
        n, s = struct.unpack_from("<II", body, 0)
        at = 8
        offsets = array("I")
        offsets.frombytes(body[at:at + 4 * (n + 1)])
        at += 4 * (n + 1)
        specials = array("I")
        specials.frombytes(body[at:at + 4 * s])
        at += 4 * s
        if sys.byteorder != "little":
            offsets.byteswap()
            specials.byteswap()
        blob = body[at:]
        if len(offsets) != n + 1 or len(specials) != s or offsets[-1] != len(blob):
            raise ValueError("not a token bytes table")
        return cls(offsets, blob, frozenset(specials))


def load(digest: str) -> TokenBytesTable | None:
    """The table of tokenizer.json sha256 `digest` from the cache, or None when there is none
    or it is damaged."""
    try:
        raw = table_path(digest).read_bytes()
    except (OSError, DrvqwenError):
        return None
    head, _, body = raw.partition(b"\n")
    if head.decode("ascii", "replace") != hashlib.sha256(body).hexdigest():
        return None
    try:
        return TokenBytesTable.from_bytes(body)
    except (ValueError, struct.error):
        return None


def store(digest: str, tok) -> bool:
    """Write the table of `tok` (the tokenizer of sha256 `digest`) to the cache, temp name then
    rename; whether a file was written (a cache that cannot be written is skipped)."""
    body = TokenBytesTable.of_tokenizer(tok).to_bytes()
    try:
        paths.atomic_write_bytes(table_path(digest), hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    except (OSError, DrvqwenError):
        return False
    return True
