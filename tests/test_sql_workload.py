"""The `sql` workload: its traces (deterministic, GRPO-like, valid, with state changes) and a real run of a few
of its tasks through the cache, checked against the oracle (each rollout's calls executed uncached in a
fresh sandbox of the same database).
"""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import sqlite3
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

import tvcache
from tvcache_bench.data import workloads_dir
from tvcache_bench.traces import Trace
from tvcache_bench.workload import Workload
from tvcache_bench.workloads import sql
from tvcache_bench.workloads.sql import queries as sqlquery
from tvcache_bench.workloads.sql import tpch

STATE_CHANGING = re.compile(r"^\s*(CREATE|INSERT|DROP)\b", re.IGNORECASE)


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tvcache-test-sql-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def build(shm: Path, **options: object) -> Workload:
    options.setdefault("tpch", False)
    return sql.build_workload(tmp=str(shm), **options)  # type: ignore[arg-type]


def close(workload: Workload) -> None:
    async def closing() -> None:
        await workload.close()

    asyncio.run(closing())


def by_task(traces: list[Trace]) -> dict[str, list[list[str]]]:
    tasks: dict[str, list[list[str]]] = defaultdict(list)
    for trace in traces:
        tasks[trace.task].append([call.args["query"] for call in trace.calls])
    return tasks


def common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------------------------------------------------
# Traces


def test_same_seed_same_traces_other_seed_other_traces(shm: Path) -> None:
    first, again, other = (build(shm, tasks=15, rollouts=4, seed=s) for s in (3, 3, 4))
    try:
        assert [t.to_json() for t in first.traces] == [t.to_json() for t in again.traces]
        assert [t.to_json() for t in first.traces] != [t.to_json() for t in other.traces]
        assert first.notes == again.notes
    finally:
        for w in (first, again, other):
            close(w)


def test_shape_tasks_and_rollouts(shm: Path) -> None:
    w = build(shm, tasks=20, rollouts=5)
    try:
        tasks = by_task(w.traces)
        assert len(tasks) == 20
        assert all(len(rollouts) == 5 for rollouts in tasks.values())
        assert [t.rollout for t in w.traces[:5]] == ["r0", "r1", "r2", "r3", "r4"]
        assert w.name == "sql"
        assert "20 text-to-SQL tasks" in w.notes
    finally:
        close(w)


def test_rollouts_share_prefixes_then_diverge(shm: Path) -> None:
    w = build(shm, tasks=40, rollouts=8)
    try:
        pairs, shared, identical, first_equal, rollouts = 0, 0, 0, 0, 0
        for runs in by_task(w.traces).values():
            for i in range(len(runs)):
                rollouts += 1
                first_equal += runs[i][:1] == runs[0][:1]
                for j in range(i + 1, len(runs)):
                    pairs += 1
                    n = common_prefix(runs[i], runs[j])
                    shared += n >= 2
                    identical += runs[i] == runs[j]
        # As GRPO samples of one prompt: most agree on their first call and many on more...
        assert first_equal / rollouts > 0.7
        assert shared / pairs > 0.4
        # ...but most pairs of rollouts end up different.
        assert identical / pairs < 0.5
    finally:
        close(w)


def test_every_call_is_a_valid_sql_call(shm: Path) -> None:
    w = build(shm, tasks=30)
    try:
        assert w.tools == tvcache.Tools()  # nothing is declared read-only: sql may write
        for trace in w.traces:
            assert trace.calls, trace
            for call in trace.calls:
                assert call.tool == "sql"
                assert set(call.args) == {"query"}
                assert isinstance(call.args["query"], str) and call.args["query"].strip()
                assert call.output is None
                assert sqlite3.complete_statement(call.args["query"] + ";"), call.args["query"]
                w.tools.call(call.tool, call.args)  # canonical key and digest
        factories = {w.sandboxes(task) for task in by_task(w.traces)}
        assert all(isinstance(f, tvcache.Sandboxes) for f in factories)
        with pytest.raises(KeyError, match="not part of this sql workload"):
            w.sandboxes("no-such-task")
    finally:
        close(w)


