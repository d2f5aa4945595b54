"""Running the servers: an app on uvicorn with uvloop and httptools, JSON-line logs, loopback by default, and
deadlines for clients that send slowly.

    serve("sqlite:///runs/cache.db", port=8470)                        # tvcache serve
    serve_sandboxes(factory, port=8471, token="...")                   # tvcache sandbox-server
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import logging.config
import os
import resource
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ..sandboxes.base import Sandboxes
from ..stores import open_store
from .api import BODY_READ, DEFAULT_MAX_BODY, DEFAULT_READ_TIMEOUT, STARTED, JSONApi
from .app import DEFAULT_WAIT_CAP, create_app
from .logs import log_config

__all__ = ["redact", "run_app", "serve", "serve_sandboxes"]

log = logging.getLogger("tvcache.server")

# Longer than any client keeps an idle pooled connection (30 s), so the server never closes one under a
# request the client is just sending on it.
KEEP_ALIVE = 75
# Connections held at once, at most (fewer where `ulimit -n` is lower: see `connection_cap`).
DEFAULT_MAX_CONNECTIONS = 4096


def serve(
    store_url: str | None,
    host: str = "127.0.0.1",
    port: int = 8470,
    token: str | None = None,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    wait_cap: float = DEFAULT_WAIT_CAP,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    log_level: str = "info",
    access_log: bool = False,
) -> None:
    """Serve the store at `store_url` (memory:// if None, sqlite:///path, redis://...) until interrupted.

    `token` (or the TVCACHE_TOKEN environment variable) turns on bearer-token authentication; without one, only
    a loopback `host` is accepted (ValueError otherwise). At most `max_connections` connections are held at
    once (see `_protocol`). Per-request access logs are off by default: at tens of thousands of lookups a
    second they would cost more than the lookups; refused requests and failures are always logged."""
    if store_url is not None and store_url.startswith(("http://", "https://")):
        raise ValueError("the server's store must be memory://, sqlite:///path or redis://..., not another server")
    # Whoever reaches an unauthenticated cache can record entries: hand every rollout a wrong answer.
    token = _token_for(host, token, "the server")
    config = _logging(log_level)
    store = open_store(store_url)
    name = redact(store_url or "memory://")
    app = create_app(
        store, store_name=name, token=token, max_body=max_body, wait_cap=wait_cap, read_timeout=read_timeout
    )
    log.info("serving", extra={"store": name, "host": host, "port": port, "auth": bool(token), "max_body": max_body})
    run_app(app, host, port, config, log_level, access_log, read_timeout, max_connections)


def _token_for(host: str, token: str | None, what: str) -> str | None:
    """The bearer token (the argument, else TVCACHE_TOKEN); a non-loopback `host` without one is refused."""
    token = token if token is not None else os.environ.get("TVCACHE_TOKEN") or None
    if not token and not _is_loopback(host):
        raise ValueError(
            f"{host} is reachable from other machines, so {what} needs a token: pass --token-file FILE or set "
            "TVCACHE_TOKEN (clients then use http://:TOKEN@host:port)"
        )
    return token


def serve_sandboxes(
    factory: Sandboxes,
    host: str = "127.0.0.1",
    port: int = 8471,
    token: str | None = None,
    *,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    log_level: str = "info",
    access_log: bool = False,
    **limits: Any,
) -> None:
    """Serve the sandbox factory `factory` until interrupted (`limits`: see `SandboxApp`).

    It runs whatever commands its clients send, so it refuses to listen beyond this machine without a token."""
    from .sandbox_app import SandboxApp

    token = _token_for(host, token, "a sandbox server (it runs any command its clients send)")
    config = _logging(log_level)
    app = SandboxApp(factory, token=token, read_timeout=read_timeout, **limits)
    log.info(
        "serving sandboxes",
        extra={"backend": repr(factory), "server": app.pool.server_id, "host": host, "port": port, "auth": bool(token)},
    )
    run_app(app, host, port, config, log_level, access_log, read_timeout, max_connections)


def _logging(level: str) -> dict[str, Any]:
    config = log_config(level.upper())
    logging.config.dictConfig(config)
    return config


def run_app(
    app: JSONApi,
    host: str,
    port: int,
    config: dict[str, Any],
    log_level: str,
    access_log: bool,
    read_timeout: float,
    max_connections: int,
) -> None:
    cap = connection_cap(max_connections)
    log.info("connections", extra={"max_connections": cap, "read_timeout": read_timeout})
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=_protocol(app, read_timeout, cap),
        ws="none",
        lifespan="on",
        log_config=config,
        log_level=log_level,
        access_log=access_log,
        server_header=False,
        # Clients are who connected: X-Forwarded-For from anyone is not trusted (and not parsed per request).
        proxy_headers=False,
        timeout_keep_alive=KEEP_ALIVE,
        # On SIGTERM, requests still held (waits, long tool calls) are cut after this long.
        timeout_graceful_shutdown=3,
    )


def connection_cap(max_connections: int) -> int:
    """How many connections the server holds at once: `max_connections`, or fewer if the limit on open files
    (`ulimit -n`) leaves no room for them. A quarter of that limit stays for everything else (the store's
    files and sockets, sandboxes' pipes, logs): a server out of file descriptors cannot accept anyone, and
    the event loop then drops the connections waiting in the backlog, legitimate or not."""
    if max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, got {max_connections}")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 16
    return max(1, min(max_connections, soft - in_use - max(64, soft // 4)))


def _protocol(app: JSONApi, read_timeout: float, cap: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with deadlines for slow clients, a cap on connections, and a short way for
    the app's eager operations.

    The short way: a POST to one of `app.eager`'s paths that comes whole (its head and body in what one read
    returned, as a client sends a lookup), on a keep-alive HTTP/1.1 connection with no earlier request still
    being answered, is served by `app.start` as soon as it is parsed, and its answer written in one piece:
    no task, no ASGI request cycle (half of a lookup's time in the server). Anything else, and any request
    `start` declines (refusals are the general path's), takes the general path, uvicorn's ASGI cycle; a
    handler that has to wait is handed to it. With access logs on (`--access-log`) every request takes it: the
    cycle writes them.

    uvicorn times out idle keep-alive connections, but not a connection that never sends a byte, sends its
    request line and headers a byte at a time, or trickles a body nobody reads: each would hold a connection
    (a file descriptor, buffers) for as long as its client likes. Here a request's head must be complete within
    `read_timeout` of the connection opening, or of the request's first byte, and its body within
    `read_timeout` of its head; otherwise the connection is closed (a body the app is reading is answered 408
    by the app, `JSONApi`, and the connection closed after that answer).

    Deadlines alone do not stop a slowloris: a thousand trickling clients hold a thousand connections for
    `read_timeout` each, and reconnect. So the server holds at most `cap` connections: a connection over the cap
    closes one that waits for a request, the one that has waited longest for its first request (else the one
    idle longest between requests, a client's pooled connection), and is refused (503) if none waits. A
    legitimate client sends its whole request head at once: one whose head is already in the socket buffer
    when it is accepted, or that was accepted in the same turn of the event loop (which accepts its whole
    backlog before it reads any of them), is not closed before it is read, and once read it is being served,
    not waiting. (uvicorn's own `limit_concurrency`
    answers 503 to every request over the limit instead, so a slowloris holding the connections would refuse
    everyone else.)"""
    # Connections waiting for a request, longest waiting first: those never served yet, then idle ones.
    fresh: dict[Protocol, None] = {}
    idle: dict[Protocol, None] = {}
    shed = Shed()

    class Protocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        # What the connection waits for now (its request's head, its body) as the parser last said, or None.
        _reading: Callable[[], None] | None = None
        _ready = False  # its request head was in the socket buffer when it was accepted (and is not read yet)
        _accepted = 0.0
        _whole: list[bytes] | None = None  # the body so far of a request to be served the short way
        _keep_alive: asyncio.TimerHandle | None = None  # the short way's keep-alive deadline (`_idle_too_long`)
        _answered = 0.0  # when the connection last finished an answer

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # Asked of every connection: one accepted under the cap can be the oldest waiting one a moment later,
            # when the rest of the backlog is accepted.
            self._ready = _has_head(transport)
            # uvloop's clock is read once per turn of the loop: the connections accepted in this turn (the
            # backlog, at once) share it, and none of them has been read yet.
            self._accepted = self.loop.time()
            if len(self.connections) > cap and not self._make_room():
                shed.refused()
                transport.write(_AT_CAPACITY)
                transport.close()
                return
            fresh[self] = None
            self._reading = self._head_too_slow
            self._arm(self._head_too_slow)

        def data_received(self, data: bytes) -> None:
            # The deadline that applies is armed once the data is parsed, not in the parser's callbacks: a request
            # that comes whole, head and body (the usual one), arms and cancels no timer (3 of a lookup's 42 us).
            waiting = self._reading
            super().data_received(data)
            if self._whole is not None:  # its body is still coming: the general path reads the rest
                body, self._whole = b"".join(self._whole), None
                if not self.transport.is_closing():  # (else the parser refused what came)
                    self._general(body, None)
            if self._reading is not waiting:
                self._disarm()
                if self._reading is not None:
                    self._arm(self._reading)

        def _make_room(self) -> bool:
            """Close the connection that has waited longest, never one not read yet."""
            now = self.loop.time()
            other = next((c for c in fresh if not c._ready and c._accepted != now), None) or next(iter(idle), None)
            if other is None:
                return False
            if fresh.pop(other, 0) is None:  # it may have sent part of a request: answer that
                other.transport.write(_AT_CAPACITY)
            else:
                del idle[other]
            shed.closed()
            other.transport.close()
            return True

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._reading is None:  # else its head's deadline runs from the connection's opening
                self._reading = self._head_too_slow

        def on_headers_complete(self) -> None:
            self._ready = False  # read: from now on it waits for its body like any other
            self._reading = self._body_too_slow
            if self._short():
                self._whole = []
            else:
                super().on_headers_complete()

        def _short(self) -> bool:
            """May this request be served the short way, if it comes whole?"""
            return (
                self.url in app.eager  # exactly the path: a query string or %-escapes take the general way
                and self.parser.get_method() == b"POST"
                and self.parser.get_http_version() == "1.1"
                and self.parser.should_keep_alive()
                and not self.expect_100_continue
                and not self.parser.should_upgrade()
                and (self.cycle is None or self.cycle.response_complete)  # else answers must wait their turn
                and not self.flow.write_paused
                and not self.access_log  # (uvicorn's request cycle writes it)
            )

        def on_body(self, body: bytes) -> None:
            if self._whole is None:
                super().on_body(body)
            else:
                self._whole.append(body)

        def on_message_complete(self) -> None:
            self._reading = None
            fresh.pop(self, None)  # being served now
            idle.pop(self, None)
            if self._whole is not None:
                body, self._whole = b"".join(self._whole), None
                answer = app.start(self.url.decode(), self.headers, body)
                if isinstance(answer, bytes):
                    self._respond(answer)
                    return
                self._general(body, answer)
            self.scope[BODY_READ] = True  # type: ignore[literal-required]  # an extension key (api.BODY_READ)
            super().on_message_complete()

        def _general(self, body: bytes, started: Awaitable[Any] | None) -> None:
            """Serve a request held for the short way the general way after all: with `started`, the rest of
            its handler, which `start` began."""
            if started is not None:
                self.scope[STARTED] = started  # type: ignore[literal-required]  # an extension key (api.STARTED)
            super().on_headers_complete()
            if body:
                super().on_body(body)

        def _respond(self, body: bytes) -> None:
            """Answer 200 with `body`, the bytes the general path would send, in one write."""
            head = [STATUS_LINE[200]]
            for name, value in self.server_state.default_headers:  # the Date header
                head += (name, b": ", value, b"\r\n")
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            self.transport.write(b"".join((*head, body)))
            # What uvicorn does once a response is sent, but for the keep-alive deadline: one lazy timer per
            # connection (`_idle_too_long`) instead of one armed and cancelled per request (3 us of a lookup's 24).
            self.server_state.total_requests += 1
            if not self.transport.is_closing():
                idle[self] = None  # until its next request
                self._answered = self.loop.time()
                if self._keep_alive is None:
                    self._keep_alive = self.loop.call_later(self.timeout_keep_alive, self._idle_too_long)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                idle[self] = None  # until its next request
                self._answered = self.loop.time()

        def _idle_too_long(self) -> None:
            """Close the connection if it has had no request for `timeout_keep_alive` seconds since its last
            answer; else look again when it could have."""
            self._keep_alive = None
            if self.transport.is_closing():
                return
            left = self._answered + self.timeout_keep_alive - self.loop.time()
            if self._reading is not None or not (self.cycle is None or self.cycle.response_complete):
                left = self.timeout_keep_alive  # a request is coming or being served: its deadlines apply
            if left > 0:
                self._keep_alive = self.loop.call_later(left, self._idle_too_long)
            else:
                self.timeout_keep_alive_handler()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._keep_alive is not None:
                self._keep_alive.cancel()
            fresh.pop(self, None)
            idle.pop(self, None)
            super().connection_lost(exc)

        def _arm(self, handler: Callable[[], None]) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout, handler)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _head_too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                log.info("closed a connection whose request head did not arrive in time", extra={"client": self.client})
                self.transport.close()

        def _body_too_slow(self) -> None:
            self._deadline = None
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False  # the app is reading it (and answers 408) or serving: close after
            elif not self.transport.is_closing():
                log.info("closed a connection whose request body did not arrive in time", extra={"client": self.client})
                self.transport.close()

    return Protocol


_FULL = b'{"error": "the server is at its connection limit; try again"}'
_AT_CAPACITY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_FULL), _FULL)
)


class Shed:
    """Counts connections closed or refused to stay under the cap, logging the counts at most every 10 s (under
    attack there are thousands a second)."""

    def __init__(self) -> None:
        self.counts = {"closed": 0, "refused": 0}
        self._logged = 0.0

    def closed(self) -> None:
        self._count("closed")

    def refused(self) -> None:
        self._count("refused")

    def _count(self, what: str) -> None:
        self.counts[what] += 1
        now = time.monotonic()
        if now - self._logged >= 10:
            self._logged = now
            log.warning("at the connection limit: closing the connections that wait longest", extra=dict(self.counts))


def _has_head(transport: asyncio.BaseTransport) -> bool:
    """Is a whole request head in the connection's socket buffer, not read yet? (Peeked through a duplicate
    of its descriptor: the event loop's socket object cannot peek.)"""
    sock = transport.get_extra_info("socket")
    try:
        with socket.fromfd(sock.fileno(), sock.family, sock.type) as peek:
            return b"\r\n\r\n" in peek.recv(8192, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (OSError, AttributeError):
        return False


def redact(url: str) -> str:
    """The URL without any password, for logs and stats."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
