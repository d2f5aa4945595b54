"""The four caching strategies a replay compares, behind one small interface.

- `none`: no cache. Every call executes in the rollout's own fresh sandbox: the ground truth.
- `naive`: results keyed on (task, tool, args), state ignored. A hit returns the stored output and executes
  nothing, so the rollout's sandbox misses that call's effect and later answers can be wrong too.
- `paper`: the published system. A call's key is the hash of the rollout's whole history of calls so far
  (exact full-history prefix), except that tools annotated read-only are memoized at their prefix without
  extending it. Every executed state-changing call is snapshotted; a miss restores the deepest snapshot on
  the rollout's prefix and replays the calls since. No single flight: concurrent rollouts that miss the
  same call all execute it.
- `tvcache`: `ToolCache` with its defaults (memory store unless a store URL is given).
- `exact`: `ToolCache(read_sets=False)`: tvcache on exact history alone, the baseline of reuse by what a call read.

A strategy hands out rollouts (`async with strategy.rollout(task, sandboxes, tools) as r`) whose
`await r.call(tool, args)` returns a `Result` (output, hit, seconds, source, error) and whose `r.stats` counts
the rollout's own executions as tvcache's `RolloutStats` does (their wall and CPU time, for the paired cost of a
command), and keeps `stats()`.
Every strategy creates its sandboxes lazily, on the first call that needs one, so the time to make a sandbox
is inside the first executed call's seconds for all of them alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from tvcache.cache import ToolCache
from tvcache.calls import ToolCall, Tools
from tvcache.graph import decode_output, encode_output
from tvcache.rollout import Result, RolloutStats
from tvcache.sandboxes.base import Outcome, Sandbox, SandboxError, Sandboxes

__all__ = [
    "STRATEGIES",
    "Counters",
    "NaiveStrategy",
    "NoCacheStrategy",
    "PaperStrategy",
    "Strategy",
    "StrategyRollout",
    "TvCacheStrategy",
    "as_cached",
    "make_strategy",
]

STRATEGIES = ("none", "naive", "paper", "tvcache", "exact")


class StrategyRollout(Protocol):
    stats: RolloutStats

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result: ...


@dataclass
class Counters:
    """What the baseline strategies count; the same names as `ToolCache.stats()`."""

    calls: int = 0
    hits: int = 0
    executions: int = 0  # executions on behalf of callers
    replays: int = 0  # executions to rebuild a state
    creates: int = 0
    restores: int = 0
    snapshots: int = 0
    warm: int = 0
    failures: int = 0
    seconds_executing: float = 0.0
    seconds_creating: float = 0.0
    seconds_restoring: float = 0.0
    seconds_replaying: float = 0.0
    seconds_snapshotting: float = 0.0


class Strategy:
    """The interface the replay engine drives. Subclasses implement `rollout`; the rest has defaults."""

    name = "?"
    read_sets = False  # reuses results by what a call read: only such a strategy needs traced sandboxes

    def rollout(
        self, task: str, sandboxes: Sandboxes, tools: Tools
    ) -> contextlib.AbstractAsyncContextManager[StrategyRollout]:
        raise NotImplementedError

    async def prefetch(self, tasks: Mapping[str, int], sandboxes: Mapping[str, Sandboxes]) -> None:
        """Get ready for the next step's tasks (task -> rollouts); only tvcache does anything here."""

    def stats(self) -> dict[str, float]:
        raise NotImplementedError

    async def flush(self) -> None:
        """Finish the work still under way after the calls answered (tvcache's snapshots), so `stats()` counts it."""

    async def close(self) -> None:
        """Release what the strategy holds (snapshots, warm sandboxes)."""


def make_strategy(name: str, *, store: str | None = None, namespace: str | None = None) -> Strategy:
    if name == "none":
        return NoCacheStrategy()
    if name == "naive":
        return NaiveStrategy()
    if name == "paper":
        return PaperStrategy()
    if name == "tvcache":
        return TvCacheStrategy(store, namespace=namespace)
    if name == "exact":
        return ExactStrategy(store, namespace=namespace)
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")


