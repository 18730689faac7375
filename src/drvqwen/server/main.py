"""`drvqwen serve`: take the port (a port in use is said before the model's seconds of loading;
a client that connects meanwhile waits in the listen backlog until the model is ready), load
the model on the worker thread, run uvicorn until Ctrl-C.

Ctrl-C (or SIGTERM) ends what is in flight at once: the worker cancels the running job and
every waiting one, each answered with a 503 "shutting down" (a stream gets it as its last
event), so uvicorn's graceful wait finds the responses finished; then "interrupted", 130.

Also `BackgroundServer`, the same server on a thread of the calling process (the tests and
tools/bench_serve.py), with the engine worker and the app reachable for inspection.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from pathlib import Path

from ..errors import DrvqwenError
from ..format.nanoqwen import NanoqwenFile
from ..gen_options import MODEL_HELP, add_draft_arguments
from ..speculative import DEFAULT_DRAFT_MAX
from .settings import (DEFAULT_HOST, DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT, DEFAULT_QUEUE_SIZE, ServerSettings,
                       cannot_listen, check_bind, is_loopback)

# Seconds uvicorn waits for open streams at shutdown before closing them.
GRACEFUL_SHUTDOWN_S = 3


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one).

    Listening, not only bound, from the start: a bound socket that does not listen keeps no
    other socket with SO_REUSEADDR (most servers, a second drvqwen serve) off the port.

    Raises:
        DrvqwenError: the address cannot be bound (in use, not this machine's, no permission).
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # No Nagle: each token's event is a small write, and holding it until the previous
        # one is acknowledged (with the client delaying its ACK) would add ~40 ms to the first
        # token and bunch the rest. Accepted connections inherit the option (Linux).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(128)
    except (OSError, UnicodeError) as e:   # UnicodeError: a name idna cannot encode (cannot_listen)
        raise cannot_listen(f"--host {host} --port {port}", e) from None
    sock.setblocking(False)
    return sock


def loader(f: NanoqwenFile, device: str, max_context: int, eager: bool = False, progress=None,
           draft: NanoqwenFile | None = None):
    """The worker's loader: builds the GPU engine or the CPU reference on the worker thread.

    progress(done, total): weight upload (GPU, bytes) or dequantization (CPU, layers).
    draft: the speculative draft model (`--draft`), built beside it on the same device with a
    context as long (capped at its own max_position); the model is then built to speculate
    (build_backend's `speculative`: its requests' verify runs as one pass on the GPU). Without
    a draft model it is built as for plain decoding, and a request's speculative_lookup
    verifies with one decode step per token (exact, no faster).
    """
    from ..tokenizer import Tokenizer
    from .worker import LoadedModel

    def load() -> LoadedModel:
        from ..loading import build_backend

        backend = build_backend(f, device, max_context, eager=eager, progress=progress, speculative=draft is not None)
        draft_backend = None
        if draft is not None:
            draft_backend = build_backend(draft, device, min(max_context, draft.config.max_position), eager=eager,
                                          progress=progress)
        tok = Tokenizer.of_model(f)
        return LoadedModel(backend, tok, f.eog_ids, device, draft_backend,
                           f"draft model {Path(draft.path).name}" if draft is not None else "draft model")

    return load


def _uvicorn_server(config, on_shutdown):
    """A uvicorn.Server that calls on_shutdown() as its shutdown begins, before it waits for
    open connections."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            on_shutdown()
            await super().shutdown(sockets)

    return Server(config)


