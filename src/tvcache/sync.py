"""A thin synchronous wrapper for agent loops that are not async (e.g. gym-style `env.step()`).

The cache runs on an event loop in a background thread; each method blocks until its coroutine there is done.
Use it from any number of threads: calls of one rollout must still be issued in order, as with the async API.

    cache = tvcache.SyncToolCache()
    with cache.rollout("task-17", boxes) as r:
        r.call("sql", {"query": "SELECT 1"}).output
    cache.close()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from .cache import ToolCache
from .calls import Tools
from .rollout import Result, Rollout, RolloutStats, _current
from .sandboxes.base import Sandboxes

__all__ = ["SyncRollout", "SyncToolCache"]

T = TypeVar("T")


class SyncRollout:
    """A `Rollout` driven from synchronous code (any thread but the cache's own); see `SyncToolCache.open`."""

    def __init__(self, owner: SyncToolCache, rollout: Rollout):
        self._owner, self._rollout = owner, rollout

    def call(self, tool: str, args: Mapping[str, Any] | str | None = None) -> Result:
        """`Rollout.call`, blocking until it answers."""
        return self._owner._run(self._rollout.call(tool, args))

    def grade(
        self, tool: str, args: Mapping[str, Any] | str | None = None, *, files: Mapping[str, str] | None = None
    ) -> Result:
        """`Rollout.grade`, blocking until it answers."""
        return self._owner._run(self._rollout.grade(tool, args, files=files))

    @property
    def detached(self) -> bool:
        """`Rollout.detached`."""
        return self._rollout.detached

    @property
    def stats(self) -> RolloutStats:
        """The rollout's own counts."""
        return self._rollout.stats

    @property
    def rollout(self) -> Rollout:
        """The async rollout underneath (its calls must run on the cache's loop: `rollout.loop`)."""
        return self._rollout

    def close(self) -> None:
        """End the rollout and close its sandbox. Idempotent."""
        self._owner._run(self._rollout.close())


class SyncToolCache:
    """`ToolCache` with blocking methods; takes the same arguments."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tvcache-loop", daemon=True)
        self._thread.start()

        async def make() -> ToolCache:
            return ToolCache(*args, **kwargs)

        self.cache = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def open(self, task: str, sandboxes: Sandboxes, tools: Tools | None = None) -> SyncRollout:
        """Start a rollout that outlives any one block of code (an env from `reset` to `close`, its steps on
        a thread pool); `close()` it when done."""
        return SyncRollout(self, self._run(self.cache.open(task, sandboxes, tools)))

    @contextmanager
    def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools | None = None) -> Iterator[SyncRollout]:
        """One rollout for the duration of a `with` block; inside it, `tvcache.current_rollout()` in this thread
        returns its async `Rollout`."""
        rollout = self.open(task, sandboxes, tools)
        token = _current.set(rollout.rollout)
        try:
            yield rollout
        finally:
            rollout.close()
            _current.reset(token)

    def prefetch(self, tasks: Iterable[str], sandboxes: Sandboxes, rollouts: int = 8) -> None:
        """Start warming sandboxes in the background and return at once."""
        self._run(self.cache.prefetch(list(tasks), sandboxes, rollouts))

    def stats(self) -> dict[str, float]:
        """`ToolCache.stats`."""
        return self.cache.stats()

    def close(self) -> None:
        """Close the cache and stop its background loop. Idempotent."""
        if self._loop.is_closed():
            return
        try:
            self._run(self.cache.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> SyncToolCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
