"""The SQLite sandbox backend, on real database files.

Outputs are checked against hand-written tables and against an independent reference (a plain connection,
every row fetched, the documented format and SkyRL's truncation rule); state handling against the oracle
the whole cache relies on: a fresh sandbox that executes the same history.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bad_calls
from sandbox_oracle import check_snapshots_against_fresh_replay
from tvcache import ToolCall
from tvcache.sandboxes.base import Outcome, Sandbox, SandboxError, Sandboxes
from tvcache.sandboxes.sqlite import (
    MAX_OUTPUT_CHARS,
    TRUNCATED_ROWS,
    TRUNCATION_NOTE,
    SQLiteSandbox,
    SQLiteSandboxes,
)
from tvcache_bench import data

WORKLOADS = data.BUNDLED  # the data that ships with tvcache
CHINOOK = WORKLOADS / "sql" / "chinook" / "chinook.sqlite"
NORTHWIND_SQL = WORKLOADS / "sql" / "northwind" / "create.sql"

SCHEMA = """
CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, qty INTEGER NOT NULL DEFAULT 0);
CREATE TABLE log(msg TEXT);
INSERT INTO items(name, qty) VALUES ('apple', 3), ('pear', 5), ('plum', 0);
"""


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tvcache-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_db(path: Path, script: str = SCHEMA) -> Path:
    conn = sqlite3.connect(path)
    conn.executescript(script)
    conn.close()
    return path


def sql(query: str) -> ToolCall:
    return ToolCall("sql", {"query": query})


async def run(box: Sandbox, query: str) -> Outcome:
    return await box.execute(sql(query))


async def seen(box: Sandbox, query: str) -> Outcome:
    """The outcome without what the call read or wrote (tests/test_reads_sqlite.py checks those)."""
    outcome = await run(box, query)
    return Outcome(outcome.output, outcome.changed, outcome.error)


async def text(box: Sandbox, query: str) -> str:
    outcome = await run(box, query)
    assert isinstance(outcome.output, str)
    return outcome.output


# ---------------------------------------------------------------------------------------------------------
# Outputs


def reference_output(db: Path, query: str) -> str:
    """The documented format, computed the slow obvious way: fetch everything, render, then truncate."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    cursor = conn.execute(query)
    names = [d[0] for d in cursor.description]
    rows = cursor.fetchall()
    conn.close()

    def cell(v: Any) -> str:
        if v is None:
            return "NULL"
        if isinstance(v, bytes):
            return "x'" + v.hex() + "'"
        if isinstance(v, float):
            return repr(v)
        return str(v).replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")

    def render(rows: list[Any]) -> str:
        lines = [list(names)] + [[cell(v) for v in row] for row in rows]
        out = [[] for _ in lines]  # type: list[list[str]]
        for i in range(len(names)):
            values = [row[i] for row in rows]
            numeric = any(v is not None for v in values) and all(
                v is None or isinstance(v, int | float) for v in values
            )
            width = max(len(line[i]) for line in lines)
            for line, parts in zip(lines, out, strict=True):
                if numeric:
                    parts.append(line[i].rjust(width))
                elif i == len(names) - 1:
                    parts.append(line[i])
                else:
                    parts.append(line[i].ljust(width))
        return "\n".join("  ".join(parts) for parts in out)

    full = render(rows)
    if len(full) > 9000:
        return "Truncated to 50 lines since returned response too long: \n" + render(rows[:50])
    return full


def test_outputs_pin_the_format() -> None:
    async def main() -> None:
        async with SQLiteSandboxes(CHINOOK) as boxes:
            box = await boxes.create()
            assert await text(box, "SELECT ArtistId, Name FROM Artist ORDER BY ArtistId LIMIT 3") == (
                "ArtistId  Name\n       1  AC/DC\n       2  Accept\n       3  Aerosmith"
            )
            # NULL, floats, blobs, embedded newlines; a numeric column with a NULL stays right-aligned.
            got = await text(box, "SELECT 1.5 AS f, NULL AS n, x'00ff' AS b, 'a' || char(10) || 'b' AS s, 7 AS i")
            assert got == "  f  n     b        s     i\n1.5  NULL  x'00ff'  a\\nb  7"
            assert await text(box, "SELECT Name FROM Artist WHERE 0") == "Name"
            assert await text(box, "SELECT CASE WHEN 1 THEN NULL END AS x UNION ALL SELECT 12") == "   x\nNULL\n  12"

    asyncio.run(main())


