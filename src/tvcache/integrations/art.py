"""ART (OpenPipe's Agent Reinforcement Trainer): rollout functions whose tool calls go through tvcache.

    import art, tvcache
    from tvcache.integrations.art import cached_rollout

    @cached_rollout(sandboxes=boxes, cache=cache)
    async def rollout(model: art.Model, scenario: Scenario) -> art.Trajectory:
        r = tvcache.current_rollout()                     # this rollout, at its scenario's task
        ...
        for tool_call in choice.message.tool_calls:       # as the model emitted them
            result = await r.call(*tvcache.parse_tool_call(tool_call))
        reward = (await r.grade("bash", {"command": "pytest -q"})).output

    groups = await art.gather_trajectory_groups(
        art.TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios
    )

The decorator opens a tvcache rollout around each call of the rollout function, so everything the function does
through `tvcache.current_rollout()` (or `ToolFunctions` wrappers, which find it themselves) is cached. The task
id comes from the scenario argument: `task_key(scenario)`, a hash of its content, the same for the eight rollouts
of a group and in every epoch, different for different scenarios; pass `task=` to use the scenario's own id.
`sandboxes` may be a function of the scenario (a database per scenario, say); it must return the same factory
object for the same scenario, since a factory's snapshots can be restored only by it (`process_sandboxes`).

Nothing here imports ART: the rollout function is ART's, the decorator only frames it. Install ART with
`pip install 'tvcache[art]'`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from ..cache import ToolCache
from ..calls import Tools
from ..sandboxes.base import Sandboxes
from .keys import task_key
from .process import process_cache

__all__ = ["cached_rollout"]

P = ParamSpec("P")
R = TypeVar("R")


def cached_rollout(
    sandboxes: Sandboxes | Callable[[Any], Sandboxes],
    *,
    cache: ToolCache | None = None,
    task: Callable[[Any], str] = task_key,
    tools: Tools | None = None,
    scenario: str = "scenario",
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Decorate an ART rollout function `async def rollout(model, scenario, ...)` so that each call runs inside
    a tvcache rollout of the scenario's task.

    - `sandboxes`: the sandbox factory, or a function of the scenario returning it.
    - `cache`: default `process_cache()` (the `TVCACHE_URL` store, else memory).
    - `task`: the task id of a scenario (default: a hash of its content).
    - `tools`: annotations of the tools (read-only, uncacheable, key functions).
    - `scenario`: the name of the rollout function's parameter that holds the scenario.
    """

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{fn.__qualname__} must be an async rollout function (async def)")
        signature = inspect.signature(fn)
        if scenario not in signature.parameters:
            raise TypeError(
                f"{fn.__qualname__} has no parameter {scenario!r} to take the task from; "
                f"name it with cached_rollout(..., scenario='...')"
            )

        @functools.wraps(fn)
        async def rollout(*args: P.args, **kwargs: P.kwargs) -> R:
            given = signature.bind(*args, **kwargs)
            given.apply_defaults()
            value = given.arguments[scenario]
            boxes = sandboxes if isinstance(sandboxes, Sandboxes) else sandboxes(value)
            async with (cache or process_cache()).rollout(task(value), boxes, tools):
                return await fn(*args, **kwargs)

        return rollout

    return decorate
