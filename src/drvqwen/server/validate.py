"""Request bodies → `GenerationRequest`: every field checked, every bad one a 400 naming it.

Fields follow the OpenAI API reference (chat completions, legacy completions) and llama.cpp's
server for /infill (`input_prefix`, `prompt`, `input_suffix`, `input_extra`, `n_predict`,
`n_indent`, `t_max_predict_ms`, `response_fields`). Extensions: `top_k` (0 = off),
`ignore_eos` (do not stop at end-of-generation tokens, `run --ignore-eos`), speculative
decoding (`speculative_lookup`: prompt lookup of up to N tokens, `run --lookup N`;
`speculative_draft`: the server's --draft model proposing up to K tokens, `run --draft-max K`)
and llama.cpp's `cache_prompt` on every route (default true: reuse the KV cache's common
prefix). Unknown
fields are ignored, as most OpenAI-compatible servers do, so that clients sending vendor extras
keep working; fields that would change the answer in a way drvqwen does not implement (n > 1,
logprobs, echo, tools, penalties …) are refused.

Defaults are the OpenAI API's: temperature 1, top_p 1, no stop strings, max_tokens 16 for
/v1/completions and the rest of the context for chat and /infill. The OpenAI routes refuse a
prompt or a max_tokens that does not fit the context (as the OpenAI API does); /infill trims its
prompt and stops at the end of the context instead, as llama.cpp's server does for editors. No `seed`: a fresh random
one (as the OpenAI API samples differently each time); with a `seed` the text is reproducible
and equal to `drvqwen run --seed` with the same options.
"""

from __future__ import annotations

import math
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import json_text
from ..sampler import SamplingParams
from ..speculative import MAX_PROPOSAL
from ..tokenizer import Tokenizer
from .api_errors import bad_field
from .prompts import chat_ids, fit_infill_ids, infill_ids
from .settings import MAX_STOP_CHARS, MAX_STOPS


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields that ask for something drvqwen does not do, and the value that asks for nothing.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
               "best_of": (None, 1), "logit_bias": (None, {}), "tools": (None, []),
               "functions": (None, []), "tool_choice": (None, "none"),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0)}
COMPLETION_DEFAULT_MAX_TOKENS = 16   # the OpenAI API's default for /v1/completions


@dataclass
class GenerationRequest:
    """One validated generation: what the worker runs and how the answer is shaped.

    prompt_ids: the prompt, every id a text-vocabulary id; max_tokens ≥ 1 (0 only for an
    /infill `n_predict: 0`: nothing is generated) with len(prompt_ids) + max_tokens ≤ the
    context; stops: the stop strings (text is cut before the first); include_usage: a last
    stream chunk with `usage`.
    """

    kind: str                     # "chat", "completion" or "infill"
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    # llama.cpp's controls (answer_text.py, worker.py): end at a line indented less than
    # n_indent; after t_max_predict_ms of generation, end at the next newline (≤ 0: off).
    n_indent: int = 0
    t_max_predict_ms: int = 0
    # /infill: max_tokens was lowered to the room the context leaves (reaching it truncates);
    # what trimming the prompt cut (prompts.fit_infill_ids); the fields to answer with.
    context_capped: bool = False
    prompt_cut: dict | None = None
    response_fields: tuple[str, ...] | None = None
    # llama.cpp's cache_prompt: reuse the KV cache's common prefix with the last sequence
    # (false: prefill the whole prompt).
    cache_prompt: bool = True
    # Speculative decoding: prompt lookup of up to `lookup` tokens, or the server's draft model
    # proposing up to `draft` tokens per verify pass; 0 = off (at most one of them is set).
    lookup: int = 0
    draft: int = 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise bad_field(name, f"must be a number, got {json_text(v)}", "invalid_type")
    if not lo <= v <= hi:
        raise bad_field(name, f"{json_text(v)} is outside [{lo:g}, {hi:g}]")
    return float(v)


