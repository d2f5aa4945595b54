"""A small stateful tool world for the core tests: a key-value "filesystem" run in PythonSandboxes.

Reads are not annotated: the sandbox observes that they leave the state untouched (pickle digest), so they
become memos by observation. `delay` lets tests shuffle the interleaving of concurrent rollouts.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import tvcache
from tvcache import ToolCall

KEYS = ["a", "b", "c"]


async def run(state: dict[str, str], call: ToolCall) -> Any:
    delay = call.args.get("delay", 0.0)
    if delay:
        await asyncio.sleep(delay)
    key = call.args.get("key", "")
    match call.tool:
        case "read":
            return state.get(key, "<missing>")
        case "list":
            return sorted(state)
        case "write":
            state[key] = call.args["value"]
            return "ok"
        case "append":
            state[key] = state.get(key, "") + call.args["value"]
            return len(state[key])
        case "delete":
            return "deleted" if state.pop(key, None) is not None else "no such key"
    raise ValueError(f"unknown tool {call.tool!r}")


def drop_delay(args: dict[str, Any]) -> dict[str, Any]:
    args.pop("delay", None)
    return args


TOOLS = tvcache.Tools(key={t: drop_delay for t in ("read", "list", "write", "append", "delete")})


def sandboxes(fingerprint: str = "kv-v1") -> Any:
    return tvcache.PythonSandboxes(make=dict, run=run, fingerprint=fingerprint)


def random_call(rng: random.Random) -> tuple[str, dict[str, Any]]:
    tool = rng.choice(["read", "read", "list", "write", "append", "delete"])
    args: dict[str, Any] = {"key": rng.choice(KEYS)}
    if tool in ("write", "append"):
        args["value"] = rng.choice(["x", "y"])
    if tool == "list":
        args = {}
    return tool, args


async def execute_uncached(
    factory: Any, calls: Sequence[tuple[str, dict[str, Any]]], tools: tvcache.Tools
) -> list[Any]:
    """The oracle: a rollout's full history executed in one fresh sandbox, no cache involved."""
    box = await factory.create()
    try:
        return [(await box.execute(tools.call(tool, args))).output for tool, args in calls]
    finally:
        await box.close()