def test_traces_change_state_and_the_sandbox_sees_it(shm: Path) -> None:
    w = build(shm, tasks=40)
    try:
        changing = [
            (trace, call.args["query"])
            for trace in w.traces
            for call in trace.calls
            if STATE_CHANGING.match(call.args["query"])
        ]
        statements = ("CREATE TEMP VIEW", "CREATE TEMP TABLE", "CREATE VIEW", "INSERT INTO", "DROP VIEW")
        kinds = {kind for _, query in changing for kind in statements if query.startswith(kind)}
        assert len(kinds) >= 4, kinds
        assert len({t.task for t, _ in changing}) >= 5

        async def run() -> int:
            changed = 0
            for trace, _ in changing[:10]:
                box = await w.sandboxes(trace.task).create()
                try:
                    for call in trace.calls:
                        outcome = await box.execute(tvcache.ToolCall(call.tool, call.args))
                        assert not outcome.error, outcome
                        if STATE_CHANGING.match(call.args["query"]):
                            changed += bool(outcome.changed)
                        elif call.args["query"].lstrip().upper().startswith(("SELECT", "PRAGMA")):
                            assert outcome.changed is False, call.args["query"]
                finally:
                    await box.close()
            return changed

        assert asyncio.run(run()) >= 5
    finally:
        close(w)


def test_failing_gold_queries_are_dropped(shm: Path) -> None:
    w = build(shm, rollouts=1)
    try:
        tasks = set(by_task(w.traces))
        families = {task.split("/")[0] for task in tasks}
        assert families == {"spider-de", "geography", "chinook", "northwind"}
        assert len(tasks) > 1800
        # Spider-de's German column "alter" (age) is an SQL keyword: those golds fail and must be gone.
        spider = sql._spider(workloads_dir() / "sql")
        broken = {q.task for q in spider if re.search(r"\balter\b", q.gold)}
        assert broken and not broken & tasks
        dropped = int(re.search(r"(\d+) tasks skipped", w.notes).group(1))  # type: ignore[union-attr]
        assert dropped >= len(broken)
    finally:
        close(w)


def test_bad_arguments_are_refused(shm: Path) -> None:
    for bad in ({"tasks": 0}, {"rollouts": 0}, {"tasks": True}):
        with pytest.raises(ValueError):
            build(shm, **bad)


# ---------------------------------------------------------------------------------------------------------
# Perturbations

TABLES = {"singer": ("id", "name", "country", "age"), "concert": ("id", "singer_id", "year")}


def test_perturbations_give_distinct_wrong_queries_that_parse() -> None:
    gold = "SELECT name, age FROM singer WHERE country = 'France' AND age > 30 ORDER BY age DESC LIMIT 3;"
    variants = sqlquery.perturb(gold, TABLES, random.Random(0), count=6)
    assert len(variants) == 6 == len(set(variants))
    conn = sqlite3.connect(":memory:")
    conn.executescript(
        "CREATE TABLE singer(id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER);"
        "CREATE TABLE concert(id INTEGER PRIMARY KEY, singer_id INTEGER, year INTEGER);"
    )
    for variant in variants:
        assert variant != gold.rstrip(";")
        conn.execute("EXPLAIN " + variant)  # every variant is valid SQL on this schema


def test_cost_preserving_perturbations_keep_every_condition() -> None:
    gold = tpch.queries(random.Random(1), ("q05",))[0].sql
    conditions = gold.count(" AND ") + gold.count("WHERE")
    for variant in sqlquery.perturb(gold, {}, random.Random(2), count=8, kinds=sqlquery.COST_PRESERVING):
        assert variant.count(" AND ") + variant.count("WHERE") == conditions, variant
        assert "!=" not in variant


def test_dropping_a_condition_never_drops_a_join() -> None:
    gold = "SELECT T1.name FROM singer AS T1 JOIN concert AS T2 ON T1.id = T2.singer_id WHERE T2.year = 2014"
    kinds = {"drop_condition": sqlquery.PERTURBATIONS["drop_condition"]}
    assert sqlquery.perturb(gold, TABLES, random.Random(0), kinds=kinds) == []
    comma_join = "SELECT name FROM singer, concert WHERE singer.id = concert.singer_id AND year = 2014"
    assert sqlquery.perturb(comma_join, TABLES, random.Random(0), kinds=kinds) == [
        "SELECT name FROM singer, concert WHERE singer.id = concert.singer_id"
    ]


# ---------------------------------------------------------------------------------------------------------
# End to end: through the cache, checked against fresh uncached sandboxes


async def oracle(w: Workload, trace: Trace) -> list[object]:
    box = await w.sandboxes(trace.task).create()
    try:
        return [(await box.execute(tvcache.ToolCall(c.tool, c.args))).output for c in trace.calls]
    finally:
        await box.close()


