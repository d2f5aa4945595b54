"""A tool-calling loop of one's own around an OpenAI-style chat model, its Python tools cached with tvcache.

    pip install 'tvcache[examples]'
    python examples/custom_loop.py                      # a built-in scripted policy stands in for the model
    python examples/custom_loop.py --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --rollouts 8

The tools are plain methods of a class over tau-bench's airline database (shipped with tvcache): an
instance per sandbox is the state they read and change. `tvcache.ToolFunctions(AirlineDesk)` turns them into
sandboxes, and its wrappers keep their names, docstrings and signatures (without `self`), from which the loop
builds the tool schemas the model sees. The model's tool calls go to the rollout as it emitted them
(`tvcache.parse_tool_call`: the name, and the arguments as a JSON string); the reward, whether the reservation ends
cancelled, is computed on the final state by a grading method, once per distinct final state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

import pydantic
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion

import tvcache
from tvcache_bench.data import workload_path

DATA = workload_path("tau-airline")  # the data that ships with tvcache, or $TVCACHE_WORKLOADS
_tables: dict[str, dict[str, Any]] = {}


def tables() -> dict[str, dict[str, Any]]:
    """The airline database, loaded once per process."""
    if not _tables:
        for name in ("flights", "reservations", "users"):
            _tables[name] = json.loads((DATA / f"{name}.json").read_text())
    return _tables


class AirlineDesk:
    """An airline's customer-service tools. The instance is the state: the tables, of which a sandbox gets its
    own copy. Tools never change a record in place (a write stores a changed copy), so a copy of the tables
    (not of every record) is a faithful fork."""

    def __init__(self) -> None:
        self.db = {name: dict(rows) for name, rows in tables().items()}

    def __deepcopy__(self, memo: dict[int, Any]) -> AirlineDesk:
        fork = AirlineDesk.__new__(AirlineDesk)
        fork.db = {name: dict(rows) for name, rows in self.db.items()}
        return fork

    def get_reservation_details(self, reservation_id: str) -> str:
        """The details of a reservation: flights, passengers, payment, status."""
        found = self.db["reservations"].get(reservation_id)
        return json.dumps(found) if found else f"Error: no reservation {reservation_id}"

    def search_direct_flight(self, origin: str, destination: str, date: str) -> str:
        """Direct flights between two airports (IATA codes) on a date (YYYY-MM-DD) that are still available."""
        flights = [
            {"flight_number": f["flight_number"], **f["dates"][date]}
            for f in self.db["flights"].values()
            if f["origin"] == origin and f["destination"] == destination and date in f["dates"]
        ]
        return json.dumps([f for f in flights if f.get("status") == "available"])

    def cancel_reservation(self, reservation_id: str) -> str:
        """Cancel a reservation."""
        found = self.db["reservations"].get(reservation_id)
        if found is None:
            return f"Error: no reservation {reservation_id}"
        if found.get("status") == "cancelled":
            return "Error: the reservation is already cancelled"
        self.db["reservations"][reservation_id] = {**found, "status": "cancelled"}
        return f"Reservation {reservation_id} cancelled"

    def grade_cancelled(self, reservation_id: str) -> float:
        """The reward (not a tool of the model's): 1 if the reservation ends cancelled."""
        return float(self.db["reservations"].get(reservation_id, {}).get("status") == "cancelled")


# Whether a call changed the state, from the call and its answer (instead of pickling the database every call):
# only a cancellation that went through ("Reservation X cancelled"); errors change nothing.
TOOLS = tvcache.ToolFunctions(
    AirlineDesk,
    changed=lambda call, output: call.tool == "cancel_reservation" and str(output).startswith("Reservation "),
)
MODEL_TOOLS = ("get_reservation_details", "search_direct_flight", "cancel_reservation")


def schema(name: str) -> dict[str, Any]:
    """An OpenAI tool schema from a wrapper's signature and docstring."""
    fn = TOOLS[name]
    parameters = pydantic.TypeAdapter(fn).json_schema()
    parameters.pop("additionalProperties", None)
    return {"type": "function", "function": {"name": name, "description": fn.__doc__, "parameters": parameters}}


class ScriptedPolicy:
    """Stands in for a model server when none is given: answers `client.chat.completions.create` with the
    completions a model would send (OpenAI's own types), each rollout following one of `PLANS` in turn."""

    # Per plan, per turn, the tool calls the "model" makes: look then cancel, only look, cancel at once, search then
    # cancel twice (the second is told it is already cancelled), an unknown reservation, malformed arguments.
    PLANS: list[list[list[tuple[str, str]]]] = [
        [
            [("get_reservation_details", '{"reservation_id": "4WQ150"}')],
            [("cancel_reservation", '{"reservation_id": "4WQ150"}')],
        ],
        [[("get_reservation_details", '{"reservation_id": "4WQ150"}')]],
        [[("cancel_reservation", '{"reservation_id": "4WQ150"}')]],
        [
            [("search_direct_flight", '{"origin": "DFW", "destination": "LAX", "date": "2024-05-22"}')],
            [("cancel_reservation", '{"reservation_id": "4WQ150"}')],
            [("cancel_reservation", '{"reservation_id": "4WQ150"}')],
        ],
        [[("cancel_reservation", '{"reservation_id": "NOSUCH"}')]],
        [[("cancel_reservation", '{"reservation_id": 4WQ150}')]],
    ]

    def __init__(self) -> None:
        self.chat = self
        self.completions = self
        self._plans: dict[int, list[list[tuple[str, str]]]] = {}  # a rollout's messages list -> its plan
        self._started = 0

    async def create(self, *, model: str, messages: list[Any], tools: list[Any]) -> ChatCompletion:
        turn = sum(m["role"] == "assistant" for m in messages)
        if turn == 0:  # a new rollout: the next plan
            self._plans[id(messages)] = self.PLANS[self._started % len(self.PLANS)]
            self._started += 1
        plan = self._plans[id(messages)]
        calls = [
            {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(plan[turn] if turn < len(plan) else [])
        ]
        message = {
            "role": "assistant",
            "content": None if calls else "Done.",
            **({"tool_calls": calls} if calls else {}),
        }
        return ChatCompletion.model_validate(
            {
                "id": f"scripted-{turn}",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            }
        )


async def rollout(
    cache: tvcache.ToolCache, client: AsyncOpenAI | ScriptedPolicy, model: str, task: dict[str, str], max_turns: int = 8
) -> dict[str, Any]:
    """One rollout of `task` ({"id", "request", "reservation_id"}): the loop, then the reward on the final state."""
    async with cache.rollout(task["id"], TOOLS.sandboxes) as r:
        messages: list[Any] = [
            {"role": "system", "content": "You are an airline's customer-service agent. Use the tools."},
            {"role": "user", "content": task["request"]},
        ]
        results = []
        for _ in range(max_turns):
            response = await client.chat.completions.create(
                model=model, messages=messages, tools=[schema(n) for n in MODEL_TOOLS]
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                result = await r.call(*tvcache.parse_tool_call(call))
                results.append(result)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result.output)})
        graded = await r.grade("grade_cancelled", {"reservation_id": task["reservation_id"]})
        return {"messages": messages, "results": results, "reward": graded.output, "graded": graded}


