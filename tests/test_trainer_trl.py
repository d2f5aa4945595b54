"""TRL: environments made by `cached_environment` as `GRPOTrainer(environment_factory=...)` sees and drives them.

What TRL does with an environment is checked against TRL itself: `GRPOTrainer.__init__` probes the factory and
builds the tool list and schemas from the class (`_env_tools`, `transformers.utils.get_json_schema`); per rollout
it resets a pooled instance with the dataset row and calls the tool methods with the model's arguments (sync ones
from its thread, async ones on its own event loop), then the reward function reads the environments. The real
SmolLM2 model and a full GRPO step run in tests/test_grpo.py; here the calls are scripted plans, so that writes,
errors and repeats are certain. Oracle: the same environment class without tvcache (each rollout on a fresh copy
of the database), and the same reward function.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from typing import Any

import pytest

os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # TRL imports weave, whose error reports go nowhere here
pytest.importorskip("trl", reason="needs TRL (pip install 'tvcache[trl]')")

from transformers.utils import get_json_schema
from trl.trainer.utils import start_event_loop_in_daemon

import tvcache
from tvcache.integrations.trl import cached_environment, results
from tvcache_bench.workloads.grpo.env import BackgroundLoop, Reward, SQLEnvironment
from tvcache_bench.workloads.grpo.tasks import chinook, database_path, rows

COUNT = "SELECT count(*) FROM Track"
PLANS = [
    [COUNT],  # right: 3503
    ["DELETE FROM Track WHERE TrackId > 10", COUNT],  # right on its own final state: 10
    ["SELECT Name FROM Artist LIMIT 2", COUNT],
    [COUNT],  # plan 0 again: its call and its grading hit
    ["CREATE TEMP TABLE picks AS SELECT TrackId FROM Track LIMIT 3", "SELECT count(*) FROM picks"],  # wrong: 3
    ["SELEC oops"],  # an SQL error as the answer: 0
    [],  # no call at all: -1
]
REWARDS = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, -1.0]


@pytest.fixture
def databases() -> dict[str, tvcache.SQLiteSandboxes]:
    return {"chinook": tvcache.SQLiteSandboxes(database_path("chinook"), timeout=10)}


@pytest.fixture
def row() -> dict[str, Any]:
    return rows(chinook(1), "count(*)\n     275")[0]  # the first question: how many tracks (gold: COUNT)


def factories(databases: dict[str, tvcache.SQLiteSandboxes], cache: tvcache.SyncToolCache) -> tuple[Any, Any]:
    loop = BackgroundLoop()

    def plain() -> SQLEnvironment:
        return SQLEnvironment(databases, loop)

    return plain, cached_environment(plain, lambda row: databases[row["database"]], cache=cache)


def drive(factory: Any, row: dict[str, Any], pool: list[Any], cached: bool) -> tuple[list[list[str]], list[float]]:
    """A step as GRPOTrainer runs one: pooled environments reset with the row, the plans' calls through the tool
    methods TRL found on the class, then the reward function over the environments."""
    while len(pool) < len(PLANS):
        pool.append(factory())
    outputs = []
    for env, plan in zip(pool, PLANS, strict=True):
        env.reset(**row)
        tools = {
            name: getattr(env, name)
            for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")
        }
        outputs.append([str(tools["sql"](**{"query": query})) for query in plan])
    reward = Reward(cached)
    scores = reward([[] for _ in PLANS], environments=pool, gold=[row["gold"]] * len(PLANS))
    return outputs, [float(s) for s in scores if s is not None]


def test_cached_environment_answers_as_the_plain_one_and_later_rollouts_hit(
    databases: dict[str, tvcache.SQLiteSandboxes], row: dict[str, Any]
) -> None:
    with tvcache.SyncToolCache() as cache:
        plain, cached = factories(databases, cache)
        expected, expected_rewards = drive(plain, row, [], cached=False)
        pool: list[Any] = []
        first, first_rewards = drive(cached, row, pool, cached=True)
        first_hits = [[r.hit for r in results(env)] for env in pool]
        again, again_rewards = drive(cached, row, pool, cached=True)  # the next epoch, the same pooled instances
        again_hits = [[r.hit for r in results(env)] for env in pool]
        stats = cache.stats()
    assert expected_rewards == REWARDS
    assert first == expected and again == expected
    assert first_rewards == expected_rewards and again_rewards == expected_rewards
    assert expected[1][1].split()[-1] == "10" and expected[4][1].split()[-1] == "3"
    # Plan 0 grades the untouched database with the query it ran itself: a memo, so the grading hits. Plan 2's
    # read leaves the state as it was (a memo), so its count and grading hit what plan 0 recorded; plan 3 repeats
    # plan 0 and hits throughout. Plan 1 deleted rows: its count runs on its own state (and its grading hits that).
    assert first_hits[0] == [False, True]
    assert first_hits[1] == [False, False, True]
    assert first_hits[2] == [False, True, True]
    assert first_hits[3] == [True, True]
    assert all(all(hits) for hits in again_hits)
    assert stats["mismatches"] == 0 and stats["detached"] == 0


def test_trl_builds_the_same_tools_and_schemas(databases: dict[str, tvcache.SQLiteSandboxes]) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tvcache_bench.workloads.grpo.model import load_model, load_tokenizer

    with tvcache.SyncToolCache() as cache:
        plain, cached = factories(databases, cache)
        tools = {}
        for name, factory in (("plain", plain), ("cached", cached)):
            config = GRPOConfig(output_dir="/tmp/tvcache-trl-test", use_cpu=True, report_to="none", max_steps=1)
            trainer = GRPOTrainer(
                model=load_model(),
                processing_class=load_tokenizer(),
                reward_funcs=Reward(cached=name == "cached"),
                args=config,
                train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}], "gold": "1"}]),
                environment_factory=factory,
            )
            tools[name] = [(fn.__name__, get_json_schema(fn)) for fn in trainer._env_tools[None]]
    assert tools["cached"] == tools["plain"]
    assert [name for name, _ in tools["plain"]] == ["sql"]
    assert tools["plain"][0][1]["function"]["parameters"]["properties"]["query"]["type"] == "string"


def test_wrong_arguments_raise_what_the_method_raises(
    databases: dict[str, tvcache.SQLiteSandboxes], row: dict[str, Any]
) -> None:
    with tvcache.SyncToolCache() as cache:
        plain, cached = factories(databases, cache)
        errors = []
        for env in (plain(), cached()):
            env.reset(**row)
            with pytest.raises(TypeError) as caught:
                env.sql(statement="SELECT 1")
            errors.append(str(caught.value))
            if env.__class__ is not SQLEnvironment:
                assert results(env) == []  # it never reached the cache
    assert errors[0] == errors[1]


class AsyncShop:
    """An environment with an async tool method, which TRL awaits on its own event loop."""

    def reset(self, **row: Any) -> str:
        return "Welcome."

    async def sql(self, query: str) -> str:
        """Run one SQLite statement.

        Args:
            query: The statement.
        """
        raise AssertionError("with tvcache the sandbox answers, not this body")


def test_async_tools_stay_async_and_reset_opens_a_new_rollout(databases: dict[str, tvcache.SQLiteSandboxes]) -> None:
    with tvcache.SyncToolCache() as cache:
        env = cached_environment(AsyncShop, databases["chinook"], cache=cache, task=lambda row: row["task"])()
        assert inspect.iscoroutinefunction(env.sql)
        assert get_json_schema(env.sql) == get_json_schema(AsyncShop().sql)
        with pytest.raises(RuntimeError, match="before reset"):
            asyncio.run(env.sql(COUNT))
        thread, trl_loop, ready = start_event_loop_in_daemon(name="trl-like")
        ready.wait()
        try:
            assert env.reset(task="t1") == "Welcome."
            run = asyncio.run_coroutine_threadsafe(env.sql(COUNT), trl_loop).result()
            assert run.split()[-1] == "3503" and not results(env)[0].hit
            assert env.reset(task="t1") == "Welcome." and results(env) == []  # a new rollout of the same task
            assert asyncio.run_coroutine_threadsafe(env.sql(COUNT), trl_loop).result() == run
            assert results(env)[0].hit
        finally:
            trl_loop.call_soon_threadsafe(trl_loop.stop)
            thread.join(timeout=10)


def test_the_example_trains_a_step() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import trl_text2sql

    # The same step without tvcache gives the same rewards (tests/test_grpo.py checks that on the benchmark's run).
    rewards = trl_text2sql.main(1, cache=True, rollouts=2, tokens=32)
    assert len(rewards) == 2 and set(rewards) <= {-1.0, 0.0, 1.0}