def stderr_line(line: str) -> None:
    """The request log's sink: one line on stderr, as it is (never through rich markup)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class BackgroundServer:
    """The server on a thread of this process: `url`, `worker`, `app`; `close()` stops it.

    Args:
        f: the model file; device: "cpu" or "cuda"; max_context: 0 = the model's.
        settings: host/port (port 0 picks a free one), key, limits, Host names.
        random_seed: the seed of requests without one (tests fix it).
        log: called with one line per request (`stderr_line` for `drvqwen serve`); None: none.
        draft, draft_max: a speculative draft model of the same tokenizer (`--draft`, checked by
            the caller) and the tokens it proposes per verify pass unless a request says
            (`speculative_draft`).
        sock: a socket from `bind` on settings' host and port (`drvqwen serve` takes the port
            before it loads the model, so a port in use is said at once); None: bound here.
    """

    def __init__(self, f: NanoqwenFile, device: str = "cpu", max_context: int = 0,
                 settings: ServerSettings = ServerSettings(port=0), *, eager: bool = False,
                 warmup: bool = True, random_seed=None, progress=None, log=None,
                 draft: NanoqwenFile | None = None, draft_max: int = DEFAULT_DRAFT_MAX,
                 sock: socket.socket | None = None):
        import uvicorn

        from ..generate import resolve_max_context
        from ..tokenizer import Tokenizer
        from .app import create_app
        from .validate import RequestParser
        from .worker import EngineWorker

        ctx = resolve_max_context(max_context, f.config.max_position)
        self.worker = EngineWorker(loader(f, device, ctx, eager, progress, draft), settings.queue_size, warmup)
        self.worker.start()
        try:  # anything failing from here on leaves no engine thread behind
            tok = Tokenizer.of_model(f)
            kw = {} if random_seed is None else {"random_seed": random_seed}
            self.parser = RequestParser(tok, ctx, f.text_vocab, draft_max=draft_max if draft is not None else 0,
                                        **kw)
            self.app = create_app(self.worker, self.parser, settings, device, log)
            self.sock = bind(settings.host, settings.port) if sock is None else sock
            host, port = self.sock.getsockname()[:2]
            self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
            # uvicorn's own access log stays off: the Gate logs each request (with tokens and
            # errors), and `--quiet` silences it.
            config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
            self.server = _uvicorn_server(config, self._begin_shutdown)
        except BaseException:
            self.worker.stop()
            raise
        self._thread: threading.Thread | None = None

    def _begin_shutdown(self) -> None:
        self.app.shutting_down = True
        self.worker.shutdown()

    def run(self) -> None:
        """Serve on this thread until uvicorn is told to stop (Ctrl-C, SIGTERM, `close`)."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.worker.stop()
            self.sock.close()

    def start(self) -> "BackgroundServer":
        """Serve on a daemon thread; returns once uvicorn accepts connections."""
        self._thread = threading.Thread(target=self.run, name="drvqwen-http", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server thread ended before it started")
            self._thread.join(0.01)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{v} is not in [0, 65535]")
    return v


def register(sub) -> None:
    """Add `drvqwen serve` to the CLI's subcommands."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, fill-in-the-middle)",
                       description="Serve one model over HTTP: /v1/chat/completions, /v1/completions, "
                                   "/infill, /v1/models, /health, /metrics (docs/serve.md).")
    s.add_argument("--model", help=MODEL_HELP)
    s.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; 0.0.0.0 = "
                        f"every interface, which needs --allowed-hosts or --api-key)")
    s.add_argument("--allowed-hosts", metavar="NAMES", default="",
                   help="comma-separated Host names served besides localhost, 127.0.0.1, [::1] and --host "
                        "(the names clients on other machines use; * = any); other Hosts get 403")
    s.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"TCP port (default: {DEFAULT_PORT}; 0 = any free one)")
    s.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but /health "
                                     "(default: none; also read from $DRVQWEN_API_KEY)")
    s.add_argument("--max-context", type=int, default=0,
                   help="context length in tokens (prompt + answer), at most the model's max_position "
                        "(default 0: all of it)")
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: a Hopper GPU when present, else the numpy reference on the CPU")
    s.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE_SIZE,
                   help=f"requests that may wait for the model; more get 503 (default: {DEFAULT_QUEUE_SIZE})")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body; larger gets 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    s.add_argument("--model-name", help="the model id reported by /v1/models (default: the model file's name)")
    s.add_argument("--no-verify", action="store_true", help="skip the one-time CRC32 check of the model file")
    s.add_argument("--eager", action="store_true", help="GPU: launch decode kernels one by one, no CUDA graphs")
    add_draft_arguments(s, "a draft model of the same tokenizer for speculative decoding (named as for --model); "
                           "requests use it unless they send speculative_draft: 0 or speculative_lookup",
                        " unless a request says")
    s.add_argument("--quiet", action="store_true",
                   help="no log line per request (method, path, status, tokens, ms, error) on stderr")
    s.set_defaults(fn=cmd_serve)


def cmd_serve(args) -> int:
    """`drvqwen serve`: resolve the model and the device as `drvqwen run` does, then serve."""
    import os

    from ..gen_options import check_speculation_options

    try:
        import prometheus_client, starlette, uvicorn  # noqa: F401
    except ImportError as e:
        raise DrvqwenError(f"drvqwen serve needs its web stack: pip install 'drvqwen[serve]' ({e.name} is "
                           f"missing)") from None
    if args.queue_size < 1:
        raise DrvqwenError(f"--queue-size={args.queue_size}: must be >= 1")
    if args.max_body_bytes < 1024:
        raise DrvqwenError(f"--max-body-bytes={args.max_body_bytes}: must be >= 1024")
    api_key = args.api_key if args.api_key is not None else os.environ.get("DRVQWEN_API_KEY") or None
    if api_key is not None and not api_key.strip():
        raise DrvqwenError("--api-key: must not be empty")
    allowed_hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    check_bind(args.host, allowed_hosts, api_key)
    check_speculation_options(args)
    draft_max = args.draft_max or DEFAULT_DRAFT_MAX
    # The port first: one in use is said before the model's seconds of loading, not after.
    sock = bind(args.host, args.port)
    # SIGTERM (a service manager's stop, `kill`) ends the server as Ctrl-C does: uvicorn catches
    # both while it runs and, once shut down, raises the signal again under the handler it found,
    # which for SIGTERM is the default one — the process would die with 143 and no line. Raised
    # as KeyboardInterrupt, it ends in the CLI's "interrupted", 130, during loading too.
    old_term = signal.signal(signal.SIGTERM, _term_as_interrupt)
    try:
        return _serve(args, sock, api_key, allowed_hosts, draft_max)
    finally:
        # None: the handler was not installed from Python; the default is what it stood for.
        signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)
        sock.close()  # a no-op once the server has run (uvicorn closed it); else nothing listens


def _term_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _serve(args, sock: socket.socket, api_key: str | None, allowed_hosts: tuple[str, ...], draft_max: int) -> int:
    """cmd_serve from the model on, with the socket bound to --host/--port."""
    from ..console import make_console, progress_bar
    from ..generate import resolve_max_context
    from ..loading import check_same_tokenizer, open_model

    opened = open_model(args.model, args.device, verify=not args.no_verify)
    f, device = opened.file, opened.device
    ctx = resolve_max_context(args.max_context, f.config.max_position)
    draft = None
    if args.draft is not None:           # the model path of --model, on the target's device
        draft = open_model(args.draft, device, verify=not args.no_verify).file
        check_same_tokenizer(f, draft)
    if device == "cpu":
        opened.say_cpu()
    err = make_console(stderr=True)
    settings = ServerSettings(host=args.host, port=args.port, api_key=api_key, queue_size=args.queue_size,
                              max_body_bytes=args.max_body_bytes,
                              model_name=args.model_name or Path(f.path).stem, allowed_hosts=allowed_hosts)
    what = "uploading weights" if device == "cuda" else "dequantizing weights"
    with progress_bar(in_bytes=device == "cuda", transient=True, console=err) as p:
        task = p.add_task(what, total=None)
        srv = BackgroundServer(f, device, ctx, settings, eager=args.eager,
                               progress=lambda done, n: p.update(task, completed=done, total=n),
                               log=None if args.quiet else stderr_line, draft=draft, draft_max=draft_max,
                               sock=sock)
    spec = f", draft model {Path(draft.path).name} proposing {draft_max}" if draft is not None else ""
    err.print(f"serving {settings.model_name} ({device}, context {ctx} tokens{spec}) on {srv.url}/v1 "
              f"— Ctrl-C stops", soft_wrap=True)
    if settings.api_key is None and not is_loopback(settings.host):
        err.print(f"warning: listening on {settings.host} without --api-key: anyone who can "
                  f"reach this port can use the model", style="yellow", soft_wrap=True)
    sys.stderr.flush()
    srv.run()
    return 0
