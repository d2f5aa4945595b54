"""SkyRL-SQL on tvcache: the `tvcache_text2sql` environment, driven the way SkyRL's generator drives environments.

    pip install 'tvcache[skyrl]'
    python examples/skyrl_text2sql.py                      # a built-in scripted policy, no model needed
    python examples/skyrl_text2sql.py --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --tasks 4

In skyrl-train, the change is one import and one config value (the rest of SkyRL-SQL stays as it is):

    import tvcache.integrations.skyrl       # in the entrypoint: registers env_class tvcache_text2sql
    environment.env_class=tvcache_text2sql  # instead of text2sql; skyrl_gym.text2sql.db_path as before

This script plays the generator's part on a few Spider questions (German, from the Spider-de data that ships with
tvcache: `tvcache_bench.data`):
per task a group of rollouts, each `skyrl_gym.make(...)` / `init` / `step` / `close` on a thread pool as
`SkyRLGymGenerator` runs them, first with SkyRL's own `text2sql`, then with `tvcache_text2sql`, and prints each
one's rewards and, for tvcache, the SQL calls answered from the cache (reported by `get_metrics()`, which SkyRL
logs). The policy is any OpenAI-compatible endpoint, or without `--base-url` a scripted one (`ScriptedPolicy`)
whose plans include a rollout that deletes the table and then answers with an empty count: SkyRL rolls the
delete back and pays 0, and so does tvcache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import skyrl_gym
from omegaconf import DictConfig

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
                "env_extras": {
                    "db_id": question["db_id"],
                    "data": "spider",
                    "reward_spec": {"method": "rule", "ground_truth": question["query"]},
                },
            }
        )
    return rows


class Policy(Protocol):
    async def act(self, chat: list[dict[str, str]], rollout: int) -> str:
        """The model's next action for rollout number `rollout` of its group, given the conversation so far."""
        ...


class OpenAIPolicy:
    """A model behind an OpenAI-compatible endpoint (vLLM, SGLang, ...)."""

    def __init__(self, base_url: str, model: str) -> None:
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
        self.model = model

    async def act(self, chat: list[dict[str, str]], rollout: int) -> str:
        response = await self.client.chat.completions.create(model=self.model, messages=chat)  # type: ignore[arg-type]
        return response.choices[0].message.content or ""


def sql(statement: str) -> str:
    return f"<think>Let me look.</think>\n<sql>{statement}</sql>"


def solve(statement: str) -> str:
    return f"<think>I know it now.</think>\n<solution>{statement}</solution>"


class ScriptedPolicy:
    """Rollout k of a group follows `plans[k % len(plans)]`, one action per turn (the gold query of the user's
    question stands in for `{gold}`); after its plan it answers with the gold query."""

    PLANS: Sequence[Sequence[str]] = (
        (sql("SELECT name FROM sqlite_master WHERE type = 'table'"), solve("{gold}")),
        (solve("{gold}"),),
        (sql("SELEC oops"), solve("{gold}")),
        ("I will answer directly.", solve("SELECT 1")),
        (sql("DELETE FROM {table}"), solve("SELECT 0")),  # a reward hack that SkyRL's rollback defeats
    )

    def __init__(self, golds: dict[str, str], plans: Sequence[Sequence[str]] = PLANS) -> None:
        self.golds, self.plans = golds, plans

    async def act(self, chat: list[dict[str, str]], rollout: int) -> str:
        gold = self.golds[chat[1]["content"]]
        plan = self.plans[rollout % len(self.plans)]
        turn = sum(m["role"] == "assistant" for m in chat)
        action = plan[turn] if turn < len(plan) else solve("{gold}")
        return action.replace("{gold}", gold).replace("{table}", gold.split("FROM ")[1].split()[0])


async def trajectory(
    policy: Policy,
    rollout: int,
    row: dict[str, Any],
    env_class: str,
    env_config: DictConfig,
    max_turns: int,
    pool: ThreadPoolExecutor,
) -> dict[str, Any]:
    """One trajectory, as SkyRL's generator runs it in text mode: the environment built from the row, each of
    its calls on the thread pool, the model's text as the action. Returns every step's output and the metrics."""
    loop = asyncio.get_running_loop()
    extras = {**row["env_extras"], "max_turns": max_turns}
    env = skyrl_gym.make(env_class, env_config=env_config, extras=extras)
    chat, _ = await loop.run_in_executor(pool, env.init, [dict(m) for m in row["prompt"]])
    steps: list[dict[str, Any]] = []
    try:
        while not steps or not steps[-1]["done"]:
            action = await policy.act(chat, rollout)
            step = await loop.run_in_executor(pool, env.step, action)
            chat = [*chat, {"role": "assistant", "content": action}, *step["observations"]]
            steps.append(dict(step))
        return {"steps": steps, "reward": steps[-1]["reward"], **env.get_metrics()}
    finally:
        await loop.run_in_executor(pool, env.close)


ENV_CLASSES = ("text2sql", "tvcache_text2sql")


async def main(
    policy: Policy | None = None,
    tasks: int = 2,
    rollouts: int = 5,
    epochs: int = 2,
    max_turns: int = 5,
    env_classes: Sequence[str] = ENV_CLASSES,
    db_path: str | None = None,
) -> dict[str, list[list[list[dict[str, Any]]]]]:
    """`epochs` passes over `tasks` questions, `rollouts` concurrent trajectories each, with each environment class;
    returns the trajectories per class, epoch and task. `db_path`: SkyRL's `db_path` (default a scratch directory
    of links to the shared Spider databases)."""
    rows = dataset(tasks)
    if policy is None:
        golds = {row["prompt"][1]["content"]: row["env_extras"]["reward_spec"]["ground_truth"] for row in rows}
        policy = ScriptedPolicy(golds)
    out: dict[str, list[list[list[dict[str, Any]]]]] = {}
    with scratch("skyrl-example") as own, ThreadPoolExecutor(max_workers=rollouts) as pool:
        env_config = DictConfig({"db_path": layout(db_path or str(own))})  # skyrl_gym.text2sql in SkyRL's config
        for env_class in env_classes:
            out[env_class] = []
            for epoch in range(epochs):
                groups = [
                    await asyncio.gather(
                        *(trajectory(policy, k, row, env_class, env_config, max_turns, pool) for k in range(rollouts))
                    )
                    for row in rows
                ]
                out[env_class].append(groups)
                results = [t for group in groups for t in group]
                rewards = [[t["reward"] for t in group] for group in groups]
                line = f"{env_class:16} epoch {epoch}: rewards {rewards}"
                if "tvcache_calls" in results[0]:
                    calls = sum(t["tvcache_calls"] for t in results)
                    hits = sum(t["tvcache_hits"] for t in results)
                    line += f"; {hits} of {calls} SQL calls from the cache"
                print(line, flush=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint; without it, a scripted policy plays")
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    chosen = OpenAIPolicy(args.base_url, args.model) if args.base_url else None
    asyncio.run(main(chosen, args.tasks, args.rollouts, args.epochs))
