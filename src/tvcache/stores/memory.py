"""The embedded in-memory store: one process, no durability, the fastest hits.

It is the graph itself, so it cannot drop entries to bound its memory: a run's graph grows with its distinct
calls. Use `sqlite:///path.db?cache_mb=N` where that matters: the file holds the graph, memory a bounded part.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..graph import MAX_CANDIDATES, Candidate, Entry
from .base import GraphExport, Lease, SnapshotRecord, TaskInfo, export_entries
from .eviction import choose_evictions
from .flights import EmbeddedEntries

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
    snapshots: dict[str, dict[bytes, _Snapshot]] = field(default_factory=dict)  # origin -> node -> snapshot
    leases: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # token -> (origin, node)
    candidates: dict[bytes, list[Candidate]] = field(default_factory=dict)  # call digest -> newest first
    info: TaskInfo | None = None


class MemoryStore(EmbeddedEntries):
    def __init__(self) -> None:
        super().__init__()
        self._tasks: dict[str, _Task] = {}
        self._hits: dict[bytes, int] = {}  # node + digest -> lookups answered with it, for exports

    def _task(self, scope_key: str) -> _Task:
        task = self._tasks.get(scope_key)
        if task is None:
            task = self._tasks[scope_key] = _Task()
        return task

    async def _get(self, scope_key: str, node: bytes, digest: bytes, hit: bool) -> Entry | None:
        key = node + digest
        entry = self._task(scope_key).entries.get(key)
        if entry is not None and hit:
            self._hits[key] = self._hits.get(key, 0) + 1
        return entry

    async def _put(self, scope_key: str, node: bytes, digest: bytes, entry: Entry) -> Entry:
        return self._task(scope_key).entries.setdefault(node + digest, entry)

    async def add_candidate(self, scope_key: str, digest: bytes, candidate: Candidate) -> None:
        kept = self._task(scope_key).candidates.setdefault(digest, [])
        if candidate in kept:
            kept.remove(candidate)
        kept.insert(0, candidate)
        del kept[MAX_CANDIDATES:]

    async def candidates(self, scope_key: str, digest: bytes) -> list[Candidate]:
        return list(self._task(scope_key).candidates.get(digest, ()))

    async def lease(self, scope_key: str, origin: str, path: Sequence[bytes], ttl: float) -> Lease | None:
        task = self._task(scope_key)
        mine = task.snapshots.get(origin, {})
        for node in reversed(path):
            snap = mine.get(node)
            if snap is not None:
                now = time.time()
                token = secrets.token_hex(8)
                snap.leases[token] = now + ttl
                snap.last_used = now
                task.leases[token] = (origin, node)
                return Lease(node, snap.snapshot_id, token)
        return None

    async def unlease(self, scope_key: str, token: str) -> None:
        task = self._task(scope_key)
        origin, node = task.leases.pop(token, ("", b""))
        snap = task.snapshots.get(origin, {}).get(node)
        if snap is not None:
            snap.leases.pop(token, None)

    async def add_snapshot(
        self, scope_key: str, origin: str, path: Sequence[bytes], snapshot_id: str, budget: int
    ) -> list[str]:
        mine = self._task(scope_key).snapshots.setdefault(origin, {})
        node = path[-1]
        if node in mine:
            return [snapshot_id]
        parent = next((n for n in reversed(path[:-1]) if n in mine), None)
        mine[node] = _Snapshot(snapshot_id, parent, time.time())
        evicted = choose_evictions(self._records(scope_key, origin), budget, node)
        for record in evicted:
            del mine[record.node]
        return [r.snapshot_id for r in evicted]

    async def drop_snapshot(self, scope_key: str, origin: str, node: bytes, snapshot_id: str) -> None:
        mine = self._task(scope_key).snapshots.get(origin, {})
        snap = mine.get(node)
        if snap is not None and snap.snapshot_id == snapshot_id:
            del mine[node]

    async def snapshots(self, scope_key: str, origin: str | None = None) -> list[SnapshotRecord]:
        return self._records(scope_key, origin)

    def _records(self, scope_key: str, origin: str | None) -> list[SnapshotRecord]:
        now = time.time()
        task = self._task(scope_key)
        return [
            SnapshotRecord(o, node, s.snapshot_id, s.parent, s.last_used, s.leased(now))
            for o, mine in task.snapshots.items()
            if origin is None or o == origin
            for node, s in mine.items()
        ]

    async def register(self, info: TaskInfo) -> None:
        self._task(info.scope_key).info = info

    async def tasks(self) -> list[TaskInfo]:
        return [t.info for t in self._tasks.values() if t.info is not None]

    async def export(self, scope_key: str, limit: int = 10_000) -> GraphExport:
        task = self._task(scope_key)
        items = list(task.entries.items())
        entries = export_entries(((k[:16], k[16:], e, self._hits.get(k, 0)) for k, e in items[:limit]))
        return GraphExport(task.info, entries, self._records(scope_key, None), len(items) > limit)

    async def ping(self) -> None:
        """Always answers: it lives in this process."""

    async def close(self) -> None:
        self._tasks.clear()
        self._hits.clear()
