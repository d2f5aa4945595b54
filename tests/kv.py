"""A small stateful tool world for the core tests: a key-value "filesystem" run in PythonSandboxes.

Reads are not annotated: the sandbox observes that they leave the state untouched (pickle digest), so they
become memos by observation. `delay` lets tests shuffle the interleaving of concurrent rollouts.
`observed_sandboxes()` runs the same tools saying what each read and wrote (reuse by what a call read).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import tvcache
from tvcache import ToolCall
from tvcache.sandboxes.python import Observed, ObservedPythonSandboxes

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


# What each tool reads and writes: a key's value, and the listing ("*", the sorted keys), which a write or delete
# reads too, since the listing it leaves depends on the one it found.
_TOUCHES = {
    "read": (True, False, False),  # (reads the key, touches the listing, writes)
    "list": (False, True, False),
    "write": (False, True, True),
    "append": (True, True, True),
    "delete": (True, True, True),
}


async def run_observed(state: dict[str, str], call: ToolCall) -> Observed:
    output = await run(state, call)
    key_read, listing, writes = _TOUCHES[call.tool]
    touched = ([f"key:{call.args['key']}"] if key_read or writes else []) + (["*"] if listing else [])
    reads = [k for k in touched if key_read or k == "*"]
    return Observed(output, reads, touched if writes else ())


def digest(state: dict[str, str], key: str) -> str:
    if key == "*":
        return repr(sorted(state))
    value = state.get(key.removeprefix("key:"))
    return "" if value is None else "=" + value


def observed_sandboxes(fingerprint: str = "kv-v1") -> Any:
    return ObservedPythonSandboxes(dict, run_observed, fingerprint, digest=digest)


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
