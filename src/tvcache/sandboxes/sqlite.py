"""Sandboxes over a SQLite database: one tool, `sql`, with args `{"query": str}`.

Every sandbox is a private copy of the database file in a directory on tmpfs, opened by one connection that
only the sandbox's own worker thread uses, so a slow query never blocks the event loop.

**Output.** One statement per call. A statement that returns rows gives a text table: a header line with
the column names, then one line per row; columns are separated by two spaces and padded to the width of
their longest cell; a column whose shown values are all numbers (NULLs aside) is right-aligned, others
left-aligned; the last column is not padded. NULL shows as `NULL`, floats as Python's `repr`, blobs as
`x'0a1b'`, and newlines, carriage returns and tabs inside values as `\\n`, `\\r`, `\\t`, so a row is one line.
As in SkyRL-SQL's text2sql environment, a table longer than 9,000 characters is replaced by
`"Truncated to 50 lines since returned response too long: "`, a newline, and the table of its first 50
rows. (SkyRL formats with pandas from a `frozenset` of the rows, which drops duplicates and reorders rows
differently in every process; here rows keep SQLite's order, so outputs are deterministic, and rows past
the truncation point are not even fetched.) A statement that returns no rows gives `OK` (DDL) or
`OK, 3 rows affected` (INSERT/UPDATE/DELETE). An SQL error is an ordinary output, `Error: <message>`; only a
timeout and `Error: database or disk is full` (the sandboxes' `tmp` is full: the machine, not the query, so it
is never cached) are `error=True` outcomes.

**Changed or not.** A call changed the state when the connection's `total_changes` moved, or the main
file's change counter or schema cookie moved (DDL, ANALYZE and REINDEX change no rows), or the temp
schema's version moved (temp views and tables live in the connection, not the file).

**Snapshots** are a byte copy of the file (exact, so a restored copy is the same database, page for page)
plus, when the connection holds temp objects, a dump of its temp schema (schema rows and table rows); a
restore copies the file and re-creates the temp objects, in their original order, with their rows and
rowids.

**What a query may not do.** A sandbox must neither reach other files nor depend on state that a snapshot
cannot carry, so an authorizer refuses: ATTACH and DETACH (and with them VACUUM, which attaches
internally), `load_extension`, transaction control (each call is its own transaction), PRAGMAs other than
read-only introspection, the connection-state functions `last_insert_rowid()`, `changes()` and
`total_changes()`, and ANALYZE or virtual tables in the temp schema. The refusal is an ordinary output
`Error: not authorized (...)`. Reads of a temp object's `rootpage` give NULL (page numbers are the one thing
a re-created temp schema does not reproduce).

The fingerprint is a blake2b content hash of the database the sandboxes start from, prefixed with the
output format's version, so a change of either gives cached results a new scope.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import pickle
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from ..calls import ToolCall
from .base import Outcome, SandboxError, no_room, refusal
from .lifecycle import ManagedSandbox, ManagedSandboxes
from .reclaim import scratch_dir

__all__ = ["MAX_OUTPUT_CHARS", "TRUNCATED_ROWS", "TRUNCATION_NOTE", "SQLiteSandbox", "SQLiteSandboxes"]

T = TypeVar("T")

TOOL = "sql"
MAX_OUTPUT_CHARS = 9000
TRUNCATED_ROWS = 50
TRUNCATION_NOTE = "Truncated to 50 lines since returned response too long: "
#: Bump when outputs change for the same database and query: it is part of the fingerprint.
FORMAT_VERSION = "v1"

_SEPARATOR = "  "
_FETCH_BATCH = 256
# The progress handler runs every this many SQLite VM instructions: often enough to stop a runaway query
# within milliseconds, rarely enough to cost nothing measurable.
_PROGRESS_STEPS = 1000
# How long past its timeout a query may run before the event loop side interrupts it itself (a single VM
# instruction, such as a big sort, can outlast the progress handler's checks).
_WATCHDOG_GRACE = 1.0


# ---------------------------------------------------------------------------------------------------------
# Formatting results


def format_rows(cursor: sqlite3.Cursor) -> str:
    """The text of a statement's result rows, truncated as described in the module docstring."""
    names = [_cell(column[0]) for column in cursor.description]
    separators = len(_SEPARATOR) * (len(names) - 1)
    # Padding only adds characters, so the plain length of the cells is a lower bound on the table's length:
    # once it passes the limit the table is certainly truncated, and the rows past the 50th are not needed.
    floor = sum(map(len, names)) + separators
    rows: list[tuple[Any, ...]] = []
    while batch := cursor.fetchmany(_FETCH_BATCH):
        for row in batch:
            rows.append(row)
            floor += 1 + separators + sum(len(_cell(value)) for value in row)
            if floor > MAX_OUTPUT_CHARS and len(rows) >= TRUNCATED_ROWS:
                return TRUNCATION_NOTE + "\n" + _table(names, rows[:TRUNCATED_ROWS])
    text = _table(names, rows)
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    return TRUNCATION_NOTE + "\n" + _table(names, rows[:TRUNCATED_ROWS])


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes):
        return f"x'{value.hex()}'"
    if isinstance(value, str):
        return value.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return str(value)