QUERIES = [
    "SELECT * FROM Artist",  # 275 rows but under 9,000 characters: not truncated
    "SELECT * FROM Track",  # truncated
    "SELECT * FROM Track WHERE TrackId <= 40",
    "SELECT a.Name, b.Name FROM Artist a, Artist b",  # 75,625 rows: truncated without fetching them all
    "SELECT g.Name, count(*) AS n, avg(t.UnitPrice) FROM Track t JOIN Genre g USING (GenreId) GROUP BY 1 ORDER BY 2",
    "SELECT * FROM Invoice ORDER BY Total DESC",
    "SELECT Composer FROM Track LIMIT 80",
    "SELECT TrackId, replace(hex(zeroblob(250)), '00', 'ab') AS pad FROM Track",  # 9,000 passed before row 50
]


@pytest.mark.parametrize("query", QUERIES)
def test_outputs_match_the_reference(query: str) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(CHINOOK) as boxes:
            box = await boxes.create()
            assert await text(box, query) == reference_output(CHINOOK, query)

    asyncio.run(main())


def test_truncation_starts_one_character_past_9000(shm: Path) -> None:
    # A one-column table of text is "s", then one line per value: 1 + sum(1 + len(value)) characters.
    conn = sqlite3.connect(make_db(shm / "t.db", "CREATE TABLE t(s TEXT);"))
    conn.executemany("INSERT INTO t VALUES (?)", [("a" * 89,)] * 99)  # 1 + 99 * 90 = 8911 so far
    conn.execute("INSERT INTO t VALUES (?)", ("b" * 88,))  # + 89 = 9000
    conn.commit()
    conn.close()

    async def main() -> None:
        async with SQLiteSandboxes(shm / "t.db") as boxes:
            box = await boxes.create()
            exact = await text(box, "SELECT s FROM t")
            assert len(exact) == MAX_OUTPUT_CHARS
            assert exact.count("\n") == 100
            await run(box, "UPDATE t SET s = s || 'b' WHERE s LIKE 'b%'")
            over = await text(box, "SELECT s FROM t")
            assert over.startswith(TRUNCATION_NOTE + "\ns\n")
            assert over.split("\n")[2:] == ["a" * 89] * TRUNCATED_ROWS

    asyncio.run(main())


def test_statements_without_rows_and_sql_errors_are_ordinary_outputs(shm: Path) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "s.db")) as boxes:
            box = await boxes.create()
            assert await seen(box, "SELECT * FROM nosuch") == Outcome("Error: no such table: nosuch", False, False)
            assert await seen(box, "SELEC 1") == Outcome('Error: near "SELEC": syntax error', False, False)
            assert (await run(box, "SELECT 1; SELECT 2")).output == (
                "Error: You can only execute one statement at a time."
            )
            assert await seen(box, "INSERT INTO log VALUES ('a'), ('b')") == Outcome("OK, 2 rows affected", True)
            assert await seen(box, "DELETE FROM log WHERE msg = 'a'") == Outcome("OK, 1 row affected", True)
            assert await seen(box, "CREATE VIEW v AS SELECT 1") == Outcome("OK", True)
            assert await text(box, "INSERT INTO log VALUES ('c') RETURNING msg, rowid") == "msg  rowid\nc        3"
            # A truncated RETURNING output still wrote every row: SQLite makes all changes at the first step.
            many = "INSERT INTO log WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 2000) "
            returned = await run(box, many + "SELECT hex(zeroblob(100)) || x FROM c RETURNING msg")
            assert str(returned.output).startswith(TRUNCATION_NOTE) and returned.changed is True
            assert await text(box, "SELECT count(*) FROM log") == "count(*)\n    2002"

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------------
# Changed or not


