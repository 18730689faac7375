"""Prompt ids for the server's three ways in: chat messages, a raw completion, fill-in-the-middle.

Every piece of text a client sends as a message or as code is plain text (`Tokenizer.encode`
with special=False): `<|im_end|>` inside a message cannot close its turn. Only a
`/v1/completions` prompt is raw model input, special tokens parsed, like `drvqwen run --raw`.
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
    fim = [tok.control_id(FIM_PREFIX), *tok.encode(prefix), tok.control_id(FIM_SUFFIX),
           *tok.encode(suffix), tok.control_id(FIM_MIDDLE)]
    if not extra:
        return fim
    repo, sep = tok.token_to_id(REPO_NAME), tok.token_to_id(FILE_SEP)
    if repo is None or sep is None:
        raise bad_field("input_extra", f"this model's vocabulary has no {REPO_NAME} / {FILE_SEP} "
                                       f"tokens for repository-level context")
    ids = [repo, *tok.encode(f"{repo_name}\n")]
    for name, text in extra:
        ids += [sep, *tok.encode(f"{name}\n{text}\n")]
    return ids + [sep, *tok.encode(f"{filename}\n")] + fim
