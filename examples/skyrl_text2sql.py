"""SkyRL-SQL on tvcache: the `tvcache_text2sql` environment, driven the way SkyRL's generator drives environments.

    pip install 'tvcache[skyrl]'
    python examples/skyrl_text2sql.py --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --tasks 4

In skyrl-train, the change is one import and one config value (the rest of SkyRL-SQL stays as it is):

    import tvcache.integrations.skyrl       # in the entrypoint: registers env_class tvcache_text2sql
    environment.env_class=tvcache_text2sql  # instead of text2sql; skyrl_gym.text2sql.db_path as before

This script plays the generator's part on a few Spider questions (German, from the Spider-de data that ships with
tvcache: `tvcache_bench.data`):
per task a group of rollouts, each `skyrl_gym.make(...)` / `init` / `step` / `close` on a thread pool as
`SkyRLGymGenerator` runs them, the policy any OpenAI-compatible endpoint. Each environment reports its tool calls
and hits through `get_metrics()`, which SkyRL logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import skyrl_gym
from omegaconf import DictConfig
from openai import AsyncOpenAI

import tvcache.integrations.skyrl  # noqa: F401  # registers tvcache_text2sql
from tvcache.sandboxes.reclaim import scratch
from tvcache_bench.data import workload_path

SPIDER = workload_path("sql", "spider-de")  # the data that ships with tvcache, or $TVCACHE_WORKLOADS

SYSTEM = (
    "You are a data scientist answering questions about a SQLite database. Think inside <think>...</think>. "
    "To run one SQL statement, write it inside <sql>...</sql>; its result comes back inside "
    "<observation>...</observation>. When you know the answer, give your final query inside "
    "<solution>...</solution>."
)


def layout(directory: str, spider: Path = SPIDER) -> str:
    """A SkyRL-SQL `db_path` (`<db_path>/spider/database/<db_id>/<db_id>.sqlite`) over the shared Spider
    databases, by a symlink: the data is read in place."""
    (Path(directory) / "spider").mkdir(parents=True, exist_ok=True)
    link = Path(directory) / "spider" / "database"
    if not link.exists():
        link.symlink_to((spider / "database").resolve(), target_is_directory=True)
    return directory


def dataset(n: int, spider: Path = SPIDER) -> list[dict[str, Any]]:
    """SkyRL-SQL dataset rows for the first `n` Spider dev questions: the prompt, the env class, and the fields
    SkyRL hands the environment as `extras`."""
    rows = []
    for question in json.loads((spider / "dev.json").read_text())[:n]:
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Database: {question['db_id']}\nQuestion: {question['question']}"},
                ],
                "env_class": "tvcache_text2sql",
                "env_extras": {
                    "db_id": question["db_id"],
                    "data": "spider",
                    "reward_spec": {"method": "rule", "ground_truth": question["query"]},
                },
            }
        )
    return rows


async def trajectory(
    client: AsyncOpenAI,
    model: str,
    row: dict[str, Any],
    env_config: DictConfig,
    max_turns: int,
    pool: ThreadPoolExecutor,
) -> dict[str, Any]:
    """One trajectory, as SkyRL's generator runs it in text mode: the environment built from the row, each of
    its calls on the thread pool, the model's text as the action."""
    loop = asyncio.get_running_loop()
    extras = {**row["env_extras"], "max_turns": max_turns}
    env = skyrl_gym.make(row["env_class"], env_config=env_config, extras=extras)
    chat, _ = await loop.run_in_executor(pool, env.init, [dict(m) for m in row["prompt"]])
    observations, reward, done = [], 0.0, False
    try:
        while not done:
            response = await client.chat.completions.create(model=model, messages=chat)
            action = response.choices[0].message.content or ""
            step = await loop.run_in_executor(pool, env.step, action)
            chat = [*chat, {"role": "assistant", "content": action}, *step["observations"]]
            observations += [o["content"] for o in step["observations"]]
            reward, done = step["reward"], step["done"]
        return {"actions": env.chat_history, "observations": observations, "reward": reward, **env.get_metrics()}
    finally:
        await loop.run_in_executor(pool, env.close)


async def main(
    base_url: str, model: str, tasks: int = 4, rollouts: int = 8, epochs: int = 2, max_turns: int = 5
) -> list[list[list[dict[str, Any]]]]:
    """`epochs` passes over `tasks` questions, `rollouts` concurrent trajectories each; returns them per epoch
    and task."""
    client = AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
    with scratch("skyrl-example") as db_path, ThreadPoolExecutor(max_workers=rollouts) as pool:
        env_config = DictConfig({"db_path": layout(str(db_path))})  # skyrl_gym.tvcache_text2sql in SkyRL's config
        rows = dataset(tasks)
        epochs_out = []
        for epoch in range(epochs):
            groups = [
                await asyncio.gather(
                    *(trajectory(client, model, row, env_config, max_turns, pool) for _ in range(rollouts))
                )
                for row in rows
            ]
            epochs_out.append(groups)
            results = [t for group in groups for t in group]
            calls = sum(t["tvcache_calls"] for t in results)
            hits = sum(t["tvcache_hits"] for t in results)
            mean = sum(t["reward"] for t in results) / len(results)
            print(f"epoch {epoch}: mean reward {mean:.2f}, {hits} of {calls} SQL calls from the cache")
        return epochs_out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    asyncio.run(main(args.base_url, args.model, args.tasks, args.rollouts, args.epochs))
