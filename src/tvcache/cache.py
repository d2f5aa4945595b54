"""ToolCache: a store, the sandboxes' measured costs, warm pools and stats, shared by its rollouts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from typing import Any

from .calls import Tools
from .graph import Scope
from .rollout import Context, Rollout
from .sandboxes.base import Sandbox, Sandboxes
from .stats import Stats
from .stores import Store, open_store
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
    ):
        if store is not None and url is not None:
            raise ValueError("pass a store URL or a Store object, not both")
        if snapshot_budget < 0 or claim_ttl <= 0 or lease_ttl <= 0 or prefetch_concurrency < 1:
            raise ValueError("snapshot_budget must be >= 0, the ttls > 0 and prefetch_concurrency >= 1")
        self.namespace = namespace
        self._ctx = Context(
            store=store if store is not None else open_store(url),
            stats=Stats(),
            warm=WarmPool(warm_limit),
            factories={},
            claim_ttl=claim_ttl,
            lease_ttl=lease_ttl,
            snapshot_budget=snapshot_budget,
            max_output_bytes=max_output_bytes,
        )
        self._prefetch_limit = asyncio.Semaphore(prefetch_concurrency)
        self._pending: Counter[tuple[int, str]] = Counter()  # prefetches under way
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def store(self) -> Store:
        return self._ctx.store

    def scope(self, task: str, sandboxes: Sandboxes) -> Scope:
        return Scope(self.namespace, task, sandboxes.fingerprint)

    @contextlib.asynccontextmanager
    async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools | None = None) -> AsyncIterator[Rollout]:
        """One rollout of `task`; its sandbox, if it made one, is closed on exit (also on errors)."""
        rollout = Rollout(self._ctx, self.scope(task, sandboxes), sandboxes, tools)
        try:
            yield rollout
        finally:
            await rollout.close()

    def stats(self) -> dict[str, float]:
        return self._ctx.stats.as_dict()

    async def prefetch(self, tasks: Iterable[str], sandboxes: Sandboxes, rollouts: int = 8) -> asyncio.Task[int]:
        """Warm sandboxes for the next step's tasks, in the background: up to `rollouts` fresh ones per task
        and one restored fork of each snapshot the graph holds for it. Rollouts take warm ones first.

        Returns the background task (its result: how many sandboxes were made); awaiting it is optional.
        """
        warm = self._ctx.warm
        jobs = []
        for task in tasks:
            scope_key = self.scope(task, sandboxes).key
            pending = (id(sandboxes), scope_key)
            missing = rollouts - warm.fresh_count(sandboxes, scope_key) - self._pending[pending]
            jobs += [self._warm_fresh(sandboxes, scope_key) for _ in range(max(0, missing))]
            self._pending[pending] += max(0, missing)
            try:
                records = await self._ctx.store.snapshots(scope_key, self._ctx.factory(sandboxes)[1])
            except Exception as exc:
                self._ctx.stats.store_errors += 1
                log.warning("prefetch could not list snapshots of %s: %s", task, exc)
                continue
            for record in records:
                pending = (id(sandboxes), record.snapshot_id)
                if warm.fork_count(sandboxes, record.snapshot_id) + self._pending[pending] == 0:
                    self._pending[pending] += 1
                    jobs.append(self._warm_fork(sandboxes, scope_key, record.node, record.snapshot_id))

        async def run() -> int:
            made = await asyncio.gather(*jobs, return_exceptions=True)
            return sum(1 for m in made if m is True)

        background = asyncio.create_task(run())
        self._background.add(background)
        background.add_done_callback(self._background.discard)
        return background

    async def _warm_fresh(self, sandboxes: Sandboxes, scope_key: str) -> bool:
        try:
            async with self._prefetch_limit:
                box = await sandboxes.create()
            await self._ctx.warm.put_fresh(sandboxes, scope_key, box)
            return True
        finally:
            self._pending[(id(sandboxes), scope_key)] -= 1

    async def _warm_fork(self, sandboxes: Sandboxes, scope_key: str, node: bytes, snapshot_id: str) -> bool:
        store = self._ctx.store
        try:
            async with self._prefetch_limit:
                lease = await store.lease(scope_key, self._ctx.factory(sandboxes)[1], [node], self._ctx.lease_ttl)
                if lease is None or lease.snapshot_id != snapshot_id:
                    return False  # evicted meanwhile
                try:
                    box: Sandbox = await sandboxes.restore(snapshot_id)
                finally:
                    await store.unlease(scope_key, lease.token)
            await self._ctx.warm.put_fork(sandboxes, snapshot_id, box)
            return True
        finally:
            self._pending[(id(sandboxes), snapshot_id)] -= 1

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
