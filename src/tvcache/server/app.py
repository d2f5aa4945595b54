"""The ASGI application: the store interface over HTTP, plus stats, metrics, health and the dashboard.

A bare ASGI app rather than a framework: a lookup is one dict lookup for the route, one msgspec decode, the
store call, one encode. Requests are refused (4xx, a JSON `{"error": ...}`, nothing changed) before the store
sees them when they are unauthenticated, too large, not JSON, or do not match the wire types. Request data
never names a file: static files are read from the package once, at start, into a dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.resources
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import msgspec

from ..graph import Entry
from ..stores.base import Store, StoreError, TaskInfo
from ..stores.wire import (
    ENDPOINTS,
    AddSnapshotRequest,
    DropSnapshotRequest,
    Endpoint,
    ExportRequest,
    HealthReply,
    LeaseRequest,
    LookupReply,
    LookupRequest,
    RecordRequest,
    RefreshRequest,
    RegisterRequest,
    ReleaseRequest,
    SnapshotsRequest,
    UnleaseRequest,
    WaitRequest,
    WireEntry,
)
from ..version import __version__
from . import openapi
from .counters import Counters, Latency
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics

__all__ = ["CacheApp", "create_app"]

log = logging.getLogger("tvcache.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Any, Receive], Awaitable[Any]]

DEFAULT_MAX_BODY = 32 << 20  # a 16 MiB output (ToolCache's default limit) is ~22 MB as base64
# A wait is answered (null: "ask again") after this long at most, so no request outlives a proxy's idle
# timeout or holds a connection for an hour; the client's rollout simply looks up and waits again.
DEFAULT_WAIT_CAP = 30.0
SAMPLE_EVERY = 1.0

_JSON_TYPE = (b"content-type", b"application/json")
_STATIC = {  # URL path -> (file in the package's static/ folder, content type)
    "/": ("index.html", b"text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", b"text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", b"text/css; charset=utf-8"),
}
_SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
]


class HTTPError(Exception):
    """A request refused with `status` and a message for the caller."""

    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or []


class _ClientGone(Exception):
    """The client hung up while we waited on its behalf; there is nobody to answer."""


@dataclass(frozen=True)
class _Route:
    endpoint: Endpoint
    decoder: msgspec.json.Decoder[Any] | None
    handler: Handler
    latency: Latency


class CacheApp:
    def __init__(
        self,
        store: Store,
        *,
        store_name: str = "memory://",
        token: str | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        wait_cap: float = DEFAULT_WAIT_CAP,
    ):
        if token is not None and not token:
            raise ValueError("an empty token would let anyone in; pass None for no authentication")
        if max_body < 1024:
            raise ValueError("max_body must be at least 1024 bytes")
        if not wait_cap > 0:
            raise ValueError("wait_cap must be > 0 seconds")
        self._wait_cap = wait_cap
        self.store = store
        self.counters = Counters(store_name)
        self._token = token.encode() if token else None
        self._max_body = max_body
        self._encoder = msgspec.json.Encoder()
        self._metrics = Metrics(self.counters)
        self._openapi = openapi.encoded(__version__)
        self._static = {
            path: (importlib.resources.files(__package__).joinpath("static", name).read_bytes(), kind)
            for path, (name, kind) in _STATIC.items()
        }
        self._routes: dict[str, _Route] = {}
        for endpoint in ENDPOINTS:
            decoder = msgspec.json.Decoder(endpoint.request) if endpoint.request is not None else None
            latency = self.counters.latency[endpoint.name] = Latency()
            self._routes[endpoint.path] = _Route(endpoint, decoder, getattr(self, f"_{endpoint.name}"), latency)
        self._sampler: asyncio.Task[None] | None = None

    # -- ASGI ------------------------------------------------------------------------------------------

    async def __call__(self, scope_key: Scope, receive: Receive, send: Send) -> None:
        if scope_key["type"] == "http":
            await self._http(scope_key, receive, send)
        elif scope_key["type"] == "lifespan":
            await self._lifespan(receive, send)
        # Websockets are not spoken here; returning without accepting makes the server refuse them.

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._sampler = asyncio.create_task(self._sample())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._sampler is not None:
                    self._sampler.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._sampler
                await self.store.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _sample(self) -> None:
        while True:
            self.counters.sample()
            await asyncio.sleep(SAMPLE_EVERY)

    async def _http(self, scope_key: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        path: str = scope_key["path"]
        route = self._routes.get(path)
        status = 200
        try:
            if route is not None:
                body = await self._answer(route, scope_key, receive)
                headers = [_JSON_TYPE]
            else:
                headers, body = self._other(path, scope_key)
        except HTTPError as exc:
            status, headers, body = exc.status, [_JSON_TYPE, *exc.headers], self._error(exc.status, str(exc), scope_key)
        except _ClientGone:
            self._latency(route, path).add(time.perf_counter() - start, 499)
            return
        except StoreError as exc:
            log.error("store failed", extra={"path": path, "error": str(exc)})
            status, headers, body = 503, [_JSON_TYPE], self._error(503, f"store failed: {exc}", scope_key)
        except Exception:
            log.exception("request failed", extra={"path": path})
            status, headers, body = 500, [_JSON_TYPE], self._error(500, "internal server error (logged)", scope_key)
        # A Content-Length, not chunked encoding: fewer bytes and writes per response.
        headers.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._latency(route, path).add(time.perf_counter() - start, status)

    def _latency(self, route: _Route | None, path: str) -> Latency:
        if route is not None:
            return route.latency
        name = path if path in self._static or path in _OTHER else "other"  # bounded label values
        latency = self.counters.latency.get(name)
        if latency is None:
            latency = self.counters.latency[name] = Latency()
        return latency

    def _error(self, status: int, message: str, scope_key: Scope) -> bytes:
        self.counters.errors += 1
        client = scope_key.get("client")
        log.log(
            logging.WARNING if status >= 500 or status == 401 else logging.INFO,
            "request refused",
            extra={
                "status": status,
                "path": scope_key["path"][:200],
                "error": message,
                "client": client[0] if client else None,
            },
        )
        return self._encoder.encode({"error": message})

    async def _answer(self, route: _Route, scope_key: Scope, receive: Receive) -> bytes:
        """The JSON reply to a request for one of the API's operations."""
        endpoint = route.endpoint
        if scope_key["method"] != endpoint.method:
            raise HTTPError(405, f"{endpoint.path} takes {endpoint.method}", [(b"allow", endpoint.method.encode())])
        if endpoint.auth:
            self._authenticate(scope_key)
        request = None
        if route.decoder is not None:
            body = await self._body(scope_key, receive)
            try:
                request = route.decoder.decode(body)
            except msgspec.DecodeError as exc:  # ValidationError is a DecodeError: both mean a 400
                raise HTTPError(400, f"invalid {endpoint.name} request: {exc}") from None
        reply = await route.handler(request, receive)
        return self._encoder.encode(reply)

    def _other(self, path: str, scope_key: Scope) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """Headers and body for the paths outside the API: the dashboard's files, the OpenAPI document, metrics."""
        if path not in _OTHER and path not in self._static:
            raise HTTPError(404, f"no such path: {path[:200]}")
        if scope_key["method"] not in ("GET", "HEAD"):
            raise HTTPError(405, f"{path} takes GET", [(b"allow", b"GET, HEAD")])
        if path in self._static:
            content, kind = self._static[path]
            return [(b"content-type", kind), (b"cache-control", b"no-cache"), *_SECURITY_HEADERS], content
        if path == "/openapi.json":
            return [_JSON_TYPE], self._openapi
        self._authenticate(scope_key)  # /metrics
        return [(b"content-type", METRICS_CONTENT_TYPE.encode())], self._metrics.render()

    def _authenticate(self, scope_key: Scope) -> None:
        if self._token is None:
            return
        for name, value in scope_key["headers"]:
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._token):
                    return
                break
        raise HTTPError(401, "missing or wrong bearer token", [(b"www-authenticate", b'Bearer realm="tvcache"')])

    async def _body(self, scope_key: Scope, receive: Receive) -> bytes:
        for name, value in scope_key["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    raise HTTPError(400, "invalid Content-Length")
                if int(value) > self._max_body:
                    raise HTTPError(413, f"request body over the {self._max_body}-byte limit")
            elif name == b"content-type" and not value.lower().startswith(b"application/json"):
                raise HTTPError(415, "request bodies are JSON: send Content-Type: application/json")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body:  # chunked uploads announce no length
                raise HTTPError(413, f"request body over the {self._max_body}-byte limit")
            if not message.get("more_body", False):
                return b"".join((*chunks, chunk)) if chunks else chunk
            chunks.append(chunk)

    # -- the store operations: one per endpoint, named as in wire.ENDPOINTS ----------------------------

    async def _lookup(self, req: LookupRequest, receive: Receive) -> LookupReply:
        c = self.counters
        task = c.task(req.scope_key)
        c.lookups += 1
        task.lookups += 1
        found = await self.store.lookup(req.scope_key, req.node, req.digest, req.claim)
        if isinstance(found, Entry):
            c.hits += 1
            task.hits += 1
            c.seconds_saved += found.seconds
            task.seconds_saved += found.seconds
            return LookupReply(entry=WireEntry.of(found))
        c.misses += 1
        if found is None:
            return _MISS
        c.claims += found.token is not None
        return LookupReply(claim=found)

    async def _wait(self, req: WaitRequest, receive: Receive) -> WireEntry | None:
        """Wait in the server, so the waiter is answered the moment the entry is recorded. If the client
        hangs up meanwhile, stop waiting for it."""
        self.counters.waits += 1
        timeout = min(req.timeout, self._wait_cap)
        waiting = asyncio.ensure_future(self.store.wait(req.scope_key, req.node, req.digest, timeout))
        hangup = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait((waiting, hangup), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the server is shutting down
            waiting.cancel()
            raise
        finally:
            hangup.cancel()
        if not waiting.done():
            waiting.cancel()
            raise _ClientGone
        entry = waiting.result()
        if entry is None:
            return None
        self.counters.waited_hit(req.scope_key, entry.seconds)
        return WireEntry.of(entry)

    async def _record(self, req: RecordRequest, receive: Receive) -> WireEntry:
        winner = await self.store.record(req.scope_key, req.node, req.digest, req.entry.entry(), req.token)
        self.counters.records += 1
        self.counters.task(req.scope_key).records += 1
        return WireEntry.of(winner)

    async def _release(self, req: ReleaseRequest, receive: Receive) -> None:
        await self.store.release(req.scope_key, req.node, req.digest, req.token)
        self.counters.releases += 1

    async def _refresh(self, req: RefreshRequest, receive: Receive) -> bool:
        return await self.store.refresh(req.scope_key, req.node, req.digest, req.token, req.ttl)

    async def _lease(self, req: LeaseRequest, receive: Receive) -> Any:
        return await self.store.lease(req.scope_key, req.origin, req.path, req.ttl)

    async def _unlease(self, req: UnleaseRequest, receive: Receive) -> None:
        await self.store.unlease(req.scope_key, req.token)

    async def _add_snapshot(self, req: AddSnapshotRequest, receive: Receive) -> list[str]:
        doomed = await self.store.add_snapshot(req.scope_key, req.origin, req.path, req.snapshot_id, int(req.budget))
        self.counters.evictions += sum(1 for d in doomed if d != req.snapshot_id)
        return doomed

    async def _drop_snapshot(self, req: DropSnapshotRequest, receive: Receive) -> None:
        await self.store.drop_snapshot(req.scope_key, req.origin, req.node, req.snapshot_id)

    async def _snapshots(self, req: SnapshotsRequest, receive: Receive) -> Any:
        return await self.store.snapshots(req.scope_key, req.origin)

    async def _register(self, req: RegisterRequest, receive: Receive) -> None:
        await self.store.register(TaskInfo(req.scope_key, req.namespace, req.task, req.fingerprint))

    async def _tasks(self, req: None, receive: Receive) -> Any:
        return await self.store.tasks()

    async def _export(self, req: ExportRequest, receive: Receive) -> Any:
        return await self.store.export(req.scope_key, int(req.limit))

    async def _stats(self, req: None, receive: Receive) -> Any:
        return self.counters.reply()

    async def _healthz(self, req: None, receive: Receive) -> HealthReply:
        return _HEALTHY


_MISS = LookupReply()
_HEALTHY = HealthReply("ok")
_OTHER = {"/openapi.json", "/metrics"}


async def _disconnect(receive: Receive) -> None:
    """Return when the client disconnects (after the body, ASGI's receive() yields nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(
    store: Store,
    *,
    store_name: str = "memory",
    token: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    wait_cap: float = DEFAULT_WAIT_CAP,
) -> CacheApp:
    """An ASGI app serving `store`. With `token`, every /v1 path and /metrics need it as a bearer token."""
    return CacheApp(store, store_name=store_name, token=token, max_body=max_body, wait_cap=wait_cap)