CHANGES = [
    ("SELECT * FROM items", False),
    ("SELECT count(*) FROM nosuch", False),
    ("INSERT INTO items(name) VALUES ('apple')", False),  # UNIQUE fails
    ("INSERT INTO items(name, qty) VALUES ('kiwi', 1), ('fig', 2), ('apple', 3)", False),  # fails on the 3rd row
    ("UPDATE items SET qty = 1 WHERE qty > 100", False),  # matches no row
    ("UPDATE items SET qty = qty + 1 WHERE name = 'pear'", True),
    ("INSERT INTO items(name) VALUES ('kiwi')", True),
    ("DELETE FROM items WHERE name = 'plum'", True),
    ("CREATE VIEW big AS SELECT * FROM items WHERE qty > 2", True),
    ("DROP VIEW big", True),
    ("CREATE INDEX by_qty ON items(qty)", True),
    ("DROP INDEX by_qty", True),
    ("CREATE TEMP VIEW tv AS SELECT name FROM items", True),
    ("SELECT * FROM tv", False),
    ("DROP VIEW tv", True),
    ("CREATE TEMP TABLE tt(x)", True),
    ("INSERT INTO tt VALUES (1)", True),
    ("CREATE INDEX tt_x ON tt(x)", True),
    ("SELECT * FROM tt", False),
    ("ANALYZE items", True),  # writes sqlite_stat1 and changes no row
    ("ALTER TABLE log ADD COLUMN at INTEGER", True),
    ("ATTACH ':memory:' AS other", False),
]


def test_changed_is_observed(shm: Path) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "c.db")) as boxes:
            box = await boxes.create()
            for query, expected in CHANGES:
                outcome = await run(box, query)
                assert outcome.changed is expected, (query, outcome)
                assert outcome.error is False
            # The failed multi-row insert left nothing behind.
            assert await text(box, "SELECT name FROM items WHERE name IN ('fig') ") == "name"

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------------
# Snapshots


def test_snapshot_and_restore_are_independent(shm: Path) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "i.db")) as boxes:
            a = await boxes.create()
            await run(a, "INSERT INTO items(name, qty) VALUES ('kiwi', 9)")
            snap = await a.snapshot()
            await run(a, "DELETE FROM items WHERE name = 'apple'")  # after the snapshot: must not leak
            b = await boxes.restore(snap)
            c = await boxes.restore(snap)
            await run(b, "UPDATE items SET qty = 100 WHERE name = 'kiwi'")  # and vice versa
            listing = "SELECT name, qty FROM items ORDER BY id"
            assert await text(a, listing) == "name  qty\npear    5\nplum    0\nkiwi    9"
            assert await text(b, listing) == "name   qty\napple    3\npear     5\nplum     0\nkiwi   100"
            assert await text(c, listing) == "name   qty\napple    3\npear     5\nplum     0\nkiwi     9"
            fresh = await boxes.create()
            assert await text(fresh, "SELECT count(*) FROM items") == "count(*)\n       3"
            # The sandbox that was snapshotted stays usable, and so does a restored one.
            snap2 = await b.snapshot()
            d = await boxes.restore(snap2)
            assert await text(d, listing) == await text(b, listing)

    asyncio.run(main())


