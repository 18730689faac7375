"""What `drvqwen serve` is started with: where it listens, who may call it, how much it takes;
and which Host names it answers to (middleware.py explains why)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from ..errors import DrvqwenError

# 127.0.0.1: reachable from this machine only. Listening on every interface is a choice the
# user makes with --host 0.0.0.0, and then --allowed-hosts or --api-key (middleware.py).
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
        allowed_hosts: Host names served besides localhost, 127.0.0.1, [::1] and `host`
            ("*": any; middleware.py).
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    queue_size: int = DEFAULT_QUEUE_SIZE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_name: str = "drvqwen"
    allowed_hosts: tuple[str, ...] = ()


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _ip(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def host_name(value: str) -> str:
    """The name in a Host header or a --host/--allowed-hosts value, without port or brackets,
    lower-case, without a trailing dot: "[::1]:8000" → "::1", "LocalHost.:80" → "localhost"."""
    v = value.strip().lower()
    if v.startswith("["):
        v = v[1:].split("]", 1)[0]
    elif v.count(":") == 1:
        v = v.split(":", 1)[0]
    return v.rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine: localhost or a loopback address."""
    name = host_name(host)
    ip = _ip(name)
    return name == "localhost" or (ip is not None and ip.is_loopback)


def cannot_listen(where: str, e: Exception) -> DrvqwenError:
    """The one line for an address that cannot be listened on: `where` (the options) and the
    reason — an OSError's text, or the name encoder's (idna: an empty label, a label over 63
    characters), which names would otherwise end in a traceback."""
    return DrvqwenError(f"{where}: cannot listen there ({getattr(e, 'strerror', None) or e})")


def check_bind(host: str, allowed_hosts: tuple[str, ...], api_key: str | None) -> None:
    """Refuse to listen beyond this machine with neither --allowed-hosts nor --api-key.

    Raises:
        DrvqwenError: `host` is a name that does not resolve (said as binding it would say), or
            it is not a loopback address and neither is given.
    """
    if _ip(host_name(host)) is None and host_name(host) != "localhost":
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:   # "Name or service not known"; idna's refusals
            raise cannot_listen(f"--host {host}", e) from None
    if not is_loopback(host) and not allowed_hosts and api_key is None:
        raise DrvqwenError(f"--host {host}: a server other machines can reach needs --allowed-hosts (the "
                           f"names its clients use for it) or --api-key")


def served_hosts(host: str, allowed_hosts: tuple[str, ...], api_key: str | None) -> frozenset[str] | None:
    """The Host names to serve, None for any: the loopback names, the bound address (unless it
    is every interface, 0.0.0.0 or ::) and --allowed-hosts ("*": any). A server on every
    interface with a key and no --allowed-hosts serves any name."""
    names = {host_name(h) for h in allowed_hosts}
    if "*" in names or (not names and api_key is not None and not is_loopback(host)):
        return None
    bound = host_name(host)
    ip = _ip(bound)
    if not (ip is not None and ip.is_unspecified):
        names.add(bound)
    return frozenset(names | LOOPBACK_NAMES)
