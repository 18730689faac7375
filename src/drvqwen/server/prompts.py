"""Prompt ids for the server's three ways in: chat messages, a raw completion, fill-in-the-middle.

Every piece of text a client sends as a message or as code is plain text (`Tokenizer.encode`
with special=False): `<|im_end|>` inside a message cannot close its turn. Only a
`/v1/completions` prompt is raw model input, special tokens parsed, like `drvqwen run --raw`.
An /infill prompt too long for the context is trimmed as llama.cpp's server trims it
(`fit_infill_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tokenizer import DEFAULT_SYSTEM, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, IM_END, IM_START, Tokenizer
from .api_errors import bad_field

REPO_NAME = "<|repo_name|>"
FILE_SEP = "<|file_sep|>"


def chat_ids(tok: Tokenizer, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Ids of a conversation in Qwen2.5's ChatML template, ending where the answer begins.

    Args:
        messages: (role, content) pairs, role in {"system", "user", "assistant"}.
    Returns:
        `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`;
        Qwen's default system turn first when the first message is not a system one (as the
        official template does). For one user message this is exactly `Tokenizer.chat(user)`,
        the prompt of `drvqwen run --prompt`.
    """
    start, end = tok.control_id(IM_START), tok.control_id(IM_END)
    nl = tok.encode("\n")
    if not messages or messages[0][0] != "system":
        messages = [("system", DEFAULT_SYSTEM), *messages]
    ids: list[int] = []
    for role, content in messages:
        ids += [start, *tok.encode(f"{role}\n{content}"), end, *nl]
    return ids + [start, *tok.encode("assistant\n")]


def infill_ids(tok: Tokenizer, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (),
               repo_name: str = "", filename: str = "") -> list[int]:
    """Ids of a fill-in-the-middle prompt, with other files of the project as context.

    Without `extra`: `Tokenizer.fim(prefix, suffix)`, the prompt of `drvqwen run --fim-prefix
    --fim-suffix`. With `extra` ((filename, text) pairs), Qwen2.5-Coder's repository-level form
    (Qwen2.5-Coder technical report, §3 and its README's "repository-level code completion"):

        <|repo_name|>{repo_name}\\n<|file_sep|>{name}\\n{text}\\n … <|file_sep|>{filename}\\n
        <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

    Raises:
        APIError 400 (param input_extra): `extra` is given and the vocabulary lacks
            <|repo_name|> or <|file_sep|>.
    """
    return fit_infill_ids(tok, prefix, suffix, extra, repo_name, filename)[0]


def fit_infill_ids(tok: Tokenizer, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (),
                   repo_name: str = "", filename: str = "", limit: int | None = None) -> tuple[list[int], dict]:
    """`infill_ids`, trimmed to at most `limit` ids as llama.cpp's server trims an /infill prompt.

    What does not fit goes in this order (llama.cpp's `format_infill`: the extra context fills
    what the prefix and suffix leave, and they share the rest 3:1):
    1. the extra chunks, whole and oldest first (editors send them oldest first);
    2. then, if the prefix and suffix alone do not fit, the prefix is cut from the left and the
       suffix from the right to their shares of what is left: 3/4 for the prefix (the code the
       completion continues), 1/4 for the suffix, a share one side does not need going to the
       other.
    Without every chunk the prompt is the plain FIM form.

    Returns:
        (ids, cut): cut = {"input_extra": chunks dropped, "input_prefix": prefix tokens cut,
        "input_suffix": suffix tokens cut}.
    Raises:
        APIError 400 (input_extra): as infill_ids. (input_prefix, context_length_exceeded): not
            even the three FIM tokens fit `limit`.
    """
    pre, suf = tok.encode(prefix), tok.encode(suffix)
    fim = [tok.control_id(FIM_PREFIX), tok.control_id(FIM_SUFFIX), tok.control_id(FIM_MIDDLE)]
    chunks: list[list[int]] = []
    head: list[int] = []
    tail: list[int] = []
    if extra:
        repo, sep = tok.token_to_id(REPO_NAME), tok.token_to_id(FILE_SEP)
        if repo is None or sep is None:
            raise bad_field("input_extra", f"this model's vocabulary has no {REPO_NAME} / {FILE_SEP} "
                                           f"tokens for repository-level context")
        head = [repo, *tok.encode(f"{repo_name}\n")]
        chunks = [[sep, *tok.encode(f"{name}\n{text}\n")] for name, text in extra]
        tail = [sep, *tok.encode(f"{filename}\n")]
    cut = {"input_extra": 0, "input_prefix": 0, "input_suffix": 0}
    if limit is not None:
        n_fim = len(pre) + len(suf) + len(fim)
        n_extra = len(head) + len(tail) + sum(map(len, chunks))
        while chunks and n_fim + n_extra > limit:
            n_extra -= len(chunks.pop(0))
            cut["input_extra"] += 1
        if not chunks:
            head = tail = []
        room = limit - len(fim)
        if room < 0:
            raise bad_field("input_prefix", f"the context of {limit} tokens has no room for a "
                                            f"fill-in-the-middle prompt", "context_length_exceeded")
        if len(pre) + len(suf) > room:
            keep_suf = min(len(suf), max(room // 4, room - len(pre)))
            keep_pre = min(len(pre), room - keep_suf)
            cut["input_prefix"], cut["input_suffix"] = len(pre) - keep_pre, len(suf) - keep_suf
            pre, suf = pre[len(pre) - keep_pre:], suf[:keep_suf]
    ids = [fim[0], *pre, fim[1], *suf, fim[2]]
    if chunks:
        ids = [*head, *(t for c in chunks for t in c), *tail, *ids]
    return ids, cut
