"""Qwen2 tokenization on the `tokenizers` library: encode, decode, stream, the chat and FIM
prompts.

A `.nanoqwen` file embeds its tokenizer as tokenizer.json text (`Tokenizer.from_json`); at
conversion time it comes from an HF checkpoint's tokenizer.json or is rebuilt from a GGUF's
metadata (`Tokenizer.from_gguf`, tokenizer_gguf.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING

import tokenizers

from .errors import DrvqwenError
from .stream_decoder import StreamDecoder
from .tokenizer_gguf import CHAR_TO_BYTE, build_tokenizer_from_gguf

if TYPE_CHECKING:
    from gguf import GGUFReader

# Special tokens of the Qwen2.5 vocabulary (docs/model.md#the-tokenizer; ids in drvqwen.config).
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_SUFFIX = "<|fim_suffix|>"

# The system prompt Qwen2.5(-Coder)'s chat template inserts when none is given (the
# `tokenizer.chat_template` of the official GGUF / tokenizer_config.json).
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Tokens that end generation, by name — the rule llama.cpp applies to every vocabulary
# (llama-vocab.cpp, `special_eog_ids`), since the metadata of a GGUF names only one
# end-of-sequence id. Qwen2.5-Coder ends a turn with <|im_end|>, a document with
# <|endoftext|>, and a fill-in-the-middle or repository-level completion with <|fim_pad|>,
# <|repo_name|> or <|file_sep|>: a model that emits one of those has finished the code.
EOG_NAMES = (
    # fill-in-the-middle pad / repository / file separators
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
    # end of turn / text
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
)


# A BPE piece's characters → the bytes they stand for, as characters U+0000…U+00FF, so that
# str.translate + encode("latin-1") gives a piece's bytes in one step. Characters of U+0000…U+00FF
# that are not in the byte alphabet map to U+FFFF, which latin-1 cannot encode: such a piece
# takes the slow path (Tokenizer._token_bytes).
_FROM_BYTE_ALPHABET = str.maketrans({**{b: "\uffff" for b in range(256)},
                                     **{ord(c): chr(b) for c, b in CHAR_TO_BYTE.items()}})


# ---- the wrapper the runtime uses -------------------------------------------------------------

class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the calls drvqwen needs.

    Build with `from_gguf` (conversion time) or `from_json` (from a `.nanoqwen` file).
    """

    def __init__(self, tk: tokenizers.Tokenizer, source: str = "tokenizer"):
        self._tk = tk
        self.source = source  # named in error messages (e.g. the .nanoqwen it came from)
        self._bytes: dict[int, bytes] = {}      # token_bytes, filled as ids are asked for
        self.from_cache = False                 # loaded from tokenizer_cache (from_json)
        self._uncached_json: str | None = None  # the text to cache, built by from_json(cache=True)

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike | GGUFReader) -> "Tokenizer":
        """Build from a GGUF's metadata. Raises DrvqwenError as `build_tokenizer_from_gguf`."""
        return cls(build_tokenizer_from_gguf(path_or_reader))

    @classmethod
    def from_json(cls, text: str, source: str = "tokenizer", *, cache: bool = False) -> "Tokenizer":
        """Load tokenizer.json text (as written by `to_json`); `source` names where it came
        from in error messages (e.g. the .nanoqwen file).

        With cache=True the tokenizer comes from drvqwen's cache when an earlier run left it
        there in its fast-loading form (tokenizer_cache.py: the same tokenizer, proved when it
        was written); `from_cache` says whether it did. Built from `text` instead, it is kept
        for `store_in_cache`, which writes that form once the caller has time for it.

        Raises:
            DrvqwenError: the text is not a valid tokenizer.json.
        """
        if cache:
            from . import tokenizer_cache

            tk = tokenizer_cache.load(text)
            if tk is not None:
                tok = cls(tk, source)
                tok.from_cache = True
                return tok
        try:
            tok = cls(tokenizers.Tokenizer.from_str(text), source)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DrvqwenError(f"{source}: embedded tokenizer.json is invalid ({str(e).splitlines()[0]})") from None
        if cache:
            tok._uncached_json = text
        return tok

    @classmethod
    def of_model(cls, f) -> "Tokenizer":
        """The tokenizer embedded in the model file `f` (a NanoqwenFile), from drvqwen's cache
        when an earlier run left it there, else built from its JSON and its fast-loading form
        written at once (about a second, once per tokenizer): for the commands whose start-up
        is not a first token (serve, step, eval, bench); `drvqwen run` defers the write.

        Raises:
            DrvqwenError: the embedded tokenizer.json is invalid (naming the file).
        """
        tok = cls.from_json(f.tokenizer_json, source=str(f.path), cache=True)
        tok.store_in_cache()
        return tok

    @property
    def store_pending(self) -> bool:
        """Whether `store_in_cache` has a form to write (built from text with cache=True)."""
        return self._uncached_json is not None

    def store_in_cache(self) -> bool:
        """Write this tokenizer's fast-loading form to drvqwen's cache (tokenizer_cache.store)
        when `from_json(cache=True)` built it from text; afterwards, and otherwise, nothing.
        Returns whether a file was written. It takes about three loads' time (the form is
        proved to build the same tokenizer), so `drvqwen run` does it after the answer."""
        text, self._uncached_json = self._uncached_json, None
        if text is None:
            return False
        from . import tokenizer_cache

        return tokenizer_cache.store(text, self._tk)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (compact), for embedding in a `.nanoqwen` file."""
        return self._tk.to_str(pretty=False)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tk

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (151665 for Qwen2.5)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @cached_property
    def text_vocab_size(self) -> int:
        """1 + the largest id with a token (151665 for Qwen2.5): ids from here up to the
        model's vocab_size (the lm_head is padded to 151936 / 152064 rows) stand for no text.
        They decode to nothing, and the backends never choose them (their logits are −inf)."""
        # llama.cpp pads a GGUF vocabulary to the lm_head's rows with "[PAD<id>]" tokens; the
        # tokenizer.json of a file converted before those were left out still carries them,
        # and they are no text either.
        ids = [i for t, i in self._tk.get_vocab(with_added_tokens=True).items() if t != f"[PAD{i}]"]
        return max(ids, default=-1) + 1

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (byte-alphabet spelling for BPE pieces), or None."""
        return self._tk.token_to_id(token)

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of `text`. No BOS/EOS is added (Qwen2 uses none).

        Args:
            text: the text. It is NFC-normalized first, so decoding returns its NFC form.
            special: False (the default): `text` is plain text — `<|im_start|>` written in it
                is encoded as the characters it is made of, never as a control id. Use this
                for anything a user wrote (chat messages, FIM code, prompt files): otherwise a
                message could close its turn and open a system turn of its own. True: special
                tokens written in the text become their ids (`drvqwen run --raw`, where the
                user writes the whole prompt, markers included, on purpose).

        Added tokens that are not special (`<tool_call>`) are ordinary text tokens: they are
        matched either way, as Qwen2's own tokenizer does.
        """
        # `encode_special_tokens=True` makes `tokenizers` skip the special-token match and
        # run the text through normalizer, pre-tokenizer and BPE like any other text
        # (transformers' `split_special_tokens=True`).
        self._tk.encode_special_tokens = not special
        return self._tk.encode(text, add_special_tokens=False).ids

    def control_id(self, token: str) -> int:
        """The id of a control token of the template (`<|im_start|>` …).

        Raises:
            DrvqwenError: the vocabulary lacks it.
        """
        return self._require_id(token)

    def chat(self, user: str, system: str = DEFAULT_SYSTEM) -> list[int]:
        """Ids of one user turn in Qwen2.5's ChatML template, ending where the answer begins.

        The ids of `chat_prompt(user, system)` with only the template's own markers as control
        ids: `user` and `system` are encoded as plain text (`encode(special=False)`), so a
        message that contains `<|im_end|>` cannot end its turn. For text without special
        tokens the ids equal `encode(chat_prompt(user, system), special=True)`: `tokenizers`
        splits the text at special tokens before anything else, so encoding the pieces
        between the markers one by one gives the same ids.

        An empty `system` is an empty system turn (as the official template renders it);
        only the default argument means the default system prompt.
        """
        start, end = self.control_id(IM_START), self.control_id(IM_END)
        nl = self.encode("\n")
        return [start, *self.encode(f"system\n{system}"), end, *nl,
                start, *self.encode(f"user\n{user}"), end, *nl,
                start, *self.encode("assistant\n")]

    def fim(self, prefix: str, suffix: str) -> list[int]:
        """Ids of a fill-in-the-middle prompt (`fim_prompt(prefix, suffix)`), the code encoded
        as plain text: `<|fim_middle|>` inside `prefix` stays text."""
        return [self.control_id(FIM_PREFIX), *self.encode(prefix),
                self.control_id(FIM_SUFFIX), *self.encode(suffix), self.control_id(FIM_MIDDLE)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`. Bytes that do not form valid UTF-8 become U+FFFD; ids without text
        (text_vocab_size and up, llama.cpp's "[PAD…]" fillers) give nothing.

        Args:
            ids: token ids (Python or numpy integers).
            skip_special: drop control tokens (`<|im_end|>` …) instead of writing them out.
        """
        # int(): tokenizers refuses numpy integers, which the sampler hands out. Ids from
        # text_vocab_size on have no text (the lm_head's padding).
        n = self.text_vocab_size
        return self._tk.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=skip_special)

    def eog_ids(self, extra: Iterable[int] = ()) -> frozenset[int]:
        """The end-of-generation set: every token of EOG_NAMES the vocabulary has (llama.cpp's
        rule, by name), plus `extra` (the end-of-sequence ids a GGUF's metadata or an HF
        config names). For Qwen2.5-Coder: 151643, 151645, 151662, 151663, 151664.

        The converter stores it in the `.nanoqwen` file (NanoqwenFile.eog_ids), which is what
        `drvqwen run` stops on; a vocabulary with none of the names gives an empty set (the
        run ends only at --max-new-tokens or when the context is full).
        """
        by_name = (self._tk.token_to_id(t) for t in EOG_NAMES)
        return frozenset(i for i in (*by_name, *(int(e) for e in extra)) if i is not None)

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        """`eog_ids()`, required to contain <|endoftext|> and <|im_end|> (Qwen's own).

        Raises:
            DrvqwenError: the vocabulary lacks either token.
        """
        for t in (ENDOFTEXT, IM_END):
            self._require_id(t)
        return self.eog_ids()

    def _require_id(self, token: str) -> int:
        i = self._tk.token_to_id(token)
        if i is None:
            raise DrvqwenError(f"{self.source}: tokenizer has no {token!r} token")
        return i

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one id: what `StreamDecoder` concatenates.

        BPE pieces are mapped back from the byte alphabet; added tokens are their UTF-8 text;
        an id without text (a gap, an id past the vocabulary, llama.cpp's "[PAD…]" fillers) is
        b"". Looked up when first asked for and kept: a run asks for the few hundred ids it
        generates, where a table of all 152k ids would take ~0.5 s to build at start-up.
        """
        got = self._bytes.get(token_id)
        if got is None:
            got = self._bytes[token_id] = self._token_bytes(token_id)
        return got

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id < 0:
            return b""
        tok = self._tk.id_to_token(token_id)
        if tok is None or tok == f"[PAD{token_id}]":
            return b""                   # no text: llama.cpp's filler rows, ids past the vocabulary
        if token_id in self._added:
            return self._added[token_id].content.encode("utf-8")
        try:
            return tok.translate(_FROM_BYTE_ALPHABET).encode("latin-1")
        except UnicodeEncodeError:
            # A character outside the byte alphabet can only come from a foreign
            # tokenizer.json; its UTF-8 bytes are the best guess at what it stands for.
            return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in tok)

    @cached_property
    def _added(self) -> dict:
        return self._tk.get_added_tokens_decoder()

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) added tokens."""
        return frozenset(i for i, t in self._tk.get_added_tokens_decoder().items() if t.special)

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        """A new `StreamDecoder` over this tokenizer."""
        return StreamDecoder(self, skip_special=skip_special)


def prompt_ids_of(spec: dict, tok: "Tokenizer") -> list[int]:
    """The ids of a prompt described by `spec` (gen_options.prompt_spec):
    {"kind": "chat", "text", "system"} — the chat template, `system` None for the default
    system prompt ("" asks for an empty system turn); {"kind": "raw", "text"} — the text with
    its special tokens parsed (--raw, on purpose); {"kind": "fim", "prefix", "suffix"}. User
    text is plain text everywhere else: only the template's own markers become control ids.

    Raises:
        DrvqwenError: an unknown kind.
    """
    kind = spec.get("kind")
    if kind == "fim":
        return tok.fim(spec["prefix"], spec["suffix"])
    if kind == "raw":
        return tok.encode(spec["text"], special=True)
    if kind == "chat":
        system = spec.get("system")
        return tok.chat(spec["text"], system=DEFAULT_SYSTEM if system is None else system)
    raise DrvqwenError(f"prompt of kind {kind!r}: want chat, raw or fim")


# ---- prompt builders ----------------------------------------------------------------------------

def chat_prompt(user: str, system: str = DEFAULT_SYSTEM) -> str:
    """One user turn in Qwen2.5's ChatML template, ending where the assistant's answer begins.

    The same string as the official chat template with `add_generation_prompt=True`:
    `<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n`.
    This is the text, to show or compare; `Tokenizer.chat` gives the ids to run, with the
    messages kept out of the control ids.
    """
    return (f"{IM_START}system\n{system}{IM_END}\n"
            f"{IM_START}user\n{user}{IM_END}\n"
            f"{IM_START}assistant\n")


def fim_prompt(prefix: str, suffix: str) -> str:
    """A fill-in-the-middle prompt (Qwen2.5-Coder, prefix-suffix-middle order).

    `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`; the model writes the middle.
    Ids: prefix 151659, suffix 151661, middle 151660. `Tokenizer.fim` gives the ids to run,
    the code encoded as plain text.
    """
    return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"
