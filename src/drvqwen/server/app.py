"""The Starlette application: routes, the API key, the body limit, errors as OpenAI JSON.

    POST /v1/chat/completions   messages → ChatML (plain text)           OpenAI chat.completion
    POST /v1/completions        prompt: raw model input (special tokens  OpenAI text_completion
                                parsed); with suffix: fill-in-the-middle
    POST /infill                input_prefix/prompt/input_suffix/        llama.cpp's /infill
                                input_extra
    GET  /v1/models             the one model
    GET  /v1/models/{id}        the model, if that is its id
    GET  /health                model, device, queue length, KV pages, tokens cached (no key needed)
    GET  /metrics               Prometheus text

The handlers only parse, validate and wait: the model runs on the worker thread (worker.py).
A client that goes away — mid-stream or while waiting for a whole answer — cancels its job,
so its generation stops within one decode step (what it ran stays in the KV cache for the next
request to reuse, worker.py).
Around the routes, middleware.py's Gate checks the Host and logs each request.
"""

from __future__ import annotations

import asyncio
import hmac
import json

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from ..errors import json_text
from .api_errors import APIError
from .metrics import CONTENT_TYPE
from .middleware import Gate, note_error, note_tokens
from .responses import Shaper, sse
from .settings import ServerSettings, served_hosts
from .validate import RequestParser
from .worker import EngineWorker, Job

