"""What `drvqwen serve` is started with: where it listens, who may call it, how much it takes."""

from __future__ import annotations

from dataclasses import dataclass

# 127.0.0.1: reachable from this machine only. Listening on every interface is a choice the
# user makes with --host 0.0.0.0 (and then --api-key).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Requests waiting behind the one that runs; one more gets 503 with Retry-After.
DEFAULT_QUEUE_SIZE = 64
# The largest request body read (bytes). 4 MiB holds ~1M tokens of code, more than any context.
DEFAULT_MAX_BODY_BYTES = 4 << 20
# Stop strings per request and characters per stop string (llama.cpp has no limit, OpenAI
# allows 4; editors send a dozen or so for fill-in-the-middle).
MAX_STOPS = 32
MAX_STOP_CHARS = 256
# Seconds a client is told to wait (Retry-After) when the queue is full.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerSettings:
    """The server's options (the `drvqwen serve` flags).

    Attributes:
        host, port: where to listen (port 0: a free port, as the tests use).
        api_key: when set, every route but /health needs `Authorization: Bearer <api_key>`.
        queue_size: requests that may wait (≥ 1); the one running is not counted.
        max_body_bytes: the largest request body; a larger one gets 413.
        model_name: the id /v1/models lists and every response carries (default: the file's stem).
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    queue_size: int = DEFAULT_QUEUE_SIZE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_name: str = "drvqwen"
