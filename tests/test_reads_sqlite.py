"""Reuse by what a call read, on SQLite sandboxes: what the authorizer shows a statement read and wrote, every
case it cannot show (the call is then reused by exact history only), and the oracle on random workloads.

The oracle is the cache's own: every answer a rollout gets (exact hit, read-set hit or execution) equals the same
calls executed uncached in a fresh sandbox. The naive (tool, args) cache fails it on the same workloads, which
shows they are strong enough to catch a cache that reuses an answer whose inputs changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kv
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


def keys(outcome: Outcome, *, written: bool = False) -> set[str]:
    found = outcome.writes if written else outcome.reads
    assert found is not None, outcome
    return set(found)


def table(name: str, schema: str = "main") -> set[str]:
    """What reading a table reads: its rows, its definition, and the temp name that would shadow it."""
    return {f"table:{schema}.{name}", f"def:{schema}.{name}", f"def:temp.{name}"}


def test_a_read_names_the_tables_it_read_and_their_definitions(db: Path) -> None:
    join, count, view_made, view, missing, constant = observe(
        db,
        "SELECT t0.v, t1.v FROM t0 JOIN t1 USING (k)",
        "SELECT count(*) FROM t0",  # reads no column: SQLite names the table without its schema
        "CREATE VIEW w AS SELECT v FROM t1",
        "SELECT * FROM w",
        "SELECT * FROM nosuch",
        "SELECT 1 + 1",
    )
    assert join.changed is False and keys(join) == table("t0") | table("t1")
    assert keys(count) == table("t0")
    assert view_made.changed and keys(view_made, written=True) == {"schema:main", "def:main.w"}
    assert keys(view) == table("t1") | table("w")  # through the view, to its table
    # Which name was missing is not reported: an error reads both schemas whole.
    assert missing.output == "Error: no such table: nosuch" and keys(missing) == {"schema:main", "schema:temp"}
    assert keys(constant) == set()
    assert join.writes is None and keys(view_made) == {"schema:main", "def:main.w"}  # what it touched, before


def test_a_write_reads_what_it_touched_as_it_was_before(db: Path) -> None:
    """A state-changing statement's reads are every key it touched, with the digests from before it ran (a write
    reads what it writes: its effect depends on the rows there), so it can be reused by them."""
    before, copy, after = observe(
        db,
        "SELECT * FROM t0 JOIN t1 USING (k)",
        "INSERT INTO t1(v) SELECT v FROM t0",
        "SELECT * FROM t0 JOIN t1 USING (k)",
    )
    assert copy.changed and keys(copy, written=True) == {"table:main.t1"}
    assert before.reads is not None and after.reads is not None and copy.reads is not None and copy.writes
    assert copy.reads == before.reads  # the same keys (both tables, their definitions), as they were before
    assert after.reads["table:main.t1"] == copy.writes["table:main.t1"] != copy.reads["table:main.t1"]


def test_a_write_gives_what_it_changed_new_digests_and_reads_see_them(db: Path) -> None:
    before, trigger, insert, after, other = observe(
        db,
        "SELECT * FROM log",
        "CREATE TRIGGER tr AFTER INSERT ON t0 BEGIN INSERT INTO log VALUES (new.v); END",
        "INSERT INTO t0(v) VALUES ('x')",
        "SELECT * FROM log",
        "SELECT * FROM t1",
    )
    assert keys(trigger, written=True) == {"schema:main", "def:main.t0"}  # a trigger belongs to its table
    assert keys(insert, written=True) == {"table:main.t0", "table:main.log"}  # the trigger's write too
    assert before.reads and after.reads and other.reads and insert.writes
    assert after.reads["table:main.log"] == insert.writes["table:main.log"] != before.reads["table:main.log"]
    assert after.reads["def:main.log"] == before.reads["def:main.log"]  # the trigger is t0's, not log's


def test_a_failed_write_reads_what_it_would_have_written(db: Path) -> None:
    """A constraint violation changes nothing, and its answer depends on the table it would have written."""
    (dup,) = observe(db, "INSERT INTO t0(k, v) VALUES (1, 'dup')")
    assert dup.output.startswith("Error: UNIQUE constraint failed") and dup.changed is False
    assert table("t0") <= keys(dup)


def test_temp_objects_are_observed_and_shadow_main_ones(db: Path) -> None:
    made, read, shadow, count, unshadowed = observe(
        db,
        "CREATE TEMP TABLE s AS SELECT v FROM t0",
        "SELECT * FROM s",
        "CREATE TEMP VIEW t1 AS SELECT 'temp' AS v",
        "SELECT count(*) FROM t1",  # names no schema, and a temp object has the name: not observable
        "SELECT * FROM t0",
    )
    assert keys(made, written=True) == {"schema:temp", "def:temp.s", "table:temp.s"}
    assert keys(read) == {"table:temp.s", "def:temp.s"}
    assert keys(shadow, written=True) == {"schema:temp", "def:temp.t1"}
    assert count.output == "count(*)\n       1" and count.reads is None
    assert unshadowed.reads is not None and "def:temp.t0" in unshadowed.reads


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
    "EXPLAIN SELECT * FROM t0",  # its program names root pages
    "EXPLAIN QUERY PLAN SELECT * FROM t0",
]


@pytest.mark.parametrize("query", UNOBSERVABLE_READS)
def test_unobservable_reads_are_none(db: Path, query: str) -> None:
    (outcome,) = observe(db, query)
    assert outcome.changed is False and outcome.reads is None


def test_schema_introspection_reads_the_schema(db: Path) -> None:
    info, names, index = observe(
        db, "PRAGMA table_info(t0)", "SELECT name, sql FROM sqlite_master ORDER BY name", "PRAGMA index_info(i)"
    )
    assert keys(info) == {"def:main.t0", "def:temp.t0"} and keys(names) == {"schema:main"}
    assert keys(index) == {"schema:main", "schema:temp"}


@pytest.mark.parametrize(
    "write",
    [
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


INSERT = "INSERT INTO t1(v) VALUES ('x')"


@pytest.mark.parametrize(
    ("first", "second", "call"),
    [
        (INSERT, "CREATE VIEW w AS SELECT 1", "DROP VIEW IF EXISTS w"),
        (INSERT, "CREATE INDEX i ON t0(v)", "DROP INDEX IF EXISTS i"),
        (INSERT, "CREATE TEMP TABLE tt(x)", "DROP TABLE IF EXISTS tt"),
        ("CREATE INDEX i ON t0(v)", INSERT, "CREATE INDEX IF NOT EXISTS i ON t0(v)"),
    ],
)
def test_ddl_with_nothing_to_do_is_not_reused_where_it_has_something_to_do(
    db: Path, first: str, second: str, call: str
) -> None:
    """The authorizer reports nothing of DDL that finds nothing to do: answered by what it read, the no-op would
    skip its write in a state where there is something to do (found by the oracle test below)."""

    async def main() -> list[str]:
        async with SQLiteSandboxes(db) as boxes, tvcache.ToolCache() as cache:
            sources = []
            for before in (first, second):  # a no-op after the first, a write after the second
                async with cache.rollout("t", boxes) as r:
                    await r.call("sql", {"query": before})
                    sources.append((await r.call("sql", {"query": call})).source)
            return sources

    assert asyncio.run(main()) == ["executed", "executed"]


def test_ddl_with_nothing_to_do_is_unobservable(db: Path) -> None:
    (noop,) = observe(db, "DROP VIEW IF EXISTS w")
    assert noop.changed is False and noop.reads is None


def test_a_statement_prepared_once_reports_its_reads_every_time(db: Path) -> None:
    """sqlite3 reuses a prepared statement (the authorizer sees only its preparation) until the schema changes:
    every execution reports the same reads, and new ones once the schema moved."""
    first, again, _, after_ddl, _, shadowed = observe(
        db,
        "SELECT * FROM t1",
        "SELECT * FROM t1",
        "CREATE INDEX i ON t1(v)",
        "SELECT * FROM t1",
        "CREATE TEMP VIEW t1 AS SELECT 'temp' AS v",
        "SELECT * FROM t1",
    )
    assert first.reads == again.reads and keys(first) == table("t1")
    assert keys(after_ddl) == table("t1") and after_ddl.reads != first.reads  # t1's definition has an index now
    assert shadowed.output == "v\ntemp" and keys(shadowed) == {"table:temp.t1", "def:temp.t1"}


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
    "SELECT v FROM t0",  # in index order where the index iv exists (a covering index scan)
    "SELECT t0.v, t1.v FROM t0 JOIN t1 USING (k)",
    "SELECT * FROM log",
    "SELECT * FROM w",  # a view: an error until some rollout creates it
    "SELECT * FROM tv",  # a temp view: the same
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
    "CREATE INDEX IF NOT EXISTS iv ON t0(v)",
    "DROP INDEX IF EXISTS iv",
    "CREATE TRIGGER IF NOT EXISTS tr AFTER INSERT ON t0 BEGIN INSERT INTO log VALUES (new.v); END",
    "ALTER TABLE t1 ADD COLUMN w TEXT",  # unobservable: exact history from there on
    "CREATE TEMP TABLE IF NOT EXISTS t1 AS SELECT 'temp' AS v",  # shadows t1
    "CREATE TEMP VIEW IF NOT EXISTS tv AS SELECT count(*) AS n FROM t0",
    "INSERT INTO t1(v) VALUES ('into temp or main')",
]
STATEMENTS = READS * 2 + WRITES


def plan_of(rng: random.Random, rollouts: int, length: int) -> Plan:
    return [[("sql", {"query": rng.choice(STATEMENTS)}) for _ in range(length)] for _ in range(rollouts)]


async def oracle_run(db: Path, plan: Plan, seed: int, cache: Any) -> int:
    async with SQLiteSandboxes(db) as boxes:
        return await check_against_oracle(cache, boxes, plan, tvcache.Tools(), seed=seed)


def oracle_examples(statements: list[str], examples: int, rollouts: int) -> Any:
    """The hypothesis decorators of an oracle test: plans of 2 to `rollouts` rollouts of up to 8 `statements`,
    a seed for their interleaving and a snapshot budget."""
    calls = st.tuples(st.just("sql"), st.fixed_dictionaries({"query": st.sampled_from(statements)}))
    plans = st.lists(st.lists(calls, max_size=8), min_size=2, max_size=rollouts)

    def decorate(test: Any) -> Any:
        examples_of = given(plan=plans, seed=st.integers(0, 2**16), budget=st.integers(0, 3))(test)
        return settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )(examples_of)

    return decorate


@oracle_examples(STATEMENTS, examples=60, rollouts=5)
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
            assert cache.stats()["read_set_edges"] > 0  # state-changing calls among them
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


# -- replays judge read-set hits --------------------------------------------------------------------------------


class Forgetful:
    """SQLite sandboxes whose read-only calls claim to have read nothing: what a tracer that loses reads would
    report. Used to plant wrong read-set hits. Subclasses plant other lies with another `box` class."""

    box: Any = None  # set below, once _Forgetful exists

    def __init__(self, inner: SQLiteSandboxes):
        self.inner, self.fingerprint = inner, inner.fingerprint

    async def create(self) -> Any:
        return self.box(await self.inner.create())

    async def restore(self, snapshot_id: str) -> Any:
        return self.box(await self.inner.restore(snapshot_id))

    async def delete(self, snapshot_id: str) -> None:
        await self.inner.delete(snapshot_id)

    async def base_digests(self, keys: Any) -> Any:
        return await self.inner.base_digests(keys)


class _Forgetful:
    def __init__(self, box: Sandbox):
        self.box = box

    async def execute(self, call: ToolCall) -> Outcome:
        outcome = await self.box.execute(call)
        return dataclasses.replace(outcome, reads={} if outcome.reads is not None else None)

    async def snapshot(self) -> str:
        return await self.box.snapshot()

    async def close(self) -> None:
        await self.box.close()


Forgetful.box = _Forgetful


def test_replays_count_read_set_hits_and_judge_each(db: Path) -> None:
    """A replay counts read-set hits on their own and checks each against the uncached answer: right ones from the
    SQLite sandbox, and wrong ones, counted as incorrect, from sandboxes that lose what calls read."""
    from tvcache_bench.replay import ReplayOptions, replay_strategies
    from tvcache_bench.traces import Trace, TraceCall
    from tvcache_bench.workload import Workload

    def sql(*queries: str) -> list[TraceCall]:
        return [TraceCall("sql", {"query": q}) for q in queries]

    traces = [
        Trace("t", "r0", "", sql("INSERT INTO t0(v) VALUES ('x')", "SELECT * FROM t1", "SELECT * FROM t0")),
        Trace("t", "r1", "", sql("INSERT INTO log VALUES ('l')", "SELECT * FROM t1", "SELECT * FROM t0")),
    ]
    options = ReplayOptions(concurrency=1, progress=False)

    async def main(forget: bool) -> dict[str, Any]:
        async with SQLiteSandboxes(db) as boxes:
            factory: Any = Forgetful(boxes) if forget else boxes
            workload = Workload("reads", traces, lambda task: factory, tvcache.Tools())
            result = await replay_strategies(workload, ["none", "exact", "tvcache"], options)
            return dict(result.summary()["strategies"])

    honest = asyncio.run(main(False))
    assert (honest["tvcache"]["read_set_hits"], honest["tvcache"]["incorrect_read_set_hits"]) == (1, 0)
    assert (honest["exact"]["read_set_hits"], honest["tvcache"]["hits"] - honest["exact"]["hits"]) == (0, 1)
    lying = asyncio.run(main(True))
    assert (lying["tvcache"]["read_set_hits"], lying["tvcache"]["incorrect_read_set_hits"]) == (2, 1)
    assert lying["tvcache"]["incorrect_hits"] == 1 and lying["exact"]["incorrect_hits"] == 0


# -- state-changing calls reused by what they read ----------------------------------------------------------------


def sources_and_outputs(db: Path, plan: Plan, factory: Any = None) -> tuple[list[list[Any]], dict[str, Any], int]:
    """Run the rollouts of `plan` one after another through one cache: what each call got (source, output), the
    cache's stats, and how many answers differ from the uncached oracle."""

    async def main() -> tuple[list[list[Any]], dict[str, Any], int]:
        async with SQLiteSandboxes(db) as boxes, tvcache.ToolCache() as cache:
            box = factory(boxes) if factory is not None else boxes
            got, wrong = [], 0
            for calls in plan:
                async with cache.rollout("t", box) as r:
                    results = [await r.call(tool, args) for tool, args in calls]
                got.append([(res.source, res.output) for res in results])
                expected = await kv.execute_uncached(boxes, calls, tvcache.Tools())
                wrong += sum(res.output != out for res, out in zip(results, expected, strict=True))
            return got, cache.stats(), wrong

    return asyncio.run(main())


