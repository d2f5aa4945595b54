"""What both servers are made of: a bare ASGI app answering JSON operations, with one set of defences.

`JSONApi` routes `wire.Endpoint`s to methods named after them (`_lookup`, `_execute`, ...), each taking the
decoded request and returning what is encoded as the reply. A request is refused (4xx, a JSON `{"error": ...}`,
nothing changed) before a handler runs when it is unauthenticated, too large, too slow, not JSON, or does not
match the wire types. Around that: `/openapi.json`, `/metrics`, request latencies and the lifespan.

A bare ASGI app rather than a framework: a request is one dict lookup for the route, one msgspec decode, the
handler, one encode. The connection protocol (`run.py`) may go further for an app's `eager` paths: `JSONApi.start`
serves a request that came whole without the ASGI machinery at all.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from ..stores.wire import Endpoint
from .counters import Latency, RequestCounters
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics

__all__ = [
    "BODY_READ",
    "DEFAULT_MAX_BODY",
    "DEFAULT_READ_TIMEOUT",
    "STARTED",
    "ClientGone",
    "HTTPError",
    "JSONApi",
    "disconnected",
    "unless_gone",
]

log = logging.getLogger("tvcache.server")

T = TypeVar("T")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

DEFAULT_MAX_BODY = 32 << 20  # a 16 MiB output (ToolCache's default limit) is ~22 MB as base64
# How long a client may take to send a request's head, and then its body. A client that trickles bytes would
# otherwise hold a connection (and its memory) for as long as it likes; a 32 MiB body must come at 2.2 MB/s.
DEFAULT_READ_TIMEOUT = 15.0

# How long a refused request's body is read and dropped so that its client, still sending, can read the refusal.
DISCARD_FOR = 2.0

JSON_TYPE = (b"content-type", b"application/json")
# A scope key the server's connection protocol (`run.py`) sets once the whole request, body included, is read: the
# app then reads the body without arming a deadline of its own (an `asyncio.timeout` cost a lookup 6 of its 42 us).
BODY_READ = "tvcache.body_read"
# A scope key holding the rest of a handler `JSONApi.start` began and that has to wait (see there).
STARTED = "tvcache.started"
_CLOSE = (b"connection", b"close")


class HTTPError(Exception):
    """A request refused with `status` and a message for the caller. `close`: the request's body may not have
    been read, so the connection is closed after the answer rather than left to a client still sending."""

    def __init__(self, status: int, message: str, headers: Headers | None = None, *, close: bool = False):
        super().__init__(message)
        self.status = status
        self.headers = headers or []
        self.close = close


class ClientGone(Exception):
    """The client hung up while we worked or waited on its behalf; there is nobody to answer."""


@dataclass(frozen=True)
class _Route:
    endpoint: Endpoint
    decoder: msgspec.json.Decoder[Any] | None
    handler: Callable[[Any, Receive], Coroutine[Any, Any, Any]]
    latency: Latency


class JSONApi:
    """The ASGI app of a server. Subclasses define one `_<name>` handler per endpoint; they may override
    `_background` (jobs that run while the server does), `shutdown` (what to release when it stops), `_failure`
    (how an exception from a handler is answered) and `_page` (paths outside the API)."""

    _known_pages: frozenset[str] = frozenset({"/openapi.json", "/metrics"})  # latency is kept per known path
    # The paths of operations `start` may serve: handlers that do not read `receive` and may run outside a task.
    eager: frozenset[bytes] = frozenset()

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        counters: RequestCounters,
        metrics: Metrics,
        openapi: bytes,
        *,
        token: str | None,
        max_body: int,
        read_timeout: float,
    ):
        if token is not None and not token:
            raise ValueError("an empty token would let anyone in; pass None for no authentication")
        if max_body < 1024:
            raise ValueError("max_body must be at least 1024 bytes")
        if not read_timeout > 0:
            raise ValueError("read_timeout must be > 0 seconds")
        self.counters = counters
        self._metrics = metrics
        self._openapi = openapi
        self._token = token.encode() if token else None
        self._max_body = max_body
        self._read_timeout = read_timeout
        self._encoder = msgspec.json.Encoder()
        self._routes: dict[str, _Route] = {}
        for endpoint in endpoints:
            decoder = msgspec.json.Decoder(endpoint.request) if endpoint.request is not None else None
            latency = counters.latency[endpoint.name] = Latency()
            self._routes[endpoint.path] = _Route(endpoint, decoder, getattr(self, f"_{endpoint.name}"), latency)

    # -- hooks -------------------------------------------------------------------------------------------

    def _background(self) -> list[Coroutine[Any, Any, None]]:
        """Jobs to run from start to shutdown (sampling counters, expiring leases)."""
        return []

    async def shutdown(self) -> None:
        pass

    def _failure(self, exc: Exception) -> HTTPError:
        """The answer to an exception a handler raised that is not an HTTPError: by default a logged 500."""
        log.error("request failed", exc_info=exc)
        return HTTPError(500, "internal server error (logged)")

    def _page(self, path: str, scope: Scope) -> tuple[Headers, bytes]:
        """Headers and body for a GET of a path outside the API, /openapi.json and /metrics."""
        raise HTTPError(404, f"no such path: {path[:200]}", close=True)

    # -- ASGI --------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        # Websockets are not spoken here; returning without accepting makes the server refuse them.

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        jobs: list[asyncio.Task[None]] = []
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                jobs = [asyncio.create_task(job) for job in self._background()]
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for job in jobs:
                    job.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        path: str = scope["path"]
        route = self._routes.get(path)
        status = 200
        try:
            if route is not None:
                body = await self._answer(route, scope, receive)
                headers = [JSON_TYPE]
            else:
                headers, body = self._other(path, scope)
        except ClientGone:
            self._latency(route, path).add(time.perf_counter() - start, 499)
            return
        except Exception as exc:
            refusal = exc if isinstance(exc, HTTPError) else self._failure(exc)
            status, body = refusal.status, self._error(refusal, scope)
            headers = [JSON_TYPE, *refusal.headers, *([_CLOSE] if refusal.close else [])]
        # A Content-Length, not chunked encoding: fewer bytes and writes per response.
        headers.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._latency(route, path).add(time.perf_counter() - start, status)

    def _latency(self, route: _Route | None, path: str) -> Latency:
        if route is not None:
            return route.latency
        name = path if path in self._known_pages else "other"  # bounded label values
        latency = self.counters.latency.get(name)
        if latency is None:
            latency = self.counters.latency[name] = Latency()
        return latency

    def _error(self, refusal: HTTPError, scope: Scope) -> bytes:
        self.counters.errors += 1
        client = scope.get("client")
        log.log(
            logging.WARNING if refusal.status >= 500 or refusal.status == 401 else logging.INFO,
            "request refused",
            extra={
                "status": refusal.status,
                "path": scope["path"][:200],
                "error": str(refusal),
                "client": client[0] if client else None,
            },
        )
        return self._encoder.encode({"error": str(refusal)})

    async def _answer(self, route: _Route, scope: Scope, receive: Receive) -> bytes:
        """The JSON reply to a request for one of the API's operations."""
        started = scope.get(STARTED)
        if started is not None:  # checked and begun by `start`
            return self._encoder.encode(await started)
        endpoint = route.endpoint
        request = None
        body = None
        try:
            if scope["method"] != endpoint.method:
                raise HTTPError(405, f"{endpoint.path} takes {endpoint.method}", [(b"allow", endpoint.method.encode())])
            if endpoint.auth:
                self._authenticate(scope["headers"])
            if route.decoder is not None:
                body = await self._body(scope, receive)
                try:
                    request = route.decoder.decode(body)
                except msgspec.DecodeError as exc:  # ValidationError is a DecodeError: both mean a 400
                    raise HTTPError(400, f"invalid {endpoint.name} request: {exc}") from None
        except HTTPError as exc:
            exc.close = True  # what is left of the body is not read: do not leave the connection to it
            if body is None and exc.status != 408:  # (a body too slow to come is not waited for again)
                await _discard_body(scope, receive)
            raise
        reply = await route.handler(request, receive)
        return self._encoder.encode(reply)

    def start(self, path: str, headers: Headers, body: bytes) -> bytes | Awaitable[Any] | None:
        """Serve a POST to one of the `eager` paths whose request (head and body) is read, at once and without
        the ASGI machinery (a task, a request cycle, a write for the head and one for the body: half of a
        lookup's server time). The connection protocol calls it, and writes the reply itself.

        Returns the encoded reply when the handler finished without waiting (an in-process store's lookup);
        the rest of the handler when it must wait (the protocol hands it to the app in the scope, under
        STARTED, and the general path answers with its result or its error); None for a request the general
        path must answer or refuse (no token, not JSON, too large, invalid): it runs every check again and
        the handler has not run."""
        route = self._routes.get(path)
        if route is None or route.decoder is None or len(body) > self._max_body:  # (a chunked body says no length)
            return None
        try:
            if route.endpoint.auth:
                self._authenticate(headers)
            self._check_body(headers)
            request = route.decoder.decode(body)
        except (HTTPError, msgspec.DecodeError):
            return None
        begun = time.perf_counter()
        handler = route.handler(request, _no_receive)
        try:
            waiting = handler.send(None)
        except StopIteration as finished:
            reply = self._encoder.encode(finished.value)
            route.latency.add(time.perf_counter() - begun, 200)
            return reply
        except Exception as exc:  # answered as from any handler (a failed store: 503)
            return _raise(exc)
        return _resume(handler, waiting)

    def _other(self, path: str, scope: Scope) -> tuple[Headers, bytes]:
        if scope["method"] not in ("GET", "HEAD"):
            if path not in self._known_pages:
                raise HTTPError(404, f"no such path: {path[:200]}", close=True)
            raise HTTPError(405, f"{path} takes GET", [(b"allow", b"GET, HEAD")], close=True)
        if path == "/openapi.json":
            return [JSON_TYPE], self._openapi
        if path == "/metrics":
            self._authenticate(scope["headers"])
            return [(b"content-type", METRICS_CONTENT_TYPE.encode())], self._metrics.render()
        return self._page(path, scope)

    def _authenticate(self, headers: Headers) -> None:
        if self._token is None:
            return
        for name, value in headers:
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._token):
                    return
                break
        raise HTTPError(401, "missing or wrong bearer token", [(b"www-authenticate", b'Bearer realm="tvcache"')])

    def _check_body(self, headers: Headers) -> None:
        """Refuse a body that says it is too large or not JSON, before reading it."""
        for name, value in headers:
            if name == b"content-length":
                if not value.isdigit():
                    raise HTTPError(400, "invalid Content-Length")
                if int(value) > self._max_body:
                    raise HTTPError(413, f"request body over the {self._max_body}-byte limit")
            elif name == b"content-type" and not value.lower().startswith(b"application/json"):
                raise HTTPError(415, "request bodies are JSON: send Content-Type: application/json")

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        self._check_body(scope["headers"])
        if scope.get(BODY_READ):  # all here: receive() answers at once
            return await self._read(receive)
        try:
            async with asyncio.timeout(self._read_timeout):
                return await self._read(receive)
        except TimeoutError:
            raise HTTPError(408, f"request body not received within {self._read_timeout:g} s") from None

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body:  # chunked uploads announce no length
                raise HTTPError(413, f"request body over the {self._max_body}-byte limit")
            if not message.get("more_body", False):
                return b"".join((*chunks, chunk)) if chunks else chunk
            chunks.append(chunk)


