"""Qwen2 tokenization on the `tokenizers` library: build from GGUF, encode, decode, stream.

A GGUF carries no tokenizer.json, only llama.cpp's metadata: the token strings, the BPE merges,
a type per token and the name of the pre-tokenizer. `build_tokenizer_from_gguf` rebuilds from
those the same pipeline as Qwen2's own tokenizer.json on the Hugging Face hub:

    NFC normalizer → Split(Qwen2 regex, Isolated) → ByteLevel(no prefix space, no regex)
    → BPE (byte-level alphabet) → ByteLevel decoder,

plus the control tokens (`<|im_start|>` …) as special added tokens. The result is serialized as
tokenizer.json text (`Tokenizer.to_json`) and embedded in the `.nanoqwen` file, so the runtime
never needs the GGUF again (docs/file-format.md, docs/model.md#the-tokenizer).

The tests hold it against `transformers`' own GGUF conversion
(`transformers.integrations.gguf.gguf_tokenizer_mapping`). One deliberate difference: that path
builds a GPT-2 pipeline with no normalizer, while Qwen2's tokenizer.json normalizes to NFC; we
follow tokenizer.json, which is what the model was trained with. The two agree on NFC text.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from .errors import DrvqwenError

if TYPE_CHECKING:
    from gguf import GGUFReader

# The pre-tokenizer split of Qwen2 (tokenizer.json of Qwen/Qwen2.5-*; also
# `transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX`). Unlike GPT-4's `\p{N}{1,3}`
# it isolates every digit, so "12345" is five tokens.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

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

# llama.cpp's token types (`llama_token_type` / gguf.TokenType): 1 normal, 2 unknown, 3 control,
# 4 user-defined, 5 unused, 6 byte.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
_TOKEN_UNUSED = 5

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


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map (openai/gpt-2 `encoder.py`).

    Byte-level BPE vocabularies spell every byte as one visible character: printable Latin-1
    bytes stand for themselves, the other 68 (control bytes, space, 0x7F-0xA0, 0xAD) are moved
    to U+0100 and up, so a space is 'Ġ' (U+0120) and a newline 'Ċ' (U+010A).
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


# ---- reading the GGUF metadata ------------------------------------------------------------------

def _open_reader(path_or_reader: str | os.PathLike | GGUFReader) -> tuple[GGUFReader, str]:
    """Return (reader, name for messages); open the file if given a path."""
    from gguf import GGUFReader

    if isinstance(path_or_reader, GGUFReader):
        return path_or_reader, str(getattr(path_or_reader.data, "filename", "<gguf>"))
    from .format.gguf_check import check_gguf

    path = Path(path_or_reader)
    if not path.is_file():
        raise DrvqwenError(f"{path}: GGUF file not found")
    check_gguf(path)                     # counts, lengths, offsets: before gguf-py trusts them
    try:
        return GGUFReader(path), str(path)
    except (ValueError, OSError) as e:
        raise DrvqwenError(f"{path}: not a readable GGUF file ({e})") from None


def _field(reader: GGUFReader, key: str, source: str, kind: str):
    """The ReaderField for `key`, checked to be of `kind`: "str", "str[]" or "int[]"."""
    from gguf import GGUFValueType as T

    f = reader.fields.get(key)
    if f is None:
        raise DrvqwenError(f"{source}: GGUF metadata key {key!r} missing")
    got = [t.name for t in f.types]
    ints = {T.INT8, T.UINT8, T.INT16, T.UINT16, T.INT32, T.UINT32, T.INT64, T.UINT64}
    ok = {
        "str": f.types == [T.STRING],
        "str[]": len(f.types) == 2 and f.types[0] == T.ARRAY and f.types[1] == T.STRING,
        "int[]": len(f.types) == 2 and f.types[0] == T.ARRAY and f.types[1] in ints,
    }[kind]
    if not ok:
        raise DrvqwenError(f"{source}: GGUF metadata key {key!r} has type {got}, expected {kind}")
    return f


def _utf8(raw: bytes, key: str, source: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DrvqwenError(f"{source}: GGUF metadata key {key!r}: not UTF-8 (byte {e.start})") from None


def _read_str(reader: GGUFReader, key: str, source: str) -> str:
    # A string field's parts are [length, bytes]; the bytes are the last part.
    return _utf8(_field(reader, key, source, "str").parts[-1].tobytes(), key, source)


def _read_str_array(reader: GGUFReader, key: str, source: str) -> list[str]:
    # An array field's parts are [item type, count, len0, bytes0, len1, bytes1, …] and `data`
    # lists the indices of the byte parts, one per element. (`ReaderField.contents()` does the
    # same but only exists in newer `gguf` releases.)
    f = _field(reader, key, source, "str[]")
    return [_utf8(f.parts[i].tobytes(), key, source) for i in f.data]


def _read_int_array(reader: GGUFReader, key: str, source: str) -> list[int]:
    # Numeric arrays: each element is its own one-item part, indexed by `data`.
    f = _field(reader, key, source, "int[]")
    return [int(f.parts[i][0]) for i in f.data]


# ---- building the tokenizer ---------------------------------------------------------------------

def build_tokenizer_from_gguf(path_or_reader: str | os.PathLike | GGUFReader) -> tokenizers.Tokenizer:
    """Build Qwen2's byte-level BPE tokenizer from a GGUF's `tokenizer.ggml.*` metadata.

    Args:
        path_or_reader: a `.gguf` path, or an open `gguf.GGUFReader` (the converter passes the
            one it already has: parsing the 0.5B file's metadata takes ~12 s in `gguf` 0.19).

    Returns:
        A `tokenizers.Tokenizer` with every GGUF token at its GGUF id except llama.cpp's unused
        filler rows (type 5, `[PAD151665]` …: ids 151665…151935 of the 0.5B, which decode to
        nothing, as in Qwen2's tokenizer.json), control tokens (type 3) added as special
        tokens and user-defined tokens (type 4, `<tool_call>`) as plain added tokens.

    Raises:
        DrvqwenError: the file is missing or not GGUF; a key is missing or mistyped;
            `tokenizer.ggml.model` is not "gpt2" or `tokenizer.ggml.pre` not "qwen2"; the token
            and type arrays differ in length; a merge is not two tokens; tokens collide.
    """
    reader, source = _open_reader(path_or_reader)
    model = _read_str(reader, "tokenizer.ggml.model", source)
    if model != "gpt2":
        raise DrvqwenError(f"{source}: tokenizer.ggml.model={model!r}, expected 'gpt2' (byte-level BPE)")
    pre = _read_str(reader, "tokenizer.ggml.pre", source)
    if pre != "qwen2":
        raise DrvqwenError(f"{source}: tokenizer.ggml.pre={pre!r}, expected 'qwen2'")
    tokens = _read_str_array(reader, "tokenizer.ggml.tokens", source)
    types = _read_int_array(reader, "tokenizer.ggml.token_type", source)
    merges = _read_str_array(reader, "tokenizer.ggml.merges", source)
    if len(types) != len(tokens):
        raise DrvqwenError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries, "
                           f"tokenizer.ggml.tokens has {len(tokens)}")
    return _assemble(tokens, types, merges, source)


def _assemble(tokens: list[str], types: list[int], merges: list[str],
              source: str) -> tokenizers.Tokenizer:
    """The tokenizers pipeline from llama.cpp's vocabulary arrays (see the module docstring)."""
    added_types = (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    vocab: dict[str, int] = {}
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty == _TOKEN_UNUSED:
            # llama.cpp's filler rows ([PAD151665] …, up to the lm_head's padded size) stand for
            # no text: leaving them out makes them decode to nothing, as Qwen2's own
            # tokenizer.json (151665 ids) does, instead of to the literal "[PAD151700]".
            continue
        # BPE pieces must be spelled in the byte alphabet; llama.cpp keeps them so, but respell
        # any that are not from their UTF-8 bytes, as transformers' GGUF converter does. Added
        # tokens keep their literal text: it is what they match in the input.
        if ty not in added_types and not all(c in _CHAR_TO_BYTE for c in tok):
            tok = "".join(_BYTE_TO_CHAR[b] for b in tok.encode("utf-8"))
        if vocab.setdefault(tok, i) != i:
            raise DrvqwenError(f"{source}: tokenizer.ggml.tokens[{i}]={tok!r} duplicates "
                               f"entry {vocab[tok]}")

    pairs: list[tuple[str, str]] = []
    for i, m in enumerate(merges):
        # Byte-level pieces never contain a real space (it is spelled 'Ġ'), so one space
        # separates the two halves unambiguously.
        a, sep, b = m.partition(" ")
        if not sep or not a or not b or " " in b:
            raise DrvqwenError(f"{source}: tokenizer.ggml.merges[{i}]={m!r} is not 'left right'")
        pairs.append((a, b))

    try:
        tk = tokenizers.Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None,
                                      continuing_subword_prefix="", end_of_word_suffix="",
                                      fuse_unk=False, byte_fallback=False, ignore_merges=False))
    except Exception as e:  # tokenizers raises a bare Exception, e.g. a merge of unknown tokens
        raise DrvqwenError(f"{source}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens "
                           f"({str(e).splitlines()[0][:120]})") from None
    # The four stages below are those of Qwen2.5's tokenizer.json.
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        # use_regex=False: the split above already did GPT-2's job; this stage only maps bytes
        # to the byte alphabet.
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tk.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                             use_regex=False)
    tk.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)

    # Added tokens are matched whole in the raw text before normalization and splitting, so
    # "<|im_start|>" typed in a prompt is one id and not eight BPE pieces. normalized=False as
    # in tokenizer.json: they must match the text exactly. Adding a string already in the vocab
    # reuses its id, which keeps them at their GGUF rows.
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
    # (Unused rows are neither: they were left out of the vocabulary above.)
    tk.add_special_tokens(control)
    tk.add_tokens(user)
    for t in (*control, *user):
        if tk.token_to_id(t.content) != vocab.get(t.content):
            raise DrvqwenError(f"{source}: added token {t.content!r} did not keep its GGUF id "
                               f"{vocab.get(t.content)}")
    return tk