def _integer(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad_field(name, f"must be an integer, got {json_text(v)}", "invalid_type")
    if v < lo or (hi is not None and v > hi):
        raise bad_field(name, f"{v} is outside [{lo}, {hi if hi is not None else '∞'}]")
    return v


def _bool(body: dict, name: str, default: bool = False, where: str | None = None) -> bool:
    """Field `name` of `body` (`where`: its path in the request, for the error) as a bool."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_field(where or name, f"must be true or false, got {json_text(v)}", "invalid_type")
    return v


def _string(v, name: str) -> str:
    if not isinstance(v, str):
        raise bad_field(name, f"must be a string, got {json_text(v)}", "invalid_type")
    return v


def _text(obj: dict, name: str, where: str | None = None) -> str:
    """Field `name` of `obj` as a string, "" when absent or null (llama.cpp's reading)."""
    v = obj.get(name)
    return "" if v is None else _string(v, where or name)


def _field_paths(body: dict) -> tuple[str, ...] | None:
    v = body.get("response_fields")
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_field("response_fields", "must be a list of field names ('timings/prompt_n' for a "
                                           "nested one)", "invalid_type")
    return tuple(_string(f, f"response_fields[{i}]") for i, f in enumerate(v))


class RequestParser:
    """Turns the JSON body of each route into a `GenerationRequest` for one model.

    Args:
        tok: the model's tokenizer.
        max_context: the server's context in tokens (prompt + generated ≤ it).
        text_vocab: ids below it have text; a prompt id at or above it is refused (the lm_head's
            padded rows stand for nothing).
        random_seed: the seed of a request that gives none (tests pass a fixed one).
        draft_max: the server's `--draft-max` when it has a draft model (the default of
            `speculative_draft`), 0 when it has none.
    """

    def __init__(self, tok: Tokenizer, max_context: int, text_vocab: int,
                 random_seed: Callable[[], int] = lambda: secrets.randbits(63), draft_max: int = 0):
        self.tok, self.max_context, self.text_vocab = tok, max_context, text_vocab
        self.random_seed = random_seed
        self.draft_max = draft_max
        # Tokenizer.encode sets the shared `tokenizers` object's special-token mode before
        # each call; requests are parsed on a thread pool, so one at a time, or a chat message
        # could be encoded in another request's raw mode.
        self._lock = threading.Lock()

    def parse(self, kind: str, body: dict) -> GenerationRequest:
        """The `GenerationRequest` of route `kind` ("chat", "completion", "infill").

        Raises:
            APIError 400: a field is missing, of the wrong type or out of range (named in
                the message and in `param`), or the prompt does not fit the context.
        """
        with self._lock:
            return {"chat": self.chat, "completion": self.completion, "infill": self.infill}[kind](body)

    # ---- the three routes -----------------------------------------------------------------
    def chat(self, body: dict) -> GenerationRequest:
        """POST /v1/chat/completions: `messages` (plain text) in the ChatML template."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad_field("messages", "must be a non-empty list of {role, content} objects",
                            "invalid_type" if msgs is not None else "missing")
        pairs = [self._message(m, f"messages[{i}]") for i, m in enumerate(msgs)]
        max_tokens = body.get("max_completion_tokens")
        name = "max_completion_tokens" if max_tokens is not None else "max_tokens"
        req = self._common(body, "chat", chat_ids(self.tok, pairs), "messages")
        req.max_tokens = self._max_tokens(body, len(req.prompt_ids), name, None)
        return req

    def completion(self, body: dict) -> GenerationRequest:
        """POST /v1/completions: `prompt` is raw model input (special tokens parsed, like
        `drvqwen run --raw`); with `suffix`, fill-in-the-middle of prompt and suffix as plain
        text (like `run --fim-prefix --fim-suffix`)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]            # a batch of one
        suffix = body.get("suffix")
        if suffix is not None:
            ids = infill_ids(self.tok, _string(prompt, "prompt"), _string(suffix, "suffix"))
        elif isinstance(prompt, str):
            ids = self.tok.encode(prompt, special=True)
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            ids = list(prompt)   # [] is caught with "" below: the prompt is empty
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise bad_field("prompt", f"a batch of {len(prompt)} prompts; one prompt per request")
        elif prompt is None:
            raise bad_field("prompt", "is required", "missing")
        else:
            raise bad_field("prompt", "must be a string or a list of token ids", "invalid_type")
        req = self._common(body, "completion", ids, "prompt")
        req.max_tokens = self._max_tokens(body, len(ids), "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        return req

    def infill(self, body: dict) -> GenerationRequest:
        """POST /infill, read as llama.cpp's server reads it: input_prefix, `prompt` (the text
        left of the cursor on its line: it continues the prefix, before <|fim_suffix|>),
        input_suffix, optional input_extra [{filename, text}] and repo_name/filename;
        n_predict (or max_tokens; -1 or absent: the rest of the context, 0: nothing generated),
        n_indent, t_max_predict_ms, response_fields.

        A prompt that leaves the answer less than min(n_predict, context / 2) tokens is trimmed
        to leave that much (`fit_infill_ids`); an answer that reaches the end of the context
        stops there (`context_capped`).
        """
        prefix = _text(body, "input_prefix") + _text(body, "prompt")
        suffix = _text(body, "input_suffix")
        extra_in = body.get("input_extra") or []
        if not isinstance(extra_in, list):
            raise bad_field("input_extra", "must be a list of {filename, text} objects", "invalid_type")
        extra = []
        for i, ch in enumerate(extra_in):
            where = f"input_extra[{i}]"
            if not isinstance(ch, dict):
                raise bad_field(where, "must be an object {filename, text}", "invalid_type")
            extra.append((_text(ch, "filename", where + ".filename"), _text(ch, "text", where + ".text")))
        name = "n_predict" if body.get("n_predict") is not None else "max_tokens"
        n_predict = _integer(body, name, None, -1)
        if n_predict == -1:                         # llama.cpp: -1 = until the end
            n_predict = None
        fields = _field_paths(body)
        # The room kept for the answer: what it asks for, but never more than half the context
        # (the prompt keeps the other half); at least one token.
        reserve = 1 if n_predict is None else max(1, min(n_predict, self.max_context // 2))
        ids, cut = fit_infill_ids(self.tok, prefix, suffix, extra, _text(body, "repo_name"),
                                  _text(body, "filename"), limit=self.max_context - reserve)
        req = self._common(body, "infill", ids, "input_prefix")
        room = self.max_context - len(ids)
        req.max_tokens = room if n_predict is None else min(n_predict, room)
        req.context_capped = n_predict is None or n_predict > room
        req.prompt_cut, req.response_fields = cut, fields
        return req

    # ---- shared fields ----------------------------------------------------------------------
    def _message(self, m, where: str) -> tuple[str, str]:
        if not isinstance(m, dict):
            raise bad_field(where, "must be an object {role, content}", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_field(where + ".role", f"{json_text(role)} is not one of {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        if isinstance(content, list):      # content parts: only text ones
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad_field(f"{where}.content[{j}]", "only {type: text, text} parts are supported")
                texts.append(_string(part.get("text"), f"{where}.content[{j}].text"))
            content = "".join(texts)
        return CHAT_ROLES[role], _string(content, where + ".content")

    def _common(self, body: dict, kind: str, ids: list[int], prompt_field: str) -> GenerationRequest:
        """The fields every route shares, and the prompt's checks; max_tokens is left at 0
        for the route to set."""
        for name, allowed in UNSUPPORTED.items():
            if name in body and body[name] not in allowed:
                raise bad_field(name, f"{json_text(body[name])} is not supported by drvqwen", "unsupported")
        if "n" in body and body["n"] not in (None, 1):
            raise bad_field("n", f"{json_text(body['n'])}: drvqwen generates one choice per request (n = 1)",
                            "unsupported")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise bad_field("response_format", f"{json_text(fmt)}: only {{type: text}} is supported", "unsupported")
        model = body.get("model")
        if model is not None:
            _string(model, "model")
        stream = _bool(body, "stream")
        opts = body.get("stream_options")
        include_usage = False
        if opts is not None:
            if not stream:
                raise bad_field("stream_options", "is only allowed when stream is true")
            if not isinstance(opts, dict):
                raise bad_field("stream_options", "must be an object", "invalid_type")
            include_usage = _bool(opts, "include_usage", where="stream_options.include_usage")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        top_k = _integer(body, "top_k", 0, 0)
        seed = _integer(body, "seed", None, -(2**63), 2**64 - 1)
        params = SamplingParams(temperature, top_k, top_p, self.random_seed() if seed is None else seed)
        stops = self._stops(body.get("stop"))
        ignore_eos = _bool(body, "ignore_eos")

        n = len(ids)
        if n == 0:
            raise bad_field(prompt_field, "the prompt is empty (0 tokens)")
        bad = next((t for t in ids if not 0 <= t < self.text_vocab), None)
        if bad is not None:
            raise bad_field(prompt_field, f"token id {bad} is outside the text vocabulary [0, {self.text_vocab})")
        if self.max_context - n < 1:
            raise bad_field(prompt_field, f"the prompt is {n} tokens; the context is {self.max_context} "
                                          f"tokens and must leave room for one more",
                            "context_length_exceeded")
        lookup, draft = self._speculation(body)
        return GenerationRequest(kind, ids, 0, params, stops, stream, include_usage, ignore_eos,
                                 n_indent=_integer(body, "n_indent", 0, 0),
                                 t_max_predict_ms=max(0, _integer(body, "t_max_predict_ms", 0, -(2**31))),
                                 cache_prompt=_bool(body, "cache_prompt", True), lookup=lookup, draft=draft)

    def _speculation(self, body: dict) -> tuple[int, int]:
        """(speculative_lookup, speculative_draft): at most one of them > 0. The draft model
        proposes by default (`draft_max`) on a server that has one, unless the request asks for
        prompt lookup or sends speculative_draft: 0."""
        lookup = _integer(body, "speculative_lookup", 0, 0, MAX_PROPOSAL)
        asked = body.get("speculative_draft")
        draft = _integer(body, "speculative_draft", 0, 0, MAX_PROPOSAL)
        if draft and not self.draft_max:
            raise bad_field("speculative_draft", "the server has no draft model (drvqwen serve --draft MODEL)",
                            "unsupported")
        if lookup and draft:
            raise bad_field("speculative_lookup", "with speculative_draft: choose one way to propose tokens")
        if asked is None and not lookup:
            draft = self.draft_max
        return lookup, draft

    def _max_tokens(self, body: dict, n_prompt: int, max_field: str, default_max: int | None) -> int:
        """The OpenAI routes' max_tokens: at least 1, refused past the context."""
        room = self.max_context - n_prompt
        max_tokens = _integer(body, max_field, None, 1)
        if max_tokens is None:
            return room if default_max is None else min(default_max, room)
        if max_tokens > room:
            raise bad_field(max_field, f"{max_tokens} new tokens after a prompt of {n_prompt} exceed the context "
                                       f"of {self.max_context} tokens (at most {room})",
                            "context_length_exceeded")
        return max_tokens

    @staticmethod
    def _stops(stop) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list):
            raise bad_field("stop", "must be a string or a list of strings", "invalid_type")
        if len(items) > MAX_STOPS:
            raise bad_field("stop", f"{len(items)} stop strings, at most {MAX_STOPS}")
        for i, s in enumerate(items):
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            _string(s, where)
            if not s or len(s) > MAX_STOP_CHARS:
                raise bad_field(where, f"must be 1 to {MAX_STOP_CHARS} characters, got {len(s)}")
        return tuple(items)