# -- shared plumbing ---------------------------------------------------------------------------------------


def as_cached(output: Any) -> Any:
    """An output as it comes back from a cache (a msgpack round trip), so every strategy's answers compare
    alike; outputs that cannot be encoded are returned as they are."""
    try:
        return decode_output(encode_output(output))
    except TypeError:
        return output


class _OwnSandbox:
    """A rollout's lazily created sandbox, for the baselines."""

    def __init__(self, sandboxes: Sandboxes, counters: Counters):
        self._sandboxes = sandboxes
        self._counters = counters
        self.box: Sandbox | None = None
        self.stats = RolloutStats()  # the rollout's own executions (replays go to the box directly)

    async def get(self) -> Sandbox:
        if self.box is None:
            t0 = time.perf_counter()
            self.box = await self._sandboxes.create()
            self._counters.creates += 1
            self._counters.seconds_creating += time.perf_counter() - t0
        return self.box

    async def execute(self, call: ToolCall) -> Outcome:
        box = await self.get()
        self._counters.executions += 1
        t0 = time.perf_counter()
        try:
            outcome = await box.execute(call)
        except BaseException:
            self._counters.failures += 1
            await self.drop()
            raise
        seconds = time.perf_counter() - t0
        self._counters.seconds_executing += seconds
        self._counters.failures += outcome.error
        self.stats.executions += 1
        self.stats.add_execution_time(seconds, outcome.cpu_seconds)
        return outcome

    async def drop(self) -> None:
        box, self.box = self.box, None
        if box is not None:
            with contextlib.suppress(Exception):
                await box.close()


# -- none -----------------------------------------------------------------------------------------------


class NoCacheStrategy(Strategy):
    name = "none"

    def __init__(self) -> None:
        self.counters = Counters()

    @contextlib.asynccontextmanager
    async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools) -> AsyncIterator[StrategyRollout]:
        own = _OwnSandbox(sandboxes, self.counters)
        try:
            yield _DirectRollout(own, tools, self.counters)
        finally:
            await own.drop()

    def stats(self) -> dict[str, float]:
        return asdict(self.counters)


class _DirectRollout:
    def __init__(self, own: _OwnSandbox, tools: Tools, counters: Counters):
        self._own = own
        self.stats = own.stats
        self._tools = tools
        self._counters = counters

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result:
        start = time.perf_counter()
        self._counters.calls += 1
        outcome = await self._own.execute(self._tools.call(tool, args))
        return Result(as_cached(outcome.output), False, time.perf_counter() - start, "executed", outcome.error)


# -- naive ----------------------------------------------------------------------------------------------


class NaiveStrategy(Strategy):
    """The cache tvcache replaces: (task, tool, args) -> output. Scoped per task (and starting state), which
    is the most favourable reading: across tasks it would be wrong even more often."""

    name = "naive"

    def __init__(self) -> None:
        self.counters = Counters()
        self.entries: dict[tuple[str, str, str], bytes] = {}

    @contextlib.asynccontextmanager
    async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools) -> AsyncIterator[StrategyRollout]:
        own = _OwnSandbox(sandboxes, self.counters)
        try:
            yield _NaiveRollout(self, (task, sandboxes.fingerprint), own, tools)
        finally:
            await own.drop()

    def stats(self) -> dict[str, float]:
        return asdict(self.counters)


class _NaiveRollout:
    def __init__(self, strategy: NaiveStrategy, scope: tuple[str, str], own: _OwnSandbox, tools: Tools):
        self._strategy = strategy
        self._scope = scope
        self._own = own
        self.stats = own.stats
        self._tools = tools

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result:
        start = time.perf_counter()
        counters = self._strategy.counters
        counters.calls += 1
        call = self._tools.call(tool, args)
        key = (*self._scope, call.key)
        cached = None if tool in self._tools.uncacheable else self._strategy.entries.get(key)
        if cached is not None:
            counters.hits += 1  # and nothing runs: the sandbox never sees this call's effect
            return Result(decode_output(cached), True, time.perf_counter() - start, "memo")
        outcome = await self._own.execute(call)
        output = as_cached(outcome.output)
        if not outcome.error and tool not in self._tools.uncacheable:
            with contextlib.suppress(TypeError):
                self._strategy.entries.setdefault(key, encode_output(outcome.output))
        return Result(output, False, time.perf_counter() - start, "executed", outcome.error)


