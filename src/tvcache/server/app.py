"""The cache server's ASGI app: the store interface over HTTP, plus stats, metrics, health and the dashboard.

The HTTP machinery and its defences are `api.JSONApi`'s; this module holds the store operations. Request data
never names a file: static files are read from the package once, at start, into a dict.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from ..graph import Entry
from ..stores.base import Store, StoreError, TaskInfo
from ..stores.memory import MemoryStore
from ..stores.wire import (
    ENDPOINTS,
    AddCandidateRequest,
    AddSnapshotRequest,
    CandidatesRequest,
    DropSnapshotRequest,
    ExportRequest,
    GiveBackRequest,
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
    WireCandidate,
    WireEntry,
)
from ..version import __version__
from . import openapi
from .api import (
    DEFAULT_MAX_BODY,
    DEFAULT_READ_TIMEOUT,
    Headers,
    HTTPError,
    JSONApi,
    Receive,
    Scope,
    unless_gone,
)
from .counters import Counters
from .lost_claims import LostClaims
from .metrics import Metrics, cache_metrics

__all__ = ["DEFAULT_MAX_BODY", "DEFAULT_READ_TIMEOUT", "DEFAULT_WAIT_CAP", "CacheApp", "create_app"]

log = logging.getLogger("tvcache.server")

T = TypeVar("T")

# A wait is answered (null: "ask again") after this long at most, so no request outlives a proxy's idle
# timeout or holds a connection for an hour; the client's rollout simply looks up and waits again.
DEFAULT_WAIT_CAP = 30.0
SAMPLE_EVERY = 1.0
# /healthz asks the store to answer within this long; a store that does not is reported down.
HEALTH_TIMEOUT = 2.0
# /healthz reports a failed write (a full disk fails writes while reads and pings go on) until a write succeeds,
# or for this long: a load balancer that took the server out of rotation sends it no writes to succeed.
WRITE_FAILURE_HOLD = 30.0

_STATIC = {  # URL path -> (file in the package's static/ folder, content type)
    "/": ("index.html", b"text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", b"text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", b"text/css; charset=utf-8"),
}
_SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
]
_ERRORS = {
    "503": "The backing store failed (for /healthz: it did not answer); the client should execute without the cache.",
}


class CacheApp(JSONApi):
    def __init__(
        self,
        store: Store,
        *,
        store_name: str = "memory://",
        token: str | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        wait_cap: float = DEFAULT_WAIT_CAP,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
    ):
        if not wait_cap > 0:
            raise ValueError("wait_cap must be > 0 seconds")
        counters = Counters(store_name)
        document = openapi.encoded(
            ENDPOINTS,
            title="tvcache server",
            version=__version__,
            description="The tvcache store interface over HTTP: one POST per store operation, JSON bodies, "
            "bytes as base64 strings. With a token set, every /v1 path and /metrics need "
            "`Authorization: Bearer <token>`.",
            errors=_ERRORS,
        )
        metrics = Metrics(lambda: cache_metrics(counters))
        super().__init__(
            ENDPOINTS, counters, metrics, document, token=token, max_body=max_body, read_timeout=read_timeout
        )
        self.counters: Counters = counters
        self._wait_cap = wait_cap
        self.store = store
        self._lost = LostClaims()
        self._write_failed: tuple[float, StoreError] | None = None  # when the last write failed, and why
        self._static = {
            path: (importlib.resources.files(__package__).joinpath("static", name).read_bytes(), kind)
            for path, (name, kind) in _STATIC.items()
        }
        self._known_pages = self._known_pages | set(_STATIC)
        # The memory store answers without waiting, so its operations can run before any task; `wait` reads the
        # request stream (a hang-up ends it), which only the general path offers.
        if isinstance(store, MemoryStore):
            self.eager = frozenset(e.path.encode() for e in ENDPOINTS if e.request is not None and e.name != "wait")

    def _background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._sample()]

    async def shutdown(self) -> None:
        await self.store.close()

    async def _sample(self) -> None:
        while True:
            self.counters.sample()
            await asyncio.sleep(SAMPLE_EVERY)

    def _failure(self, exc: Exception) -> HTTPError:
        if isinstance(exc, StoreError):
            log.error("store failed", extra={"error": str(exc)})
            return HTTPError(503, f"store failed: {exc}")
        return super()._failure(exc)

    def _page(self, path: str, scope: Scope) -> tuple[Headers, bytes]:
        if path not in self._static:
            return super()._page(path, scope)
        content, kind = self._static[path]
        return [(b"content-type", kind), (b"cache-control", b"no-cache"), *_SECURITY_HEADERS], content

    # -- the store operations: one per endpoint, named as in wire.ENDPOINTS ----------------------------

    async def _lookup(self, req: LookupRequest, receive: Receive) -> LookupReply:
        c = self.counters
        task = c.task(req.scope_key)
        c.lookups += 1
        task.lookups += 1
        lookup, claim = req.lookup, req.claim
        if lookup is not None and claim > 0 and not self._lost.may_claim(lookup):
            claim = 0.0  # its claim was given back already: its answer is not awaited
        found = await self.store.lookup(req.scope_key, req.node, req.digest, claim)
        if isinstance(found, Entry):
            c.hits += 1
            task.hits += 1
            c.seconds_saved += found.seconds
            task.seconds_saved += found.seconds
            return LookupReply(entry=WireEntry.of(found))
        c.misses += 1
        if found is None:
            return _MISS
        if found.token is not None:
            c.claims += 1
            claimed = (req.scope_key, req.node, req.digest, found.token)
            if lookup is not None and not self._lost.granted(lookup, claimed):  # given back while the store took it
                await self.store.release(*claimed)
                c.releases += 1
        return LookupReply(claim=found)

    async def _wait(self, req: WaitRequest, receive: Receive) -> WireEntry | None:
        """Wait in the server, so the waiter is answered the moment the entry is recorded. If the client
        hangs up meanwhile, stop waiting for it."""
        self.counters.waits += 1
        timeout = min(req.timeout, self._wait_cap)
        entry = await unless_gone(self.store.wait(req.scope_key, req.node, req.digest, timeout), receive)
        if entry is None:
            return None
        self.counters.waited_hit(req.scope_key, entry.seconds)
        return WireEntry.of(entry)

    async def _written(self, write: Awaitable[T]) -> T:
        """`write`'s result; its failure is what /healthz reports until a write succeeds (see WRITE_FAILURE_HOLD)."""
        try:
            result = await write
        except StoreError as exc:
            self._write_failed = (time.monotonic(), exc)
            raise
        self._write_failed = None
        return result

    async def _record(self, req: RecordRequest, receive: Receive) -> WireEntry:
        winner = await self._written(
            self.store.record(req.scope_key, req.node, req.digest, req.entry.entry(), req.token, reused=req.reused)
        )
        self.counters.records += 1
        self.counters.task(req.scope_key).records += 1
        if req.reused:
            self.counters.read_set_hit(req.scope_key, winner.seconds)
        return WireEntry.of(winner)

    async def _release(self, req: ReleaseRequest, receive: Receive) -> None:
        await self.store.release(req.scope_key, req.node, req.digest, req.token)
        self.counters.releases += 1

    async def _give_back(self, req: GiveBackRequest, receive: Receive) -> None:
        claim = self._lost.give_back(req.lookup)
        if claim is not None:
            await self.store.release(*claim)
            self.counters.releases += 1

    async def _refresh(self, req: RefreshRequest, receive: Receive) -> bool:
        return await self.store.refresh(req.scope_key, req.node, req.digest, req.token, req.ttl)

    async def _add_candidate(self, req: AddCandidateRequest, receive: Receive) -> None:
        await self.store.add_candidate(req.scope_key, req.digest, req.candidate.candidate())

    async def _candidates(self, req: CandidatesRequest, receive: Receive) -> list[WireCandidate]:
        return [WireCandidate.of(c) for c in await self.store.candidates(req.scope_key, req.digest)]

    async def _lease(self, req: LeaseRequest, receive: Receive) -> Any:
        return await self.store.lease(req.scope_key, req.origin, req.path, req.ttl)

    async def _unlease(self, req: UnleaseRequest, receive: Receive) -> None:
        await self.store.unlease(req.scope_key, req.token)

    async def _add_snapshot(self, req: AddSnapshotRequest, receive: Receive) -> list[str]:
        doomed = await self._written(
            self.store.add_snapshot(req.scope_key, req.origin, req.path, req.snapshot_id, int(req.budget))
        )
        self.counters.evictions += sum(1 for d in doomed if d != req.snapshot_id)
        return doomed

    async def _drop_snapshot(self, req: DropSnapshotRequest, receive: Receive) -> None:
        await self.store.drop_snapshot(req.scope_key, req.origin, req.node, req.snapshot_id)

    async def _snapshots(self, req: SnapshotsRequest, receive: Receive) -> Any:
        return await self.store.snapshots(req.scope_key, req.origin)

    async def _register(self, req: RegisterRequest, receive: Receive) -> None:
        await self._written(self.store.register(TaskInfo(req.scope_key, req.namespace, req.task, req.fingerprint)))

    async def _tasks(self, req: None, receive: Receive) -> Any:
        return await self.store.tasks()

    async def _export(self, req: ExportRequest, receive: Receive) -> Any:
        return await self.store.export(req.scope_key, int(req.limit))

    async def _stats(self, req: None, receive: Receive) -> Any:
        return self.counters.reply()

    async def _healthz(self, req: None, receive: Receive) -> HealthReply:
        """200 while the store answers and writes; 503 with the reason when it does not (a down Redis, a locked
        file) or when its last write failed (a full disk), until a write succeeds or WRITE_FAILURE_HOLD passes."""
        try:
            await asyncio.wait_for(self.store.ping(), HEALTH_TIMEOUT)
        except TimeoutError:
            raise StoreError(f"the store did not answer a ping within {HEALTH_TIMEOUT:g} s") from None
        failed = self._write_failed
        if failed is not None and time.monotonic() - failed[0] < WRITE_FAILURE_HOLD:
            raise StoreError(f"a write failed {time.monotonic() - failed[0]:.0f} s ago: {failed[1]}")
        return _HEALTHY


_MISS = LookupReply()
_HEALTHY = HealthReply("ok")


def create_app(
    store: Store,
    *,
    store_name: str = "memory",
    token: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    wait_cap: float = DEFAULT_WAIT_CAP,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
) -> CacheApp:
    """An ASGI app serving `store`. With `token`, every /v1 path and /metrics need it as a bearer token."""
    return CacheApp(
        store, store_name=store_name, token=token, max_body=max_body, wait_cap=wait_cap, read_timeout=read_timeout
    )
