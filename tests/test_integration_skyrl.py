"""SkyRL-gym: SkyRL's own `text2sql` environment next to `tvcache_text2sql`, both built by `skyrl_gym.make` and
stepped on a thread pool as SkyRL's generator steps them (the example's driver), on real Spider databases.

The parity harness: the same scripted actions, adversarial ones included (a write and then an answer that only the
write makes right, SQL errors, a statement that times out, malformed and repeated tags, two statements in one
action, a NUL byte, a huge result, more turns than allowed), and every step output (observations, reward, done,
metadata) equal byte for byte over two epochs, the second answered from the cache. The model is the one stand-in:
a scripted policy.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig

import tvcache

skyrl_gym = pytest.importorskip("skyrl_gym", reason="needs skyrl-gym (pip install 'tvcache[skyrl]')")

from frameworks import load_example  # noqa: E402
from tvcache.integrations import skyrl  # noqa: E402

example = load_example("skyrl_text2sql")
sql, solve = example.sql, example.solve
MAX_TURNS = 4
GOLD = "SELECT count(*) FROM sänger"  # question 0 of Spider-de dev: "Wie viele Sängerinnen und Sänger haben wir?"
TABLES = "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
SLOW = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
HUGE = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 2000) SELECT i, 'row ' || i FROM n"
PLANS = [
    [sql(TABLES), sql(GOLD), solve(GOLD)],  # right
    [sql(TABLES), solve("SELECT count(*) FROM stadion")],  # wrong table
    ["I will answer directly.", solve(GOLD)],  # an action without <sql>: SkyRL's "invalid" observation
    [sql("DELETE FROM sänger"), solve("SELECT 0")],  # the reward hack: a write, then the answer it would make right
    [sql("DELETE FROM sänger WHERE sänger_id > 2"), sql(GOLD), solve("SELECT 2")],  # a write, read back
    [sql("CREATE TEMP VIEW s AS SELECT * FROM sänger"), sql("SELECT count(*) FROM s"), solve("SELECT count(*) FROM s")],
    [sql("SELEC count(*) FROM sänger"), sql("SELECT 1; DELETE FROM sänger"), solve(GOLD)],  # SQL errors
    [sql("SELECT 'a\0b'"), sql(HUGE), solve(GOLD)],  # a NUL byte; a result SkyRL truncates to 50 rows
    [sql(TABLES) + sql(GOLD), "<sql>SELECT 1", solve(GOLD) + solve(GOLD)],  # two statements; unclosed; two answers
    [sql(TABLES)] * (MAX_TURNS + 1),  # never answers: the turn limit ends it
    [sql(SLOW), solve(GOLD)],  # a statement that runs into SkyRL's 5 s timeout
    [solve(GOLD + " ;")],  # answers at once
]
TIMEOUTS = 1


def run(env_class: str, epochs: int, db_path: str) -> list[list[dict[str, Any]]]:
    policy = example.ScriptedPolicy({}, PLANS)
    policy.golds = {row["prompt"][1]["content"]: GOLD for row in example.dataset(1)}
    result = asyncio.run(
        example.main(
            policy,
            tasks=1,
            rollouts=len(PLANS),
            epochs=epochs,
            max_turns=MAX_TURNS,
            env_classes=[env_class],
            db_path=db_path,
        )
    )
    return [group for (group,) in result[env_class]]


def test_tvcache_text2sql_steps_as_skyrl_text2sql_byte_for_byte(tmp_path: Path) -> None:
    (plain,) = run("text2sql", 1, str(tmp_path))  # one db_path: SkyRL's error messages name the database file
    cached = run("tvcache_text2sql", 2, str(tmp_path))
    rewards = [t["reward"] for t in plain]
    # Rewards as SkyRL pays them: the hack (plan 3) earns nothing, since SkyRL rolled the DELETE back.
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
    for epoch, group in enumerate(cached):
        for k, (mine, theirs) in enumerate(zip(group, plain, strict=True)):
            assert mine["steps"] == theirs["steps"], (epoch, k)
            assert [repr(s["reward"]) for s in mine["steps"]] == [repr(s["reward"]) for s in theirs["steps"]]
    texts = [o["content"] for t in plain for s in t["steps"] for o in s["observations"]]
    assert any("no such table: s" in t for t in texts) and any("Truncated to 50 lines" in t for t in texts)
    assert any(t.startswith(f"\n\n<observation>SQL Timeout:\n{SLOW}") for t in texts)
    assert any("the query contains a null character" in t for t in texts)
    first, second = cached
    calls = sum(t["tvcache_calls"] for t in second)
    assert sum(t["tvcache_hits"] for t in first) > 0  # plans repeat statements within the first epoch
    # The second epoch is answered from the cache, but for the statement that timed out (never cached).
    assert sum(t["tvcache_hits"] for t in second) == calls - TIMEOUTS
    assert all(t["tvcache_graded_from_cache"] for t in second if "tvcache_graded_from_cache" in t)


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


def test_the_sandbox_refuses_bad_calls_and_goes_on(tmp_path: Path) -> None:
    db_path = example.layout(str(tmp_path))

    async def go() -> list[tvcache.Outcome]:
        async with skyrl.Text2SQLSandboxes(f"{db_path}/spider/database", "concert_singer") as boxes:
            box = await boxes.create()
            calls = [("sql", {"query": 5}), ("sql", "not json"), ("bash", {"command": "ls"}), ("sql", {"query": GOLD})]
            return [await box.execute(tvcache.ToolCall(tool, args)) for tool, args in calls]

    *bad, good = asyncio.run(go())
    assert all(o.error and o.changed is False and str(o.output).startswith("Error: the skyrl-sql") for o in bad)
    assert not good.error and "6" in str(good.output)


def test_the_example_runs_without_arguments() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(skyrl.__file__).parents[2]), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(Path(example.__file__))], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["text2sql"] * 2 + ["tvcache_text2sql"] * 2
    assert lines[0].split("rewards")[1] == lines[2].split("rewards")[1].split(";")[0]  # the same rewards
    assert lines[3].endswith("SQL calls from the cache") and "of" in lines[3]
