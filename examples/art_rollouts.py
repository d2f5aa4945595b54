"""ART rollouts of an agent whose tools are methods of a Python object, cached by wrapping that object.

    pip install 'tvcache[art]'
    python examples/art_rollouts.py                      # a built-in scripted policy stands in for the model
    python examples/art_rollouts.py --plain              # the same rollouts without tvcache
    python examples/art_rollouts.py --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --rollouts 8

The rollout function is written as for ART alone: it makes the rollout's state (`Shop`, a shop's database and the
agent's answer), asks the model through `art.Model`'s client, runs the tool methods the model calls, and rewards the
answer the state holds. The one line tvcache adds is `shop = cached_tools(Shop(scenario))`: the tool calls of the
rollouts of a group that start from the same state are answered from the cache, each rollout's own writes included,
and the reward reads the object as a plain run would have left it.

Any OpenAI-compatible endpoint serves the model (the key from `OPENAI_API_KEY`), or without `--base-url` the one
stand-in, `ScriptedPolicy` (scripted_model.py): a chat-completions server on loopback answering from `PLANS`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from dataclasses import dataclass
from typing import Any

# ART imports LiteLLM, which would fetch a model price list from the internet at import; its bundled copy serves.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art

# examples/scripted_model.py: the stand-in for a model server, and the examples' command line
from scripted_model import ScriptedPolicy, policy_arguments

from tvcache.integrations import process_sync_cache
from tvcache.integrations.art import cached_tools, results


@dataclass(frozen=True)
class Scenario:
    question: str
    answer: str
    lines: tuple[tuple[int, str, float, int], ...]  # (order, item, price, quantity)


class Database:
    """A SQLite database in memory. tvcache copies the state by pickle: a connection pickles as its content."""

    def __init__(self, lines: tuple[tuple[int, str, float, int], ...]) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.db.execute("CREATE TABLE line(order_id INTEGER, item TEXT, price REAL, quantity INTEGER)")
        self.db.executemany("INSERT INTO line VALUES (?, ?, ?, ?)", lines)

    def __getstate__(self) -> bytes:
        return self.db.serialize()

    def __setstate__(self, content: bytes) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.db.deserialize(content)


class Shop:
    """The rollout's state, and its tools (the public methods)."""

    def __init__(self, scenario: Scenario) -> None:
        self.data = Database(scenario.lines)
        self.answer: str | None = None

    def sql(self, query: str) -> str:
        """Run one SQL statement on the shop's database (table `line(order_id, item, price, quantity)`)."""
        return json.dumps(self.data.db.execute(query).fetchall())

    def submit(self, answer: str) -> str:
        """Give the final answer."""
        self.answer = answer
        return "submitted"


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": method.__name__,
            "description": method.__doc__,
            "parameters": {"type": "object", "properties": {name: {"type": "string"}}, "required": [name]},
        },
    }
    for method, name in ((Shop.sql, "query"), (Shop.submit, "answer"))
]


async def rollout(model: art.Model, scenario: Scenario, cached: bool = True) -> art.Trajectory:
    shop = cached_tools(Shop(scenario)) if cached else Shop(scenario)  # ART alone: shop = Shop(scenario)
    client = model.openai_client()
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Answer from the shop's database with the tools."},
            {"role": "user", "content": scenario.question},
        ],
        tools=TOOLS,  # type: ignore[arg-type]
    )
    for _ in range(6):
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            tools=TOOLS,  # type: ignore[arg-type]
        )
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            break
        for tool_call in choice.message.tool_calls:
            try:
                if tool_call.function.name not in ("sql", "submit"):
                    raise LookupError(f"no tool {tool_call.function.name!r}")
                tool = getattr(shop, tool_call.function.name)
                content = tool(**json.loads(tool_call.function.arguments))
            except Exception as exc:  # the model sees what went wrong
                content = f"{type(exc).__name__}: {exc}"
            trajectory.messages_and_choices.append({"role": "tool", "tool_call_id": tool_call.id, "content": content})
    trajectory.reward = float(shop.answer == scenario.answer)
    if cached:
        found = results(shop)
        trajectory.metrics.update(tool_calls=len(found), tool_hits=sum(r.hit for r in found))
    return trajectory


TOTAL = "SELECT sum(price * quantity) FROM line WHERE order_id = 7"
# The plans of the built-in scripted policy, a rollout each in turn: add it up and answer; forget the quantities;
# the first plan with its query laid out otherwise (the same call to tvcache, so it hits); zero the order, then answer.
PLANS = [
    [[("sql", json.dumps({"query": TOTAL}))], [("submit", '{"answer": "13.0"}')]],
    [
        [("sql", json.dumps({"query": "SELECT sum(price) FROM line WHERE order_id = 7"}))],
        [("submit", '{"answer": "3.5"}')],
    ],
    [[("sql", '{ "query" :\n "' + TOTAL + '" }')], [("submit", '{"answer": "13.0"}')]],
    [
        [("sql", '{"query": "UPDATE line SET quantity = 0"}')],
        [("sql", json.dumps({"query": TOTAL}))],
        [("submit", '{"answer": "0.0"}')],
    ],
]
SCENARIO = Scenario(
    "What is the total value of order 7?", "13.0", ((7, "pen", 2.5, 4), (7, "pad", 1.0, 3), (8, "ink", 9.0, 1))
)


async def main(
    base_url: str | None = None,
    model_name: str = "scripted-policy",
    rollouts: int = 8,
    epochs: int = 2,
    cached: bool = True,
) -> list[list[art.Trajectory]]:
    """Run `epochs` steps of one group of `rollouts` on the scenario against the model server at `base_url` (without
    one, the built-in scripted policy); return the trajectories of each step."""
    if base_url is None:
        async with ScriptedPolicy(PLANS) as url:
            return await main(url, model_name, rollouts, epochs, cached)
    model = art.Model(
        name="tvcache-example",
        project="tvcache",
        inference_model_name=model_name,
        inference_base_url=base_url,
        inference_api_key=os.environ.get("OPENAI_API_KEY", "none"),
    )
    steps = []
    for epoch in range(epochs):
        (group,) = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, SCENARIO, cached) for _ in range(rollouts))], pbar_desc=f"epoch {epoch}"
        )
        steps.append(list(group.trajectories))
        line = f"epoch {epoch}: rewards {[t.reward for t in group.trajectories]}"
        if cached:
            hits, calls = (sum(int(t.metrics[k]) for t in group.trajectories) for k in ("tool_hits", "tool_calls"))
            line += f"; {hits} of {calls} tool calls hit"
        print(line)
    if cached:
        stats = process_sync_cache().stats()
        print(f"cache: {stats['calls']:.0f} calls, {stats['hits']:.0f} hits, {stats['executions']:.0f} executions")
    return steps


if __name__ == "__main__":
    args = policy_arguments(__doc__, uncached="--plain")
    asyncio.run(main(args.base_url, args.model, args.rollouts, args.epochs, args.cached))