async def through_cache(cache: tvcache.ToolCache, w: Workload, rollouts: list[Trace]) -> list[list[object]]:
    """All rollouts of one task at once, as a GRPO step runs them."""

    async def one(trace: Trace) -> list[object]:
        outputs = []
        async with cache.rollout(trace.task, w.sandboxes(trace.task), tools=w.tools) as r:
            for call in trace.calls:
                result = await r.call(call.tool, call.args)
                assert not result.error, result
                outputs.append(result.output)
        return outputs

    return list(await asyncio.gather(*(one(t) for t in rollouts)))


def run_against_oracle(w: Workload, seen: dict[tuple[str, str], set[str]]) -> dict[str, float]:
    """Run `w` through a cache, task by task, checking every result; record each call's outputs in `seen`."""
    tasks: dict[str, list[Trace]] = defaultdict(list)
    for trace in w.traces:
        tasks[trace.task].append(trace)

    async def main() -> dict[str, float]:
        cache = tvcache.ToolCache()
        try:
            for rollouts in tasks.values():
                cached = await through_cache(cache, w, rollouts)
                for trace, outputs in zip(rollouts, cached, strict=True):
                    expected = await oracle(w, trace)
                    assert outputs == expected, trace.task
                    for call, output in zip(trace.calls, expected, strict=True):
                        seen[trace.task, call.args["query"]].add(str(output))
            return cache.stats()
        finally:
            await cache.close()
            await w.close()

    return asyncio.run(main())


def test_end_to_end_cached_results_equal_uncached(shm: Path) -> None:
    # Seed 1's first tasks include a rollout that inserts a row into a real table and one with temp objects.
    w = build(shm, tasks=8, rollouts=6, seed=1)
    queries = [c.args["query"] for t in w.traces for c in t.calls]
    assert any(q.startswith("INSERT INTO") and "scratch" not in q for q in queries)
    assert any(q.startswith("CREATE TEMP") for q in queries)
    seen: dict[tuple[str, str], set[str]] = defaultdict(set)
    stats = run_against_oracle(w, seen)
    assert stats["hits"] > 0, stats
    # The workload can catch a cache that ignores state: one query of one task answers differently in
    # different rollouts, which a (tool, args) cache would get wrong.
    assert any(len(outputs) > 1 for outputs in seen.values())


# ---------------------------------------------------------------------------------------------------------
# TPC-H


@pytest.fixture(scope="module")
def tpch_cache() -> Iterator[Path]:
    """A cache directory (as `$XDG_CACHE_HOME`) holding a TPC-H database at scale factor 0.01, built here."""
    if tpch.generator() is None:
        pytest.skip("tpchgen-cli is not installed (pip install tpchgen-cli)")
    root = Path(tempfile.mkdtemp(prefix="tvcache-test-tpch-", dir="/dev/shm"))
    tpch.ensure_database(0.01, directory=root / "tvcache", tmp=str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_tpch_database_builds_once_and_its_queries_run(tpch_cache: Path) -> None:
    path = tpch_cache / "tvcache" / "tpch-sf0.01.sqlite"
    assert path.is_file()
    assert not list(tpch_cache.glob("tvcache-tpch-*"))  # the scratch CSVs are gone
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        counts = {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("nation", "orders")}
        assert counts == {"nation": 25, "orders": 15000}  # TPC-H's cardinalities at SF 0.01
        for query in tpch.queries(random.Random(0)):
            rows = conn.execute(query.sql).fetchall()
            # Each adapted query finds rows, as on a real TPC-H database; Q18's orders of more than 312
            # items only exist from scale factor 0.1 or so.
            assert rows or query.name == "q18", query.name
    finally:
        conn.close()
    built = path.stat().st_mtime_ns
    started = time.monotonic()
    assert tpch.ensure_database(0.01, directory=path.parent) == path
    assert path.stat().st_mtime_ns == built and time.monotonic() - started < 1  # reused, not rebuilt


def test_tpch_tasks_in_the_workload(tpch_cache: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tpch_cache))
    monkeypatch.setenv(tpch.SCALE_ENV, "0.01")
    w = build(shm, tasks=10, rollouts=3, tpch=True)
    heavy = [t for t in w.traces if t.task.startswith("tpch/")]
    assert {t.task for t in heavy} == {f"tpch/{tpch.DEFAULT_QUERIES[0]}"}  # every tenth task is TPC-H
    w.traces = heavy
    run_against_oracle(w, defaultdict(set))


def test_without_tpchgen_the_error_says_what_to_do(monkeypatch: pytest.MonkeyPatch, shm: Path) -> None:
    monkeypatch.setattr(tpch, "generator", lambda: None)
    with pytest.raises(tpch.TpchUnavailable, match="pip install tpchgen-cli"):
        tpch.ensure_database(0.02, directory=shm / "nothing-cached")