# Deeper JSON than this is no request of ours, and Python's parser would recurse on it.
MAX_JSON_DEPTH = 64


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always watches for the client going away.

    Starlette's StreamingResponse notices a disconnect only on the next write under ASGI 2.4;
    here the stream is cancelled as soon as the server sees the connection close, and
    `on_close` runs however the response ended (the job is cancelled, its pages freed);
    `on_gone` runs first when it ended because the client went away before the last event (the
    request's log line says so: the stream's own end, which notes the tokens, never came).
    """

    media_type = "text/event-stream"

    def __init__(self, content, on_close, on_gone=None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close
        self.on_gone = on_gone

    async def __call__(self, scope, receive, send) -> None:
        streamed = False
        try:
            async with anyio.create_task_group() as tg:
                async def run_stream() -> None:
                    nonlocal streamed
                    try:
                        await self.stream_response(send)
                        streamed = True
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(run_stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            if not streamed and self.on_gone is not None:
                self.on_gone()
            self.on_close()


def _json_depth_ok(raw: bytes) -> bool:
    depth = 0
    in_str = esc = False
    for b in raw:
        if in_str:
            esc, in_str = (False, True) if esc else (b == 0x5C, b != 0x22)
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError 415: the body is not declared `application/json` (parameters such as
            charset allowed): a web page can send text/plain, form and multipart bodies to any
            address without a CORS preflight, so only JSON is read (middleware.py).
        APIError 413: the body is larger than `limit` bytes (checked while reading).
        APIError 400: not UTF-8 JSON, NaN/Infinity, nested deeper than MAX_JSON_DEPTH, or
            not an object.
    """
    ctype = request.headers.get("content-type")
    if (ctype or "").split(";", 1)[0].strip().lower() != "application/json":
        got = f"got {ctype!r}" if ctype is not None else "none was given"
        raise APIError(415, f"the body must be JSON, sent with Content-Type: application/json ({got})",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes "
                            f"(--max-body-bytes)", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)",
                           code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not _json_depth_ok(raw):
        raise APIError(400, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except json.JSONDecodeError as e:
        raise APIError(400, f"body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                       code="invalid_json") from None
    except ValueError as e:   # not UTF-8, or NaN/Infinity
        raise APIError(400, f"body is not valid JSON: {str(e).splitlines()[0][:160]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"body must be a JSON object, got {json_text(body)}", code="invalid_json")
    _check_text(body, "")
    return body


def _check_text(obj, path: str) -> None:
    """Refuse strings that are not Unicode text: JSON's \\ud800 escapes give lone surrogates,
    which no encoder (the tokenizer included) accepts."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{path or 'body'}: a lone surrogate {obj[e.start]!r} at offset {e.start} "
                                f"is not text", param=path or None, code="invalid_value") from None
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_text(k, path)
            _check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_text(v, f"{path}[{i}]")


def create_app(worker: EngineWorker, parser: RequestParser, settings: ServerSettings, device: str,
               log=None) -> Gate:
    """The ASGI app serving `worker`'s model: the routes inside the Gate (Host check, log).

    Args:
        worker: the started engine worker (its model loaded).
        parser: validates request bodies for this model.
        settings: API key, body limit, model name, the address and the Host names to serve.
        device: "cuda" or "cpu", for /health and system_fingerprint.
        log: called with one line per request; None: no log.
    """
    metrics = worker.metrics
    fingerprint = f"drvqwen-{__version__}-{device}"
    model_name = settings.model_name

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    def answered(request: Request, response: Response, error: APIError | None = None) -> Response:
        # Labelled by the route's template, not the path: a client's made-up paths and model
        # ids must not grow the metrics without bound.
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        if error is not None:
            note_error(request, error.message)
        return response

    async def generation(request: Request, kind: str) -> Response:
        try:
            authorize(request)
            body = await read_json(request, settings.max_body_bytes)
            req = await run_in_threadpool(parser.parse, kind, body)   # tokenizing: off the loop
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()

            def emit(ev: tuple) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, ev)
                except RuntimeError:        # the loop is gone (shutting down): nobody listens
                    pass

            job = Job(req, emit)
            worker.submit(job)
        except APIError as e:
            return answered(request, e.response(), e)
        shaper = Shaper(req, model_name, fingerprint)
        if req.stream:
            return answered(request, SSEResponse(_stream(request, shaper, events), job.cancel,
                                                 lambda: note_error(request, "cancelled: the client went away")))
        return answered(request, await _collect(request, shaper, job, events))

    def _ended(request: Request, outcome) -> None:
        note_tokens(request, outcome.prompt_tokens, outcome.completion_tokens)
        if outcome.finish_reason == "cancelled":
            note_error(request, "cancelled: the client went away")

    async def _stream(request: Request, shaper: Shaper, events: asyncio.Queue):
        if shaper.kind == "chat":
            yield sse(shaper.chunk("", first=True))
        while True:
            what, value = await events.get()
            if what == "text":
                yield sse(shaper.chunk(value))
                continue
            if what == "error":             # the stream did not complete: no [DONE]
                note_error(request, value.message)
                yield sse(value.body())
                return
            _ended(request, value)
            if value.finish_reason == "cancelled":      # its client is gone
                return
            if shaper.kind == "infill":     # llama.cpp's last event: the whole object, no content
                yield sse(shaper.full("", value))
                return
            yield sse(shaper.chunk(None, value.finish_reason))
            if shaper.request.include_usage:
                yield sse(shaper.usage_chunk(value))
            yield sse("[DONE]")
            return

    async def _collect(request: Request, shaper: Shaper, job: Job, events: asyncio.Queue) -> Response:
        parts: list[str] = []
        result: Response | None = None
        async with anyio.create_task_group() as tg:
            async def watch() -> None:      # the client leaving cancels the job
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                job.cancel()

            tg.start_soon(watch)
            while result is None:
                what, value = await events.get()
                if what == "text":
                    parts.append(value)
                elif what == "error":
                    note_error(request, value.message)
                    result = value.response()
                else:
                    _ended(request, value)
                    result = JSONResponse(shaper.full("".join(parts), value))
            tg.cancel_scope.cancel()
        return result

    async def chat(request: Request) -> Response:
        return await generation(request, "chat")

    async def completions(request: Request) -> Response:
        return await generation(request, "completion")

    async def infill(request: Request) -> Response:
        return await generation(request, "infill")

    model_object = {"id": model_name, "object": "model", "created": 0, "owned_by": "drvqwen",
                    "max_context": parser.max_context}

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except APIError as e:
            return answered(request, e.response(), e)
        return answered(request, JSONResponse({"object": "list", "data": [model_object]}))

    async def model(request: Request) -> Response:
        """GET /v1/models/{id} (the openai client's models.retrieve): 404 for another id, as
        the OpenAI API answers for a model it does not have."""
        try:
            authorize(request)
            wanted = request.path_params["model_id"]
            if wanted != model_name:
                raise APIError(404, f"model {wanted!r} does not exist: this server has {model_name!r}",
                               param="model", code="model_not_found")
        except APIError as e:
            return answered(request, e.response(), e)
        return answered(request, JSONResponse(model_object))

    async def health(request: Request) -> Response:
        free, total = worker.kv_pages()
        return answered(request, JSONResponse({
            "status": "ok", "model": model_name, "device": device, "max_context": parser.max_context,
            "queue_length": worker.queue_length(), "busy": worker.busy,
            "kv_pages_free": free, "kv_pages_total": total, "tokens_cached": worker.tokens_cached}))

    async def prometheus(request: Request) -> Response:
        try:
            authorize(request)
        except APIError as e:
            return answered(request, e.response(), e)
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        e = APIError(exc.status_code, what.get(exc.status_code, str(exc.detail)),
                     code="not_found" if exc.status_code == 404 else None)
        return answered(request, e.response(), e)

    async def server_error(request: Request, exc: Exception) -> Response:
        e = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
        note_error(request, e.message)
        return e.response()

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/infill", infill, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
    return Gate(app, served_hosts(settings.host, settings.allowed_hosts, settings.api_key), log)
