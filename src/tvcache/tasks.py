"""The cache's task group: every task a cache starts belongs to it, and nothing it owns is lost to cancellation.

Cancellation reaches a coroutine at any `await`. Three kinds of work must not stop half-way there:

- work that makes something someone must later free (a sandbox, a snapshot, a claim, a lease): `acquire` runs
  it to the end in a task of the group; if the caller was cancelled meanwhile, what it made is freed at once,
  so nothing is ever made that nobody owns;
- work that records such a thing (`add_snapshot` after `snapshot`): it runs in a task of its own, which
  cancelling its rollout does not reach;
- cleanup (closing a sandbox, releasing a claim): `cleanup` runs it to the end and never raises, so it cannot
  mask the outcome it cleans up after.

Background work (prefetch, claim refreshes) is `spawn`ed. `ToolCache.close()` cancels the background work and
then `join`s the group: when it returns, every task the cache started has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["TaskGroup"]

log = logging.getLogger("tvcache")

T = TypeVar("T")


class TaskGroup:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._background: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], *, background: bool = False) -> asyncio.Task[T]:
        """Start `coro` as a task of the group; `background` ones are cancelled by `cancel_background`."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if background:
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return task

    async def acquire(self, make: Coroutine[Any, Any, T], free: Callable[[T], Awaitable[Any]]) -> T:
        """What `make` makes, owned by the caller from the moment it exists. If the caller is cancelled
        while `make` runs, `make` still runs to its end and what it made is freed with `free`."""
        task = self.spawn(make)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda done: self._free_orphan(done, free))
            raise

    def _free_orphan(self, done: asyncio.Task[T], free: Callable[[T], Awaitable[Any]]) -> None:
        if not done.cancelled() and done.exception() is None:
            self.cleanup_soon(free(done.result()))

    async def cleanup(self, work: Awaitable[Any]) -> None:
        """Run `work` to its end even if the caller is cancelled; log, never raise, its failure."""
        await asyncio.shield(self.spawn(_quietly(work)))

    def cleanup_soon(self, work: Awaitable[Any]) -> asyncio.Task[None]:
        """`cleanup` without waiting for it (`join` does)."""
        return self.spawn(_quietly(work))

    def cancel_background(self) -> None:
        for task in list(self._background):
            task.cancel()

    async def join(self) -> None:
        """Wait until every task of the group has ended (including those started meanwhile, e.g. to free what
        a cancelled task made)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def _quietly(work: Awaitable[Any]) -> None:
    try:
        await work
    except Exception as exc:
        log.debug("cleanup step failed: %s", exc)