def test_a_snapshot_of_an_unwritten_database_is_a_link_not_a_copy(shm: Path) -> None:
    """Strategies that snapshot after every call would copy a large database each time; a database nobody
    wrote since it equalled an immutable file shares that file. Written ones are copied, and every restore
    sees exactly the state it was snapshotted in."""

    def inode(boxes: SQLiteSandboxes, snapshot_id: str) -> int:
        return os.stat(boxes._snapshots[snapshot_id].main).st_ino

    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "l.db")) as boxes:
            base = os.stat(boxes._base).st_ino
            a = await boxes.create()
            await run(a, "SELECT * FROM items")
            read_only = await a.snapshot()
            assert inode(boxes, read_only) == base
            await run(a, "INSERT INTO items(name, qty) VALUES ('kiwi', 9)")
            written = await a.snapshot()
            assert inode(boxes, written) != base
            await run(a, "SELECT count(*) FROM items")
            again = await a.snapshot()  # unwritten since its last snapshot: that snapshot's file
            assert inode(boxes, again) == inode(boxes, written)
            await boxes.delete(written)  # the shared file outlives the name it was made under
            b = await boxes.restore(again)
            await run(b, "DELETE FROM items WHERE name = 'pear'")  # a restored copy, never the shared file
            c = await boxes.restore(again)
            count = "SELECT count(*) FROM items"
            assert await text(c, count) == "count(*)\n       4"
            assert await text(b, count) == "count(*)\n       3"
            d = await boxes.restore(read_only)
            assert (
                await text(d, count) == "count(*)\n       3"
                and await text(d, "SELECT qty FROM items WHERE name = 'pear'") == "qty\n  5"
            )
            after_restore = await c.snapshot()  # restored and unwritten: links the snapshot it came from
            assert inode(boxes, after_restore) == inode(boxes, again)

    asyncio.run(main())


TEMP_HISTORY = [
    "CREATE TEMP TABLE gone(id INTEGER PRIMARY KEY AUTOINCREMENT, v)",  # leaves temp.sqlite_sequence behind
    "INSERT INTO gone(v) VALUES (1)",
    "DROP TABLE gone",
    "CREATE TEMP TABLE t(id INTEGER PRIMARY KEY AUTOINCREMENT, v TEXT, twice AS (id * 2))",
    "INSERT INTO t(v) VALUES ('a'), ('b'), ('c'), ('d')",
    "DELETE FROM t WHERE v IN ('b', 'd')",  # rowid gaps, and the next id is 5, not 3
    "CREATE TEMP TABLE early(x)",
    "CREATE TEMP TABLE late(x)",
    "DROP TABLE early",
    "CREATE TEMP TABLE reuses_a_page(x)",  # re-created, it would get a page number after late's
    "CREATE TEMP TABLE plain(x, y)",
    "INSERT INTO plain VALUES (1, 'one'), (2, 'two'), (3, 'three')",
    "DELETE FROM plain WHERE x = 2",  # implicit rowids with a gap
    "CREATE TEMP VIEW dropped AS SELECT 1",
    "CREATE TEMP TABLE w(k PRIMARY KEY, v) WITHOUT ROWID",
    "INSERT INTO w VALUES ('z', 1), ('a', 2)",
    "DROP VIEW dropped",  # a gap in sqlite_temp_master's rowids
    "CREATE UNIQUE INDEX t_v ON t(v)",
    "CREATE TEMP VIEW tv AS SELECT v, twice FROM t",
    "CREATE TEMP TRIGGER on_item AFTER INSERT ON items BEGIN INSERT INTO t(v) VALUES (new.name); END",
    "CREATE TEMP TRIGGER on_t AFTER INSERT ON t BEGIN INSERT INTO plain VALUES (new.id, new.v); END",
]
TEMP_PROBES = [
    "SELECT rowid, * FROM sqlite_temp_master",
    "SELECT rowid, * FROM temp.sqlite_sequence",
    "SELECT rowid, * FROM t",
    "SELECT rowid, * FROM plain",
    "SELECT * FROM w",
    "SELECT * FROM tv",
    "SELECT name FROM pragma_table_list WHERE schema = 'temp' ORDER BY name",
]
TEMP_AFTER = [
    "INSERT INTO items(name, qty) VALUES ('kiwi', 1)",  # fires on_item, then on_t
    "INSERT INTO t(v) VALUES ('e')",
    "INSERT INTO plain VALUES (9, 'nine')",
    "INSERT INTO t(v) VALUES ('a')",  # violates t_v
]