# -- paper ----------------------------------------------------------------------------------------------


def _chain(prefix: bytes, digest: bytes) -> bytes:
    return hashlib.blake2b(prefix + digest, digest_size=16).digest()


class PaperStrategy(Strategy):
    """Exact full-history prefix keys, annotation-only memos, a snapshot at every state-changing call."""

    name = "paper"

    def __init__(self) -> None:
        self.counters = Counters()
        self.entries: dict[tuple[bytes, bytes], bytes] = {}  # (prefix, call digest) -> encoded output
        self.snapshots: dict[bytes, tuple[Sandboxes, str]] = {}  # prefix -> (factory, snapshot id)

    @contextlib.asynccontextmanager
    async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools) -> AsyncIterator[StrategyRollout]:
        root = hashlib.blake2b(f"{task}\0{sandboxes.fingerprint}".encode(), digest_size=16).digest()
        own = _OwnSandbox(sandboxes, self.counters)
        try:
            yield _PaperRollout(self, root, sandboxes, own, tools)
        finally:
            await own.drop()

    def stats(self) -> dict[str, float]:
        return {**asdict(self.counters), "snapshots_kept": len(self.snapshots)}

    async def close(self) -> None:
        snapshots, self.snapshots = self.snapshots, {}
        for factory, snapshot_id in snapshots.values():
            with contextlib.suppress(Exception):
                await factory.delete(snapshot_id)


class _PaperRollout:
    def __init__(self, strategy: PaperStrategy, root: bytes, sandboxes: Sandboxes, own: _OwnSandbox, tools: Tools):
        self._strategy = strategy
        self._sandboxes = sandboxes
        self._own = own
        self.stats = own.stats
        self._tools = tools
        self._prefix = root
        self._path: list[tuple[bytes, ToolCall]] = []  # state-changing calls: (prefix after it, call)
        self._depth = 0  # how many of `_path` the live sandbox has applied
        self._detached = False

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result:
        start = time.perf_counter()
        strategy, counters = self._strategy, self._strategy.counters
        counters.calls += 1
        call = self._tools.call(tool, args)
        read_only = tool in self._tools.read_only
        key = (self._prefix, call.digest)
        cacheable = not self._detached and tool not in self._tools.uncacheable
        cached = strategy.entries.get(key) if cacheable else None
        if cached is not None:
            counters.hits += 1
            if not read_only:
                self._extend(call)
            return Result(decode_output(cached), True, time.perf_counter() - start, "memo" if read_only else "edge")
        await self._sandbox_at_prefix()
        outcome = await self._own.execute(call)
        if outcome.error:
            self._detached = True  # the state after a failed call is unknown: no more caching for us
        elif cacheable:
            with contextlib.suppress(TypeError):
                strategy.entries.setdefault(key, encode_output(outcome.output))
        if not read_only:
            self._extend(call)
            self._depth = len(self._path)
            if not self._detached:
                await self._snapshot()
        return Result(as_cached(outcome.output), False, time.perf_counter() - start, "executed", outcome.error)

    def _extend(self, call: ToolCall) -> None:
        self._prefix = _chain(self._prefix, call.digest)
        self._path.append((self._prefix, call))

    async def _sandbox_at_prefix(self) -> None:
        """Restore the deepest snapshot on the prefix (or keep the own sandbox if it is as deep) and replay
        the state-changing calls since."""
        target = len(self._path)
        if self._own.box is not None and self._depth == target:
            return
        if self._detached:
            raise SandboxError("a detached rollout lost its sandbox")
        floor = self._depth if self._own.box is not None else 0
        for depth in range(target, floor, -1):
            found = self._strategy.snapshots.get(self._path[depth - 1][0])
            if found is None:
                continue
            t0 = time.perf_counter()
            try:
                restored = await self._sandboxes.restore(found[1])
            except Exception:
                self._strategy.snapshots.pop(self._path[depth - 1][0], None)
                continue
            finally:
                self._strategy.counters.seconds_restoring += time.perf_counter() - t0
            self._strategy.counters.restores += 1
            await self._own.drop()
            self._own.box, self._depth = restored, depth
            break
        else:
            if self._own.box is None:
                await self._own.get()
                self._depth = 0
        box = self._own.box
        assert box is not None
        while self._depth < target:
            self._strategy.counters.replays += 1
            t0 = time.perf_counter()
            try:
                await box.execute(self._path[self._depth][1])
            except BaseException:
                await self._own.drop()
                raise
            finally:
                self._strategy.counters.seconds_replaying += time.perf_counter() - t0
            self._depth += 1

    async def _snapshot(self) -> None:
        strategy, prefix = self._strategy, self._prefix
        box = self._own.box
        if prefix in strategy.snapshots or box is None:
            return
        t0 = time.perf_counter()
        snapshot_id = await box.snapshot()
        strategy.counters.snapshots += 1
        strategy.counters.seconds_snapshotting += time.perf_counter() - t0
        if prefix in strategy.snapshots:  # another rollout got there while we saved: keep one
            await self._sandboxes.delete(snapshot_id)
        else:
            strategy.snapshots[prefix] = (self._sandboxes, snapshot_id)


