"""The store interface: where entries, claims and snapshot records live.

Every method is one round trip for a remote store, and each does one whole step of the per-call algorithm
atomically (a lookup that also claims a miss, a lease of the deepest snapshot on a path, an insert that also
evicts), so a store shared by many processes needs no client-side locking.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from ..errors import StoreError
from ..graph import EDGE, Candidate, Entry, Kind, child_id

__all__ = [
    "Claim",
    "EntryInfo",
    "GraphExport",
    "Lease",
    "SnapshotRecord",
    "Store",
    "StoreError",
    "TaskInfo",
    "export_entries",
]


class Claim(msgspec.Struct, frozen=True):
    """Answer to a claiming lookup that missed: `token` is ours to execute under, None if another holds it."""

    token: str | None


class Lease(msgspec.Struct, frozen=True):
    """A snapshot protected from eviction until `unlease(token)` or the lease's expiry."""

    node: bytes
    snapshot_id: str
    token: str


class SnapshotRecord(msgspec.Struct, frozen=True):
    origin: str
    node: bytes
    snapshot_id: str
    parent: bytes | None
    last_used: float
    leased: bool


class TaskInfo(msgspec.Struct, frozen=True):
    """A scope as people name it; `scope_key` is its root node id in hex, what every other call takes."""

    scope_key: str
    namespace: str
    task: str
    fingerprint: str


class EntryInfo(msgspec.Struct, frozen=True):
    """One entry of an exported graph: an edge from `node` to `child`, or a memo on `node`."""

    node: bytes
    digest: bytes
    child: bytes | None
    kind: Kind
    call: str
    seconds: float
    size: int
    hits: int


class GraphExport(msgspec.Struct, frozen=True):
    task: TaskInfo | None
    entries: list[EntryInfo]
    snapshots: list[SnapshotRecord]
    truncated: bool


class Store(Protocol):
    async def lookup(self, scope_key: str, node: bytes, digest: bytes, claim: float = 0.0) -> Entry | Claim | None:
        """The entry for `(node, digest)`. On a miss with `claim` > 0, also try to claim it for that many
        seconds: `Claim(token)` if we got it, `Claim(None)` if someone else is executing it. On a miss
        without `claim`, None."""
        ...

    async def wait(self, scope_key: str, node: bytes, digest: bytes, timeout: float) -> Entry | None:
        """Block until the entry is recorded (return it) or its claim is released or expires (None)."""
        ...

    async def record(
        self, scope_key: str, node: bytes, digest: bytes, entry: Entry, token: str | None, *, reused: bool = False
    ) -> Entry:
        """Store `entry` unless one exists (first writer wins), release our claim, and return the winner. `reused`:
        the entry is a result reused by what the call read (`tvcache.reads`), which a server counts as a hit."""
        ...

    async def release(self, scope_key: str, node: bytes, digest: bytes, token: str) -> None:
        """Give a claim up without an entry (the execution failed); waiters wake and retry."""
        ...

    async def refresh(self, scope_key: str, node: bytes, digest: bytes, token: str, ttl: float) -> bool:
        """Extend our claim while a long call runs; False if it was lost (expired and taken over)."""
        ...

    async def add_candidate(self, scope_key: str, digest: bytes, candidate: Candidate) -> None:
        """Keep a result of the call `digest` with what it read (and, for a state-changing call, wrote), for reuse
        by what a call read (`tvcache.reads`): the newest `reads.MAX_CANDIDATES` per call, an identical one
        replaced."""
        ...

    async def candidates(self, scope_key: str, digest: bytes) -> list[Candidate]:
        """The candidates kept for the call `digest`, newest first."""
        ...

    async def lease(self, scope_key: str, origin: str, path: Sequence[bytes], ttl: float) -> Lease | None:
        """Lease the snapshot of `origin` at the deepest node of `path` (root first) that holds one.

        A snapshot can be restored only where it was made (the origin: a process, a machine, a registry),
        so every snapshot call names the caller's origin and sees only that origin's snapshots."""
        ...

    async def unlease(self, scope_key: str, token: str) -> None: ...

    async def add_snapshot(
        self, scope_key: str, origin: str, path: Sequence[bytes], snapshot_id: str, budget: int
    ) -> list[str]:
        """Attach `snapshot_id` to `path[-1]` (root first), evict down to `budget` snapshots of the origin,
        and return the snapshot ids the caller must now delete from its sandboxes: the evicted ones, and
        `snapshot_id` itself if the node already had a snapshot. Leased snapshots are never evicted."""
        ...

    async def drop_snapshot(self, scope_key: str, origin: str, node: bytes, snapshot_id: str) -> None:
        """Forget a snapshot that turned out to be unusable (its restore failed)."""
        ...

    async def snapshots(self, scope_key: str, origin: str | None = None) -> list[SnapshotRecord]:
        """The scope's snapshots, of one origin or (None) of all."""
        ...

    async def register(self, info: TaskInfo) -> None:
        """Name a scope, for people: dashboards and exports. Idempotent."""
        ...

    async def tasks(self) -> list[TaskInfo]: ...

    async def export(self, scope_key: str, limit: int = 10_000) -> GraphExport:
        """The scope's graph as data (at most `limit` entries), with hit counts, for dashboards."""
        ...

    async def ping(self) -> None:
        """Check, cheaply, that the store answers and accepts us; raise `StoreError` if not."""
        ...

    async def close(self) -> None: ...


def export_entries(rows: Iterable[tuple[bytes, bytes, Entry, int]]) -> list[EntryInfo]:
    """`EntryInfo`s from `(node, digest, entry, hits)` rows: the part of `export` every store shares."""
    return [
        EntryInfo(
            node,
            digest,
            child_id(node, digest) if e.kind == EDGE else None,
            e.kind,
            e.call,
            e.seconds,
            len(e.output),
            hits,
        )
        for node, digest, e, hits in rows
    ]
