"""ToolCache: a store, the sandboxes' measured costs, warm pools and stats, shared by its rollouts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from typing import Any

from .calls import Tools
from .context import Context, OnStoreError
from .graph import Scope
from .rollout import Rollout, _current
from .sandboxes.base import Sandbox, Sandboxes
from .stats import Stats
from .stores import Store, open_store
from .stores.base import StoreError
from .warm import WarmPool

__all__ = ["ToolCache"]

log = logging.getLogger("tvcache")


class ToolCache:
    """A stateful tool-value cache.

        cache = ToolCache()                           # embedded, in memory
        cache = ToolCache("sqlite:///runs/cache.db")  # embedded, durable across restarts

    `namespace` separates unrelated runs sharing a store. `snapshot_budget` bounds the snapshots kept per
    task. `claim_ttl` is how long a claim on a miss lasts without being refreshed (a claimant that died
    is taken over after it); `lease_ttl` the same for a lease on a snapshot being restored. Outputs larger
    than `max_output_bytes` are returned but not cached. `prefetch` keeps at most `warm_limit` warm sandboxes,
    closing the oldest unused ones beyond it.

    When the store fails (unreachable, wrong token, a dead Redis), `on_store_error="continue"` (the default)
    runs calls without the cache, counts them in `stats()["store_errors"]` and logs a rate-limited summary;
    `"raise"` lets the `StoreError` reach the caller, for runs that must not go on uncached. `check_store=True`
    pings the store before the first rollout starts and raises `StoreError` if it does not answer (`await
    cache.check()` does the same at any time).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        store: Store | None = None,
        namespace: str = "default",
        snapshot_budget: int = 32,
        claim_ttl: float = 30.0,
        lease_ttl: float = 600.0,
        max_output_bytes: int = 16 << 20,
        prefetch_concurrency: int = 4,
        warm_limit: int = 64,
        on_store_error: OnStoreError = "continue",
        check_store: bool = False,
    ):
        if store is not None and url is not None:
            raise ValueError("pass a store URL or a Store object, not both")
        if snapshot_budget < 0 or claim_ttl <= 0 or lease_ttl <= 0 or prefetch_concurrency < 1:
            raise ValueError("snapshot_budget must be >= 0, the ttls > 0 and prefetch_concurrency >= 1")
        if on_store_error not in ("continue", "raise"):
            raise ValueError(f"on_store_error must be 'continue' or 'raise', got {on_store_error!r}")
        self.namespace = namespace
        self._ctx = Context(
            store=store if store is not None else open_store(url),
            stats=Stats(),
            warm=WarmPool(warm_limit),
            claim_ttl=claim_ttl,
            lease_ttl=lease_ttl,
            snapshot_budget=snapshot_budget,
            max_output_bytes=max_output_bytes,
            on_store_error=on_store_error,
        )
        self._unchecked = check_store
        self._prefetch_limit = asyncio.Semaphore(prefetch_concurrency)
        self._pending: Counter[tuple[str, str]] = Counter()  # prefetches under way, by (origin, scope or snapshot)
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def store(self) -> Store:
        """The store the graph lives in."""
        return self._ctx.store

    def scope(self, task: str, sandboxes: Sandboxes) -> Scope:
        """The scope of `task`'s graph: this cache's namespace, the task id and the sandboxes' fingerprint."""
        return Scope(self.namespace, task, sandboxes.fingerprint)

    async def check(self) -> None:
        """Ping the store; raise `StoreError` saying what is wrong if it does not answer."""
        try:
            await self._ctx.store.ping()
        except StoreError as exc:
            raise StoreError(f"the cache store does not answer: {exc}") from exc

    @contextlib.asynccontextmanager
    async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools | None = None) -> AsyncIterator[Rollout]:
        """One rollout of `task`; its sandbox, if it made one, is closed on exit (also on errors). Inside the
        block, `tvcache.current_rollout()` returns it."""
        rollout = await self.open(task, sandboxes, tools)
        token = _current.set(rollout)
        try:
            yield rollout
        finally:
            _current.reset(token)
            await rollout.close()

    async def open(self, task: str, sandboxes: Sandboxes, tools: Tools | None = None) -> Rollout:
        """A rollout that outlives any one block of code (an environment from its setup to its cleanup, in
        other tasks); `await rollout.close()` it when done. `tvcache.current_rollout()` does not return it."""
        if self._unchecked:
            await self.check()
            self._unchecked = False
        return Rollout(self._ctx, self.scope(task, sandboxes), sandboxes, tools)

    def stats(self) -> dict[str, float]:
        """The cache's counters: calls, hits, executions, waits, replays, snapshots, store_errors, seconds_saved,
        ... (see the Getting started page's Stats section)."""
        return self._ctx.stats.as_dict()

    async def prefetch(self, tasks: Iterable[str], sandboxes: Sandboxes, rollouts: int = 8) -> asyncio.Task[int]:
        """Warm sandboxes for the next step's tasks, in the background: up to `rollouts` fresh ones per task
        and one restored fork of each snapshot the graph holds for it. Rollouts that miss take warm ones first.

        Returns at once with the background `asyncio.Task`; its result is the number of sandboxes made. Awaiting
        it is optional (a step usually runs while it works); `close()` cancels what is still under way and
        closes the warm sandboxes nobody took.
        """
        origin = self._ctx.factories[sandboxes].origin
        warm, jobs = self._ctx.warm, []
        for task in tasks:
            scope_key = self.scope(task, sandboxes).key
            pending = (origin, scope_key)
            missing = rollouts - warm.count(("fresh", origin, scope_key)) - self._pending[pending]
            jobs += [self._warm_fresh(sandboxes, origin, scope_key) for _ in range(max(0, missing))]
            self._pending[pending] += max(0, missing)
            try:
                records = await self._ctx.store.snapshots(scope_key, origin)
            except StoreError as exc:
                self._ctx.store_failed(exc)
                continue
            for record in records:
                pending = (origin, record.snapshot_id)
                if warm.count(("fork", origin, record.snapshot_id)) + self._pending[pending] == 0:
                    self._pending[pending] += 1
                    jobs.append(self._warm_fork(sandboxes, origin, scope_key, record.node, record.snapshot_id))

        # Each job is a task of its own from the start, so `close()` can cancel any of them at any point.
        started = [self._track(asyncio.create_task(job)) for job in jobs]

        async def run() -> int:
            made = await asyncio.gather(*started, return_exceptions=True)
            return sum(1 for m in made if m is True)

        return self._track(asyncio.create_task(run()))

    def _track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _warm_fresh(self, sandboxes: Sandboxes, origin: str, scope_key: str) -> bool:
        try:
            async with self._prefetch_limit:
                box = await sandboxes.create()
            await self._ctx.warm.put(("fresh", origin, scope_key), box)
            return True
        finally:
            self._pending[(origin, scope_key)] -= 1

    async def _warm_fork(self, sandboxes: Sandboxes, origin: str, scope_key: str, node: bytes, snap: str) -> bool:
        store = self._ctx.store
        try:
            async with self._prefetch_limit:
                lease = await store.lease(scope_key, origin, [node], self._ctx.lease_ttl)
                if lease is None or lease.snapshot_id != snap:
                    return False  # evicted meanwhile
                try:
                    box: Sandbox = await sandboxes.restore(snap)
                finally:
                    await store.unlease(scope_key, lease.token)
            await self._ctx.warm.put(("fork", origin, snap), box)
            return True
        finally:
            self._pending[(origin, snap)] -= 1

    async def close(self) -> None:
        """Stop prefetching, close warm sandboxes nobody took, and close the store."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._ctx.warm.close()
        await self._ctx.store.close()

    async def __aenter__(self) -> ToolCache:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
