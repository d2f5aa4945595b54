"""ToolCache: a store, the sandboxes' measured costs, warm pools and stats, shared by its rollouts."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any

from .calls import Tools
from .context import Context, OnStoreError
from .graph import Scope
from .rollout import Rollout, _current
from .sandboxes.base import Sandbox, Sandboxes
from .stats import Stats
from .stores import Store, open_store
from .stores.base import Lease, StoreError
from .tasks import TaskGroup
from .warm import WarmPool

__all__ = ["State", "ToolCache"]

log = logging.getLogger("tvcache")


class State(enum.Enum):
    """Where a `ToolCache` (or `SyncToolCache`) is in its life; see `ToolCache.state`."""

    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


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

    Snapshots are taken off the critical path: after the call that reached the state has answered, while the
    model generates its next turn. The rollout's next miss waits for its snapshot (the sandbox holds still while it
    is saved); hits do not. `await cache.flush()` waits for the snapshots under way, so that `stats()` counts them;
    `close()` waits for them too.

    `read_sets=True` (the default) also reuses a result recorded in another state when everything the call read is
    the same in the rollout's state, a state-changing call with its recorded writes (`tvcache.reads`; counted in
    `stats()["read_set_hits"]` and `["read_set_edges"]`), for sandboxes that observe what calls read and write
    (SQLite; workspaces); `False` keeps to exact history.

    Its life is httpx's client's: usable once made, `async with` it (once) to have it closed at the end; after
    `close()` every method but `stats()` raises `RuntimeError`, and closing again does nothing. Closing cancels
    its background work (prefetch, claim refreshes), closes its open rollouts (waiting for a call in progress),
    the warm sandboxes and the store; when it returns, every task the cache started has ended.
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
        read_sets: bool = True,
    ):
        if store is not None and url is not None:
            raise ValueError("pass a store URL or a Store object, not both")
        if isinstance(store, str | bytes | os.PathLike):
            raise TypeError(f"store= takes a Store object; pass a URL as the first argument: ToolCache({store!r})")
        if store is not None and not callable(getattr(store, "lookup", None)):
            raise TypeError(f"store must be a tvcache Store (see tvcache.stores), got {type(store).__name__}")
        if snapshot_budget < 0 or claim_ttl <= 0 or lease_ttl <= 0 or prefetch_concurrency < 1:
            raise ValueError("snapshot_budget must be >= 0, the ttls > 0 and prefetch_concurrency >= 1")
        if on_store_error not in ("continue", "raise"):
            raise ValueError(f"on_store_error must be 'continue' or 'raise', got {on_store_error!r}")
        self.namespace = namespace
        tasks = TaskGroup()
        self._ctx = Context(
            store=store if store is not None else open_store(url),
            stats=Stats(),
            warm=WarmPool(tasks, warm_limit),
            claim_ttl=claim_ttl,
            lease_ttl=lease_ttl,
            snapshot_budget=snapshot_budget,
            max_output_bytes=max_output_bytes,
            on_store_error=on_store_error,
            read_sets=read_sets,
            tasks=tasks,
        )
        self._state = State.UNOPENED
        self._unchecked = check_store
        self._prefetch_limit = asyncio.Semaphore(prefetch_concurrency)
        self._pending: Counter[tuple[str, str]] = Counter()  # prefetches under way, by (origin, scope or snapshot)

    @property
    def state(self) -> State:
        """`UNOPENED` (usable: a cache need not be entered), `OPENED` (inside `async with`) or `CLOSED`."""
        return self._state

    @property
    def store(self) -> Store:
        """The store the graph lives in."""
        return self._ctx.store

    def scope(self, task: str, sandboxes: Sandboxes) -> Scope:
        """The scope of `task`'s graph: this cache's namespace, the task id and the sandboxes' fingerprint."""
        return Scope(self.namespace, task, _factory(sandboxes).fingerprint)

    async def check(self) -> None:
        """Ping the store; raise `StoreError` saying what is wrong if it does not answer."""
        self._ctx.check_open()
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
        self._ctx.check_open()
        if self._unchecked:
            await self.check()
            self._unchecked = False
        return Rollout(self._ctx, self.scope(task, sandboxes), sandboxes, tools)

    def stats(self) -> dict[str, float]:
        """The cache's counters: calls, hits, executions, waits, replays, snapshots, store_errors, seconds_saved,
        ... (see the Getting started page's Stats section). Snapshots still being taken after their call answered
        are not counted yet: `await flush()` first for exact figures."""
        return self._ctx.stats.as_dict()

    async def flush(self) -> None:
        """Wait until every snapshot taken after its call answered is saved and recorded (or has failed), the
        sandbox of a rollout that ended meanwhile is closed, and every result whose read set was worked out after
        its answer is kept for other states, also those started meanwhile. For exact `stats()`; training need not
        call it."""
        saving, finishing = self._ctx.saving, self._ctx.finishing
        while saving or finishing:
            await asyncio.wait([*saving, *finishing])

    async def prefetch(self, tasks: Iterable[str], sandboxes: Sandboxes, rollouts: int = 8) -> asyncio.Task[int]:
        """Warm sandboxes for the next step's tasks, in the background: up to `rollouts` fresh ones per task
        and one restored fork of each snapshot the graph holds for it. Rollouts that miss take warm ones first.

        Returns, once the work has started, the background `asyncio.Task`; its result is the number of
        sandboxes made (one that could not be made is logged). Awaiting it is optional (a step usually runs
        while it works); `close()` cancels what is still under way and closes the warm sandboxes nobody took.
        """
        self._ctx.check_open()
        origin = self._ctx.factories[_factory(sandboxes)].origin
        warm, names, jobs = self._ctx.warm, list(tasks), []
        scope_keys = [self.scope(task, sandboxes).key for task in names]
        for scope_key in scope_keys:
            missing = rollouts - warm.count(("fresh", origin, scope_key)) - self._pending[(origin, scope_key)]
            jobs += [
                self._start((origin, scope_key), self._warm_fresh(sandboxes, origin, scope_key)) for _ in range(missing)
            ]
        try:
            for scope_key in scope_keys:
                try:
                    records = await self._ctx.store.snapshots(scope_key, origin)
                except StoreError as exc:
                    self._ctx.store_failed(exc)
                    continue
                for record in records:
                    key = (origin, record.snapshot_id)
                    if warm.count(("fork", *key)) + self._pending[key] == 0:
                        jobs.append(self._start(key, self._warm_fork(sandboxes, scope_key, record.node, *key)))
        finally:
            counted = self._ctx.tasks.spawn(_count(jobs), background=True)
        return counted

    def _start(self, pending: tuple[str, str], job: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        """Start a prefetch job as a background task of the cache, counted as pending until it ends, however."""
        self._pending[pending] += 1
        task = self._ctx.tasks.spawn(job, background=True)

        def ended(done: asyncio.Task[bool]) -> None:
            self._pending[pending] -= 1
            if not done.cancelled() and done.exception() is not None:
                log.warning("prefetch could not make a sandbox: %r", done.exception())

        task.add_done_callback(ended)
        return task

    async def _warm_fresh(self, sandboxes: Sandboxes, origin: str, scope_key: str) -> bool:
        async with self._prefetch_limit:
            box = await self._ctx.tasks.acquire(sandboxes.create(), _close)
            self._ctx.warm.put(("fresh", origin, scope_key), box)
        return True

    async def _warm_fork(self, sandboxes: Sandboxes, scope_key: str, node: bytes, origin: str, snap: str) -> bool:
        store, tasks = self._ctx.store, self._ctx.tasks

        async def unlease(lease: Lease | None) -> None:
            if lease is not None:
                await store.unlease(scope_key, lease.token)

        async with self._prefetch_limit:
            lease = await tasks.acquire(store.lease(scope_key, origin, [node], self._ctx.lease_ttl), unlease)
            if lease is None:
                return False
            try:
                if lease.snapshot_id != snap:
                    return False  # evicted meanwhile
                box: Sandbox = await tasks.acquire(sandboxes.restore(snap), _close)
                self._ctx.warm.put(("fork", origin, snap), box)
            finally:
                await tasks.cleanup(unlease(lease))
        return True

    async def close(self) -> None:
        """Stop prefetching, close the open rollouts, the warm sandboxes nobody took and the store. Idempotent."""
        if self._state is State.CLOSED:
            return
        self._state, self._ctx.closed = State.CLOSED, True
        tasks = self._ctx.tasks
        tasks.cancel_background()
        for rollout in list(self._ctx.rollouts):
            with contextlib.suppress(RuntimeError):  # one whose sandbox() block runs in this task closes with it
                await rollout.close()
        self._ctx.warm.close()
        await tasks.join()
        self._ctx.warm.close()  # what a prefetch job cancelled during the joins had filed meanwhile
        await tasks.join()
        await self._ctx.store.close()

    async def __aenter__(self) -> ToolCache:
        if self._state is not State.UNOPENED:
            raise RuntimeError(
                "a ToolCache can be entered (`async with`) once; it is closed at the end of that block"
                if self._state is State.OPENED
                else "this ToolCache is closed and cannot be reopened; make a new one"
            )
        self._state = State.OPENED
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _count(jobs: list[asyncio.Task[bool]]) -> int:
    made = await asyncio.gather(*jobs, return_exceptions=True)
    return sum(1 for m in made if m is True)


async def _close(box: Sandbox) -> None:
    await box.close()


def _factory(sandboxes: Sandboxes) -> Sandboxes:
    """`sandboxes`, checked: a mistake here would otherwise surface later as an AttributeError deep inside."""
    if not isinstance(sandboxes, Sandboxes):
        raise TypeError(
            "sandboxes must be a sandbox factory (tvcache.Sandboxes: fingerprint, create, restore, delete; e.g. "
            f"WorkspaceSandboxes(base)), got {type(sandboxes).__name__}"
        )
    return sandboxes