@types.coroutine
def _resume(handler: Coroutine[Any, Any, Any], waiting: Any) -> Generator[Any, Any, Any]:
    """The rest of `handler`, begun outside a task and stopped at `waiting` (what it yielded to the event loop):
    awaited in a task, it waits for that as the handler would have, then resumes the handler where it stopped."""
    try:
        yield waiting
    except BaseException:  # cancelled (the server stops): end the handler where it waits
        handler.close()
        raise
    return (yield from handler.__await__())


async def _raise(exc: Exception) -> Any:
    raise exc


async def _no_receive() -> Message:
    """`receive` for a handler `start` runs: eager handlers do not read it."""
    raise RuntimeError("an eager handler read the request stream")


async def _discard_body(scope: Scope, receive: Receive) -> None:
    """Read and drop what is left of a refused request's body, for at most DISCARD_FOR seconds, before the refusal
    is sent and the connection closed. Clients send a body whole before they read the answer, and a connection
    closed with data still coming is reset by the kernel: the client would meet a broken pipe or a reset, not the
    refusal. Not for a client that waits for `100 Continue` before it sends (it has sent nothing, and is told
    before it does)."""
    if any(name == b"expect" for name, _ in scope["headers"]):
        return
    try:
        async with asyncio.timeout(DISCARD_FOR):
            while (message := await receive())["type"] == "http.request" and message.get("more_body", False):
                pass
    except TimeoutError:
        pass  # closed under what still comes: that client meets a reset


async def disconnected(receive: Receive) -> None:
    """Return when the client disconnects (after the body, ASGI's receive() yields nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[T], receive: Receive) -> T:
    """`work`'s result, for a handler that waits on its client's behalf; if the client hangs up first, `work` is
    cancelled and ClientGone raised (there is nobody to answer)."""
    working = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait((working, hangup), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the server is shutting down
        working.cancel()
        raise
    finally:
        hangup.cancel()
    if not working.done():
        working.cancel()
        raise ClientGone
    return working.result()
