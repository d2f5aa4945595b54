"""The embedded in-memory store: one process, no durability, the fastest hits."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..graph import Entry
from ..policy import choose_evictions
from .base import Claim, Lease, SnapshotRecord
from .flights import Flights

__all__ = ["MemoryStore"]


@dataclass
class _Snapshot:
    snapshot_id: str
    parent: bytes | None
    last_used: float
    leases: dict[str, float] = field(default_factory=dict)  # token -> expiry

    def leased(self, now: float) -> bool:
        for token, expiry in list(self.leases.items()):
            if expiry <= now:  # a crashed client's lease runs out instead of pinning forever
                del self.leases[token]
        return bool(self.leases)


@dataclass
class _Task:
    entries: dict[bytes, Entry] = field(default_factory=dict)  # node + digest -> entry
    hits: dict[bytes, int] = field(default_factory=dict)
    snapshots: dict[bytes, _Snapshot] = field(default_factory=dict)  # node -> snapshot
    leases: dict[str, bytes] = field(default_factory=dict)  # token -> node


class MemoryStore:
    def __init__(self) -> None:
        self._tasks: dict[str, _Task] = {}
        self._flights = Flights()

    def _task(self, scope: str) -> _Task:
        task = self._tasks.get(scope)
        if task is None:
            task = self._tasks[scope] = _Task()
        return task

    async def lookup(
        self, scope: str, node: bytes, digest: bytes, claim: float = 0.0
    ) -> Entry | Claim | None:
        task = self._task(scope)
        key = node + digest
        entry = task.entries.get(key)
        if entry is not None:
            task.hits[key] = task.hits.get(key, 0) + 1
            return entry
        if claim <= 0:
            return None
        return Claim(self._flights.claim(key, claim))

    async def wait(self, scope: str, node: bytes, digest: bytes, timeout: float) -> Entry | None:
        key = node + digest
        await self._flights.wait(key, timeout)
        return self._task(scope).entries.get(key)

    async def record(self, scope: str, node: bytes, digest: bytes, entry: Entry, token: str | None) -> Entry:
        key = node + digest
        winner = self._task(scope).entries.setdefault(key, entry)
        self._flights.finish(key, None)
        return winner

    async def release(self, scope: str, node: bytes, digest: bytes, token: str) -> None:
        self._flights.finish(node + digest, token)

    async def refresh(self, scope: str, node: bytes, digest: bytes, token: str, ttl: float) -> bool:
        return self._flights.refresh(node + digest, token, ttl)

    async def lease(self, scope: str, path: Sequence[bytes], ttl: float) -> Lease | None:
        task = self._task(scope)
        for node in reversed(path):
            snap = task.snapshots.get(node)
            if snap is not None:
                now = time.time()
                token = secrets.token_hex(8)
                snap.leases[token] = now + ttl
                snap.last_used = now
                task.leases[token] = node
                return Lease(node, snap.snapshot_id, token)
        return None

    async def unlease(self, scope: str, token: str) -> None:
        task = self._task(scope)
        node = task.leases.pop(token, None)
        snap = task.snapshots.get(node) if node is not None else None
        if snap is not None:
            snap.leases.pop(token, None)

    async def add_snapshot(
        self, scope: str, path: Sequence[bytes], snapshot_id: str, budget: int
    ) -> list[str]:
        task = self._task(scope)
        node = path[-1]
        if node in task.snapshots:
            return [snapshot_id]
        parent = next((n for n in reversed(path[:-1]) if n in task.snapshots), None)
        task.snapshots[node] = _Snapshot(snapshot_id, parent, time.time())
        evicted = choose_evictions(self._records(task), budget)
        for record in evicted:
            del task.snapshots[record.node]
        return [r.snapshot_id for r in evicted]

    async def drop_snapshot(self, scope: str, node: bytes, snapshot_id: str) -> None:
        task = self._task(scope)
        snap = task.snapshots.get(node)
        if snap is not None and snap.snapshot_id == snapshot_id:
            del task.snapshots[node]

    async def snapshots(self, scope: str) -> list[SnapshotRecord]:
        return self._records(self._task(scope))

    def _records(self, task: _Task) -> list[SnapshotRecord]:
        now = time.time()
        return [
            SnapshotRecord(node, s.snapshot_id, s.parent, s.last_used, s.leased(now))
            for node, s in task.snapshots.items()
        ]

    async def close(self) -> None:
        self._tasks.clear()