def test_temp_objects_survive_snapshot_and_restore(shm: Path) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "t.db")) as boxes:
            original = await boxes.create()
            for query in TEMP_HISTORY:
                assert (await text(original, query)).startswith("OK"), query
            snap = await original.snapshot()
            restored = await boxes.restore(snap)
            oracle = await boxes.create()
            for query in TEMP_HISTORY:
                await run(oracle, query)
            for query in TEMP_PROBES + TEMP_AFTER + TEMP_PROBES:
                expected = await run(oracle, query)
                assert await run(restored, query) == expected, query
                assert await run(original, query) == expected, query
            # A restore of a restore still carries everything.
            again = await boxes.restore(await restored.snapshot())
            for query in TEMP_PROBES:
                assert await run(again, query) == await run(oracle, query), query

    asyncio.run(main())


def test_deleted_and_unknown_snapshots_cannot_be_restored(shm: Path) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "d.db")) as boxes, SQLiteSandboxes(shm / "d.db") as other:
            box = await boxes.create()
            await run(box, "CREATE TEMP TABLE x(a)")
            snap = await box.snapshot()
            files = sorted(p.name for p in (boxes.directory / "snapshots").iterdir())
            assert files == [f"{snap}.sqlite", f"{snap}.temp.pickle"]
            await boxes.delete(snap)
            await boxes.delete(snap)  # twice is harmless
            assert list((boxes.directory / "snapshots").iterdir()) == []
            with pytest.raises(SandboxError, match="does not exist"):
                await boxes.restore(snap)
            with pytest.raises(SandboxError, match="does not exist"):
                await boxes.restore("../../etc/passwd")
            theirs = await (await other.create()).snapshot()
            with pytest.raises(SandboxError, match="does not exist"):
                await boxes.restore(theirs)  # same database, other factory: not ours
            assert boxes.snapshot_count == 0
            # A temp table whose columns shadow every rowid alias cannot be carried: a clear error, no files.
            await run(box, "CREATE TEMP TABLE odd(rowid, _rowid_, oid)")
            with pytest.raises(SandboxError, match="shadows rowid"):
                await box.snapshot()
            assert list((boxes.directory / "snapshots").iterdir()) == []

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------------
# What a query may not do


def test_a_sandbox_cannot_reach_other_files_or_connection_state(shm: Path) -> None:
    outside = make_db(shm / "outside.db", "CREATE TABLE secret(s); INSERT INTO secret VALUES ('x');")

    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "a.db")) as boxes:
            box = await boxes.create()
            denied = [
                f"ATTACH '{outside}' AS o",
                "ATTACH ':memory:' AS m",
                f"VACUUM INTO '{shm / 'copy.db'}'",
                "VACUUM",
                "SELECT load_extension('/usr/lib/x86_64-linux-gnu/libsqlite3.so.0')",
                "BEGIN",
                "SAVEPOINT s",
                "PRAGMA journal_mode=WAL",
                "PRAGMA user_version = 7",
                "PRAGMA writable_schema = ON",
                "SELECT * FROM pragma_database_list",  # would reveal the sandbox's file name
                "SELECT last_insert_rowid()",
                "SELECT changes()",
                "CREATE VIRTUAL TABLE temp.f USING fts5(x)",
            ]
            for query in denied:
                outcome = await run(box, query)
                assert isinstance(outcome.output, str)
                assert outcome.output.startswith("Error: not authorized ("), (query, outcome)
                assert (outcome.changed, outcome.error) == (False, False), query
            assert await text(box, "SELECT * FROM o.secret") == "Error: no such table: o.secret"
            assert not (shm / "copy.db").exists()
            # Read-only introspection stays available.
            assert await text(box, "PRAGMA user_version") == "user_version\n           0"
            assert (await text(box, "PRAGMA table_info(items)")).startswith("cid  name  type")
            assert (await text(box, "SELECT name FROM pragma_table_info('log')")) == "name\nmsg"

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------------
# Time limits and the event loop

ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
ENDLESS_INSERT = "INSERT INTO log WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c"