def _table(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_cell(value) for value in row] for row in rows]
    right = [
        any(row[i] is not None for row in rows)
        and all(row[i] is None or isinstance(row[i], int | float) for row in rows)
        for i in range(len(names))
    ]
    widths = [max([len(name), *(len(line[i]) for line in cells)]) for i, name in enumerate(names)]
    last = len(names) - 1

    def line(values: Sequence[str]) -> str:
        parts = [
            value.rjust(widths[i]) if right[i] else value if i == last else value.ljust(widths[i])
            for i, value in enumerate(values)
        ]
        return _SEPARATOR.join(parts)

    return "\n".join([line(names), *(line(row) for row in cells)])


def _ok(rowcount: int) -> str:
    if rowcount < 0:
        return "OK"
    return f"OK, {rowcount} row{'' if rowcount == 1 else 's'} affected"


# ---------------------------------------------------------------------------------------------------------
# What a query may do

# Introspection pragmas: allowed with any argument, they only read.
_READ_PRAGMAS = frozenset(
    {
        "collation_list",
        "compile_options",
        "foreign_key_check",
        "foreign_key_list",
        "function_list",
        "index_info",
        "index_list",
        "index_xinfo",
        "integrity_check",
        "module_list",
        "pragma_list",
        "quick_check",
        "table_info",
        "table_list",
        "table_xinfo",
    }
)
# Settings that may be read but not set (setting them changes the file header or the connection).
_QUERY_PRAGMAS = frozenset(
    {"application_id", "auto_vacuum", "encoding", "foreign_keys", "page_size", "recursive_triggers", "user_version"}
)
_DENIED_FUNCTIONS = {
    "load_extension": "extensions cannot be loaded",
    "last_insert_rowid": "last_insert_rowid() is connection state a snapshot cannot carry; use RETURNING",
    "changes": "changes() is connection state a snapshot cannot carry",
    "total_changes": "total_changes() is connection state a snapshot cannot carry",
    "sqlite_offset": "file offsets are not stable across snapshots",
}
_TEMP_MASTER = frozenset({"sqlite_temp_master", "sqlite_temp_schema"})


def _refusal(action: int, arg1: str | None, arg2: str | None, db: str | None) -> str | None:
    """Why a query may not perform `action` (sqlite3 authorizer arguments), or None if it may."""
    if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
        return "ATTACH, DETACH and VACUUM are not allowed in a sandbox"
    if action in (sqlite3.SQLITE_TRANSACTION, sqlite3.SQLITE_SAVEPOINT):
        return "transaction control is not allowed: each call is its own transaction"
    if action == sqlite3.SQLITE_PRAGMA:
        name = (arg1 or "").lower()
        if name in _READ_PRAGMAS or (name in _QUERY_PRAGMAS and arg2 is None):
            return None
        return f"PRAGMA {name} is not allowed in a sandbox (only read-only introspection)"
    if action == sqlite3.SQLITE_FUNCTION:
        return _DENIED_FUNCTIONS.get((arg2 or "").lower())
    if db == "temp" and action == sqlite3.SQLITE_CREATE_VTABLE:
        return "virtual tables in the temp schema are not allowed (snapshots cannot carry them)"
    if db == "temp" and action == sqlite3.SQLITE_ANALYZE:
        return "ANALYZE of the temp schema is not allowed (snapshots cannot carry its statistics)"
    return None


# ---------------------------------------------------------------------------------------------------------
# What a call read

