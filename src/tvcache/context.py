"""What a cache shares with its rollouts: the store, the stats, the warm pool, what it knows of each sandbox factory,
its settings, and how it reacts when the store fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from .policy import Costs, Reuse
from .sandboxes.base import Sandboxes
from .stats import Stats
from .stores.base import Store, StoreError
from .stores.flights import EmbeddedEntries
from .tasks import TaskGroup
from .warm import WarmPool

__all__ = ["Context", "Factory", "OnStoreError", "StoreHealth"]

log = logging.getLogger("tvcache")

#: What a failing store does to a call: "continue" runs it without the cache (training goes on, slower),
#: "raise" lets the StoreError reach the caller (a misconfigured cache stops the run at once).
OnStoreError = Literal["continue", "raise"]

_instances = itertools.count(1)

#: Tasks whose `Reuse` a cache remembers: a training step's tasks, many times over.
MAX_REUSES = 4096


@dataclass(frozen=True, slots=True)
class Factory:
    """What the cache knows of one sandbox factory: its measured costs and the origin of its snapshots."""

    costs: Costs
    origin: str


class Factories:
    """Per sandbox factory object, its `Factory` record, for as long as the object lives.

    Keyed by the object itself, never by `id()`: an id is reused once its object is collected, and a new factory
    inheriting an old one's origin would be offered the old one's snapshot ids. Each factory instance gets an
    origin of its own unless it declares a shared one (an `origin` attribute: its snapshots can be restored by
    every factory that declares the same string, in other processes or on other machines).
    """

    def __init__(self) -> None:
        self._weak: weakref.WeakKeyDictionary[Sandboxes, Factory] = weakref.WeakKeyDictionary()
        self._strong: dict[int, tuple[Sandboxes, Factory]] = {}  # objects that take no weak reference

    def __getitem__(self, sandboxes: Sandboxes) -> Factory:
        try:
            known = self._weak.get(sandboxes)
        except TypeError:  # unhashable or not weak-referenceable: hold it (so its id cannot be reused)
            pair = self._strong.get(id(sandboxes))
            known = pair[1] if pair is not None else None
        if known is not None:
            return known
        declared = getattr(sandboxes, "origin", None)
        origin = str(declared) if declared else f"{socket.gethostname()}:{os.getpid()}:{next(_instances)}"
        made = Factory(Costs(), origin)
        try:
            self._weak[sandboxes] = made
        except TypeError:
            self._strong[id(sandboxes)] = (sandboxes, made)
        return made


class StoreHealth:
    """Counts store failures and says so in the log without flooding it: the first failure at once, then one
    summary line per `every` seconds while failures go on, and one line when the store answers again."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self.failing = False
        self._unreported = 0
        self._last_report = 0.0
        self._last_error = ""

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._last_error = f"{type(exc).__name__}: {exc}"
        if not self.failing:
            self.failing = True
            self._last_report = now
            log.warning("cache store failed (%s); calls run without the cache until it answers", self._last_error)
            return
        self._unreported += 1
        if now - self._last_report >= self.every:
            log.warning(
                "cache store still failing: %d more store errors in the last %.0f s (last: %s)",
                self._unreported,
                now - self._last_report,
                self._last_error,
            )
            self._unreported = 0
            self._last_report = now

    def answered(self) -> None:
        if self.failing:
            self.failing = False
            log.warning("cache store answers again; %d store errors since the last report", self._unreported)
            self._unreported = 0


@dataclass
class Context:
    """What a cache hands each of its rollouts."""

    store: Store
    stats: Stats
    warm: WarmPool
    claim_ttl: float
    lease_ttl: float
    snapshot_budget: int
    max_output_bytes: int
    on_store_error: OnStoreError = "continue"
    read_sets: bool = True  # reuse a result when what the call read is unchanged (`tvcache.reads`)
    factories: Factories = field(default_factory=Factories)
    health: StoreHealth = field(default_factory=StoreHealth)
    tasks: TaskGroup = field(default_factory=TaskGroup)
    #: Restores of a snapshot that failed without the backend saying it is gone, by snapshot id.
    suspects: Counter[str] = field(default_factory=Counter)
    #: What each task's rollouts showed of coming back to the same states, by scope key (the most recent tasks).
    reuses: dict[str, Reuse] = field(default_factory=dict)
    #: Snapshots being taken after their call answered (`LiveSandbox.maybe_snapshot`): the scope key and node of
    #: each, for misses that would rather wait for one than rebuild its state, and for `ToolCache.flush`.
    saving: dict[asyncio.Task[None], tuple[str, bytes]] = field(default_factory=dict)
    #: Work after an answer that `ToolCache.flush` waits for (`finish_later`): candidates being made
    #: (`Rollout._keep_later`), sandboxes closed once their snapshot is taken (`LiveSandbox.drop`).
    finishing: set[asyncio.Task[None]] = field(default_factory=set)
    #: The rollouts not closed yet, closed with the cache.
    rollouts: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    closed: bool = False

    def __post_init__(self) -> None:
        #: Whether the store's claiming lookups take their claim in this process, after their last `await`
        #: (memory, SQLite), so a cancelled lookup cannot have taken one.
        self.claims_in_process = isinstance(self.store, EmbeddedEntries)

    def finish_later(self, task: asyncio.Task[None]) -> None:
        self.finishing.add(task)
        task.add_done_callback(self.finishing.discard)

    def reuse(self, scope_key: str) -> Reuse:
        """The task's `Reuse`, made on first use; the least recently used task's is forgotten past `MAX_REUSES`."""
        reuse = self.reuses.pop(scope_key, None) or Reuse()
        self.reuses[scope_key] = reuse  # (re)inserted last: dicts keep insertion order
        if len(self.reuses) > MAX_REUSES:
            del self.reuses[next(iter(self.reuses))]
        return reuse

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this ToolCache is closed; make a new one")

    def store_failed(self, exc: StoreError, *, took_effect: bool = False) -> None:
        """A store operation failed: count it, say so (rate-limited), and raise if the cache must fail fast,
        unless the call it served already took effect in its sandbox: a caller told it failed would retry it
        and apply it twice, so it gets its result and the failure is only counted and logged."""
        self.stats.store_errors += 1
        if self.on_store_error == "raise" and not took_effect:
            raise exc
        self.health.failed(exc)
