"""The correctness invariant of DESIGN.md, on random workloads.

Many concurrent rollouts of one task issue random read and write calls in random interleavings. Every result a
rollout gets through the cache must equal what executing that rollout's full history, uncached, in a fresh
sandbox returns. The same workloads through a naive (tool, args) cache must break the invariant, which shows
the workloads are strong enough to catch a cache that ignores state.
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

import kv
import tvcache

Plan = list[list[tuple[str, dict[str, Any]]]]


def kv_plan(seed: int, rollouts: int, length: int) -> Plan:
    """Rollouts of one task share prefixes (as GRPO samples do) and then diverge."""
    rng = random.Random(seed)
    shared = [kv.random_call(rng) for _ in range(length)]
    plan = []
    for _ in range(rollouts):
        cut = rng.randrange(length + 1)
        calls = shared[:cut] + [kv.random_call(rng) for _ in range(length - cut)]
        plan.append([(tool, dict(args, delay=rng.choice([0, 0, 0.0005, 0.002]))) for tool, args in calls])
    return plan


async def run_plan(
    cache: Any, factory: Any, plan: Plan, tools: tvcache.Tools, task: str = "t", seed: int = 0
) -> list[list[Any]]:
    """Run every rollout of `plan` concurrently. Each pauses a random moment before each call, as an agent
    does while it generates, so which rollout executes a shared call first (and whose sandbox falls behind,
    to be caught up later) changes from call to call."""
    rng = random.Random(seed)

    async def one(calls: list[tuple[str, dict[str, Any]]], thinks: list[float]) -> list[Any]:
        outputs = []
        async with cache.rollout(task, factory, tools=tools) as r:
            for (tool, args), think in zip(calls, thinks, strict=True):
                await asyncio.sleep(think)
                outputs.append((await r.call(tool, args)).output)
        return outputs

    thinks = [[rng.choice([0, 0, 0.001, 0.003]) for _ in calls] for calls in plan]
    return list(await asyncio.gather(*(one(calls, t) for calls, t in zip(plan, thinks, strict=True))))

    return list(await asyncio.gather(*(one(calls) for calls in plan)))


async def check_against_oracle(cache: Any, factory: Any, plan: Plan, tools: tvcache.Tools, seed: int = 0) -> int:
    """Run `plan` through `cache` and return how many results differ from the uncached oracle."""
    got = await run_plan(cache, factory, plan, tools, seed=seed)
    wrong = 0
    for calls, outputs in zip(plan, got, strict=True):
        expected = await kv.execute_uncached(factory, calls, tools)
        wrong += sum(1 for a, b in zip(outputs, expected, strict=True) if a != b)
    return wrong


class NaiveCache:
    """The cache tvcache replaces: results keyed on (tool, args) alone, state ignored."""

    def __init__(self) -> None:
        self.entries: dict[str, Any] = {}

    def rollout(self, task: str, factory: Any, tools: tvcache.Tools) -> Any:
        cache = self

        class _Rollout:
            async def __aenter__(self) -> _Rollout:
                self.box = await factory.create()
                return self

            async def __aexit__(self, *exc: object) -> None:
                await self.box.close()

            async def call(self, tool: str, args: dict[str, Any]) -> Any:
                c = tools.call(tool, args)
                if c.key not in cache.entries:
                    cache.entries[c.key] = (await self.box.execute(c)).output
                else:
                    await self.box.execute(c)  # the sandbox still moves on; only the answer is reused
                return type("R", (), {"output": cache.entries[c.key]})

        return _Rollout()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), rollouts=st.integers(2, 8), length=st.integers(1, 10), budget=st.integers(0, 4))
def test_kv_results_equal_uncached_history(seed: int, rollouts: int, length: int, budget: int) -> None:
    plan = kv_plan(seed, rollouts, length)

    async def main() -> int:
        async with tvcache.ToolCache(snapshot_budget=budget) as cache:
            return await check_against_oracle(cache, kv.sandboxes(), plan, kv.TOOLS, seed=seed)

    assert asyncio.run(main()) == 0


def test_kv_oracle_holds_on_the_sqlite_store(tmp_path: Path) -> None:
    async def main() -> int:
        wrong = 0
        for seed in range(15):
            async with tvcache.ToolCache(f"sqlite:///{tmp_path}/c{seed % 3}.db") as cache:
                wrong += await check_against_oracle(cache, kv.sandboxes(), kv_plan(seed, 6, 8), kv.TOOLS)
        return wrong

    assert asyncio.run(main()) == 0


def test_naive_cache_breaks_the_invariant() -> None:
    async def main() -> int:
        return sum(
            [await check_against_oracle(NaiveCache(), kv.sandboxes(), kv_plan(s, 6, 8), kv.TOOLS) for s in range(10)]
        )

    assert asyncio.run(main()) > 0


# -- SQLite sandboxes ------------------------------------------------------------------------------------

SQL_READS = [
    "SELECT count(*) FROM t",
    "SELECT id, v FROM t ORDER BY id",
    "SELECT sum(v) FROM t",
    "SELECT * FROM recent",  # a view: fails until some rollout creates it
]
SQL_WRITES = [
    "INSERT INTO t (v) VALUES (1)",
    "INSERT INTO t (v) VALUES (5)",
    "UPDATE t SET v = v + 1 WHERE id % 2 = 0",
    "DELETE FROM t WHERE id = (SELECT max(id) FROM t)",
    "CREATE VIEW IF NOT EXISTS recent AS SELECT v FROM t ORDER BY id DESC LIMIT 2",
    "CREATE TEMP TABLE IF NOT EXISTS scratch AS SELECT * FROM t",
]


@pytest.fixture(scope="module")
def small_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("db") / "small.sqlite"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER); INSERT INTO t (v) VALUES (3), (4);")
    db.commit()
    db.close()
    return path


def sql_plan(seed: int, rollouts: int, length: int) -> Plan:
    rng = random.Random(seed)

    def call() -> tuple[str, dict[str, Any]]:
        return "sql", {"query": rng.choice(SQL_READS * 2 + SQL_WRITES)}

    shared = [call() for _ in range(length)]
    return [
        shared[: (cut := rng.randrange(length + 1))] + [call() for _ in range(length - cut)] for _ in range(rollouts)
    ]


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32), rollouts=st.integers(2, 6), length=st.integers(1, 8))
def test_sqlite_results_equal_uncached_history(small_db: Path, seed: int, rollouts: int, length: int) -> None:
    plan = sql_plan(seed, rollouts, length)

    async def main() -> int:
        factory = tvcache.SQLiteSandboxes(small_db)
        try:
            async with tvcache.ToolCache(snapshot_budget=3) as cache:
                return await check_against_oracle(cache, factory, plan, tvcache.Tools(), seed=seed)
        finally:
            await factory.close()

    assert asyncio.run(main()) == 0


def test_naive_cache_breaks_the_invariant_on_sqlite(small_db: Path) -> None:
    async def main() -> int:
        factory = tvcache.SQLiteSandboxes(small_db)
        try:
            return sum(
                [
                    await check_against_oracle(NaiveCache(), factory, sql_plan(s, 5, 8), tvcache.Tools())
                    for s in range(8)
                ]
            )
        finally:
            await factory.close()

    assert asyncio.run(main()) > 0