def test_a_query_past_its_timeout_is_an_error_and_the_sandbox_stays_usable(shm: Path) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "to.db"), timeout=0.3) as boxes:
            box = await boxes.create()
            outcome = await run(box, ENDLESS)
            assert outcome.error is True
            assert outcome.output == "Error: timeout after 0.3 s; the query was cancelled"
            outcome = await run(box, ENDLESS_INSERT)
            assert (outcome.error, outcome.changed) == (True, False)  # the insert was rolled back
            assert await seen(box, "SELECT count(*) FROM log") == Outcome("count(*)\n       0", False)
            assert (await run(box, "INSERT INTO log VALUES ('after')")).changed is True

    asyncio.run(main())


def test_the_watchdog_interrupts_what_the_progress_handler_misses(shm: Path, monkeypatch: Any) -> None:
    # A fault we cannot cause with real SQL on demand: a single VM step outlasting the timeout. Disable the
    # progress handler's check so only the event-loop side watchdog can stop the query.
    monkeypatch.setattr("tvcache.sandboxes.sqlite._WATCHDOG_GRACE", 0.2)
    monkeypatch.setattr(SQLiteSandbox, "_progress", lambda self: 0)

    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "wd.db"), timeout=0.2) as boxes:
            box = await boxes.create()
            outcome = await run(box, ENDLESS)
            assert outcome.error is True and str(outcome.output).startswith("Error: timeout")
            assert await text(box, "SELECT count(*) FROM items") == "count(*)\n       3"

    asyncio.run(main())


def test_queries_do_not_block_the_event_loop_and_cancellation_stops_them(shm: Path) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "l.db"), timeout=0.5) as boxes:
            slow, quick = await boxes.create(), await boxes.create()
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            tick_task = asyncio.create_task(ticker())
            outcome, answer = await asyncio.gather(run(slow, ENDLESS), run(quick, "SELECT count(*) FROM items"))
            tick_task.cancel()
            assert outcome.error and answer.output == "count(*)\n       3"
            assert ticks >= 10  # the loop kept running during the half-second query

            task = asyncio.create_task(run(slow, ENDLESS))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            started = time.monotonic()
            assert await text(slow, "SELECT 1 AS one") == "one\n  1"
            assert time.monotonic() - started < 0.4  # it did not wait for the cancelled query's timeout

    asyncio.run(main())


def test_closing_a_sandbox_mid_call_is_a_sandbox_failure_not_an_answer(shm: Path) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "mid.db"), timeout=10) as boxes:
            box = await boxes.create()
            call = asyncio.create_task(run(box, ENDLESS))
            await asyncio.sleep(0.1)
            started = time.monotonic()
            await box.close()
            outcome = await call
            assert time.monotonic() - started < 2
            assert outcome.error is True and outcome.output == "Error: interrupted; the query was cancelled"
            assert not box.path.exists()

    asyncio.run(main())


def test_concurrent_calls_on_one_sandbox_run_one_at_a_time(shm: Path) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "cc.db")) as boxes:
            box = await boxes.create()
            outcomes = await asyncio.gather(*(run(box, f"INSERT INTO log VALUES ('{i}')") for i in range(20)))
            assert all(o.changed for o in outcomes)
            assert await text(box, "SELECT count(*) FROM log") == "count(*)\n      20"

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------------
# Files, fingerprints, inputs


def test_files_are_private_and_removed_on_close(shm: Path) -> None:
    source = make_db(shm / "f.db")
    digest = hashlib.blake2b(source.read_bytes()).digest()

    async def main() -> None:
        boxes = SQLiteSandboxes(source)
        root = boxes.directory
        assert root.parent == Path("/dev/shm") and root.name.startswith(f"tvcache-sqlite-{os.getpid()}-")
        box = await boxes.create()
        assert isinstance(box, Sandbox) and isinstance(boxes, Sandboxes)
        assert box.path.is_file() and box.path.parent.parent == root
        await run(box, "DELETE FROM items")
        snap = await box.snapshot()
        assert (root / "snapshots" / f"{snap}.sqlite").is_file()
        await box.close()
        await box.close()
        assert not box.path.exists()
        with pytest.raises(SandboxError, match="closed"):
            await run(box, "SELECT 1")
        left_open = await boxes.restore(snap)
        await boxes.close()
        assert not root.exists()
        assert not left_open.path.exists()
        with pytest.raises(SandboxError, match="closed"):
            await boxes.create()
        await boxes.close()  # idempotent

    asyncio.run(main())
    assert hashlib.blake2b(source.read_bytes()).digest() == digest  # the source was only read

    # A factory nobody closes still removes its directory once collected.
    forgotten = SQLiteSandboxes(source)
    root = forgotten.directory
    del forgotten
    assert not root.exists()