def sql_calls(*queries: str) -> list[tuple[str, dict[str, Any]]]:
    return [("sql", {"query": q}) for q in queries]


def test_writes_in_another_order_are_reused_by_what_they_read(db: Path) -> None:
    """Two rollouts make the same two inserts in opposite orders. Exact history shares nothing after the root; by
    what they read, the second rollout's inserts are the first's (each read only its own table, as it was), its
    state is the same content, and its reads are hits too: it never starts a sandbox."""
    first = sql_calls("INSERT INTO t0(v) VALUES ('x')", "INSERT INTO t1(v) VALUES ('y')", "SELECT * FROM t1")
    second = sql_calls("INSERT INTO t1(v) VALUES ('y')", "INSERT INTO t0(v) VALUES ('x')", "SELECT * FROM t1")
    got, stats, wrong = sources_and_outputs(db, [first, second, second])
    assert wrong == 0
    assert [source for source, _ in got[1]] == ["reads", "reads", "reads"]
    assert [source for source, _ in got[2]] == ["edge", "edge", "memo"]  # recorded on the second's own path
    assert got[1][1][1] == "OK, 1 row affected" and got[1][2][1] == got[0][2][1] == "k  v\n1  c\n2  y"
    assert (stats["read_set_edges"], stats["creates"], stats["executions"]) == (2, 1, 3)