# ---- the wrapper the runtime uses -------------------------------------------------------------

class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the calls drvqwen needs.

    Build with `from_gguf` (conversion time) or `from_json` (from a `.nanoqwen` file).
    """

    def __init__(self, tk: tokenizers.Tokenizer, source: str = "tokenizer"):
        self._tk = tk
        self.source = source  # named in error messages (e.g. the .nanoqwen it came from)

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike | GGUFReader) -> "Tokenizer":
        """Build from a GGUF's metadata. Raises DrvqwenError as `build_tokenizer_from_gguf`."""
        return cls(build_tokenizer_from_gguf(path_or_reader))

    @classmethod
    def from_json(cls, text: str, source: str = "tokenizer") -> "Tokenizer":
        """Load tokenizer.json text (as written by `to_json`); `source` names where it came
        from in error messages (e.g. the .nanoqwen file).

        Raises:
            DrvqwenError: the text is not a valid tokenizer.json.
        """
        try:
            return cls(tokenizers.Tokenizer.from_str(text), source)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DrvqwenError(f"{source}: embedded tokenizer.json is invalid ({str(e).splitlines()[0]})") from None

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

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """Raw bytes of every id (index = id): what `StreamDecoder` concatenates.

        BPE pieces are mapped back from the byte alphabet; added tokens are their UTF-8 text;
        an id without a token (a gap) is b"". Built on first use (~0.2 s for 152k ids).
        """
        table = [b""] * self.text_vocab_size
        added = self._tk.get_added_tokens_decoder()
        for tok, i in self._tk.get_vocab(with_added_tokens=True).items():
            if i >= len(table) or tok == f"[PAD{i}]":
                continue                 # no text: llama.cpp's filler rows (text_vocab_size)
            if i in added:
                table[i] = added[i].content.encode("utf-8")
            else:
                # A character outside the byte alphabet can only come from a foreign
                # tokenizer.json; its UTF-8 bytes are the best guess at what it stands for.
                table[i] = b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE
                                    else c.encode("utf-8") for c in tok)
        return table

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) added tokens."""
        return frozenset(i for i, t in self._tk.get_added_tokens_decoder().items() if t.special)

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        """A new `StreamDecoder` over this tokenizer."""
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Incremental detokenization for streaming generated tokens to a terminal.

    One token may end in the middle of a multi-byte UTF-8 character (emoji and CJK are often
    split over two or three byte-level tokens). Decoding each token on its own would print
    U+FFFD for each fragment; instead the bytes are fed to an incremental UTF-8 decoder, which
    holds back an incomplete tail until the next token completes it. Concatenating every
    `push` and the final `flush` equals `Tokenizer.decode` of all the ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
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
        if not 0 <= token_id < len(self._bytes) or token_id in self._skip:
            return ""
        return self._utf8.decode(self._bytes[token_id])

    def flush(self) -> str:
        """End of stream: return what is held back (U+FFFD if it is an incomplete character)."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


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
