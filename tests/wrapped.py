"""A strategy for replay tests: no cache, with every call passed through a function first."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from tvcache import Result, Tools
from tvcache.sandboxes.base import Sandboxes
from tvcache_bench.strategies import NoCacheStrategy, StrategyRollout

Before = Callable[[str, Mapping[str, Any]], Awaitable[Mapping[str, Any]]]


class Wrapped(NoCacheStrategy):
    """No cache, named `name`; each call's arguments go through `before(tool, args)` (which may pause, or rewrite
    them) and the call runs with what it returns."""

    def __init__(self, name: str, before: Before):
        super().__init__()
        self.name = name
        self._before = before

    @contextlib.asynccontextmanager
    async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools) -> AsyncIterator[StrategyRollout]:
        before = self._before
        async with super().rollout(task, sandboxes, tools) as inner:

            class Passed:
                stats = inner.stats

                async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result:
                    return await inner.call(tool, await before(tool, args or {}))

            yield Passed()
