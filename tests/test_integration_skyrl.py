"""SkyRL-gym: the `tvcache_text2sql` environment built by `skyrl_gym.make` and stepped on a thread pool as SkyRL's
generator steps it (the example's driver), on real Spider databases in tvcache's SQLite sandboxes.

Oracles: every observation and reward against the same actions executed in a fresh SQLite sandbox without any
cache; and every reward of a rollout that writes nothing against SkyRL's own `text2sql` environment.
The model is the one stand-in: a scripted policy behind an OpenAI-compatible endpoint (tests/frameworks.py).
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig

import tvcache

skyrl_gym = pytest.importorskip("skyrl_gym", reason="needs skyrl-gym (pip install 'tvcache[skyrl]')")

from frameworks import ScriptedLLM, load_example, plan_of  # noqa: E402
from tvcache.integrations import skyrl  # noqa: E402
from tvcache.integrations.skyrl import same_rows_query  # noqa: E402

example = load_example("skyrl_text2sql")
TMP = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
MAX_TURNS = 5
GOLD = "SELECT count(*) FROM sänger"  # question 0 of Spider-de dev: "Wie viele Sängerinnen und Sänger haben wir?"


def sql(statement: str) -> str:
    return f"<think>Let me look.</think>\n<sql>{statement}</sql>"


def solve(statement: str) -> str:
    return f"<think>I know it now.</think>\n<solution>{statement}</solution>"


TABLES = "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
PLANS = [
    [sql(TABLES), sql("SELECT count(*) FROM sänger"), solve(GOLD)],  # right
    [sql(TABLES), solve("SELECT count(*) FROM stadion")],  # wrong table
    ["I will answer directly.", solve(GOLD)],  # an action without <sql>: the environment says it is invalid
    [sql("CREATE TEMP VIEW s AS SELECT * FROM sänger"), solve("SELECT count(*) FROM s")],  # writes a view
    [sql("SELEC count(*) FROM sänger"), solve(GOLD)],  # a syntax error, as an observation
    [sql("DELETE FROM sänger WHERE sänger_id > 2"), sql("SELECT count(*) FROM sänger"), solve(GOLD)],  # writes
    [sql(TABLES), sql("SELECT count(*) FROM sänger"), solve(GOLD)],  # plan 0 again
    [solve(GOLD + " ;")],  # answers at once (the grading statement drops the semicolon)
]
WRITES = {3, 5}
# Plans 0, 2, 4, 6 and 7 end in the untouched database with the same solution: one grading; 1, 3 and 5 their own.
FINAL_GRADES = 4


def statement(action: str) -> str | None:
    found = re.search(r"<sql>(.*?)</sql>", action, re.DOTALL)
    return found.group(1) if found else None


async def uncached(db_file: str, plan: list[str]) -> tuple[list[str], float]:
    """The oracle: the plan's statements and its grading executed in order in one fresh sandbox, no cache."""
    async with tvcache.SQLiteSandboxes(db_file, tmp=TMP) as boxes:
        box = await boxes.create()
        observations = []
        for turn, action in enumerate(plan, start=1):
            if "<solution>" in action:
                break
            query = statement(action)
            reminder = f"<reminder>You have {MAX_TURNS - turn} turns left to complete the task.</reminder>"
            if query is None:
                text = skyrl.INVALID_ACTION
            else:
                text = str((await box.execute(tvcache.ToolCall("sql", {"query": query}))).output)
            observations.append(f"\n\n<observation>{text}\n{reminder}</observation>\n\n")
        predicted = re.search(r"<solution>(.*?)</solution>", plan[-1], re.DOTALL)
        assert predicted is not None
        graded = await box.execute(tvcache.ToolCall("sql", {"query": same_rows_query(predicted.group(1), GOLD)}))
        await box.close()
        return observations, 1.0 if skyrl.answers_one(str(graded.output)) else 0.0


