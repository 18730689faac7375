"""Qwen2's tokenizer rebuilt from a GGUF's metadata, and the byte alphabet of byte-level BPE.

A GGUF carries no tokenizer.json, only llama.cpp's metadata: the token strings, the BPE merges,
a type per token and the name of the pre-tokenizer. `build_tokenizer_from_gguf` rebuilds from
those the same pipeline as Qwen2's own tokenizer.json on the Hugging Face hub:

    NFC normalizer → Split(Qwen2 regex, Isolated) → ByteLevel(no prefix space, no regex)
    → BPE (byte-level alphabet) → ByteLevel decoder,

plus the control tokens (`<|im_start|>` …) as special added tokens. The converter serializes
the result as tokenizer.json text and embeds it in the `.nanoqwen` file, so the runtime
(tokenizer.py) never needs the GGUF again (docs/file-format.md, docs/model.md#the-tokenizer).

The tests hold it against `transformers`' own GGUF conversion
(`transformers.integrations.gguf.gguf_tokenizer_mapping`). One deliberate difference: that path
builds a GPT-2 pipeline with no normalizer, while Qwen2's tokenizer.json normalizes to NFC; we
follow tokenizer.json, which is what the model was trained with. The two agree on NFC text.
"""

from __future__ import annotations

import os
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

# llama.cpp's token types (`llama_token_type` / gguf.TokenType): 1 normal, 2 unknown, 3 control,
# 4 user-defined, 5 unused, 6 byte.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
_TOKEN_UNUSED = 5


# ---- the byte alphabet --------------------------------------------------------------------------

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


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


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
        if ty not in added_types and not all(c in CHAR_TO_BYTE for c in tok):
            tok = "".join(BYTE_TO_CHAR[b] for b in tok.encode("utf-8"))
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