def test_a_write_whose_inputs_differ_executes(db: Path) -> None:
    """An insert that copies from a table another rollout changed first is not the recorded one: it executes."""
    copy = "INSERT INTO t1(v) SELECT v FROM t0"
    got, stats, wrong = sources_and_outputs(
        db, [sql_calls(copy, "SELECT * FROM t1"), sql_calls("DELETE FROM t0 WHERE k = 1", copy, "SELECT * FROM t1")]
    )
    assert wrong == 0 and [source for source, _ in got[1]] == ["executed", "executed", "executed"]
    assert stats["read_set_edges"] == 0


class _Afterwards(_Forgetful):
    """For a key a write both read and wrote, the digest after the call: what a tracer that digests what a command
    read once it has run would report (a hazard)."""

    async def execute(self, call: ToolCall) -> Outcome:
        outcome = await self.box.execute(call)
        if outcome.reads is None or outcome.writes is None:
            return outcome
        return dataclasses.replace(outcome, reads={**outcome.reads, **outcome.writes})


def test_a_write_that_reads_what_it_writes_is_keyed_on_the_state_before_it(db: Path) -> None:
    """Doubling a table reads it and writes it. A candidate keyed on the digest after the call would match the
    state the first doubling left, and answer the second doubling with a write that changes nothing: the count
    after two doublings would be wrong. The cache keys it on its own state before the call, so the second doubling
    executes and every answer is right."""
    double = "INSERT INTO t1(v) SELECT v FROM t1"
    plan = [sql_calls(double, "SELECT count(*) FROM t1"), sql_calls(double, double, "SELECT count(*) FROM t1")]
    got, stats, wrong = sources_and_outputs(db, plan, Afterwards)
    assert wrong == 0 and got[1][:2] == [("edge", "OK, 1 row affected"), ("executed", "OK, 2 rows affected")]
    assert got[1][2][1] == "count(*)\n       4" and stats["read_set_edges"] == 0


