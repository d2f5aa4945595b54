"""The one JSON-over-HTTP client of the library, under the HTTP store (`stores.http`) and remote sandboxes
(`sandboxes.remote`): each operation is a POST of a msgspec struct (or a GET) answered with JSON.

It owns what both need and must get right once: the server URL without its token (safe to log) and the
token as a bearer header, a pooled aiohttp session per event loop (a session belongs to the loop it was made
in; one used under another loop, another `asyncio.run`, gets a new one, and each is closed when its loop
shuts down), decoders made once per reply type, replies bounded in size, and every failure sorted into one of
three exceptions its caller maps to its own (`StoreError`, `SandboxError`, ...): `Unreachable` (no answer),
`Refused` (an error status, with the server's message) and `Invalid` (a reply that does not decode).
After `close()` it refuses to be used (`RuntimeError`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import msgspec
from yarl import URL

__all__ = ["ErrorReply", "Invalid", "JSONClient", "Refused", "Unreachable", "parse_url"]

IDLE_SECONDS = 30.0  # idle pooled connections close before the servers' keep-alive (75 s) would close them

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


class ErrorReply(msgspec.Struct, frozen=True):
    """What a server answers with an error status."""

    error: str


class Unreachable(Exception):
    """No answer: refused, reset, timed out."""


class Refused(Exception):
    """The server answered with an error status; the message is the server's own."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Invalid(Exception):
    """A reply that does not decode as the type asked for, or is larger than allowed."""


def _decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    return decoder


def parse_url(url: str, what: str) -> tuple[str, str | None]:
    """`url` without user info, query or trailing slash, and the token it carried (`http://:TOKEN@host:port`);
    `ValueError` naming `what` if it is not an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} URL is http://host:port, got {url!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", "")), parts.password or parts.username


class JSONClient:
    """A pooled client for the servers of one kind; `token` (else TVCACHE_TOKEN) is sent as a bearer token."""

    def __init__(self, token: str | None, *, timeout: float, connect_timeout: float, max_reply: int | None = None):
        if not (timeout > 0 and connect_timeout > 0):
            raise ValueError("timeouts must be > 0")
        token = token or os.environ.get("TVCACHE_TOKEN") or None
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=connect_timeout)
        self.connect_timeout = connect_timeout
        self._max_reply = max_reply
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closer: AsyncGenerator[None, None] | None = None
        self._closed = False

    def deadline(self, seconds: float) -> aiohttp.ClientTimeout:
        """A timeout of `seconds` for one request (a long wait, an execute), instead of the default."""
        return aiohttp.ClientTimeout(total=seconds, sock_connect=self.connect_timeout)

    async def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("this client is closed; make a new one")
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_SECONDS, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self.headers, timeout=self.timeout, auto_decompress=False
            )
            self._loop = loop
            self._closer = _closed_with_loop(self._session)
            await anext(self._closer)
        return self._session

    async def call(
        self, url: URL, request: msgspec.Struct | None, reply: Any, timeout: aiohttp.ClientTimeout | None = None
    ) -> Any:
        """POST `request` (GET if None) to `url` and decode the answer as `reply` (None: any answer)."""
        session = await self._client()
        try:
            if request is None:
                response = await session.get(url, timeout=timeout or self.timeout)
            else:
                response = await session.post(url, data=_encoder.encode(request), timeout=timeout or self.timeout)
            async with response:
                size = response.content_length
                if self._max_reply is not None and (size is None or size > self._max_reply):
                    raise Invalid(f"a reply of {size} bytes")
                data = await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from exc
        if response.status != 200:
            try:
                message = _decoder(ErrorReply).decode(data).error
            except msgspec.DecodeError:
                message = data[:200].decode(errors="replace")
            raise Refused(response.status, message)
        try:
            return _decoder(reply).decode(data)
        except msgspec.DecodeError as exc:
            raise Invalid(str(exc)) from exc

    async def close(self) -> None:
        """Close the connections; idempotent. Later calls raise `RuntimeError`."""
        self._closed = True
        closer, self._closer, self._session = self._closer, None, None
        if closer is not None and self._loop is asyncio.get_running_loop():
            await closer.aclose()


async def _closed_with_loop(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    """Suspended until closed: by `JSONClient.close`, or by its event loop shutting down (asyncio.run finalizes
    the async generators of its loop), so a session never outlives its loop's connections."""
    try:
        yield
    finally:
        await session.close()