async def main(
    base_url: str | None = None, model: str = "scripted-policy", rollouts: int = 8, epochs: int = 2
) -> list[list[dict[str, Any]]]:
    """`epochs` groups of `rollouts` concurrent rollouts of one request, against the model server at `base_url`
    (without one, the built-in scripted policy); prints each epoch's rewards and cache figures, returns the
    rollouts per epoch."""
    client: AsyncOpenAI | ScriptedPolicy = (
        AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
        if base_url
        else ScriptedPolicy()
    )
    task = {
        "id": "cancel-4WQ150",
        "request": "Hi, I'm Chen Jackson. Please cancel my reservation 4WQ150.",
        "reservation_id": "4WQ150",
    }
    async with tvcache.ToolCache() as cache:
        groups = []
        for epoch in range(epochs):
            group = await asyncio.gather(*(rollout(cache, client, model, task) for _ in range(rollouts)))
            groups.append(group)
            hits = sum(r.hit for g in group for r in g["results"])
            calls = sum(len(g["results"]) for g in group)
            graded = sum(not g["graded"].hit for g in group)
            print(
                f"epoch {epoch}: rewards {[g['reward'] for g in group]}; {hits} of {calls} tool calls hit; "
                f"{graded} of {len(group)} gradings executed"
            )
        stats = cache.stats()
        print(
            f"cache: {stats['calls']:.0f} calls, {stats['hits']:.0f} hits, {stats['executions']:.0f} executions, "
            f"{stats['seconds_saved'] * 1e3:.1f} ms of tool time saved"
        )
        return groups


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an OpenAI-compatible server (default: a built-in scripted policy)")
    parser.add_argument("--model", default="scripted-policy", help="the model the server serves")
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    if args.base_url and args.model == "scripted-policy":
        parser.error("--base-url needs --model: the model the server serves")
    asyncio.run(main(args.base_url, args.model, args.rollouts, args.epochs))