# Functions whose result is not a function of the database: the clock, randomness, connection state.
_UNOBSERVABLE_FUNCTIONS = frozenset(
    {
        "random",
        "randomblob",
        "date",
        "time",
        "datetime",
        "julianday",
        "strftime",
        "unixepoch",
        "timediff",
        "current_date",
        "current_time",
        "current_timestamp",
        "changes",
        "total_changes",
        "last_insert_rowid",
        "sqlite_offset",
        "load_extension",
    }
)
# Introspection pragmas whose answer is a function of one table's definition (its argument), and the others.
_TABLE_PRAGMAS = frozenset({"table_info", "table_xinfo", "index_list", "foreign_key_list"})
_SCHEMA_PRAGMAS = frozenset({"index_info", "index_xinfo"})
_MASTER = {
    "main": frozenset({"sqlite_master", "sqlite_schema"}),
    "temp": _TEMP_MASTER | {"sqlite_master", "sqlite_schema"},
}
_ROW_WRITES = frozenset({sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE})
# DDL by schema: action -> whether its object has rows (a table), and which argument names the object whose
# definition changes (an index or trigger belongs to its table's).
_DDL: dict[int, tuple[str, bool, int]] = {
    sqlite3.SQLITE_CREATE_TABLE: ("main", True, 1),
    sqlite3.SQLITE_DROP_TABLE: ("main", True, 1),
    sqlite3.SQLITE_CREATE_VIEW: ("main", False, 1),
    sqlite3.SQLITE_DROP_VIEW: ("main", False, 1),
    sqlite3.SQLITE_CREATE_INDEX: ("main", False, 2),
    sqlite3.SQLITE_DROP_INDEX: ("main", False, 2),
    sqlite3.SQLITE_CREATE_TRIGGER: ("main", False, 2),
    sqlite3.SQLITE_DROP_TRIGGER: ("main", False, 2),
    sqlite3.SQLITE_CREATE_TEMP_TABLE: ("temp", True, 1),
    sqlite3.SQLITE_DROP_TEMP_TABLE: ("temp", True, 1),
    sqlite3.SQLITE_CREATE_TEMP_VIEW: ("temp", False, 1),
    sqlite3.SQLITE_DROP_TEMP_VIEW: ("temp", False, 1),
    sqlite3.SQLITE_CREATE_TEMP_INDEX: ("temp", False, 2),
    sqlite3.SQLITE_DROP_TEMP_INDEX: ("temp", False, 2),
    sqlite3.SQLITE_CREATE_TEMP_TRIGGER: ("temp", False, 2),
    sqlite3.SQLITE_DROP_TEMP_TRIGGER: ("temp", False, 2),
}
# REINDEX rebuilds indexes from their tables (CREATE INDEX reports it too): no content any read can see changes.
_HARMLESS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_RECURSIVE, sqlite3.SQLITE_REINDEX})
_PREPARED = 128  # statements whose authorizer reports a sandbox keeps: sqlite3's own statement cache's size
# The columns of EXPLAIN and EXPLAIN QUERY PLAN, which the authorizer does not report.
_EXPLAINED = frozenset(
    {("addr", "opcode", "p1", "p2", "p3", "p4", "p5", "comment"), ("id", "parent", "notused", "detail")}
)
_SCHEMAS = ("main", "temp")


class _Seen:
    """What one statement touched, from the authorizer's reports (which include the statements of the triggers
    and views it runs): the state keys it read and wrote, or `opaque`, why it touched what has no key.

    Keys, for each schema S (main, or the connection's temp schema, which snapshots carry):

    - "table:S.N": the rows of table N;
    - "def:S.N": the definition of the table or view N with its indexes and triggers (what names resolve to,
      what a query plan may use, what a write sets off). Unqualified names look in temp first, so a statement
      touching main.N also reads "def:temp.N": a temp object of that name made later would be taken instead;
    - "schema:S": the whole schema, read where a statement's dependence on it cannot be named: an SQL error
      (which name was missing is not reported), a read of sqlite_master, DDL (it may fail on any name).

    Opaque: `sqlite_sequence` and `sqlite_stat*` (SQLite writes them unannounced), the `rootpage` of a main
    schema row (page numbers depend on the order writes happened in), functions of the clock or randomness,
    pragmas beyond introspection, and every action not named here (ALTER TABLE, REINDEX, ANALYZE, virtual
    tables, ...), and EXPLAIN (its programs name root pages).

    A statement the authorizer reports nothing of is unobservable too: DDL that found nothing to do (`DROP VIEW IF
    EXISTS v` without v), which would write where v exists.
    """

    __slots__ = ("events", "opaque", "reads", "unqualified", "writes")

    def __init__(self) -> None:
        self.events = 0  # authorizer reports: none for DDL that found nothing to do, or a statement not prepared
        self.reads: set[str] = set()
        self.writes: set[str] = set()
        self.unqualified: set[str] = set()  # tables named without their schema (see `_table`)
        self.opaque: str | None = None

    def copy(self) -> _Seen:
        other = _Seen()
        other.events, other.opaque = self.events, self.opaque
        other.reads, other.writes, other.unqualified = set(self.reads), set(self.writes), set(self.unqualified)
        return other

    def touched(self) -> set[str]:
        return self.reads | self.writes

    def failed(self) -> None:
        """The statement failed: its answer may depend on any name of either schema."""
        self.reads.update(f"schema:{db}" for db in _SCHEMAS)

    def add(self, action: int, arg1: str | None, arg2: str | None, db: str | None) -> None:
        self.events += 1
        if action == sqlite3.SQLITE_READ:
            self._table(arg1 or "", db, self.reads, column=arg2)
        elif action in _ROW_WRITES:
            self._table(arg1 or "", db, self.writes)
        elif action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in _UNOBSERVABLE_FUNCTIONS:
                self.opaque = f"{arg2}()"
        elif action == sqlite3.SQLITE_PRAGMA:
            pragma = (arg1 or "").lower()
            if pragma in _TABLE_PRAGMAS and arg2:
                self.reads.update(f"def:{schema}.{arg2}" for schema in _SCHEMAS)
            elif pragma in _SCHEMA_PRAGMAS:
                self.failed()
            else:
                self.opaque = f"PRAGMA {arg1}"
        elif action in _DDL:
            schema, rows, which = _DDL[action]
            name = (arg1 if which == 1 else arg2) or ""
            self.reads.add(f"schema:{schema}")
            self.writes.update((f"schema:{schema}", f"def:{schema}.{name}"))
            if rows:
                self.writes.add(f"table:{schema}.{name}")
            elif which == 2:
                self.reads.add(f"table:{schema}.{name}")  # an index is built from its table (UNIQUE may fail)
        elif action not in _HARMLESS:
            self.opaque = f"authorizer action {action}"

    def _table(self, name: str, db: str | None, into: set[str], column: str | None = None) -> None:
        if db is None:
            # A table reference that extracts no column (count(*)) comes without its schema: main, unless a
            # temp object has its name (checked after the statement, `SQLiteSandbox._observed`).
            self.unqualified.add(name)
            db = "main"
        if db not in _SCHEMAS:
            self.opaque = f"table {db}.{name}"
        elif name in _MASTER[db]:
            if column == "rootpage" and db == "main":  # temp rootpages read as NULL (see `_authorize`)
                self.opaque = "the rootpage of a schema row"
            else:
                into.add(f"schema:{db}")
                self.reads.add(f"schema:{db}")
        elif name.startswith("sqlite_"):
            self.opaque = f"table {db}.{name}"
        else:
            into.add(f"table:{db}.{name}")
            self.reads.update((f"def:{db}.{name}", f"def:temp.{name}"))


