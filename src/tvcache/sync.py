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
import inspect
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

from .cache import State, ToolCache
from .calls import Tools
from .rollout import Result, Rollout, RolloutStats, _current
from .sandboxes.base import Sandboxes

__all__ = ["SyncRollout", "SyncToolCache"]

T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S")


def _takes_the_arguments_of(
    target: Callable[P, Any],
) -> Callable[[Callable[Concatenate[S, ...], None]], Callable[Concatenate[S, P], None]]:
    """Give the decorated `__init__` the signature of `target`, for type checkers and `help()` alike."""

    def give(init: Callable[Concatenate[S, ...], None]) -> Callable[Concatenate[S, P], None]:
        init.__signature__ = inspect.signature(target.__init__)  # type: ignore[attr-defined]
        return init

    return give


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
    """`ToolCache` with blocking methods; takes the same arguments, and has the same life (`state`): use after
    `close()` raises `RuntimeError`, closing twice does nothing, `with` enters it once."""

    @_takes_the_arguments_of(ToolCache)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tvcache-loop", daemon=True)
        self._thread.start()

        async def make() -> ToolCache:
            return ToolCache(*args, **kwargs)

        try:
            self.cache = self._run(make())
        except BaseException:
            self._stop()
            raise

    @property
    def state(self) -> State:
        return self.cache.state

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this SyncToolCache is closed; make a new one")
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

    def flush(self) -> None:
        """`ToolCache.flush`: wait for the snapshots under way."""
        self._run(self.cache.flush())

    def close(self) -> None:
        """Close the cache and stop its thread. Idempotent."""
        if self._loop.is_closed():
            return
        try:
            self._run(self.cache.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncToolCache:
        self._run(self.cache.__aenter__())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