def test_fingerprint_is_stable_and_content_sensitive(shm: Path) -> None:
    a, b = SQLiteSandboxes(CHINOOK), SQLiteSandboxes(CHINOOK)
    assert a.fingerprint == b.fingerprint and a.fingerprint.startswith("sqlite-v1-")
    copy = shm / "chinook.sqlite"
    shutil.copyfile(CHINOOK, copy)
    assert SQLiteSandboxes(copy, tmp=shm).fingerprint == a.fingerprint  # content, not path
    conn = sqlite3.connect(copy)
    conn.execute("UPDATE Artist SET Name = 'AC/DC!' WHERE ArtistId = 1")
    conn.commit()
    conn.close()
    assert SQLiteSandboxes(copy, tmp=shm).fingerprint != a.fingerprint

    async def writes_do_not_touch_the_base() -> None:
        box = await a.create()
        await run(box, "DELETE FROM Track")
        await a.close()

    asyncio.run(writes_do_not_touch_the_base())
    assert SQLiteSandboxes(CHINOOK).fingerprint == b.fingerprint


def test_from_sql_builds_the_database_once(shm: Path) -> None:
    script = shm / "schema.sql"
    script.write_text(SCHEMA)
    from_text = SQLiteSandboxes.from_sql(SCHEMA, tmp=shm)
    from_path = SQLiteSandboxes.from_sql(script, tmp=shm)
    from_str_path = SQLiteSandboxes.from_sql(str(script), tmp=shm)
    assert from_text.fingerprint == from_path.fingerprint == from_str_path.fingerprint
    assert SQLiteSandboxes.from_sql(SCHEMA + "INSERT INTO log VALUES (1);", tmp=shm).fingerprint != (
        from_text.fingerprint
    )
    assert sorted(p.name for p in shm.iterdir() if p.name.startswith("tvcache-sqlite-build")) == []
    with pytest.raises(ValueError, match="SQL script failed"):
        SQLiteSandboxes.from_sql("CREATE TABLE (", tmp=shm)

    async def main() -> None:
        box = await from_text.create()
        assert await text(box, "SELECT name FROM items ORDER BY id") == "name\napple\npear\nplum"
        await from_text.close()

    asyncio.run(main())


def test_northwind_from_its_create_script(shm: Path) -> None:
    boxes = SQLiteSandboxes.from_sql(NORTHWIND_SQL, tmp=shm)

    async def main() -> None:
        box = await boxes.create()
        assert await text(box, "SELECT count(*) FROM Categories") == "count(*)\n       8"
        assert (await text(box, "SELECT * FROM Orders")).startswith(TRUNCATION_NOTE)
        await boxes.close()

    asyncio.run(main())


def test_bad_input_gets_a_clear_error(shm: Path) -> None:
    with pytest.raises(FileNotFoundError):
        SQLiteSandboxes(shm / "missing.db")
    (shm / "junk.db").write_bytes(b"this is not a database, not at all" * 10)
    with pytest.raises(ValueError, match="not a usable SQLite database"):
        SQLiteSandboxes(shm / "junk.db", tmp=shm)
    assert [p.name for p in shm.iterdir()] == ["junk.db"]  # nothing left behind
    with pytest.raises(ValueError, match="timeout"):
        SQLiteSandboxes(make_db(shm / "ok.db"), timeout=0)


