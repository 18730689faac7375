"""A model's tokenizer kept in the cache in the form `tokenizers` loads fastest.

`tokenizers.Tokenizer.from_str` spends its time on the BPE model: 151k vocabulary entries
and 151k merges for Qwen2.5, parsed into a generic JSON tree and then into the model, all of
it holding the GIL. The library has no binary form (its pickle is the
same JSON), but two spellings of the same tokenizer.json parse faster, and both are the
library's own:

- the vocabulary written in token order instead of id order: the generic JSON tree is an
  ordered map, and inserting keys in order is cheaper than in id order;
- the merges in the "left right" string form (the form tokenizers wrote before 0.20 and
  still reads), instead of ["left", "right"] pairs; used only when no piece holds a space,
  which that form could not tell apart.

Together they shorten the load (tools/bench_startup.py times the phase). The cached text is
only written after it was proved to build the same tokenizer: `from_str(compact).to_str()`
equals the JSON-built tokenizer's `to_str()`, every field of it (model, added tokens, normalizer, pre-tokenizer,
decoder, post-processor). Files live in `paths.tokenizer_dir()`, named by the sha256 of the
tokenizer.json text and the `tokenizers` version (a new version re-proves the form), and start
with the sha256 of what follows, so a damaged file is noticed and rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import paths
from .errors import DrvqwenError

# `tokenizers` is imported where a tokenizer is loaded, stored or named: `drvqwen run` asks only
# for a tokenizer's digest here (tokenizer_process.start_for) when its worker process encodes the
# prompt, and never loads the library before its first token.
if TYPE_CHECKING:
    import tokenizers

# Names the cache files' layout: a change of the compact form changes it.
FORM = "compact-1"


def text_digest(text: str) -> str:
    """sha256 hex of tokenizer.json `text`: the key of its cache files (this one's and
    token_bytes_table's)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def cache_path(text: str, digest: str | None = None) -> Path:
    """The cache file for tokenizer.json `text` (of sha256 `digest`, when known) under this
    `tokenizers` version (the folder is created). Raises DrvqwenError when the cache root
    cannot be made."""
    return digest_path(digest or text_digest(text))


def digest_path(digest: str) -> Path:
    """The cache file of the tokenizer.json of sha256 `digest` (`cache_path`)."""
    import tokenizers

    return paths.tokenizer_dir() / f"{digest[:32]}-{FORM}-tokenizers-{tokenizers.__version__}.json"


def compact_json(tk: tokenizers.Tokenizer) -> str | None:
    """`tk` as tokenizer.json text in the faster-loading spelling (module doc), or None when
    its model is not BPE (nothing to gain, nothing cached)."""
    doc = json.loads(tk.to_str())
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    model["vocab"] = dict(sorted(model["vocab"].items()))
    merges = model.get("merges") or []
    if all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges):
        model["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


def load(text: str) -> tokenizers.Tokenizer | None:
    """The tokenizer of tokenizer.json `text` from its cache file, or None when there is none
    or it is damaged (the caller builds from `text` and calls `store`)."""
    try:
        return load_file(cache_path(text))
    except DrvqwenError:                # no cache root: build from the text
        return None


def load_file(path: Path) -> tokenizers.Tokenizer | None:
    """The tokenizer in cache file `path` (cache_path), or None when it is missing or damaged."""
    try:
        raw = Path(path).read_bytes()
    except OSError:                     # none yet: build from the text
        return None
    head, _, body = raw.partition(b"\n")
    if head.decode("ascii", "replace") != hashlib.sha256(body).hexdigest():
        return None
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_buffer(body)     # the bytes as they are: no str made
    except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        return None


def store(text: str, tk: tokenizers.Tokenizer) -> bool:
    """Write the compact form of `tk` (built from tokenizer.json `text`) to its cache file,
    temp name then rename, after proving it builds the same tokenizer. Returns whether a file
    was written; a cache that cannot be written is skipped (the next run builds again)."""
    import tokenizers

    compact = compact_json(tk)
    if compact is None or tokenizers.Tokenizer.from_str(compact).to_str() != tk.to_str():
        return False
    body = compact.encode("utf-8")
    try:
        paths.atomic_write_bytes(cache_path(text), hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    except (OSError, DrvqwenError):     # a read-only or full cache: the next run builds again
        return False
    return True


# The digest of the tokenizer.json the last GPU run's prompt was encoded with (one line), for
# the next run's tokenizer worker to load its cached form before its request arrives
# (tokenizer_worker.py).
LAST_USED = "last-used"


def remember_last_used(digest: str) -> None:
    """Record tokenizer.json sha256 `digest` as the last one used, where it is not already
    (temp name, then rename); a cache that cannot be written is skipped (the next worker just
    waits for its request)."""
    try:
        pointer = paths.tokenizer_dir() / LAST_USED
        try:
            if pointer.read_text(encoding="utf-8") == digest:
                return
        except OSError:                 # none yet
            pass
        paths.atomic_write_bytes(pointer, digest.encode("utf-8"))
    except (OSError, DrvqwenError, UnicodeError):
        pass


def last_used() -> str | None:
    """The digest `remember_last_used` recorded, if any."""
    try:
        digest = (paths.tokenizer_dir() / LAST_USED).read_text(encoding="utf-8").strip()
    except (OSError, DrvqwenError, UnicodeError):
        return None
    return digest or None
