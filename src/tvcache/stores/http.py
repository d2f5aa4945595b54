"""A store that is a `tvcache serve` server: every operation is one HTTP round trip on a pooled connection.

    ToolCache("http://127.0.0.1:8470")
    ToolCache("http://:TOKEN@cache-host:8470")     # or set TVCACHE_TOKEN

The client is aiohttp: on this project's machines it did 2.5x, 4x and 19x the lookups/s of httpx at 1, 8 and 32
concurrent requests (httpx's pool slows down as concurrency grows), with keep-alive connections reused.
The pool is not capped: a `wait` holds its connection until the entry arrives, and a capped pool full of
waiters would hold up the very `record` that wakes them.

Failures are quick and loud: a refused connection fails at once, a connect that hangs after
`connect_timeout`, and any failure, timeout or non-200 answer (a 401 for a wrong token, a 503 when the
server's own store fails) raises `StoreError`, so the rollout executes the call directly (counted as a store
error) and uses the cache again once the server answers. Numbers past the wire format's limits (a claim of
2**64 seconds) are clamped to them here rather than refused there.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import aiohttp
import msgspec
from yarl import URL

from ..graph import Candidate, Entry
from ..jsonhttp import Invalid, JSONClient, Refused, Unreachable, parse_url
from .base import Claim, GraphExport, Lease, SnapshotRecord, StoreError, TaskInfo
from .wire import (
    MAX_COUNT,
    MAX_EXPORT,
    MAX_TTL,
    MAX_WAIT,
    AddCandidateRequest,
    AddSnapshotRequest,
    CandidatesRequest,
    DropSnapshotRequest,
    ExportRequest,
    GiveBackRequest,
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

__all__ = ["HTTPStore"]

T = TypeVar("T")

GIVE_BACK_PAUSE = 0.5  # seconds between tries to give back a claim a failed lookup may have taken
GIVE_BACK_FOR = 60.0  # and for at most this long (within the server's window, lost_claims.WINDOW)
WAIT_MARGIN = 10.0  # a wait's HTTP timeout exceeds its wait timeout by this much: the server answers first
PING_SCOPE = "0" * 32  # no task has this scope key (a root node id is a hash): `ping` lists its snapshots


def _within(value: float, high: float) -> float:
    """`value` clamped to the wire's range [0, high]: in range for the server, and small enough to encode."""
    return max(0.0, min(value, high))