def test_a_models_bad_calls_are_answers_and_the_sandbox_goes_on(shm: Path) -> None:
    write = ToolCall("sql", {"query": "CREATE TABLE kept (x)"})
    read = ToolCall("sql", {"query": "SELECT name FROM sqlite_master ORDER BY name"})

    async def main() -> None:
        async with SQLiteSandboxes(make_db(shm / "bad.db"), tmp=shm) as boxes:
            await bad_calls.check(boxes, bad_calls.SQL, write, read)
            answer = (await (await boxes.create()).execute(ToolCall("sql", {"query": 1}))).output
            assert answer == 'Error: the \'sql\' tool takes args {"query": str}, got {"query":1}'

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------------
# The oracle: restored sandboxes behave exactly like a fresh one replaying the history

READS = [
    "SELECT * FROM items ORDER BY id",
    "SELECT * FROM items",
    "SELECT name, qty FROM items WHERE qty > {n} ORDER BY name",
    "SELECT count(*), sum(qty) FROM items",
    "SELECT * FROM log",
    "SELECT rowid, * FROM tmp",
    "SELECT * FROM w",
    "SELECT * FROM v",
    "SELECT rowid, * FROM sqlite_temp_master",
    "SELECT type, name FROM sqlite_master ORDER BY name",
]
WRITES = [
    "INSERT INTO items(name, qty) VALUES ('n{n}', {m})",
    "INSERT INTO items(name, qty) VALUES ('n{n}', {m}) RETURNING id",
    "UPDATE items SET qty = qty + {m} WHERE id % 3 = {k}",
    "DELETE FROM items WHERE qty < {n}",
    "INSERT INTO log VALUES ('m{n}')",
    "CREATE TEMP TABLE IF NOT EXISTS tmp(x INTEGER PRIMARY KEY AUTOINCREMENT, y)",
    "INSERT INTO tmp(y) VALUES ({n})",
    "DELETE FROM tmp WHERE y % 2 = {k}",
    "DROP TABLE IF EXISTS tmp",
    "CREATE TEMP TABLE IF NOT EXISTS w(k PRIMARY KEY, v) WITHOUT ROWID",
    "INSERT OR REPLACE INTO w VALUES ({n}, {m})",
    "CREATE TEMP VIEW IF NOT EXISTS v AS SELECT name FROM items WHERE qty > 3",
    "DROP VIEW IF EXISTS v",
    "CREATE INDEX IF NOT EXISTS by_qty ON items(qty)",
    "DROP INDEX IF EXISTS by_qty",
    "CREATE TEMP TRIGGER IF NOT EXISTS tg AFTER INSERT ON items BEGIN INSERT INTO log VALUES (new.name); END",
    "DROP TRIGGER IF EXISTS tg",
    "CREATE TABLE IF NOT EXISTS extra(a)",
    "DROP TABLE IF EXISTS extra",
]

statement = st.builds(
    lambda template, n, m, k: template.format(n=n, m=m, k=k),
    st.sampled_from(READS + WRITES),
    st.integers(0, 6),
    st.integers(-2, 5),
    st.integers(0, 2),
)
# ("sql", query) | ("restore", None): continue on a restored copy of a snapshot of the current sandbox
# | ("rewind", i): go back to the i-th snapshot taken so far (its history, its state).
step = st.one_of(
    statement.map(lambda q: ("sql", q)),
    st.just(("restore", 0)),
    st.integers(0, 5).map(lambda i: ("rewind", i)),
)


@pytest.fixture(scope="module")
def oracle_db() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="tvcache-test-", dir="/dev/shm"))
    yield make_db(folder / "o.db")
    shutil.rmtree(folder, ignore_errors=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=30))
def test_restored_sandboxes_match_a_fresh_replay(oracle_db: Path, steps: list[tuple[str, Any]]) -> None:
    async def main() -> None:
        async with SQLiteSandboxes(oracle_db) as boxes:
            await check_snapshots_against_fresh_replay(boxes, [(k, sql(a) if k == "sql" else a) for k, a in steps])

    asyncio.run(main())
