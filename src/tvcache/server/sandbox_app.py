"""The sandbox server's ASGI app: one sandbox factory over HTTP, for `tvcache.RemoteSandboxes` clients.

The HTTP machinery and its defences are `api.JSONApi`'s (the same as the cache server's); what the server holds
and how it is bounded is `sandbox_pool.SandboxPool`'s. This module maps one onto the other.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..calls import ToolCall
from ..sandboxes.base import Sandboxes, no_room
from ..sandboxes.remote.wire import (
    BaseDigestsRequest,
    CreateRequest,
    ExecuteReply,
    ExecuteRequest,
    InfoReply,
    Listing,
    ReadsRequest,
    RenewRequest,
    SandboxReply,
    SandboxRequest,
    SnapshotReply,
    SnapshotRequest,
)
from ..stores.wire import HEALTHZ, Endpoint, HealthReply, operation
from ..version import __version__
from . import openapi
from .api import DEFAULT_MAX_BODY, DEFAULT_READ_TIMEOUT, HTTPError, JSONApi, Receive, unless_gone
from .counters import RequestCounters
from .metrics import Metrics, request_metrics
from .sandbox_pool import AtCapacity, BackendFailed, CallRefused, SandboxPool, UnknownId, WrongEnvironment

__all__ = ["SANDBOX_ENDPOINTS", "SandboxApp"]


SANDBOX_ENDPOINTS: list[Endpoint] = [
    operation("create", CreateRequest, SandboxReply, "A new sandbox in the starting state."),
    operation("restore", SnapshotRequest, SandboxReply, "A new sandbox in a snapshot's state (404: no such snapshot)."),
    operation("execute", ExecuteRequest, ExecuteReply, "Execute one tool call in a sandbox; renews its lease."),
    operation(
        "reads",
        ReadsRequest,
        dict[str, str] | None,
        "The read set an execute left pending (`reads_later`), once digested; given once (404 after; null: it "
        "could not be made).",
    ),
    operation("snapshot", SandboxRequest, SnapshotReply, "Save a sandbox's state; the sandbox stays usable."),
    operation("close", SandboxRequest, None, "Close a sandbox. Idempotent."),
    operation("delete", SnapshotRequest, None, "Delete a snapshot. Idempotent."),
    operation("renew", RenewRequest, list[str], "Renew the leases of live sandboxes; the ids that are gone."),
    operation(
        "base_digests",
        BaseDigestsRequest,
        dict[str, str] | None,
        "The starting state's digests of state keys (null: the backend cannot tell them).",
    ),
    operation("info", None, InfoReply, "What this server serves: its id, fingerprint, limits and load."),
    operation("sandboxes", None, Listing, "The live sandboxes and the snapshots, oldest first."),
    HEALTHZ,
]

_ERRORS = {
    "404": "No such sandbox, snapshot or pending read set here: closed, expired, evicted, fetched already, or made "
    "by another server process.",
    "409": "The client expects another starting state (fingerprint) than this server serves.",
    "422": "The sandbox refused the call (its backend raised ValueError, TypeError or LookupError: an unknown "
    "tool, a missing argument).",
    "429": "The server holds its maximum of live sandboxes; try another server or close some.",
    "502": "The sandbox backend failed (raised, or hung past the call timeout); the message says how.",
    "507": "The sandbox backend failed for want of room (a full disk or quota: ENOSPC, EDQUOT), which may pass.",
}
_REFUSALS: dict[type[Exception], int] = {
    UnknownId: 404,
    WrongEnvironment: 409,
    CallRefused: 422,
    AtCapacity: 429,
    BackendFailed: 502,
}
_HEALTHY = HealthReply("ok")


class SandboxApp(JSONApi):
    """`pool_options` go to `SandboxPool`: lease, max_sandboxes, max_snapshots, max_output, timeout."""

    def __init__(
        self,
        factory: Sandboxes,
        *,
        token: str | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        **pool_options: Any,
    ):
        pool = self.pool = SandboxPool(factory, **pool_options)
        counters = RequestCounters()
        document = openapi.encoded(
            SANDBOX_ENDPOINTS,
            title="tvcache sandbox server",
            version=__version__,
            description="One sandbox factory over HTTP: create, restore, execute, snapshot, close, delete. JSON "
            "bodies; tool outputs as base64 of tvcache's msgpack encoding. With a token set, every /v1 path and "
            "/metrics need `Authorization: Bearer <token>`.",
            errors=_ERRORS,
        )
        metrics = Metrics(lambda: _metrics(pool, counters))
        super().__init__(
            SANDBOX_ENDPOINTS, counters, metrics, document, token=token, max_body=max_body, read_timeout=read_timeout
        )

    def _background(self) -> list[Coroutine[Any, Any, None]]:
        return [self.pool.reap()]

    async def shutdown(self) -> None:
        await self.pool.close_all()

    def _failure(self, exc: Exception) -> HTTPError:
        status = _REFUSALS.get(type(exc))
        if status is None:
            return super()._failure(exc)
        if status == 502 and no_room(exc):  # the errno does not cross the wire: the status says it
            status = 507
        return HTTPError(status, str(exc))

    # -- the operations: one per endpoint, named as in remote.wire.SANDBOX_ENDPOINTS ----------------------

    async def _create(self, req: CreateRequest, receive: Receive) -> SandboxReply:
        return SandboxReply(await self.pool.create(req.fingerprint), self.pool.live, reads_later=True)

    async def _restore(self, req: SnapshotRequest, receive: Receive) -> SandboxReply:
        return SandboxReply(await self.pool.restore(req.snapshot), self.pool.live, reads_later=True)

    async def _execute(self, req: ExecuteRequest, receive: Receive) -> ExecuteReply:
        try:
            call = ToolCall(req.tool, req.args)
        except (TypeError, ValueError) as exc:
            raise HTTPError(400, f"invalid tool call: {exc}") from None
        return await self.pool.execute(req.sandbox, call, req.reads_later)

    async def _reads(self, req: ReadsRequest, receive: Receive) -> dict[str, str] | None:
        # A client that hangs up stops the wait; the read set stays until fetched or dropped.
        return await unless_gone(self.pool.reads(req.sandbox, req.pending), receive)

    async def _base_digests(self, req: BaseDigestsRequest, receive: Receive) -> dict[str, str] | None:
        return await self.pool.base_digests(req.keys)

    async def _snapshot(self, req: SandboxRequest, receive: Receive) -> SnapshotReply:
        return SnapshotReply(await self.pool.snapshot(req.sandbox))

    async def _close(self, req: SandboxRequest, receive: Receive) -> None:
        await self.pool.close(req.sandbox)

    async def _delete(self, req: SnapshotRequest, receive: Receive) -> None:
        await self.pool.delete(req.snapshot)

    async def _renew(self, req: RenewRequest, receive: Receive) -> list[str]:
        return self.pool.renew(req.sandboxes)

    async def _info(self, req: None, receive: Receive) -> InfoReply:
        return self.pool.info()

    async def _sandboxes(self, req: None, receive: Receive) -> Listing:
        return self.pool.listing()

    async def _healthz(self, req: None, receive: Receive) -> HealthReply:
        return _HEALTHY


_COUNTS = {
    "creates": "Sandboxes created.",
    "restores": "Sandboxes restored from a snapshot.",
    "executions": "Tool calls executed.",
    "snapshots": "Snapshots saved.",
    "closes": "Sandboxes closed by their clients.",
    "deletes": "Snapshots deleted by clients.",
    "expired": "Sandboxes closed because their lease ran out (their client vanished).",
    "evicted": "Snapshots deleted to stay within the snapshot limit.",
    "failures": "Backend operations that raised or hung.",
}


def _metrics(pool: SandboxPool, counters: RequestCounters) -> Iterator[Metric]:
    prefix = "tvcache_sandbox"
    for name, text in _COUNTS.items():
        yield CounterMetricFamily(f"{prefix}_{name}", text, value=getattr(pool.counts, name))
    seconds = "Seconds spent executing tool calls."
    yield CounterMetricFamily(f"{prefix}_execution_seconds", seconds, value=pool.counts.seconds_executing)
    yield GaugeMetricFamily(f"{prefix}_live", "Live sandboxes.", value=pool.live)
    yield GaugeMetricFamily(f"{prefix}_held_snapshots", "Snapshots held.", value=pool.snapshot_count)
    pending = "Read sets held for their clients to fetch."
    yield GaugeMetricFamily(f"{prefix}_pending_read_sets", pending, value=pool.pending_reads)
    yield CounterMetricFamily(f"{prefix}_errors", "Requests answered with a 4xx or 5xx status.", value=counters.errors)
    yield from request_metrics(prefix, counters)
