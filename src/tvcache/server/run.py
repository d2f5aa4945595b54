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
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..sandboxes.base import Sandboxes
from ..stores import open_store
from .api import DEFAULT_MAX_BODY, DEFAULT_READ_TIMEOUT, JSONApi
from .app import DEFAULT_WAIT_CAP, create_app
from .logs import log_config

__all__ = ["redact", "run_app", "serve", "serve_sandboxes"]

log = logging.getLogger("tvcache.server")

# Longer than any client keeps an idle pooled connection (30 s), so the server never closes one under a
# request the client is just sending on it.
KEEP_ALIVE = 75


def serve(
    store_url: str | None,
    host: str = "127.0.0.1",
    port: int = 8470,
    token: str | None = None,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    wait_cap: float = DEFAULT_WAIT_CAP,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    log_level: str = "info",
    access_log: bool = False,
) -> None:
    """Serve the store at `store_url` (memory:// if None, sqlite:///path, redis://...) until interrupted.

    `token` (or the TVCACHE_TOKEN environment variable) turns on bearer-token authentication; without one, only
    a loopback `host` is accepted (ValueError otherwise). Per-request
    access logs are off by default: at tens of thousands of lookups a second they would cost more than the
    lookups; refused requests and failures are always logged."""
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
    run_app(app, host, port, config, log_level=log_level, access_log=access_log, read_timeout=read_timeout)


def _token_for(host: str, token: str | None, what: str) -> str | None:
    """The bearer token (the argument, else TVCACHE_TOKEN); a non-loopback `host` without one is refused."""
    token = token if token is not None else os.environ.get("TVCACHE_TOKEN") or None
    if not token and not _is_loopback(host):
        raise ValueError(
            f"{host} is reachable from other machines, so {what} needs a token: pass --token TOKEN or set "
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
    run_app(app, host, port, config, log_level=log_level, access_log=access_log, read_timeout=read_timeout)


def _logging(level: str) -> dict[str, Any]:
    config = log_config(level.upper())
    logging.config.dictConfig(config)
    return config


def run_app(
    app: JSONApi,
    host: str,
    port: int,
    config: dict[str, Any],
    *,
    log_level: str,
    access_log: bool,
    read_timeout: float,
) -> None:
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=_protocol(read_timeout),
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


def _protocol(read_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a deadline on each request's head.

    uvicorn times out idle keep-alive connections, but not a connection that never sends a byte or sends its
    request line and headers a byte at a time: each would hold a connection (a file descriptor, buffers) for as
    long as its client likes. Here a request's head must be complete within `read_timeout` of the connection
    opening, or of the request's first byte; otherwise the connection is closed. (Bodies have their own
    deadline, in `JSONApi`, once the app reads them.)"""

    class Protocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._head_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(read_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                log.info("closed a connection whose request head did not arrive in time", extra={"client": self.client})
                self.transport.close()

    return Protocol


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