class HTTPStore:
    def __init__(self, url: str, token: str | None = None, *, timeout: float = 5.0, connect_timeout: float = 1.0):
        self.url, given = parse_url(url, "an HTTP store")  # no token: safe to log
        self._urls = {name: URL(f"{self.url}/v1/{name}") for name in _NAMES}
        self._client = JSONClient(token or given, timeout=timeout, connect_timeout=connect_timeout)
        self._giving_back: set[asyncio.Task[None]] = set()
        self._names_lookups = True  # until the server refuses a lookup's id (one older than give-backs)

    async def _call(
        self, name: str, request: msgspec.Struct | None, reply: type[T] | Any, wait: float = 0.0, *, doing: str = ""
    ) -> T:
        """One request to the operation `name`; errors name what the caller was `doing` (default: the operation)."""
        doing = doing or name
        client = self._client
        try:
            result: T = await client.call(
                self._urls[name], request, reply, client.deadline(wait + WAIT_MARGIN) if wait else None
            )
        except Unreachable as exc:
            raise StoreError(f"cache server {self.url} failed on {doing}: {exc}") from exc
        except Refused as exc:
            raise StoreError(f"cache server {self.url} answered {doing} with {exc.status}: {exc.message}") from None
        except Invalid as exc:
            raise StoreError(f"cache server {self.url} sent an invalid reply to {doing}: {exc}") from exc
        return result

    # -- the Store protocol ----------------------------------------------------------------------------

    async def lookup(self, scope_key: str, node: bytes, digest: bytes, claim: float = 0.0) -> Entry | Claim | None:
        lookup = secrets.token_hex(8) if claim > 0 and self._names_lookups else None
        request = LookupRequest(scope_key, node, digest, _within(claim, MAX_TTL), lookup)
        try:
            found: LookupReply = await self._call("lookup", request, LookupReply)
        except BaseException as exc:
            if lookup is not None and _refused_the_id(exc):  # a server older than give-backs: ask it as before
                self._names_lookups = False
                return await self.lookup(scope_key, node, digest, claim)
            if lookup is not None and _may_have_arrived(exc):  # then it may have taken the claim
                task = asyncio.get_running_loop().create_task(self._give_back(lookup))
                self._giving_back.add(task)
                task.add_done_callback(self._giving_back.discard)
            raise
        if found.entry is not None:
            return found.entry.entry()
        if claim > 0 and found.claim is None:
            raise StoreError(f"cache server {self.url} sent an invalid lookup reply: neither an entry nor a claim")
        return found.claim

    async def _give_back(self, lookup: str) -> None:
        """Give back the claim a lookup whose answer was lost may have taken (see server.lost_claims), so that
        others making the call need not wait out its ttl; tried every `GIVE_BACK_PAUSE` seconds while the server
        does not answer or its store fails, for at most `GIVE_BACK_FOR`."""
        deadline = time.monotonic() + GIVE_BACK_FOR
        while True:
            try:
                await self._call("give_back", GiveBackRequest(lookup), None, doing="giving a claim back")
                return
            except StoreError as exc:
                refused = _refusal(exc)
                if refused is not None and refused.status < 500:  # e.g. a server older than give-backs
                    return
                if time.monotonic() + GIVE_BACK_PAUSE >= deadline:
                    return
                await asyncio.sleep(GIVE_BACK_PAUSE)
            except RuntimeError:  # the store was closed meanwhile (a StoreError is a RuntimeError too: after it)
                return

    async def wait(self, scope_key: str, node: bytes, digest: bytes, timeout: float) -> Entry | None:
        timeout = _within(timeout, MAX_WAIT)  # a shorter wait ends in "not yet": the caller looks up and waits again
        request = WaitRequest(scope_key, node, digest, timeout)
        found: WireEntry | None = await self._call("wait", request, WireEntry | None, wait=timeout)
        return found.entry() if found is not None else None

    async def record(
        self, scope_key: str, node: bytes, digest: bytes, entry: Entry, token: str | None, *, reused: bool = False
    ) -> Entry:
        request = RecordRequest(scope_key, node, digest, WireEntry.of(entry), token, reused)
        return (await self._call("record", request, WireEntry)).entry()

    async def release(self, scope_key: str, node: bytes, digest: bytes, token: str) -> None:
        await self._call("release", ReleaseRequest(scope_key, node, digest, token), None)

    async def refresh(self, scope_key: str, node: bytes, digest: bytes, token: str, ttl: float) -> bool:
        return await self._call("refresh", RefreshRequest(scope_key, node, digest, token, _within(ttl, MAX_TTL)), bool)

    async def add_candidate(self, scope_key: str, digest: bytes, candidate: Candidate) -> None:
        await self._call("add_candidate", AddCandidateRequest(scope_key, digest, WireCandidate.of(candidate)), None)

    async def candidates(self, scope_key: str, digest: bytes) -> list[Candidate]:
        found: list[WireCandidate] = await self._call(
            "candidates", CandidatesRequest(scope_key, digest), list[WireCandidate]
        )
        return [c.candidate() for c in found]

    async def lease(self, scope_key: str, origin: str, path: Sequence[bytes], ttl: float) -> Lease | None:
        return await self._call(
            "lease", LeaseRequest(scope_key, origin, list(path), _within(ttl, MAX_TTL)), Lease | None
        )

    async def unlease(self, scope_key: str, token: str) -> None:
        await self._call("unlease", UnleaseRequest(scope_key, token), None)

    async def add_snapshot(
        self, scope_key: str, origin: str, path: Sequence[bytes], snapshot_id: str, budget: int
    ) -> list[str]:
        request = AddSnapshotRequest(scope_key, origin, list(path), snapshot_id, _within(budget, MAX_COUNT))
        return await self._call("add_snapshot", request, list[str])

    async def drop_snapshot(self, scope_key: str, origin: str, node: bytes, snapshot_id: str) -> None:
        await self._call("drop_snapshot", DropSnapshotRequest(scope_key, origin, node, snapshot_id), None)

    async def snapshots(self, scope_key: str, origin: str | None = None) -> list[SnapshotRecord]:
        return await self._call("snapshots", SnapshotsRequest(scope_key, origin), list[SnapshotRecord])

    async def register(self, info: TaskInfo) -> None:
        request = RegisterRequest(info.scope_key, info.namespace, info.task, info.fingerprint)
        await self._call("register", request, None)

    async def tasks(self) -> list[TaskInfo]:
        return await self._call("tasks", None, list[TaskInfo])

    async def export(self, scope_key: str, limit: int = 10_000) -> GraphExport:
        return await self._call("export", ExportRequest(scope_key, _within(limit, MAX_EXPORT)), GraphExport)

    async def ping(self) -> None:
        """One authenticated round trip that reaches the server's store (the snapshots of a scope no task has):
        a server that is down, a wrong token or a server whose store fails raise `StoreError`."""
        await self._call("snapshots", SnapshotsRequest(PING_SCOPE, None), list[SnapshotRecord], doing="a ping")

    async def close(self) -> None:
        """Close the connections, and stop giving claims back; idempotent. Afterwards every operation raises
        `RuntimeError`."""
        for task in list(self._giving_back):
            task.cancel()
        await asyncio.gather(*self._giving_back, return_exceptions=True)
        await self._client.close()


def _refusal(exc: BaseException) -> Refused | None:
    """The server's answer behind a `StoreError` of `_call`, if it answered (an error status)."""
    refused = exc.__context__  # (`_call` raises its StoreError from None)
    return refused if isinstance(refused, Refused) else None


def _refused_the_id(exc: BaseException) -> bool:
    """Whether the server refused a lookup for its `lookup` field: a server older than give-backs refuses fields it
    does not know (400)."""
    refused = _refusal(exc)
    return refused is not None and refused.status == 400 and "unknown field `lookup`" in refused.message


def _may_have_arrived(exc: BaseException) -> bool:
    """Whether a request that failed so may have reached the server all the same: it was cancelled, or its answer
    did not come whole. Not a connection that could not be made: then nothing was sent, and a server that is down
    gets no give-backs."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    cause = exc.__cause__
    if isinstance(cause, Unreachable):
        return not isinstance(cause.__cause__, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)
    return isinstance(cause, Invalid)


_NAMES = (
    "lookup",
    "give_back",
    "wait",
    "record",
    "release",
    "refresh",
    "add_candidate",
    "candidates",
    "lease",
    "unlease",
    "add_snapshot",
    "drop_snapshot",
    "snapshots",
    "register",
    "tasks",
    "export",
    "stats",
)
