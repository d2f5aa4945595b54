"""`serve()`: the app on uvicorn with uvloop and httptools, JSON-line logs, loopback by default."""

from __future__ import annotations

import ipaddress
import logging
import logging.config
import os
from urllib.parse import urlsplit, urlunsplit

import uvicorn

from ..stores import open_store
from .app import DEFAULT_MAX_BODY, DEFAULT_WAIT_CAP, create_app
from .logs import log_config

__all__ = ["redact", "serve"]

log = logging.getLogger("tvcache.server")

# Longer than any client keeps an idle pooled connection (HTTPStore: 30 s), so the server never closes one
# under a request the client is just sending on it.
KEEP_ALIVE = 75


def serve(
    store_url: str | None,
    host: str = "127.0.0.1",
    port: int = 8470,
    token: str | None = None,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    wait_cap: float = DEFAULT_WAIT_CAP,
    log_level: str = "info",
    access_log: bool = False,
) -> None:
    """Serve the store at `store_url` (memory:// if None, sqlite:///path, redis://...) until interrupted.

    `token` (or the TVCACHE_TOKEN environment variable) turns on bearer-token authentication. Per-request
    access logs are off by default: at tens of thousands of lookups a second they would cost more than the
    lookups; refused requests and failures are always logged."""
    if store_url is not None and store_url.startswith(("http://", "https://")):
        raise ValueError("the server's store must be memory://, sqlite:///path or redis://..., not another server")
    token = token if token is not None else os.environ.get("TVCACHE_TOKEN") or None
    config = log_config(log_level.upper())
    logging.config.dictConfig(config)
    store = open_store(store_url)
    name = redact(store_url or "memory://")
    app = create_app(store, store_name=name, token=token, max_body=max_body, wait_cap=wait_cap)
    if not token and not _is_loopback(host):
        log.warning("serving without a token on a non-loopback address", extra={"host": host})
    log.info("serving", extra={"store": name, "host": host, "port": port, "auth": bool(token), "max_body": max_body})
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        ws="none",
        lifespan="on",
        log_config=config,
        log_level=log_level,
        access_log=access_log,
        server_header=False,
        # Clients are who connected: X-Forwarded-For from anyone is not trusted (and not parsed per request).
        proxy_headers=False,
        timeout_keep_alive=KEEP_ALIVE,
        # On SIGTERM, waits still held are cut after this long; their clients just look up again.
        timeout_graceful_shutdown=3,
    )


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
