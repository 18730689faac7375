"""What every request passes through before and after the routes: the Host check, the request
log, and a quiet end when the server stops.

The Host check: a server on 127.0.0.1 is reachable by every web page the user opens — a page
of evil.example whose name the attacker re-points at 127.0.0.1 (DNS rebinding) talks to it as
its own origin, and the browser sends `Host: evil.example`. So only the names this machine
gives itself are served: localhost, 127.0.0.1, [::1], the address it is bound to and the names
of `--allowed-hosts` (a port in Host is ignored); anything else is 403 before any route runs.
On every interface (`--host 0.0.0.0`) clients use names drvqwen cannot know, so that takes
`--allowed-hosts` or `--api-key` (the key then guards it: a page cannot send one), checked by
settings.check_bind before the server starts; settings.served_hosts gives the names. (JSON
bodies only, the other half of it, is app.py's `read_json`: 415 for a body a page can post
without a CORS preflight.)

The request log: one line per request when it is answered — a stream when it ends —
`METHOD PATH STATUS [P+C tokens] MS ms[: error message]`, so that a client's 4xx are seen.
The routes leave the token counts and the error in the request's state (`note_tokens`,
`note_error`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from .api_errors import APIError
from .settings import host_name

TOKENS_KEY, ERROR_KEY = "drvqwen.tokens", "drvqwen.error"


def note_tokens(request, prompt: int, completion: int) -> None:
    """Record a generation's token counts for the request's log line."""
    request.scope.setdefault("state", {})[TOKENS_KEY] = (prompt, completion)


def note_error(request, message: str) -> None:
    """Record why a request was refused or failed, for its log line."""
    request.scope.setdefault("state", {})[ERROR_KEY] = message


def _printable(text: str, limit: int = 300) -> str:
    """Text safe on one log line: control characters escaped, at most `limit` characters."""
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return out if len(out) <= limit else out[: limit - 1] + "…"


class Gate:
    """ASGI middleware around the app: the Host check, the request log, the end at shutdown.

    Args:
        app: the Starlette app.
        hosts: the Host names served (`served_hosts`), None for any.
        log: called with each request's log line; None logs nothing (`--quiet`).
    """

    def __init__(self, app, hosts: frozenset[str] | None, log: Callable[[str], None] | None = None):
        self.app, self.hosts, self.log = app, hosts, log
        self.shutting_down = False

    def _host_ok(self, scope) -> str | None:
        """None when the Host is served, else the refusal's message."""
        if self.hosts is None:
            return None
        values = [v for k, v in scope.get("headers", ()) if k == b"host"]
        if not values:                    # HTTP/1.0 without Host: no browser sends that
            return None
        raw = values[0].decode("latin-1")
        if host_name(raw) in self.hosts:
            return None
        return (f"Host {raw!r} is not served: this server answers as {', '.join(sorted(self.hosts))} "
                f"(drvqwen serve --allowed-hosts adds names)")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        status = {"code": None}

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._host_ok(scope)
            if refusal is not None:
                state[ERROR_KEY] = refusal
                await APIError(403, refusal, code="forbidden_host").response()(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        except asyncio.CancelledError:
            # Ctrl-C a second time (or the graceful wait over): uvicorn cancels what still
            # runs. The responses were ended by EngineWorker.shutdown; nothing to report.
            if not self.shutting_down:
                raise
            state.setdefault(ERROR_KEY, "stopped: the server is shutting down")
        finally:
            if self.log is not None:
                self.log(self._line(scope, status["code"], state, time.perf_counter() - t0))

    @staticmethod
    def _line(scope, code: int | None, state: dict, seconds: float) -> str:
        tokens = state.get(TOKENS_KEY)
        parts = [scope["method"], _printable(scope["path"], 200), str(code) if code is not None else "-"]
        if tokens is not None:
            parts.append(f"{tokens[0]}+{tokens[1]} tokens")
        parts.append(f"{seconds * 1e3:.1f} ms")
        line = " ".join(parts)
        error = state.get(ERROR_KEY)
        return f"{line}: {_printable(error)}" if error else line
