"""The JSON the server answers with: OpenAI's chat.completion / text_completion objects and their
stream chunks, llama.cpp's /infill object, and server-sent events.

Streams (OpenAI API reference, "Streaming"): one `data: {chunk}\\n\\n` event per piece of text,
a last chunk with `finish_reason`, a chunk with `usage` and no choices when the request set
`stream_options.include_usage`, then `data: [DONE]\\n\\n`. An /infill stream (llama.cpp's) is
`{content, stop: false}` events and a last event that is the whole answer's object with empty
content; it has no [DONE].

The /infill object carries llama.cpp's fields: `content`, `stop`, `stop_type` ("eos", "word",
"limit"), `stopping_word`, `tokens_evaluated` (prompt tokens), `tokens_predicted`,
`tokens_cached` (llama.cpp's n_past: the positions the KV cache holds after the request, the
prompt and the tokens that were run — the last token chosen, an end-of-generation one too, is
run only if the next step was already under way: on the GPU, not on the CPU),
`truncated` (the prompt was trimmed or the answer reached the end of the context) and
`timings` — plus `truncated_input` (what trimming cut), `finish_reason` and `usage`.
`response_fields` picks fields by path ("timings/prompt_n" names a nested one, and is the key
it is answered under), as llama.cpp does.
"""

from __future__ import annotations

import json
import secrets
import time

from .validate import GenerationRequest
from .worker import Outcome

_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "infill": "infill-"}


def new_id(kind: str) -> str:
    return _PREFIX[kind] + secrets.token_hex(12)


def sse(obj) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (`[DONE]` given as the str)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(o: Outcome) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompt tokens taken from the KV
    cache (as the OpenAI API reports its prompt caching, and llama.cpp's server its cache_n)."""
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": o.reused_tokens}}


def timings(o: Outcome) -> dict:
    """llama.cpp's `timings`: cache_n (prompt tokens reused from the KV cache), prompt_n
    (prompt tokens run) in prompt_ms (submitted → first token), predicted_n (tokens generated)
    in predicted_ms (first token → last; the per-token figures are over its n - 1 intervals,
    as `drvqwen run`'s decode rate). 0 where nothing was measured. A speculative request adds
    draft_n (tokens proposed) and draft_n_accepted, as llama.cpp's server does."""
    prompt_n, prompt_ms = o.prompt_tokens - o.reused_tokens, o.prompt_s * 1e3
    n, ms = o.completion_tokens, o.predicted_s * 1e3
    steps = n - 1 if n > 1 and ms > 0 else 0
    out = {"cache_n": o.reused_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
           "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n and prompt_ms > 0 else 0.0,
           "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
           "predicted_n": n, "predicted_ms": ms,
           "predicted_per_token_ms": ms / steps if steps else 0.0,
           "predicted_per_second": 1e3 * steps / ms if steps else 0.0}
    if o.draft_n is not None:
        out.update(draft_n=o.draft_n, draft_n_accepted=o.draft_n_accepted)
    return out


def pick_fields(obj: dict, paths: tuple[str, ...] | None) -> dict:
    """llama.cpp's `response_fields`: {path: value} for each path ("a/b" = obj["a"]["b"]) that
    exists; the whole object when no paths are given."""
    if not paths:
        return obj
    out = {}
    for path in paths:
        v, found = obj, True
        for key in path.split("/"):
            if isinstance(v, dict) and key in v:
                v = v[key]
            else:
                found = False
                break
        if found:
            out[path] = v
    return out


class Shaper:
    """Builds the objects of one response (one id and creation time for all its chunks).

    Args:
        request: the validated request (its kind: "chat", "completion" or "infill").
        model: the model id to report.
        fingerprint: system_fingerprint (drvqwen's version and device).
    """

    def __init__(self, request: GenerationRequest, model: str, fingerprint: str):
        self.request, self.kind, self.model, self.fingerprint = request, request.kind, model, fingerprint
        self.id, self.created = new_id(self.kind), int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def full(self, text: str, o: Outcome) -> dict:
        """The whole answer of a request without `stream`."""
        if self.kind == "infill":
            cut = self.request.prompt_cut or {}
            obj = {"index": 0, "content": text, "id_slot": 0, "stop": True, "model": self.model,
                   "stop_type": o.stop_type, "stopping_word": o.stopping_word, "finish_reason": o.finish_reason,
                   "tokens_evaluated": o.prompt_tokens, "tokens_predicted": o.completion_tokens,
                   "tokens_cached": o.cached_tokens,
                   "truncated": any(cut.values()) or o.context_full, "truncated_input": cut,
                   "timings": timings(o), "usage": usage(o)}
            return pick_fields(obj, self.request.response_fields)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": o.finish_reason}
            return {**self._base("chat.completion"), "choices": [choice], "usage": usage(o)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": o.finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage(o)}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        """A stream chunk carrying `text` (or, with finish_reason, the closing chunk)."""
        if self.kind == "infill":          # the last event is `full("", outcome)`
            return {"index": 0, "content": text or "", "stop": False}
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, o: Outcome) -> dict:
        """The last chunk before [DONE] when `stream_options.include_usage`: no choices, usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(o)}