class _Blind(_Forgetful):
    """A write's reads without the t0 keys it only read: a tracer that loses reads, planting a wrong reuse of a
    state-changing call."""

    async def execute(self, call: ToolCall) -> Outcome:
        outcome = await self.box.execute(call)
        if outcome.reads is None or outcome.writes is None:
            return outcome
        kept = {key: digest for key, digest in outcome.reads.items() if key.split(".")[-1] != "t0"}
        return dataclasses.replace(outcome, reads=kept)


class Afterwards(Forgetful):
    box = _Afterwards


class Blind(Forgetful):
    box = _Blind


def test_a_rebuilt_state_that_wrote_otherwise_than_recorded_detaches_the_rollout(db: Path) -> None:
    """A wrong reuse planted by a sandbox that loses reads: the copy from t0 is reused after t0 changed, so the
    rollout believes t1 holds the recorded rows. When its next miss rebuilds the state in a sandbox, the copy is
    executed again and writes another digest than recorded: the cache sees the divergence, counts it as a
    mismatch and detaches the rollout, whose calls from then on execute in its own sandbox, answered right. (Were
    it not detached, its last call would be answered by the first rollout's read of t1, keyed on the recorded
    digest its state does not have.)"""
    copy = "INSERT INTO t1(v) SELECT v FROM t0"
    plan = [
        sql_calls(copy, "SELECT * FROM t1"),
        sql_calls("UPDATE t0 SET v = 'changed'", copy, "SELECT v FROM t1 ORDER BY v", "SELECT * FROM t1"),
    ]
    got, stats, wrong = sources_and_outputs(db, plan, Blind)
    assert [source for source, _ in got[1]] == ["executed", "reads", "executed", "executed"]
    assert got[1][2][1] == "v\nc\nchanged\nchanged"  # the rebuilt sandbox's, not the recorded state's
    assert (stats["mismatches"], stats["detached"], wrong) == (1, 1, 0)


