"""Reuse by what a call read, on SQLite sandboxes: what the authorizer shows a statement read and wrote, every
case it cannot show (the call is then reused by exact history only), and the oracle on random workloads.

The oracle is the cache's own: every answer a rollout gets (exact hit, read-set hit or execution) equals the same
calls executed uncached in a fresh sandbox. The naive (tool, args) cache fails it on the same workloads, which
shows they are strong enough to catch a cache that reuses an answer whose inputs changed.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tvcache
from test_oracle import NaiveCache, Plan, check_against_oracle, run_plan
from tvcache import ToolCall
from tvcache.sandboxes.base import Outcome, Sandbox
from tvcache.sandboxes.sqlite import SQLiteSandboxes

SCHEMA = """
CREATE TABLE t0(k INTEGER PRIMARY KEY, v TEXT);
CREATE TABLE t1(k INTEGER PRIMARY KEY, v TEXT);
CREATE TABLE log(m TEXT);
CREATE TABLE seq(k INTEGER PRIMARY KEY AUTOINCREMENT, v TEXT);
INSERT INTO t0(v) VALUES ('a'), ('b');
INSERT INTO t1(v) VALUES ('c');
"""


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reads") / "base.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA)
    conn.close()
    return path


async def run(box: Sandbox, query: str) -> Outcome:
    return await box.execute(ToolCall("sql", {"query": query}))


def observe(db: Path, *queries: str) -> list[Outcome]:
    """The outcomes of `queries` run one after another in one fresh sandbox."""

    async def main() -> list[Outcome]:
        async with SQLiteSandboxes(db) as boxes:
            box = await boxes.create()
            return [await run(box, q) for q in queries]

    return asyncio.run(main())


# -- what a statement read and wrote --------------------------------------------------------------------------


def test_a_read_names_the_schema_and_the_tables_it_read(db: Path) -> None:
    join, count, view_made, view, missing = observe(
        db,
        "SELECT t0.v, t1.v FROM t0 JOIN t1 USING (k)",
        "SELECT count(*) FROM t0",  # reads no column: SQLite names the table without its schema
        "CREATE VIEW w AS SELECT v FROM t1",
        "SELECT * FROM w",
        "SELECT * FROM nosuch",
    )
    assert (join.changed, set(join.reads or ())) == (False, {"schema", "table:main.t0", "table:main.t1"})
    assert set(count.reads or ()) == {"schema", "table:main.t0"}
    assert view_made.changed and set(view_made.writes or ()) == {"schema"}
    assert set(view.reads or ()) == {"schema", "table:main.t1", "table:main.w"}  # through the view, to its table
    assert missing.output == "Error: no such table: nosuch" and set(missing.reads or ()) == {"schema"}
    assert join.writes is None and view_made.reads is None


def test_a_write_gives_the_tables_it_changed_new_digests_and_reads_see_them(db: Path) -> None:
    before, trigger, insert, after, other = observe(
        db,
        "SELECT * FROM log",
        "CREATE TRIGGER tr AFTER INSERT ON t0 BEGIN INSERT INTO log VALUES (new.v); END",
        "INSERT INTO t0(v) VALUES ('x')",
        "SELECT * FROM log",
        "SELECT * FROM t1",
    )
    assert set(trigger.writes or ()) == {"schema"}
    assert set(insert.writes or ()) == {"table:main.t0", "table:main.log"}  # the trigger's write too
    assert before.reads and after.reads and other.reads and insert.writes
    assert after.reads["table:main.log"] == insert.writes["table:main.log"] != before.reads["table:main.log"]
    assert after.reads["schema"] == trigger.writes["schema"] != before.reads["schema"]


def test_a_failed_write_reads_what_it_would_have_written(db: Path) -> None:
    """A constraint violation changes nothing, and its answer depends on the table it would have written."""
    (dup,) = observe(db, "INSERT INTO t0(k, v) VALUES (1, 'dup')")
    assert dup.output.startswith("Error: UNIQUE constraint failed") and dup.changed is False
    assert set(dup.reads or ()) == {"schema", "table:main.t0"}


def test_the_same_statements_give_the_same_digests_in_any_order_of_unrelated_writes(db: Path) -> None:
    a = observe(db, "INSERT INTO t0(v) VALUES ('x')", "INSERT INTO t1(v) VALUES ('y')", "SELECT * FROM t1")
    b = observe(db, "INSERT INTO t1(v) VALUES ('y')", "INSERT INTO t0(v) VALUES ('x')", "SELECT * FROM t1")
    c = observe(db, "INSERT INTO t1(v) VALUES ('z')", "SELECT * FROM t1")
    assert a[2].reads == b[2].reads and a[2].output == b[2].output
    assert c[1].reads != a[2].reads


def test_digests_survive_snapshots(db: Path) -> None:
    async def main() -> tuple[Outcome, Outcome]:
        async with SQLiteSandboxes(db) as boxes:
            box = await boxes.create()
            await run(box, "INSERT INTO t1(v) VALUES ('y')")
            restored = await boxes.restore(await box.snapshot())
            return await run(box, "SELECT * FROM t1"), await run(restored, "SELECT * FROM t1")

    live, restored = asyncio.run(main())
    assert live.reads is not None and live.reads == restored.reads


# -- what cannot be observed: the call is reused by exact history only ------------------------------------------

UNOBSERVABLE_READS = [
    "SELECT random()",
    "SELECT randomblob(4)",
    "SELECT datetime('now')",
    "SELECT current_timestamp",
    "SELECT v, julianday('2020-01-01') FROM t0",
    "SELECT load_extension('x')",  # refused by the sandbox, and unobservable anyway
    "ATTACH ':memory:' AS other",  # refused
    "PRAGMA integrity_check",
    "PRAGMA user_version",
    "SELECT rootpage FROM sqlite_master",  # page numbers depend on the order of earlier writes
    "SELECT * FROM sqlite_master",
    "SELECT * FROM sqlite_sequence",  # SQLite writes it unannounced
]


@pytest.mark.parametrize("query", UNOBSERVABLE_READS)
def test_unobservable_reads_are_none(db: Path, query: str) -> None:
    (outcome,) = observe(db, query)
    assert outcome.changed is False and outcome.reads is None


def test_schema_introspection_reads_the_schema(db: Path) -> None:
    info, names = observe(db, "PRAGMA table_info(t0)", "SELECT name, sql FROM sqlite_master ORDER BY name")
    assert set(info.reads or ()) == {"schema"} and set(names.reads or ()) == {"schema"}


@pytest.mark.parametrize(
    "write",
    [
        "CREATE TEMP TABLE tmp AS SELECT * FROM t0",  # connection state: shadows main tables
        "ALTER TABLE t1 ADD COLUMN w TEXT",
        "INSERT INTO t1(v) VALUES (random())",
        "INSERT INTO t1(v) VALUES (datetime('now'))",
        "ANALYZE",
        "INSERT INTO sqlite_sequence VALUES ('seq', 7)",
    ],
)
def test_unobservable_writes_lose_track_for_good(db: Path, write: str) -> None:
    """A write the authorizer cannot name has unknown writes, and the sandbox (and its snapshots) no longer know
    their content: every later read is unobservable too."""

    async def main() -> tuple[Outcome, Outcome, Outcome]:
        async with SQLiteSandboxes(db) as boxes:
            box = await boxes.create()
            written = await run(box, write)
            restored = await boxes.restore(await box.snapshot())
            return written, await run(box, "SELECT * FROM t0"), await run(restored, "SELECT * FROM t0")

    written, later, restored = asyncio.run(main())
    assert written.changed is True and written.writes is None, written.output
    assert later.reads is None and restored.reads is None


def test_a_temp_table_shadowing_a_main_table_is_not_taken_for_it(db: Path) -> None:
    """`count(*)` names no schema: after a temp table `t0` exists, it is the temp one, and must not be keyed as
    the main table."""
    made, count = observe(db, "CREATE TEMP TABLE t0(k)", "SELECT count(*) FROM t0")
    assert count.output == "count(*)\n       0" and count.reads is None and made.writes is None


def test_virtual_tables_in_the_base_make_nothing_observable(tmp_path: Path) -> None:
    path = tmp_path / "fts.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE VIRTUAL TABLE docs USING fts5(body); INSERT INTO docs VALUES ('hello'); CREATE TABLE t(x)"
    )
    conn.close()
    read, write = observe(path, "SELECT * FROM t", "INSERT INTO docs VALUES ('more')")
    assert read.reads is None and write.writes is None

    async def base() -> Any:
        async with SQLiteSandboxes(path) as boxes:
            return await boxes.base_digests(["table:main.t"])

    assert asyncio.run(base()) == {}


def test_a_call_that_reads_the_clock_is_never_answered_by_what_it_read(db: Path) -> None:
    """End to end: after different histories, `datetime('now')` executes again, while a plain read is reused."""

    async def main() -> list[str]:
        async with SQLiteSandboxes(db) as boxes, tvcache.ToolCache() as cache:
            sources = []
            for first in ("INSERT INTO t0(v) VALUES ('x')", "INSERT INTO t0(v) VALUES ('y')"):
                async with cache.rollout("t", boxes) as r:
                    await r.call("sql", {"query": first})
                    sources.append((await r.call("sql", {"query": "SELECT datetime('now') > '2000'"})).source)
                    sources.append((await r.call("sql", {"query": "SELECT * FROM t1"})).source)
            return sources

    assert asyncio.run(main()) == ["executed", "executed", "executed", "reads"]


# -- the oracle ------------------------------------------------------------------------------------------------

READS = [
    "SELECT * FROM t0",
    "SELECT * FROM t1",
    "SELECT count(*) FROM t0",
    "SELECT count(*) FROM t1",
    "SELECT t0.v, t1.v FROM t0 JOIN t1 USING (k)",
    "SELECT * FROM log",
    "SELECT * FROM w",  # a view: an error until some rollout creates it
    "SELECT * FROM t2",  # a table: the same
    "SELECT name FROM sqlite_master ORDER BY name",
    "PRAGMA table_info(t1)",
    "INSERT INTO t0(k, v) VALUES (1, 'dup')",  # fails while row 1 exists, then writes
]
WRITES = [
    "INSERT INTO t0(v) VALUES ('x')",
    "INSERT INTO t1(v) VALUES ('y')",
    "UPDATE t0 SET v = v || 'z' WHERE k = 1",
    "DELETE FROM t0 WHERE k = 1",
    "DELETE FROM t1 WHERE k = (SELECT max(k) FROM t1)",
    "INSERT INTO t1(v) SELECT v FROM t0 WHERE k = (SELECT min(k) FROM t0)",
    "INSERT INTO seq(v) VALUES ('s')",
    "DELETE FROM seq",
    "CREATE TABLE IF NOT EXISTS t2(k INTEGER PRIMARY KEY, v TEXT)",
    "INSERT INTO t2(v) SELECT v FROM t1",
    "CREATE VIEW IF NOT EXISTS w AS SELECT t0.k, t1.v FROM t0 JOIN t1 USING (k)",
    "DROP VIEW IF EXISTS w",
    "CREATE TRIGGER IF NOT EXISTS tr AFTER INSERT ON t0 BEGIN INSERT INTO log VALUES (new.v); END",
    "ALTER TABLE t1 ADD COLUMN w TEXT",  # unobservable: exact history from there on
    "CREATE TEMP TABLE IF NOT EXISTS t1 AS SELECT 'temp' AS v",  # unobservable, and shadows t1
]
STATEMENTS = READS * 2 + WRITES


def plan_of(rng: random.Random, rollouts: int, length: int) -> Plan:
    return [[("sql", {"query": rng.choice(STATEMENTS)}) for _ in range(length)] for _ in range(rollouts)]


async def oracle_run(db: Path, plan: Plan, seed: int, cache: Any) -> int:
    async with SQLiteSandboxes(db) as boxes:
        return await check_against_oracle(cache, boxes, plan, tvcache.Tools(), seed=seed)


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    plan=st.lists(
        st.lists(st.tuples(st.just("sql"), st.fixed_dictionaries({"query": st.sampled_from(STATEMENTS)})), max_size=8),
        min_size=2,
        max_size=5,
    ),
    seed=st.integers(0, 2**16),
    budget=st.integers(0, 3),
)
def test_every_answer_equals_the_uncached_history(db: Path, plan: Plan, seed: int, budget: int) -> None:
    async def main() -> int:
        async with tvcache.ToolCache(snapshot_budget=budget) as cache:
            return await oracle_run(db, plan, seed, cache)

    assert asyncio.run(main()) == 0


def test_read_set_hits_happen_and_are_right_where_the_naive_cache_is_wrong(db: Path) -> None:
    """On the same seeded workloads: tvcache answers some calls by what they read and gets every answer right;
    the naive cache gets some wrong."""
    plans = [plan_of(random.Random(seed), 4, 8) for seed in range(12)]

    async def main() -> tuple[int, int, int, int]:
        wrong = naive_wrong = 0
        async with tvcache.ToolCache() as cache:
            for seed, plan in enumerate(plans):
                wrong += await oracle_run(db, plan, seed, cache)
            hits = cache.stats()["read_set_hits"]
        async with tvcache.ToolCache(read_sets=False) as exact:
            for seed, plan in enumerate(plans):
                wrong += await oracle_run(db, plan, seed, exact)
            exact_hits = exact.stats()["hits"]
        for seed, plan in enumerate(plans):
            naive_wrong += await oracle_run(db, plan, seed, NaiveCache())
        return wrong, hits, exact_hits, naive_wrong

    wrong, hits, exact_hits, naive_wrong = asyncio.run(main())
    assert wrong == 0 and hits > 0 and naive_wrong > 0
    assert exact_hits > 0  # both see the same workloads; read sets add hits on top


def test_rollouts_in_any_order_share_reads(db: Path) -> None:
    """Rollouts run one after another (no concurrency) reuse each other's reads across different histories."""
    plan: Plan = [
        [("sql", {"query": q}) for q in ("INSERT INTO t0(v) VALUES ('x')", "SELECT * FROM t1", "SELECT * FROM t0")],
        [("sql", {"query": q}) for q in ("INSERT INTO t1(v) VALUES ('y')", "SELECT * FROM t0", "SELECT * FROM t1")],
        [("sql", {"query": q}) for q in ("DELETE FROM log", "SELECT * FROM t1", "SELECT * FROM t0")],
    ]

    async def main() -> tuple[list[list[Any]], dict[str, Any]]:
        async with SQLiteSandboxes(db) as boxes, tvcache.ToolCache() as cache:
            got = [(await run_plan(cache, boxes, [calls], tvcache.Tools()))[0] for calls in plan]
            return got, cache.stats()

    got, stats = asyncio.run(main())
    assert (got[2][1], got[2][2]) == (got[0][1], got[1][1]) and stats["read_set_hits"] == 2
