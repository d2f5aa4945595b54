"""What a sandbox server holds: the live sandboxes it made for its clients, and the snapshots it saved.

Ids are the pool's own (random; a snapshot's starts with this process's `server_id`), never the backend's, so
a request can only name what this process made. Bounds, so a host survives its clients:

- a live sandbox is leased: unused for `lease` seconds (its client crashed, or forgot it), it is closed;
- at most `max_sandboxes` are live at once (more is `AtCapacity`, and the client tries another server);
- at most `max_snapshots` are kept; beyond, the least recently used is deleted. The graph may still name it:
  its restore then fails, and the rollout takes a shallower route, as with any lost snapshot;
- a call that outlives the backend's own timeout by `GRACE` seconds (at most: as much again for short
  timeouts) is abandoned and its sandbox closed;
- an output whose encoding is over `max_output` bytes is replaced by a note and marked an error (not cached);
- a read set left for its client to fetch (`execute(..., reads_later=True)`, then `reads`) is held until fetched,
  at most `MAX_PENDING_READS` per sandbox (beyond, the oldest is dropped), and dropped with its sandbox.

Calls in one sandbox run one at a time, in order of arrival; a sandbox that answers before its read set is
digested runs nothing else until it is (`Outcome.reads_later`), so a call that follows waits for that too.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..calls import ToolCall
from ..graph import encode_output
from ..sandboxes.base import BaseDigests, Outcome, Sandbox, Sandboxes, settled
from ..sandboxes.remote.wire import ExecuteReply, InfoReply, Listing, SandboxInfo, SnapshotInfo
from ..version import __version__

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_MAX_OUTPUT",
    "DEFAULT_MAX_SANDBOXES",
    "DEFAULT_MAX_SNAPSHOTS",
    "DEFAULT_TIMEOUT",
    "MAX_PENDING_READS",
    "AtCapacity",
    "BackendFailed",
    "CallRefused",
    "PoolCounts",
    "SandboxPool",
    "UnknownId",
    "WrongEnvironment",
]

log = logging.getLogger("tvcache.server")

T = TypeVar("T")

DEFAULT_LEASE = 300.0
DEFAULT_MAX_SANDBOXES = 256
DEFAULT_MAX_SNAPSHOTS = 1024
DEFAULT_MAX_OUTPUT = 16 << 20  # ToolCache's max_output_bytes: larger outputs would not be cached anyway
DEFAULT_TIMEOUT = 600.0  # per call, for a backend that has no timeout of its own
GRACE = 10.0
MAX_PENDING_READS = 16  # per sandbox: a client fetches each read set as soon as it is answered


class UnknownId(LookupError):
    """No live sandbox or snapshot has that id here (closed, expired, evicted, or made by another process)."""


class AtCapacity(RuntimeError):
    """The server holds `max_sandboxes` live sandboxes already."""


class WrongEnvironment(ValueError):
    """The client expects another starting state (fingerprint) than this server's."""


class CallRefused(ValueError):
    """The backend refused the call itself (it raised ValueError, TypeError or LookupError: an unknown tool,
    a missing argument): the caller's mistake, not the machinery's."""


class BackendFailed(RuntimeError):
    """The sandbox backend raised (or hung): the machinery failed, not the tool."""


@dataclass(eq=False)
class _Live:
    box: Sandbox
    created: float = field(default_factory=time.time)
    used: float = field(default_factory=time.monotonic)
    executions: int = 0
    closed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Read sets being digested (or digested) for the client to fetch, by id, oldest first.
    pending: OrderedDict[str, asyncio.Future[Mapping[str, str] | None]] = field(default_factory=OrderedDict)


@dataclass(eq=False)
class _Snapshot:
    backend_id: str
    created: float = field(default_factory=time.time)
    used: float = field(default_factory=time.monotonic)
    restores: int = 0


@dataclass
class PoolCounts:
    creates: int = 0
    restores: int = 0
    executions: int = 0
    snapshots: int = 0
    closes: int = 0
    deletes: int = 0
    expired: int = 0  # closed because their lease ran out
    evicted: int = 0  # snapshots deleted to stay within max_snapshots
    failures: int = 0  # backend operations that raised or hung
    seconds_executing: float = 0.0