# Writes that often commute (each touches one or two tables) and reads of what they wrote: rollouts drawing from a
# small pool make the same writes in other orders and interleavings, where exact history shares nothing.
SHUFFLED = [
    "INSERT INTO t0(v) VALUES ('x')",
    "INSERT INTO t1(v) VALUES ('y')",
    "INSERT INTO log VALUES ('l')",
    "UPDATE t0 SET v = v || 'z' WHERE k = 1",
    "DELETE FROM t1 WHERE k = (SELECT max(k) FROM t1)",
    "INSERT INTO t1(v) SELECT v FROM t0 WHERE k = (SELECT min(k) FROM t0)",
    "INSERT INTO t1(v) SELECT v FROM t1",
    "INSERT INTO seq(v) VALUES ('s')",
    "DELETE FROM seq WHERE k = (SELECT min(k) FROM seq)",
    "CREATE TEMP TABLE IF NOT EXISTS scratch AS SELECT v FROM t0",
    "INSERT INTO scratch SELECT v FROM t1",
    "SELECT * FROM t0",
    "SELECT * FROM t1",
    "SELECT count(*) FROM log",
    "SELECT * FROM seq",
    "SELECT * FROM scratch",
]


@oracle_examples(SHUFFLED, examples=40, rollouts=6)
def test_writes_reused_by_what_they_read_across_caches_sharing_a_store_equal_the_uncached_history(
    db: Path, tmp_path_factory: pytest.TempPathFactory, plan: Plan, seed: int, budget: int
) -> None:
    """Two caches (two processes' worth: each its own store client and sandbox factory) share one SQLite store file;
    their rollouts run at once, half through each, and every answer equals the rollout's history executed uncached."""
    url = f"sqlite:///{tmp_path_factory.mktemp('shared')}/cache.db"
    halves = [plan[0::2], plan[1::2]]

    async def main() -> int:
        async with (
            SQLiteSandboxes(db) as boxes_a,
            SQLiteSandboxes(db) as boxes_b,
            tvcache.ToolCache(url, snapshot_budget=budget) as a,
            tvcache.ToolCache(url, snapshot_budget=budget) as b,
        ):
            got = await asyncio.gather(
                run_plan(a, boxes_a, halves[0], tvcache.Tools(), seed=seed),
                run_plan(b, boxes_b, halves[1], tvcache.Tools(), seed=seed + 1),
            )
            wrong = 0
            for half, outputs in zip(halves, got, strict=True):
                for calls, answers in zip(half, outputs, strict=True):
                    expected = await kv.execute_uncached(boxes_a, calls, tvcache.Tools())
                    wrong += sum(x != y for x, y in zip(answers, expected, strict=True))
            return wrong

    assert asyncio.run(main()) == 0


def test_shuffled_writes_are_reused_and_the_naive_cache_is_wrong_on_them(db: Path) -> None:
    """The control for the test above, on seeded plans from the same pool: tvcache reuses writes by what they read
    and is right; the naive cache is wrong."""
    plans = [
        [[("sql", {"query": rng.choice(SHUFFLED)}) for _ in range(8)] for _ in range(4)]
        for rng in map(random.Random, range(10))
    ]

    async def main() -> tuple[int, int, int]:
        wrong = naive_wrong = 0
        async with tvcache.ToolCache() as cache:
            for seed, plan in enumerate(plans):
                wrong += await oracle_run(db, plan, seed, cache)
            edges = cache.stats()["read_set_edges"]
        for seed, plan in enumerate(plans):
            naive_wrong += await oracle_run(db, plan, seed, NaiveCache())
        return wrong, edges, naive_wrong

    wrong, edges, naive_wrong = asyncio.run(main())
    assert wrong == 0 and edges > 0 and naive_wrong > 0
