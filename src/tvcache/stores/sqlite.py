"""The embedded durable store: one SQLite file in WAL mode.

    SQLiteStore("runs/cache.db")                       # or open_store("sqlite:///runs/cache.db?cache_mb=64")

Every acknowledged write is committed before the call returns, so a process killed with SIGKILL loses
nothing it recorded (WAL with synchronous=NORMAL survives process death; only a power cut can lose the last
transactions).

Entries never change once written (first writer wins), so the ones read or written recently are also kept
in memory (`EntryCache`, least recently used dropped first past `cache_mb`, 64 MiB by default): a hit on one
costs no SQL and never leaves the event loop. Everything else runs on two threads of the store's own, each
with its own connection: a writer, where each write is one transaction, and a reader, which WAL lets read
while a write waits. So a write lock held by another process (for up to the busy `timeout`, after which the
write fails with `StoreError`) holds up neither the event loop nor lookups.

Several processes may open the same file: they share entries and snapshot records; single flight (who is
executing what) is per process, so two processes can execute the same miss once each, never wrongly.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import msgspec

from .._owner import forks, inherited
from ..graph import MAX_CANDIDATES, Candidate, Entry, decode_candidate, encode_candidate
from .base import GraphExport, Lease, SnapshotRecord, StoreError, TaskInfo, export_entries
from .eviction import choose_evictions
from .flights import EmbeddedEntries
from .lru import DEFAULT_CACHE_MB, EntryCache

__all__ = ["SQLiteStore"]

T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0  # seconds a write waits for a lock another connection holds
MAX_LIMIT = 1 << 62  # SQLite integers are 64-bit: a larger LIMIT would not bind

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
CREATE TABLE IF NOT EXISTS candidates (
    scope TEXT NOT NULL, digest BLOB NOT NULL, ident BLOB NOT NULL, added INTEGER NOT NULL, candidate BLOB NOT NULL,
    PRIMARY KEY (scope, digest, ident)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (
    token TEXT PRIMARY KEY, scope TEXT NOT NULL, origin TEXT NOT NULL, node BLOB NOT NULL, expiry REAL NOT NULL
) WITHOUT ROWID;
"""