def _observable(path: Path) -> bool:
    """Whether what calls on this database read can all be observed: not with virtual tables (their rows live
    in shadow tables written unannounced) or foreign keys enforced (cascades write unannounced)."""
    conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True)
    try:
        virtual = conn.execute("SELECT count(*) FROM sqlite_master WHERE sql LIKE 'CREATE VIRTUAL%'").fetchone()[0]
        return not virtual and not conn.execute("PRAGMA foreign_keys").fetchone()[0]
    finally:
        conn.close()


def _hash(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# The factory


@dataclass(frozen=True, slots=True)
class _Snapshot:
    main: Path
    temp: Path | None  # the connection's temp schema (a pickled _TempSchema), when it had objects
    versions: dict[str, str] | None = None  # the sandbox's `_versions` (see "What a call read")


class SQLiteSandboxes(ManagedSandboxes["SQLiteSandbox", _Snapshot]):
    """A factory of SQLite sandboxes that all start from the database at `db_path`.

    `db_path` is only read, once, here: it is copied (with SQLite's backup API, so a WAL database is read
    consistently) into a private directory under `tmp` (default /dev/shm). `timeout` bounds each query in
    seconds. Close the factory (`await boxes.close()`, or `async with`) to remove that directory; a factory
    that is garbage collected or still open at exit removes it too, and the next factory in the same `tmp`
    removes those of processes that were killed (the directory names its owner: see `reclaim`).
    """

    kind = "sqlite"

    def __init__(
        self, db_path: str | os.PathLike[str], *, tmp: str | os.PathLike[str] | None = None, timeout: float = 30.0
    ) -> None:
        source = Path(db_path)
        if not source.is_file():
            raise FileNotFoundError(f"no SQLite database at {source}")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        super().__init__()
        self._timeout = float(timeout)
        self._root = scratch_dir("sqlite", _tmp_parent(tmp))  # reclaims the copies of killed processes first
        self._cleanup_with(shutil.rmtree, self._root, True)
        (self._root / "boxes").mkdir()
        (self._root / "snapshots").mkdir()
        self._base = self._root / "base.sqlite"
        try:
            _copy_database(source, self._base)
        except BaseException:
            shutil.rmtree(self._root, ignore_errors=True)
            raise
        self._fingerprint = f"sqlite-{FORMAT_VERSION}-{_file_digest(self._base)}"
        self._observable = _observable(self._base)
        self._base_digests: dict[str, str] = {}  # key -> its digest in the starting state, as computed
        self._files = itertools.count(1)

    @classmethod
    def from_sql(
        cls, sql: str | os.PathLike[str], *, tmp: str | os.PathLike[str] | None = None, timeout: float = 30.0
    ) -> SQLiteSandboxes:
        """A factory whose database is built by running an SQL script once (e.g. northwind's create.sql).

        `sql` is a path (a `Path`, or a string naming an existing file) or the script's text. This runs the
        script synchronously (seconds for a large one): build factories before the event loop gets busy, or
        in `asyncio.to_thread`.
        """
        text = _read_script(sql)
        build = scratch_dir("sqlite-build", _tmp_parent(tmp))
        try:
            path = build / "db.sqlite"
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                conn.execute("PRAGMA synchronous=OFF")
                conn.executescript(text)
            except sqlite3.Error as exc:
                raise ValueError(f"the SQL script failed: {exc}") from exc
            finally:
                conn.close()
            return cls(path, tmp=tmp, timeout=timeout)
        finally:
            shutil.rmtree(build, ignore_errors=True)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def directory(self) -> Path:
        """The private directory holding the base copy, the sandboxes' files and the snapshots."""
        return self._root

    @property
    def timeout(self) -> float:
        return self._timeout

    async def create(self) -> SQLiteSandbox:
        return await self._open(_Snapshot(self._base, None, {} if self._observable else None))

    async def restore(self, snapshot_id: str) -> SQLiteSandbox:
        return await self._open(self._lookup(snapshot_id))

    async def base_digests(self, keys: Collection[str]) -> Mapping[str, str]:
        """The starting state's digest of each key (see "What a call read"): a hash of the fingerprint and the
        key, computed without reading the database. A database whose reads cannot all be observed has none."""
        return {key: self._base_digest(key) for key in keys} if self._observable else {}

    def _base_digest(self, key: str) -> str:
        digest = self._base_digests.get(key)
        if digest is None:
            digest = self._base_digests[key] = _hash(self._fingerprint, key)
        return digest

    async def delete(self, snapshot_id: str) -> None:
        # Deleting twice is harmless: eviction and cleanup may race.
        snapshot = self._forget(snapshot_id)
        if snapshot is not None:
            await asyncio.to_thread(_remove, snapshot.main, snapshot.temp)

    async def _open(self, source: _Snapshot) -> SQLiteSandbox:
        self._check_open()
        box = SQLiteSandbox(self, self._root / "boxes" / f"{next(self._files)}.sqlite", self._timeout)
        try:
            await box._start(source)
        except BaseException as exc:
            await box.close()
            if isinstance(exc, OSError | sqlite3.Error):
                raise SandboxError(f"could not open a sandbox: {exc}") from exc
            raise
        return box

    def _new_snapshot(self) -> tuple[str, _Snapshot]:
        """A new snapshot id and the files it will be saved in, named after it."""
        self._check_open()
        snapshot_id = self._new_id()
        folder = self._root / "snapshots"
        return snapshot_id, _Snapshot(folder / f"{snapshot_id}.sqlite", folder / f"{snapshot_id}.temp.pickle")


# ---------------------------------------------------------------------------------------------------------
# One sandbox


class SQLiteSandbox(ManagedSandbox):
    """A private copy of the database and the one connection that uses it.

    Everything that touches the connection runs on the sandbox's own worker thread, one call at a time.
    """

    def __init__(self, factory: SQLiteSandboxes, path: Path, timeout: float) -> None:
        super().__init__(factory)
        self._factory = factory
        self._path = path
        self._timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tvcache-sqlite")
        self._conn: sqlite3.Connection | None = None
        self._header_fd = -1
        # Set on the worker thread while the sandbox runs its own statements, which the authorizer allows.
        self._internal = False
        self._refused: str | None = None
        self._deadline: float | None = None
        self._timed_out = False
        # The immutable file this sandbox's database was last equal to (its base, the snapshot it was
        # restored from, or its own last snapshot) and the file's stat at that moment: while the stat has not
        # moved, a snapshot of the database is a hard link to that file instead of a copy (see `_save`).
        self._origin: Path | None = None
        self._origin_stat: tuple[int, int, int] | None = None
        # The digest of every key written since the starting state (see "What a call read"); None once a
        # statement changed what the authorizer cannot name, for good (snapshots carry it).
        self._versions: dict[str, str] | None = None
        self._seen = _Seen()  # what the running statement touched, as the authorizer reports it
        self._temp_tables: tuple[int, frozenset[str]] | None = None  # (temp schema version, its table names)
        self._prepared: dict[tuple[str, bytes, int], _Seen] = {}  # see `_remember`

    @property
    def path(self) -> Path:
        """This sandbox's database file."""
        return self._path

    async def execute(self, call: ToolCall) -> Outcome:
        query = _query_of(call)
        if isinstance(query, Outcome):
            return query
        async with self._turn():
            return await self._on_worker(self._run, query, watchdog=True)

    async def snapshot(self) -> str:
        async with self._turn():
            snapshot_id, snapshot = self._factory._new_snapshot()
            try:
                saved = await self._on_worker(self._save, snapshot)
            except BaseException as exc:
                await asyncio.to_thread(_remove, snapshot.main, snapshot.temp)
                if isinstance(exc, OSError | sqlite3.Error):
                    raise SandboxError(f"could not snapshot the sandbox: {exc}") from exc
                raise
            return self._factory._keep(saved, snapshot_id)

    def _interrupt(self) -> None:
        if self._conn is not None:
            self._conn.interrupt()  # a query still running (its caller was cancelled) stops now

    async def _release(self) -> None:
        """Close the connection and remove the sandbox's file."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._shutdown)
        finally:
            self._executor.shutdown(wait=False)

    async def _on_worker(self, fn: Callable[..., T], *args: Any, watchdog: bool = False) -> T:
        """Run `fn(*args)` on the worker thread; interrupt it if its caller is cancelled or it overruns."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            if watchdog:
                done, _ = await asyncio.wait({future}, timeout=self._timeout + _WATCHDOG_GRACE)
                if not done:
                    self._timed_out = True
                    self._interrupt()
            return await future
        except asyncio.CancelledError:
            self._interrupt()
            raise

    async def _start(self, source: _Snapshot) -> None:
        await self._on_worker(self._open, source)

    # Everything below runs on the worker thread.

    def _open(self, source: _Snapshot) -> None:
        shutil.copyfile(source.main, self._path)
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False, timeout=0)
        self._conn = conn
        self._header_fd = os.open(self._path, os.O_RDONLY)
        # The file is private and disposable: no durability needed, and temp objects stay in memory.
        # With auto_vacuum off, temp pages never move, so hiding temp rootpages (see _authorize) is safe.
        for pragma in ("journal_mode=MEMORY", "synchronous=OFF", "temp_store=MEMORY", "temp.auto_vacuum=NONE"):
            conn.execute(f"PRAGMA {pragma}").fetchall()
        if source.temp is not None:
            _load_temp_schema(conn, pickle.loads(source.temp.read_bytes()))
        self._origin, self._origin_stat = source.main, _stat(self._path)
        self._versions = dict(source.versions) if source.versions is not None else None
        conn.set_authorizer(self._authorize)
        conn.set_progress_handler(self._progress, _PROGRESS_STEPS)

    def _run(self, query: str) -> Outcome:
        conn = self._connection()
        self._timed_out = False
        self._refused = None
        self._seen = _Seen()
        before = self._marker()
        self._deadline = time.monotonic() + self._timeout
        try:
            cursor = conn.cursor()
            try:
                try:
                    cursor.execute(query)
                finally:
                    self._remember(query, before)
                output = _ok(cursor.rowcount) if cursor.description is None else format_rows(cursor)
                if cursor.description is not None and tuple(c[0] for c in cursor.description) in _EXPLAINED:
                    self._seen.opaque = "EXPLAIN"
            finally:
                cursor.close()
        except (sqlite3.Error, UnicodeError) as exc:
            # Only the sandbox interrupts queries (a timeout, a cancelled caller, close()), and a full disk is the
            # machine's (no query can set max_page_count): failures of the sandbox, not answers to the query, so
            # they must never be cached (a statement refused for want of room runs once room is freed).
            full = no_room(exc)
            if self._timed_out or str(exc) == "interrupted" or full:
                why = f"timeout after {self._timeout:g} s" if self._timed_out else "interrupted"
                changed = before != self._marker()
                if changed:
                    self._versions = None
                output = f"Error: {exc}" if full else f"Error: {why}; the query was cancelled"
                return Outcome(output, changed=changed, error=True)
            output = f"Error: {exc}"
            self._seen.failed()
            if self._refused is not None and "authoriz" in str(exc):
                # SQLite's own message does not say why ("not authorized", "authorization denied").
                output = f"Error: not authorized ({self._refused})"
        finally:
            self._deadline = None
        after = self._marker()
        reads, writes = self._observed(query, before != after, after[2])
        return Outcome(output, changed=before != after, reads=reads, writes=writes)

    def _observed(
        self, query: str, changed: bool, temp_version: int
    ) -> tuple[dict[str, str] | None, dict[str, str] | None]:
        """What the statement read, as digests by key before it ran, and what it wrote (None if it changed
        nothing); None where unknown. A write's reads are everything it touched: its effect depends on nothing
        else (see below), so executing it in any state where those digests are the same writes the same digests."""
        seen, versions = self._seen, self._versions
        if versions is None:
            return None, None
        if seen.unqualified & self._temp_names(temp_version):
            seen.opaque = "a table named without its schema, as a temp one is"
        if not seen.events:
            seen.opaque = "a statement the authorizer showed nothing of"
        if versions is None or seen.opaque or (changed and not seen.writes):
            if changed:
                self._versions = None  # lost track of the content for good
            return None, None
        touched = {key: versions.get(key) or self._factory._base_digest(key) for key in seen.touched()}
        if not changed:
            return touched, None
        # A written table's new digest names how it was made: this statement over the digests of everything
        # it touched (its effect depends on nothing else), so no table is ever scanned to digest it.
        made = _hash(query, *(f"{key}={digest}" for key, digest in sorted(touched.items())))
        writes = {key: _hash(made, key) for key in sorted(seen.writes)}
        versions.update(writes)
        return touched, writes

    def _save(self, snapshot: _Snapshot) -> _Snapshot:
        # Between calls no transaction is open and every change is in the file, so a byte copy is exact. A
        # database not written since it equalled an immutable file (every write moves its mtime; SQLite
        # writes with write(2), not mmap) is that file: link it, which takes no time and no space. Most
        # calls only read, and policies that snapshot after every call would otherwise copy a large database
        # each time.
        now = _stat(self._path)
        if self._origin is None or self._origin_stat != now or not _link(self._origin, snapshot.main):
            shutil.copyfile(self._path, snapshot.main)  # reads the file only: its stat stays `now`
            self._origin, self._origin_stat = snapshot.main, now
        self._internal = True
        try:
            temp = _dump_temp_schema(self._connection())
        finally:
            self._internal = False
        versions = dict(self._versions) if self._versions is not None else None
        if temp is None:
            return _Snapshot(snapshot.main, None, versions)
        assert snapshot.temp is not None
        snapshot.temp.write_bytes(pickle.dumps(temp, protocol=pickle.HIGHEST_PROTOCOL))
        return _Snapshot(snapshot.main, snapshot.temp, versions)

    def _shutdown(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._header_fd >= 0:
            os.close(self._header_fd)
            self._header_fd = -1
        _remove(self._path)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise SandboxError("this sandbox is closed")
        return self._conn

    def _remember(self, query: str, before: tuple[int, bytes, int]) -> None:
        """The authorizer sees a statement only while it is prepared, and sqlite3 reuses a prepared statement for
        the same text until the schema changes (then SQLite prepares it again): keep what a preparation showed,
        by text and schema versions, for the executions that reuse it. A statement that shows nothing and is not
        kept here (DDL that found nothing to do, or a preparation forgotten) is unobservable."""
        key = (query, before[1][4:], before[2])  # the schema cookie and the temp schema's version
        seen = self._seen
        if seen.events:
            if len(self._prepared) >= _PREPARED and key not in self._prepared:
                del self._prepared[next(iter(self._prepared))]
            self._prepared[key] = seen.copy()
        elif key in self._prepared:
            self._seen = self._prepared[key].copy()

    def _temp_names(self, version: int) -> frozenset[str]:
        """The names of the temp schema's tables and views, read again only when its version moved."""
        if self._temp_tables is None or self._temp_tables[0] != version:
            rows = self._internal_query("SELECT name FROM temp.sqlite_master WHERE type IN ('table', 'view')")
            self._temp_tables = (version, frozenset(name for (name,) in rows))
        return self._temp_tables[1]

    def _marker(self) -> tuple[int, bytes, int]:
        """What moves whenever a statement changes the state (see the module docstring)."""
        header = os.pread(self._header_fd, 44, 0)
        temp_version = self._internal_query("PRAGMA temp.schema_version")[0][0]
        # Bytes 24-27: file change counter; 40-43: schema cookie.
        return self._connection().total_changes, header[24:28] + header[40:44], temp_version

    def _internal_query(self, sql: str, parameters: tuple[Any, ...] = ()) -> list[Any]:
        self._internal = True
        try:
            return self._connection().execute(sql, parameters).fetchall()
        finally:
            self._internal = False

    def _authorize(self, action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None) -> int:
        if self._internal:
            return sqlite3.SQLITE_OK
        self._seen.add(action, arg1, arg2, db)
        if action == sqlite3.SQLITE_READ and db == "temp" and arg1 in _TEMP_MASTER and arg2 == "rootpage":
            return sqlite3.SQLITE_IGNORE  # reads as NULL
        reason = _refusal(action, arg1, arg2, db)
        if reason is None:
            return sqlite3.SQLITE_OK
        self._refused = reason
        return sqlite3.SQLITE_DENY

    def _progress(self) -> int:
        deadline = self._deadline
        if deadline is not None and time.monotonic() > deadline:
            self._timed_out = True
            return 1
        return 0


# ---------------------------------------------------------------------------------------------------------
# Temp schema snapshots


@dataclass(frozen=True, slots=True)
class _TempTable:
    columns: list[str]  # the columns to insert (generated ones are computed), rowid first when kept
    rows: list[tuple[Any, ...]]


@dataclass(frozen=True, slots=True)
class _TempSchema:
    """Everything a connection's temp schema holds: its schema rows (rowid order) and its tables' rows."""

    objects: list[tuple[int, str, str, str | None]]  # (rowid, type, name, sql) from sqlite_temp_master
    tables: dict[str, _TempTable]


def _dump_temp_schema(conn: sqlite3.Connection) -> _TempSchema | None:
    objects = conn.execute("SELECT rowid, type, name, sql FROM temp.sqlite_master ORDER BY rowid").fetchall()
    if not objects:
        return None
    without_rowid = {
        name for name, wr in conn.execute("SELECT name, wr FROM pragma_table_list WHERE schema='temp'") if wr
    }
    tables = {}
    for _, kind, name, sql in objects:
        if kind != "table" or sql is None:
            continue
        quoted = _quote(name)
        # Generated columns (hidden 2 and 3) are computed, not inserted.
        columns = [_quote(row[1]) for row in conn.execute(f"PRAGMA temp.table_xinfo({quoted})") if row[6] == 0]
        if name not in without_rowid:
            # Rowids decide scan order and the next rowid; keep them, under a name no column shadows.
            taken = {c.strip('"').lower() for c in columns}
            alias = next((a for a in ("rowid", "_rowid_", "oid") if a not in taken), None)
            if alias is None:
                raise SandboxError(f"temp table {name!r} shadows rowid, _rowid_ and oid; cannot snapshot it")
            columns.insert(0, alias)
        rows = conn.execute(f"SELECT {', '.join(columns)} FROM temp.{quoted}").fetchall()
        tables[name] = _TempTable(columns, rows)
    return _TempSchema(objects, tables)


def _load_temp_schema(conn: sqlite3.Connection, schema: _TempSchema) -> None:
    """Re-create a dumped temp schema in `conn`, which has none yet.

    Objects are created in their original order, so `sqlite_temp_master` lists them alike and with the same
    rowids (placeholder views fill the gaps dropped objects left); each table gets its rows, rowids included,
    right after it is created, before any trigger on it exists.
    """
    placeholders: list[str] = []

    def fill_gaps_below(rowid: int) -> None:
        # sqlite_master rowids are max + 1: occupy the gaps so that the next object gets `rowid`.
        while conn.execute("SELECT coalesce(max(rowid), 0) FROM temp.sqlite_master").fetchone()[0] + 1 < rowid:
            placeholders.append(f"tvcache_placeholder_{len(placeholders)}")
            conn.execute(f"CREATE TEMP VIEW {placeholders[-1]} AS SELECT 1")

    for rowid, kind, name, sql in schema.objects:
        if sql is None:
            continue  # an automatic index, made with its table
        if name == "sqlite_sequence":
            # AUTOINCREMENT makes this table right after its own table (at rowid - 1); if that table is gone,
            # a stand-in takes its place.
            if not _temp_exists(conn, "sqlite_sequence"):
                fill_gaps_below(rowid - 1)
                conn.execute("CREATE TEMP TABLE tvcache_autoincrement(id INTEGER PRIMARY KEY AUTOINCREMENT)")
                conn.execute("DROP TABLE temp.tvcache_autoincrement")
            continue
        fill_gaps_below(rowid)
        if kind == "index":
            conn.execute(sql)  # an index goes to its table's schema
        else:
            conn.execute("CREATE TEMP " + _after_create(sql))
        if kind == "table":
            _insert_rows(conn, name, schema.tables[name])
    if "sqlite_sequence" in schema.tables:
        conn.execute("DELETE FROM temp.sqlite_sequence")  # the inserts above advanced it
        _insert_rows(conn, "sqlite_sequence", schema.tables["sqlite_sequence"])
    for placeholder in placeholders:
        conn.execute(f"DROP VIEW temp.{placeholder}")


def _insert_rows(conn: sqlite3.Connection, name: str, table: _TempTable) -> None:
    marks = ", ".join("?" * len(table.columns))
    conn.executemany(f"INSERT INTO temp.{_quote(name)}({', '.join(table.columns)}) VALUES ({marks})", table.rows)


def _after_create(sql: str) -> str:
    # SQLite stores every schema statement normalised to start with "CREATE TABLE|VIEW|TRIGGER ...".
    if not sql.startswith("CREATE "):
        raise SandboxError(f"unexpected temp schema statement in a snapshot: {sql[:80]!r}")
    return sql[len("CREATE ") :]


def _temp_exists(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM temp.sqlite_master WHERE name = ?", (name,)).fetchone() is not None


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# ---------------------------------------------------------------------------------------------------------
# Files


def _tmp_parent(tmp: str | os.PathLike[str] | None) -> Path:
    if tmp is not None:
        parent = Path(tmp)
        parent.mkdir(parents=True, exist_ok=True)
        return parent
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def _copy_database(source: Path, target: Path) -> None:
    """Copy a database with the backup API (consistent even for a WAL database), in rollback-journal mode."""
    try:
        reader = sqlite3.connect(f"file:{quote(str(source.resolve()))}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise ValueError(f"cannot open {source} as a SQLite database: {exc}") from exc
    writer = sqlite3.connect(target, isolation_level=None)
    try:
        reader.backup(writer)
        writer.execute("PRAGMA journal_mode=DELETE").fetchall()
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{source} is not a usable SQLite database: {exc}") from exc
    finally:
        writer.close()
        reader.close()


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def _read_script(sql: str | os.PathLike[str]) -> str:
    if isinstance(sql, os.PathLike):
        return Path(sql).read_text()
    if not isinstance(sql, str):
        raise TypeError(f"sql must be a path or the script's text, got {type(sql).__name__}")
    if "\n" not in sql and len(sql) < 4096 and os.path.isfile(sql):
        return Path(sql).read_text()
    return sql


def _remove(*paths: Path | None) -> None:
    for path in paths:
        if path is not None:
            path.unlink(missing_ok=True)


def _query_of(call: ToolCall) -> str | Outcome:
    """The call's query, or the refusal the model gets for a call the sandbox cannot run (the same every time)."""
    if call.tool != TOOL:
        return refusal(f"Error: a SQLite sandbox has one tool, {TOOL!r}; got {call.tool!r}")
    query = call.args.get("query") if isinstance(call.args, dict) else None
    if not isinstance(call.args, dict) or set(call.args) != {"query"} or not isinstance(query, str):
        return refusal(f'Error: the {TOOL!r} tool takes args {{"query": str}}, got {call.key[len(TOOL) + 1 :][:200]}')
    return query


def _stat(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _link(source: Path, target: Path) -> bool:
    """Hard-link `target` to `source`; False if that cannot be done (the source was deleted meanwhile, or
    another filesystem), and the caller copies instead."""
    try:
        os.link(source, target)
    except OSError:
        return False
    return True