# -- tvcache --------------------------------------------------------------------------------------------


class TvCacheStrategy(Strategy):
    """tvcache with its defaults. `namespace` defaults to a fresh one, so a durable `store` shared with
    earlier runs starts this replay empty."""

    name = "tvcache"

    def __init__(self, store: str | None = None, *, namespace: str | None = None, **options: Any):
        self.cache = ToolCache(store, namespace=namespace or f"replay-{uuid.uuid4().hex[:12]}", **options)
        self.read_sets = bool(options.get("read_sets", True))
        self._factories: dict[str, Sandboxes] = {}  # scope key -> factory, to delete snapshots at the end

    def rollout(
        self, task: str, sandboxes: Sandboxes, tools: Tools
    ) -> contextlib.AbstractAsyncContextManager[StrategyRollout]:
        self._factories[self.cache.scope(task, sandboxes).key] = sandboxes
        return self.cache.rollout(task, sandboxes, tools)

    async def prefetch(self, tasks: Mapping[str, int], sandboxes: Mapping[str, Sandboxes]) -> None:
        by_factory: dict[int, tuple[Sandboxes, list[str], int]] = {}
        for task, rollouts in tasks.items():
            factory = sandboxes[task]
            _, names, most = by_factory.get(id(factory), (factory, [], 0))
            by_factory[id(factory)] = (factory, [*names, task], max(most, rollouts))
        for factory, names, rollouts in by_factory.values():
            await self.cache.prefetch(names, factory, rollouts=rollouts)  # runs in the background

    def stats(self) -> dict[str, float]:
        return self.cache.stats()

    async def flush(self) -> None:
        await self.cache.flush()

    async def close(self) -> None:
        store = self.cache.store
        await self.cache.flush()  # the snapshots still being taken are in the graph, to be deleted with the rest
        with contextlib.suppress(Exception):
            for key, factory in self._factories.items():
                for record in await store.snapshots(key):
                    with contextlib.suppress(Exception):
                        await factory.delete(record.snapshot_id)
        await self.cache.close()


class ExactStrategy(TvCacheStrategy):
    """tvcache without reuse by what a call read (`read_sets=False`): exact history only."""

    name = "exact"

    def __init__(self, store: str | None = None, *, namespace: str | None = None):
        super().__init__(store, namespace=namespace, read_sets=False)
