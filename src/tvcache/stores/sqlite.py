"""The embedded durable store: one SQLite file in WAL mode.

Every acknowledged write is committed before the call returns, so a process killed with SIGKILL loses
nothing it recorded (WAL with synchronous=NORMAL survives process death; only a power cut can lose the last
transactions). Entries are immutable once written (first writer wins), so each one read is also kept in a
dict and later hits cost no SQL at all. Statements run on the event loop's thread: each is tens of
microseconds, less than handing it to a thread would cost.

Several processes may open the same file: they share entries and snapshot records; single flight (who is
executing what) is per process, so two processes can execute the same miss once each, never wrongly.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

from ..graph import Entry
from ..policy import choose_evictions
from .base import GraphExport, Lease, SnapshotRecord, StoreError, TaskInfo, export_entries
from .flights import EmbeddedEntries

__all__ = ["SQLiteStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    node BLOB NOT NULL, digest BLOB NOT NULL, scope TEXT NOT NULL,
    kind TEXT NOT NULL, output BLOB NOT NULL, seconds REAL NOT NULL, call TEXT NOT NULL,
    PRIMARY KEY (node, digest)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_scope ON entries (scope);
CREATE TABLE IF NOT EXISTS snapshots (
    scope TEXT NOT NULL, origin TEXT NOT NULL, node BLOB NOT NULL, snapshot_id TEXT NOT NULL, parent BLOB,
    last_used REAL NOT NULL,
    PRIMARY KEY (scope, origin, node)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tasks (
    key TEXT PRIMARY KEY, namespace TEXT NOT NULL, task TEXT NOT NULL, fingerprint TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (
    token TEXT PRIMARY KEY, scope TEXT NOT NULL, origin TEXT NOT NULL, node BLOB NOT NULL, expiry REAL NOT NULL
) WITHOUT ROWID;
"""


class SQLiteStore(EmbeddedEntries):
    def __init__(self, path: str | Path):
        super().__init__()
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the cache database {str(path)!r}: {exc}") from exc
        self.path = path
        self._entries: dict[bytes, Entry] = {}

    def _get(self, scope_key: str, node: bytes, digest: bytes) -> Entry | None:
        key = node + digest
        entry = self._entries.get(key)
        if entry is None:
            row = self._db.execute(
                "SELECT kind, output, seconds, call FROM entries WHERE node = ? AND digest = ?", (node, digest)
            ).fetchone()
            if row is None:
                return None
            entry = self._entries[key] = Entry(*row)
        return entry

    def _put(self, scope_key: str, node: bytes, digest: bytes, entry: Entry) -> Entry:
        self._db.execute(
            "INSERT OR IGNORE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)",
            (node, digest, scope_key, entry.kind, entry.output, entry.seconds, entry.call),
        )
        return self._get(scope_key, node, digest) or entry

    async def lease(self, scope_key: str, origin: str, path: Sequence[bytes], ttl: float) -> Lease | None:
        if not path:
            return None
        with self._db:  # one transaction: another process cannot evict between the find and the lease
            self._db.execute("BEGIN IMMEDIATE")
            marks = ",".join("?" * len(path))
            rows = dict(
                self._db.execute(
                    f"SELECT node, snapshot_id FROM snapshots WHERE scope = ? AND origin = ? AND node IN ({marks})",
                    (scope_key, origin, *path),
                ).fetchall()
            )
            node = next((n for n in reversed(path) if n in rows), None)
            if node is None:
                return None
            now, token = time.time(), secrets.token_hex(8)
            self._db.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?)", (token, scope_key, origin, node, now + ttl))
            self._db.execute(
                "UPDATE snapshots SET last_used = ? WHERE scope = ? AND origin = ? AND node = ?",
                (now, scope_key, origin, node),
            )
            return Lease(node, rows[node], token)

    async def unlease(self, scope_key: str, token: str) -> None:
        self._db.execute("DELETE FROM leases WHERE token = ?", (token,))

    async def add_snapshot(
        self, scope_key: str, origin: str, path: Sequence[bytes], snapshot_id: str, budget: int
    ) -> list[str]:
        node = path[-1]
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            records = {r.node: r for r in self._records(scope_key, origin)}
            if node in records:
                return [snapshot_id]
            parent = next((n for n in reversed(path[:-1]) if n in records), None)
            now = time.time()
            self._db.execute(
                "INSERT INTO snapshots VALUES (?, ?, ?, ?, ?, ?)", (scope_key, origin, node, snapshot_id, parent, now)
            )
            records[node] = SnapshotRecord(origin, node, snapshot_id, parent, now, False)
            evicted = choose_evictions(records.values(), budget, node)
            self._db.executemany(
                "DELETE FROM snapshots WHERE scope = ? AND origin = ? AND node = ?",
                [(scope_key, origin, r.node) for r in evicted],
            )
        return [r.snapshot_id for r in evicted]

    async def drop_snapshot(self, scope_key: str, origin: str, node: bytes, snapshot_id: str) -> None:
        self._db.execute(
            "DELETE FROM snapshots WHERE scope = ? AND origin = ? AND node = ? AND snapshot_id = ?",
            (scope_key, origin, node, snapshot_id),
        )

    async def snapshots(self, scope_key: str, origin: str | None = None) -> list[SnapshotRecord]:
        return self._records(scope_key, origin)

    def _records(self, scope_key: str, origin: str | None) -> list[SnapshotRecord]:
        now = time.time()
        self._db.execute("DELETE FROM leases WHERE expiry <= ?", (now,))
        leased = set(self._db.execute("SELECT origin, node FROM leases WHERE scope = ?", (scope_key,)).fetchall())
        rows = self._db.execute(
            "SELECT origin, node, snapshot_id, parent, last_used FROM snapshots WHERE scope = ?"
            + (" AND origin = ?" if origin is not None else ""),
            (scope_key, origin) if origin is not None else (scope_key,),
        ).fetchall()
        return [SnapshotRecord(o, n, sid, parent, used, (o, n) in leased) for o, n, sid, parent, used in rows]

    async def register(self, info: TaskInfo) -> None:
        self._db.execute(
            "INSERT OR IGNORE INTO tasks VALUES (?, ?, ?, ?)",
            (info.scope_key, info.namespace, info.task, info.fingerprint),
        )

    async def tasks(self) -> list[TaskInfo]:
        return [TaskInfo(*row) for row in self._db.execute("SELECT key, namespace, task, fingerprint FROM tasks")]

    async def export(self, scope_key: str, limit: int = 10_000) -> GraphExport:
        row = self._db.execute(
            "SELECT key, namespace, task, fingerprint FROM tasks WHERE key = ?", (scope_key,)
        ).fetchone()
        rows = self._db.execute(
            "SELECT node, digest, kind, output, seconds, call FROM entries WHERE scope = ? LIMIT ?",
            (scope_key, limit + 1),
        ).fetchall()
        entries = export_entries(
            (n, d, Entry(k, o, s, c), self._hits.get(n + d, 0)) for n, d, k, o, s, c in rows[:limit]
        )
        return GraphExport(TaskInfo(*row) if row else None, entries, self._records(scope_key, None), len(rows) > limit)

    async def close(self) -> None:
        self._entries.clear()
        self._db.close()
