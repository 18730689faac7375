"""The JSON the server answers with: OpenAI's chat.completion / text_completion objects and their
stream chunks, llama.cpp's /infill object, and server-sent events.

Streams (OpenAI API reference, "Streaming"): one `data: {chunk}\\n\\n` event per piece of text,
a last chunk with `finish_reason`, a chunk with `usage` and no choices when the request set
`stream_options.include_usage`, then `data: [DONE]\\n\\n`.
"""

from __future__ import annotations

import json
import secrets
import time

from .worker import Outcome

_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "infill": "infill-"}


def new_id(kind: str) -> str:
    return _PREFIX[kind] + secrets.token_hex(12)


def sse(obj) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (`[DONE]` given as the str)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(o: Outcome) -> dict:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens}


class Shaper:
    """Builds the objects of one response (one id and creation time for all its chunks).

    Args:
        kind: "chat", "completion" or "infill".
        model: the model id to report.
        fingerprint: system_fingerprint (drvqwen's version and device).
    """

    def __init__(self, kind: str, model: str, fingerprint: str):
        self.kind, self.model, self.fingerprint = kind, model, fingerprint
        self.id, self.created = new_id(kind), int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def full(self, text: str, o: Outcome) -> dict:
        """The whole answer of a request without `stream`."""
        if self.kind == "infill":
            return {"content": text, "model": self.model, "stop": True, "finish_reason": o.finish_reason,
                    "tokens_evaluated": o.prompt_tokens, "tokens_predicted": o.completion_tokens,
                    "usage": usage(o)}
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": o.finish_reason}
            return {**self._base("chat.completion"), "choices": [choice], "usage": usage(o)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": o.finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage(o)}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        """A stream chunk carrying `text` (or, with finish_reason, the closing chunk)."""
        if self.kind == "infill":
            return {"content": text or "", "stop": finish_reason is not None,
                    **({"finish_reason": finish_reason} if finish_reason else {})}
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