class _Connection:
    """A connection that lives on one thread of its own: `run(fn)` calls `fn(db)` there, so a statement that
    waits for a lock waits on that thread, and `fn` runs whole, one transaction at a time."""

    def __init__(self, path: Path, timeout: float, role: str, setup: Callable[[sqlite3.Connection], None]):
        self.path = path
        self._timeout = timeout
        self._role = role
        self._setup = setup
        self._closed = False
        self._start()
        try:
            self._thread.submit(self._connected).result()
        except (OSError, sqlite3.Error) as exc:
            self._thread.shutdown()
            raise StoreError(f"cannot open the cache database {str(path)!r}: {exc}") from exc

    def _start(self) -> None:
        self._owner = forks()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"tvcache-sqlite-{self._role}")
        self._db: sqlite3.Connection | None = None

    def _connected(self) -> sqlite3.Connection:
        """The connection, opened on first use, on the thread."""
        if self._db is None:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=self._timeout)
            try:
                self._setup(db)
            except BaseException:
                db.close()
                raise
            self._db = db
        return self._db

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise StoreError(f"the cache database {str(self.path)!r} is closed")
        if inherited(self._owner):
            # A forked child: the parent's thread does not exist here (work handed to it would wait forever),
            # and SQLite forbids using a connection across fork. Start afresh.
            self._start()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(self._connected()))
        except sqlite3.Error as exc:  # "database is locked" after the busy timeout, a full disk, corruption...
            raise StoreError(f"cache database {str(self.path)!r}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        if not self._closed:
            await self.run(lambda db: db.close())
            self._closed = True
            self._thread.shutdown(wait=False)


def _create(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(_SCHEMA)
    # Files made before edges recorded their writes (reuse by what a call read) gain the column: their
    # entries read as writes unknown.
    if "writes" not in {row[1] for row in db.execute("PRAGMA table_info(entries)")}:
        db.execute("ALTER TABLE entries ADD COLUMN writes BLOB")


_decode_writes = msgspec.msgpack.Decoder(dict[str, str] | None).decode


def _entry(row: tuple[Any, ...]) -> Entry:
    """An entry from its row, checked: a row another program wrote badly is a store failure, not a crash."""
    try:
        kind, output, seconds, call, writes = row
        fields = (kind, output, seconds, call, None if writes is None else _decode_writes(writes))
        return msgspec.convert(fields, Entry, builtin_types=(bytes,))  # bytes only from a BLOB, not base64 text
    except (msgspec.ValidationError, msgspec.DecodeError, TypeError) as exc:
        raise StoreError(f"a corrupt entry in the cache database: {exc}") from exc


def _select(db: sqlite3.Connection, node: bytes, digest: bytes) -> Entry | None:
    row = db.execute(
        "SELECT kind, output, seconds, call, writes FROM entries WHERE node = ? AND digest = ?", (node, digest)
    ).fetchone()
    return None if row is None else _entry(row)


def _records(db: sqlite3.Connection, scope_key: str, origin: str | None) -> list[SnapshotRecord]:
    now = time.time()
    leased = set(db.execute("SELECT origin, node FROM leases WHERE scope = ? AND expiry > ?", (scope_key, now)))
    rows = db.execute(
        "SELECT origin, node, snapshot_id, parent, last_used FROM snapshots WHERE scope = ?"
        + (" AND origin = ?" if origin is not None else ""),
        (scope_key, origin) if origin is not None else (scope_key,),
    ).fetchall()
    return [SnapshotRecord(o, n, sid, parent, used, (o, n) in leased) for o, n, sid, parent, used in rows]


def _writes(entry: Entry) -> bytes | None:
    return None if entry.writes is None else msgspec.msgpack.encode(entry.writes)


class SQLiteStore(EmbeddedEntries):
    def __init__(self, path: str | Path, *, cache_mb: float = DEFAULT_CACHE_MB, timeout: float = DEFAULT_TIMEOUT):
        if not cache_mb >= 0:
            raise ValueError(f"cache_mb is >= 0 (0 keeps no entries in memory), got {cache_mb}")
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout is a number of seconds > 0, got {timeout}")
        super().__init__()
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot open the cache database {str(path)!r}: {exc}") from exc
        self.path = path
        self.cache = EntryCache(cache_mb * (1 << 20))  # inf: unbounded
        self._writer = _Connection(path, timeout, "writer", _create)
        self._reader = _Connection(path, timeout, "reader", lambda db: None)

    @classmethod
    def from_url(cls, url: str) -> SQLiteStore:
        """`sqlite:///relative/path.db` or `sqlite:////absolute/path.db`, with optional `?cache_mb=64` (memory
        for entries, in MiB) and `&timeout=10` (seconds a write waits for another connection's lock)."""
        rest, _, query = url.removeprefix("sqlite://").partition("?")
        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"a sqlite store URL is sqlite:///relative/path.db or sqlite:////abs/path.db, got {url!r}")
        options: dict[str, float] = {}
        for name, value in parse_qsl(query, keep_blank_values=True):
            if name not in ("cache_mb", "timeout"):
                raise ValueError(f"unknown option {name!r} in {url!r}: a sqlite store takes cache_mb and timeout")
            try:
                options[name] = float(value)
            except ValueError:
                raise ValueError(f"{name} in {url!r} is a number, got {value!r}") from None
        return cls(rest[1:], **options)

    # -- entries -----------------------------------------------------------------------------------------

    async def _get(self, scope_key: str, node: bytes, digest: bytes, hit: bool) -> Entry | None:
        key = node + digest
        item = self.cache.get(key)
        if item is None:
            entry = await self._reader.run(lambda db: _select(db, node, digest))
            # Recorded here while we read? Then it is cached now: a claim would only execute it again.
            item = self.cache.peek(key) if entry is None else self.cache.put(key, entry)
            if item is None:
                return None
        item.hits += hit
        return item.entry

    async def _put(self, scope_key: str, node: bytes, digest: bytes, entry: Entry) -> Entry:
        key = node + digest
        known = self.cache.peek(key)
        if known is not None:  # already recorded, and the first writer wins
            return known.entry

        def insert(db: sqlite3.Connection) -> Entry:
            inserted = db.execute(
                "INSERT OR IGNORE INTO entries (node, digest, scope, kind, output, seconds, call, writes)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (node, digest, scope_key, entry.kind, entry.output, entry.seconds, entry.call, _writes(entry)),
            ).rowcount
            return entry if inserted else _select(db, node, digest) or entry

        return self.cache.put(key, await self._writer.run(insert)).entry

    # -- candidates (reuse by what a call read) ------------------------------------------------------------

    async def add_candidate(self, scope_key: str, digest: bytes, candidate: Candidate) -> None:
        blob = encode_candidate(candidate)
        ident = hashlib.blake2b(blob, digest_size=16).digest()

        def add(db: sqlite3.Connection) -> None:
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.execute(
                    "INSERT OR REPLACE INTO candidates VALUES (?, ?, ?,"
                    " (SELECT coalesce(max(added), 0) + 1 FROM candidates WHERE scope = ? AND digest = ?), ?)",
                    (scope_key, digest, ident, scope_key, digest, blob),
                )
                db.execute(
                    "DELETE FROM candidates WHERE scope = ? AND digest = ? AND ident NOT IN"
                    " (SELECT ident FROM candidates WHERE scope = ? AND digest = ? ORDER BY added DESC LIMIT ?)",
                    (scope_key, digest, scope_key, digest, MAX_CANDIDATES),
                )

        await self._writer.run(add)

    async def candidates(self, scope_key: str, digest: bytes) -> list[Candidate]:
        rows = await self._reader.run(
            lambda db: db.execute(
                "SELECT candidate FROM candidates WHERE scope = ? AND digest = ? ORDER BY added DESC",
                (scope_key, digest),
            ).fetchall()
        )
        try:
            return [decode_candidate(blob) for (blob,) in rows]
        except (msgspec.ValidationError, msgspec.DecodeError, TypeError) as exc:
            raise StoreError(f"a corrupt candidate in the cache database: {exc}") from exc

    # -- snapshots ---------------------------------------------------------------------------------------

    async def lease(self, scope_key: str, origin: str, path: Sequence[bytes], ttl: float) -> Lease | None:
        if not path:
            return None

        def lease(db: sqlite3.Connection) -> Lease | None:
            with db:  # one transaction: another process cannot evict between the find and the lease
                db.execute("BEGIN IMMEDIATE")
                marks = ",".join("?" * len(path))
                rows = dict(
                    db.execute(
                        f"SELECT node, snapshot_id FROM snapshots WHERE scope = ? AND origin = ? AND node IN ({marks})",
                        (scope_key, origin, *path),
                    ).fetchall()
                )
                node = next((n for n in reversed(path) if n in rows), None)
                if node is None:
                    return None
                now, token = time.time(), secrets.token_hex(8)
                db.execute("DELETE FROM leases WHERE expiry <= ?", (now,))
                db.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?)", (token, scope_key, origin, node, now + ttl))
                db.execute(
                    "UPDATE snapshots SET last_used = ? WHERE scope = ? AND origin = ? AND node = ?",
                    (now, scope_key, origin, node),
                )
                return Lease(node, rows[node], token)

        return await self._writer.run(lease)

    async def unlease(self, scope_key: str, token: str) -> None:
        await self._writer.run(lambda db: db.execute("DELETE FROM leases WHERE token = ?", (token,)))

    async def add_snapshot(
        self, scope_key: str, origin: str, path: Sequence[bytes], snapshot_id: str, budget: int
    ) -> list[str]:
        node = path[-1]

        def add(db: sqlite3.Connection) -> list[str]:
            with db:
                db.execute("BEGIN IMMEDIATE")
                records = {r.node: r for r in _records(db, scope_key, origin)}
                if node in records:
                    return [snapshot_id]
                parent = next((n for n in reversed(path[:-1]) if n in records), None)
                now = time.time()
                db.execute(
                    "INSERT INTO snapshots VALUES (?, ?, ?, ?, ?, ?)",
                    (scope_key, origin, node, snapshot_id, parent, now),
                )
                records[node] = SnapshotRecord(origin, node, snapshot_id, parent, now, False)
                evicted = choose_evictions(records.values(), budget, node)
                db.executemany(
                    "DELETE FROM snapshots WHERE scope = ? AND origin = ? AND node = ?",
                    [(scope_key, origin, r.node) for r in evicted],
                )
                return [r.snapshot_id for r in evicted]

        return await self._writer.run(add)

    async def drop_snapshot(self, scope_key: str, origin: str, node: bytes, snapshot_id: str) -> None:
        await self._writer.run(
            lambda db: db.execute(
                "DELETE FROM snapshots WHERE scope = ? AND origin = ? AND node = ? AND snapshot_id = ?",
                (scope_key, origin, node, snapshot_id),
            )
        )

    async def snapshots(self, scope_key: str, origin: str | None = None) -> list[SnapshotRecord]:
        return await self._reader.run(lambda db: _records(db, scope_key, origin))

    # -- tasks, export, health ---------------------------------------------------------------------------

    async def register(self, info: TaskInfo) -> None:
        await self._writer.run(
            lambda db: db.execute(
                "INSERT OR IGNORE INTO tasks VALUES (?, ?, ?, ?)",
                (info.scope_key, info.namespace, info.task, info.fingerprint),
            )
        )

    async def tasks(self) -> list[TaskInfo]:
        rows = await self._reader.run(
            lambda db: db.execute("SELECT key, namespace, task, fingerprint FROM tasks").fetchall()
        )
        return [TaskInfo(*row) for row in rows]

    async def export(self, scope_key: str, limit: int = 10_000) -> GraphExport:
        limit = max(0, min(limit, MAX_LIMIT))

        def read(db: sqlite3.Connection) -> tuple[Any, list[tuple[bytes, bytes, Entry]], list[SnapshotRecord]]:
            task = db.execute(
                "SELECT key, namespace, task, fingerprint FROM tasks WHERE key = ?", (scope_key,)
            ).fetchone()
            rows = db.execute(
                "SELECT node, digest, kind, output, seconds, call, writes FROM entries WHERE scope = ? LIMIT ?",
                (scope_key, limit + 1),
            ).fetchall()
            return task, [(n, d, _entry(tuple(e))) for n, d, *e in rows], _records(db, scope_key, None)

        task, rows, snapshots = await self._reader.run(read)
        # Hit counts live with the cached entries, on the event loop's thread: an entry no longer cached here
        # shows none.
        entries = export_entries((n, d, e, self._hits(n + d)) for n, d, e in rows[:limit])
        return GraphExport(TaskInfo(*task) if task else None, entries, snapshots, len(rows) > limit)

    def _hits(self, key: bytes) -> int:
        item = self.cache.peek(key)
        return item.hits if item is not None else 0

    async def ping(self) -> None:
        """Reads the schema, then takes and gives back the write lock: a file that is no longer a database,
        or a lock another connection holds past the busy timeout, raises `StoreError`."""

        def write(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            db.execute("ROLLBACK")

        await self._reader.run(lambda db: db.execute("SELECT count(*) FROM sqlite_master").fetchone())
        await self._writer.run(write)

    async def close(self) -> None:
        self.cache.clear()
        await self._reader.close()
        await self._writer.close()