def skyrl_reward(db_path: str, row: dict[str, Any], plan: list[str]) -> float:
    """SkyRL's own text2sql environment on the same actions (its statements rolled back, the original file)."""
    env = skyrl_gym.make("text2sql", env_config=DictConfig({"db_path": db_path}), extras=dict(row["env_extras"]))
    env.init(row["prompt"])
    reward = 0.0
    for action in plan:
        step = env.step(action)
        reward = step["reward"]
        if step["done"]:
            break
    env.close()
    return float(reward)


def test_skyrl_text2sql_through_tvcache_matches_uncached_and_skyrl_rewards() -> None:
    async def main() -> list[list[list[dict[str, Any]]]]:
        async with ScriptedLLM(PLANS) as llm:
            return await example.main(llm.url, "scripted-policy", tasks=1, rollouts=len(PLANS), max_turns=MAX_TURNS)

    epochs = asyncio.run(main())
    (row,) = example.dataset(1)
    with tempfile.TemporaryDirectory() as db_path:
        example.layout(db_path)
        db_file = f"{db_path}/spider/database/concert_singer/concert_singer.sqlite"
        oracle = [asyncio.run(uncached(db_file, plan)) for plan in PLANS]
        skyrl_rewards = [skyrl_reward(db_path, row, plan) for plan in PLANS]
    assert [reward for _, reward in oracle] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert oracle[5][0][1] != oracle[0][0][1]  # after the DELETE the same count answers differently
    for k in set(range(len(PLANS))) - WRITES:
        assert skyrl_rewards[k] == oracle[k][1], k  # the reward SkyRL's own environment computes
    assert skyrl_rewards[3] == 0.0  # SkyRL rolls the view back; the rollout's own database keeps it

    for epoch, (group,) in enumerate(epochs):
        by_plan = {plan_of(t["actions"][0]["content"]): t for t in group}
        assert sorted(by_plan) == list(range(len(PLANS)))
        for k, t in by_plan.items():
            observations, reward = oracle[k]
            assert t["observations"] == observations, (epoch, k)
            assert t["reward"] == reward, (epoch, k)
        graded_here = [t for t in group if not t["tvcache_graded_from_cache"]]
        if epoch == 0:
            assert len(graded_here) == FINAL_GRADES  # rollouts that end alike are graded once
            assert 0 < sum(t["tvcache_hits"] for t in group) < sum(t["tvcache_calls"] for t in group)
        else:
            assert not graded_here
            assert all(t["tvcache_hits"] == t["tvcache_calls"] for t in group)  # every call of epoch 2 hits


def test_task_ids_come_from_the_row_and_its_prompt() -> None:
    rows = example.dataset(2)  # two questions about one database with the same gold query
    assert rows[0]["env_extras"] == rows[1]["env_extras"]
    with tempfile.TemporaryDirectory() as db_path:
        config = DictConfig({"db_path": example.layout(db_path)})

        def task_of(row: dict[str, Any], max_turns: int) -> str:
            env = skyrl_gym.make("tvcache_text2sql", env_config=config, extras={**row["env_extras"], "max_turns": 3})
            env.init([dict(m) for m in row["prompt"]])
            task = env.tvcache_task()
            env.close()
            return str(task)

        first, again, other = task_of(rows[0], 3), task_of(rows[0], 7), task_of(rows[1], 3)
    assert first == again  # the same row in another epoch (and another generator setting)
    assert first != other  # another question


def test_a_failing_statement_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A runaway query times out: SkyRL's "SQL Timeout" observation, a failure that is never cached.
    monkeypatch.setattr(skyrl, "SQL_TIMEOUT", 0.5)  # a factory for this db_path is made with it
    (row,) = example.dataset(1)
    config = DictConfig({"db_path": example.layout(str(tmp_path))})
    slow = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
    for _ in range(2):
        env = skyrl_gym.make("tvcache_text2sql", env_config=config, extras=dict(row["env_extras"]))
        env.init(row["prompt"])
        observation = env.step(sql(slow))["observations"][0]["content"]
        metrics = env.get_metrics()
        env.close()
        assert observation.startswith(f"\n\n<observation>SQL Timeout:\n{slow}")
        assert metrics["tvcache_calls"] == 1 and metrics["tvcache_hits"] == 0