class SandboxPool:
    def __init__(
        self,
        factory: Sandboxes,
        *,
        lease: float = DEFAULT_LEASE,
        max_sandboxes: int = DEFAULT_MAX_SANDBOXES,
        max_snapshots: int = DEFAULT_MAX_SNAPSHOTS,
        max_output: int = DEFAULT_MAX_OUTPUT,
        timeout: float | None = None,
    ):
        if not lease > 0 or max_sandboxes < 1 or max_snapshots < 1 or max_output < 1024:
            raise ValueError("lease must be > 0, max_sandboxes and max_snapshots >= 1, and max_output >= 1024")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.factory = factory
        self.fingerprint = factory.fingerprint  # once: some backends hash a whole tree for it
        self.server_id = secrets.token_hex(6)
        self.lease = lease
        self.max_sandboxes = max_sandboxes
        self.max_snapshots = max_snapshots
        self.max_output = max_output
        own = getattr(factory, "timeout", None)  # the backend's per-call timeout, where it has one
        self.timeout = float(timeout or (own if isinstance(own, int | float) and own > 0 else DEFAULT_TIMEOUT))
        self.deadline = self.timeout + min(GRACE, self.timeout)  # the backend's own timeout should fire first
        self.counts = PoolCounts()
        self._live: dict[str, _Live] = {}
        self._opening = 0  # creates and restores under way, counted against max_sandboxes
        self._snapshots: OrderedDict[str, _Snapshot] = OrderedDict()  # least recently used first

    # -- operations ------------------------------------------------------------------------------------

    async def create(self, fingerprint: str) -> str:
        if fingerprint != self.fingerprint:
            raise WrongEnvironment(
                f"this server's sandboxes start from fingerprint {self.fingerprint}, not {fingerprint}: "
                "the client's servers serve different environments"
            )
        sandbox = await self._open(self.factory.create)
        self.counts.creates += 1
        return sandbox

    async def restore(self, snapshot: str) -> str:
        snap = self._snapshots.get(snapshot)
        if snap is None:
            raise UnknownId(f"no snapshot {snapshot} here (deleted, evicted, or made by another server process)")
        self._snapshots.move_to_end(snapshot)
        snap.used = time.monotonic()
        sandbox = await self._open(lambda: self.factory.restore(snap.backend_id))
        snap.restores += 1
        self.counts.restores += 1
        return sandbox

    async def execute(self, sandbox: str, call: ToolCall, reads_later: bool = False) -> ExecuteReply:
        """The call's encoded output, whether it changed the state, whether it failed, what it read and wrote.
        With `reads_later`, a sandbox that answers before it has digested what the call read is not waited for:
        the reply names the read set for `reads` instead."""
        live = self._get(sandbox)
        async with live.lock:
            if live.closed:
                raise UnknownId(f"sandbox {sandbox} was closed")
            live.used = t0 = time.monotonic()
            try:
                outcome = await asyncio.wait_for(live.box.execute(call), self.deadline)
            except TimeoutError:
                self.counts.failures += 1
                await self._drop(sandbox, live)
                raise BackendFailed(f"the sandbox did not answer within {self.deadline:g} s; it was closed") from None
            except (ValueError, TypeError, LookupError) as exc:
                raise CallRefused(f"the sandbox refused the call: {type(exc).__name__}: {exc}") from exc
            except Exception as exc:
                self.counts.failures += 1
                raise BackendFailed(f"the sandbox raised {type(exc).__name__}: {exc}") from exc
            finally:
                live.used = time.monotonic()
                live.executions += 1
                self.counts.executions += 1
                self.counts.seconds_executing += live.used - t0
        if not isinstance(outcome, Outcome):
            raise BackendFailed(f"Sandbox.execute must return an Outcome, got {type(outcome).__name__}")
        try:
            blob = encode_output(outcome.output)
        except TypeError as exc:
            raise BackendFailed(str(exc)) from None
        if len(blob) > self.max_output:
            note = (
                f"[tvcache sandbox server: an output of {len(blob):,} bytes is over its {self.max_output:,}-byte limit]"
            )
            return ExecuteReply(encode_output(note), outcome.changed, True)
        writes = dict(outcome.writes) if outcome.writes is not None else None
        if reads_later and outcome.reads_later is not None:
            pending = secrets.token_hex(8)
            live.pending[pending] = outcome.reads_later
            while len(live.pending) > MAX_PENDING_READS:
                live.pending.popitem(last=False)  # its client never fetched it: a later fetch gets None
            return ExecuteReply(blob, outcome.changed, outcome.error, None, writes, pending)
        outcome = await settled(outcome)  # the client takes the read set with the answer
        reads = dict(outcome.reads) if outcome.reads is not None else None
        return ExecuteReply(blob, outcome.changed, outcome.error, reads, writes)

    async def reads(self, sandbox: str, pending: str) -> dict[str, str] | None:
        """The read set `execute` left pending under that id, once digested (None: it could not be made); given
        once. Waits at most as long as a call may take."""
        live = self._get(sandbox)
        later = live.pending.get(pending)
        if later is None:
            raise UnknownId(
                f"no pending read set {pending} in sandbox {sandbox} (fetched already, or dropped: a sandbox holds "
                f"at most {MAX_PENDING_READS})"
            )
        live.used = time.monotonic()
        done, _ = await asyncio.wait([later], timeout=self.deadline)
        live.pending.pop(pending, None)
        if not done:
            self.counts.failures += 1
            raise BackendFailed(f"the sandbox did not digest the read set within {self.deadline:g} s")
        failed = "cancelled" if later.cancelled() else later.exception()
        if failed is not None:  # the sandbox's bug, not the files (those give None): never a wrong read set
            log.warning("a read set could not be made", extra={"error": repr(failed)[:500]})
            return None
        reads = later.result()
        return dict(reads) if reads is not None else None

    async def base_digests(self, keys: list[str]) -> dict[str, str] | None:
        """The starting state's digests of `keys`, or None if the backend cannot tell them (`BaseDigests`)."""
        if not isinstance(self.factory, BaseDigests):
            return None
        return dict(await self._backend(self.factory.base_digests(keys)))

    async def snapshot(self, sandbox: str) -> str:
        live = self._get(sandbox)
        async with live.lock:
            if live.closed:
                raise UnknownId(f"sandbox {sandbox} was closed")
            live.used = time.monotonic()
            backend_id = await self._backend(live.box.snapshot())
        snapshot = f"{self.server_id}.{secrets.token_hex(8)}"
        self._snapshots[snapshot] = _Snapshot(backend_id)
        self.counts.snapshots += 1
        while len(self._snapshots) > self.max_snapshots:
            _, oldest = self._snapshots.popitem(last=False)
            self.counts.evicted += 1
            await self._quietly(self.factory.delete(oldest.backend_id))
        return snapshot

    async def close(self, sandbox: str) -> None:
        live = self._live.get(sandbox)
        if live is not None:
            await self._drop(sandbox, live)
            self.counts.closes += 1

    async def delete(self, snapshot: str) -> None:
        snap = self._snapshots.pop(snapshot, None)
        if snap is not None:
            self.counts.deletes += 1
            await self._backend(self.factory.delete(snap.backend_id))

    def renew(self, sandboxes: list[str]) -> list[str]:
        """Renew the leases of `sandboxes`; return those that are not live here."""
        now = time.monotonic()
        gone = []
        for sandbox in sandboxes:
            live = self._live.get(sandbox)
            if live is None:
                gone.append(sandbox)
            else:
                live.used = now
        return gone

    # -- upkeep ------------------------------------------------------------------------------------------

    async def expire(self) -> int:
        """Close the sandboxes unused for longer than the lease; return how many."""
        deadline = time.monotonic() - self.lease
        idle = [(k, live) for k, live in self._live.items() if live.used < deadline and not live.lock.locked()]
        for sandbox, live in idle:
            log.info("closing a sandbox whose lease expired", extra={"sandbox": sandbox})
            await self._drop(sandbox, live)
        self.counts.expired += len(idle)
        return len(idle)

    async def reap(self) -> None:
        """Expire leases until cancelled."""
        while True:
            await asyncio.sleep(min(self.lease / 4, 30.0))
            await self.expire()

    async def close_all(self) -> None:
        for sandbox, live in list(self._live.items()):
            await self._drop(sandbox, live)
        close = getattr(self.factory, "close", None)
        if close is not None:
            await self._quietly(close())

    def info(self) -> InfoReply:
        return InfoReply(
            server=self.server_id,
            fingerprint=self.fingerprint,
            backend=repr(self.factory)[:200],
            timeout=self.deadline,
            lease=self.lease,
            live=len(self._live),
            snapshots=len(self._snapshots),
            max_sandboxes=self.max_sandboxes,
            version=__version__,
        )

    def listing(self) -> Listing:
        now, wall = time.monotonic(), time.time()
        return Listing(
            sandboxes=[
                SandboxInfo(k, wall - v.created, now - v.used, v.executions, v.lock.locked())
                for k, v in self._live.items()
            ],
            snapshots=[
                SnapshotInfo(k, wall - v.created, now - v.used, v.restores)
                for k, v in sorted(self._snapshots.items(), key=lambda kv: kv[1].created)
            ],
        )

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def snapshot_count(self) -> int:
        return len(self._snapshots)

    @property
    def pending_reads(self) -> int:
        return sum(len(live.pending) for live in self._live.values())

    # -- plumbing ----------------------------------------------------------------------------------------

    async def _open(self, make: Callable[[], Awaitable[Sandbox]]) -> str:
        if len(self._live) + self._opening >= self.max_sandboxes:
            raise AtCapacity(f"this server holds its maximum of {self.max_sandboxes} live sandboxes")
        self._opening += 1
        try:
            box = await self._backend(make())
        finally:
            self._opening -= 1
        sandbox = secrets.token_hex(12)
        self._live[sandbox] = _Live(box)
        return sandbox

    def _get(self, sandbox: str) -> _Live:
        live = self._live.get(sandbox)
        if live is None:
            raise UnknownId(f"no sandbox {sandbox} here (closed, expired, or made by another server process)")
        return live

    async def _drop(self, sandbox: str, live: _Live) -> None:
        if self._live.get(sandbox) is live:
            del self._live[sandbox]
        live.closed = True
        live.pending.clear()
        await self._quietly(live.box.close())

    async def _backend(self, work: Awaitable[T]) -> T:
        try:
            return await work
        except Exception as exc:
            self.counts.failures += 1
            raise BackendFailed(f"{type(exc).__name__}: {exc}") from exc

    async def _quietly(self, work: Awaitable[Any]) -> None:
        try:
            await work
        except Exception as exc:
            self.counts.failures += 1
            log.warning("sandbox cleanup failed", extra={"error": f"{type(exc).__name__}: {exc}"})
