"""One rollout's walk through the tool-call graph: the per-call algorithm of DESIGN.md.

A rollout holds a cursor (the node of its current state) and the path of edges that led there. A call is
looked up at the cursor; a hit returns the recorded result and, for an edge, moves the cursor. A miss is
claimed (so concurrent rollouts wait instead of executing it again), executed in a live sandbox brought to
the cursor's state by the cheapest route, and recorded. The live sandbox is made lazily: a rollout that only
hits never starts one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .calls import ToolCall, Tools
from .graph import EDGE, MEMO, Entry, Kind, Scope, child_id, decode_output, encode_output
from .policy import Costs, should_snapshot
from .sandboxes.base import Outcome, Sandbox, SandboxError, Sandboxes
from .stats import Stats
from .stores.base import Claim, Lease, Store, StoreError, TaskInfo
from .warm import WarmPool

__all__ = ["Context", "Result", "Rollout", "Source"]

log = logging.getLogger("tvcache")

Source = Literal["memo", "edge", "waited", "executed"]


@dataclass(frozen=True, slots=True)
class Result:
    """What `Rollout.call` returns.

    `seconds` is the wall time of the call as the caller saw it, including any waiting, restoring and
    replaying. `error` is True when the sandbox or tool failed (crash, timeout); such results are never cached.
    """

    output: Any
    hit: bool
    seconds: float
    source: Source
    error: bool = False


@dataclass
class Context:
    """What a cache hands each of its rollouts: shared state and settings."""

    store: Store
    stats: Stats
    warm: WarmPool
    factories: dict[int, tuple[Costs, str]]  # per sandbox factory (keyed by id): measured costs, origin
    claim_ttl: float
    lease_ttl: float
    snapshot_budget: int
    max_output_bytes: int

    def factory(self, sandboxes: Sandboxes) -> tuple[Costs, str]:
        """What the cache knows of a sandbox factory: its measured costs and the origin of its snapshots.

        A factory whose snapshots other processes or machines can restore says so with an `origin`
        attribute (the same string everywhere they can); by default only the factory itself can."""
        known = self.factories.get(id(sandboxes))
        if known is None:
            origin = getattr(sandboxes, "origin", None) or f"{socket.gethostname()}:{os.getpid()}:{id(sandboxes):x}"
            known = self.factories[id(sandboxes)] = (Costs(), str(origin))
        return known


@dataclass(frozen=True, slots=True)
class _Step:
    """An edge the rollout took: the call, the state it led to, the recorded result (for replay checks),
    and the execution seconds of all edges from the root up to and including this one (replay costs)."""

    node: bytes
    call: ToolCall
    output: bytes
    total: float


class Rollout:
    def __init__(self, ctx: Context, scope: Scope, sandboxes: Sandboxes, tools: Tools | None):
        self._ctx = ctx
        self._scope = scope
        self._scope_key = scope.key
        self._sandboxes = sandboxes
        self._tools = tools or Tools()
        self._costs, self._origin = ctx.factory(sandboxes)
        self._root = scope.root
        self._cursor = self._root
        self._steps: list[_Step] = []
        self._box: Sandbox | None = None
        self._box_depth = 0  # how many of `_steps` the live sandbox has applied
        self._known_snapshot_depth = 0  # deepest depth known to hold a snapshot (0: the fresh root)
        self._detached = False
        self._registered = False

    @property
    def cursor(self) -> bytes:
        return self._cursor

    @property
    def detached(self) -> bool:
        return self._detached

    # -- the per-call algorithm ------------------------------------------------------------------------

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result:
        start = time.perf_counter()
        call = self._tools.call(tool, args)
        stats = self._ctx.stats
        stats.calls += 1
        if self._detached:
            return await self._execute_direct(call, start)
        if tool in self._tools.uncacheable:
            return await self._execute_uncacheable(call, start)
        store, scope_key, node, digest, ttl = (
            self._ctx.store,
            self._scope_key,
            self._cursor,
            call.digest,
            self._ctx.claim_ttl,
        )
        try:
            found = await store.lookup(scope_key, node, digest, ttl)
            while isinstance(found, Claim) and found.token is None:
                stats.waits += 1  # another rollout is executing this very call: wait for its entry
                entry = await store.wait(scope_key, node, digest, ttl)
                if entry is not None:
                    return self._hit(call, entry, "waited", start)
                found = await store.lookup(scope_key, node, digest, ttl)  # its claim ended without an entry
            if found is None:
                raise StoreError("the store neither found nor claimed a call it was asked to claim")
        except Exception as exc:
            self._store_failed(exc)
            return await self._execute_direct(call, start)
        if isinstance(found, Entry):
            return self._hit(call, found, found.kind, start)
        assert found.token is not None
        return await self._execute_claimed(call, found.token, start)

    def _hit(self, call: ToolCall, entry: Entry, source: Source, start: float) -> Result:
        stats = self._ctx.stats
        stats.hits += 1
        stats.seconds_saved += entry.seconds
        if entry.kind == EDGE:
            self._advance(call, entry.output, entry.seconds)
        return Result(decode_output(entry.output), True, time.perf_counter() - start, source)

    def _advance(self, call: ToolCall, output: bytes, seconds: float) -> None:
        self._cursor = child_id(self._cursor, call.digest)
        self._steps.append(_Step(self._cursor, call, output, self._replay_seconds(len(self._steps)) + seconds))

    def _replay_seconds(self, depth: int, start: int = 0) -> float:
        """Recorded execution time of the edges from depth `start` to depth `depth`."""
        total = self._steps[depth - 1].total if depth else 0.0
        return total - (self._steps[start - 1].total if start else 0.0)

    def _kind(self, call: ToolCall, outcome: Outcome) -> Kind:
        """Annotation first, then what the sandbox observed, else assume the state changed."""
        if call.tool in self._tools.read_only or outcome.changed is False:
            return MEMO
        return EDGE

    async def _execute_claimed(self, call: ToolCall, token: str, start: float) -> Result:
        store, scope_key, node = self._ctx.store, self._scope_key, self._cursor
        try:
            box = await self._sandbox_at_cursor(use_store=True)
            if self._detached:  # rebuilding the state showed a nondeterministic tool
                await self._quietly(store.release(scope_key, node, call.digest, token))
                return await self._execute_direct(call, start)
            async with self._holding_claim(node, call.digest, token):
                outcome, blob, seconds = await self._execute(box, call)
        except BaseException:
            await self._quietly(store.release(scope_key, node, call.digest, token))
            raise
        if outcome.error:
            await self._quietly(store.release(scope_key, node, call.digest, token))
            return self._failed(call, outcome, blob, start)
        kind = self._kind(call, outcome)
        if len(blob) > self._ctx.max_output_bytes:
            await self._quietly(store.release(scope_key, node, call.digest, token))
            self._ctx.stats.uncached += 1
        else:
            try:
                if not self._registered:  # once per rollout, and only for rollouts that add to the graph
                    s = self._scope
                    await store.register(TaskInfo(scope_key, s.namespace, s.task, s.fingerprint))
                    self._registered = True
                await store.record(scope_key, node, call.digest, Entry(kind, blob, seconds, call.key[:200]), token)
            except Exception as exc:
                self._store_failed(exc)
        if kind == EDGE:
            self._advance(call, blob, seconds)
            self._box_depth = len(self._steps)
            await self._maybe_snapshot(box)
        return Result(decode_output(blob), False, time.perf_counter() - start, "executed")

    async def _execute_direct(self, call: ToolCall, start: float) -> Result:
        """Execute without recording: the rollout is detached, or the store is unreachable."""
        box = await self._sandbox_at_cursor(use_store=False)
        outcome, blob, _ = await self._execute(box, call)
        self._ctx.stats.uncached += 1
        if outcome.error:
            return self._failed(call, outcome, blob, start)
        if not self._detached and self._kind(call, outcome) == EDGE:
            # The store is down but the call is deterministic: keep the cursor right, so the rollout
            # can use the cache again once the store is back.
            self._advance(call, blob, 0.0)
            self._box_depth = len(self._steps)
        return Result(decode_output(blob), False, time.perf_counter() - start, "executed")

    async def _execute_uncacheable(self, call: ToolCall, start: float) -> Result:
        box = await self._sandbox_at_cursor(use_store=True)
        outcome, blob, _ = await self._execute(box, call)
        self._ctx.stats.uncached += 1
        if outcome.error:
            return self._failed(call, outcome, blob, start)
        if self._kind(call, outcome) == EDGE:
            # The new state depends on something outside the history (the clock, the network): no later
            # call of this rollout can be answered from, or recorded into, the shared graph.
            self._detach(f"uncacheable tool {call.tool!r} changed the state")
        return Result(decode_output(blob), False, time.perf_counter() - start, "executed")

    def _failed(self, call: ToolCall, outcome: Outcome, blob: bytes, start: float) -> Result:
        """A failed execution (timeout, crash) is never cached. If it may have changed the state, the state
        is not reproducible, so the rollout goes on in its own sandbox exactly as it would without a cache."""
        self._ctx.stats.failures += 1
        if not self._detached and outcome.changed is not False and call.tool not in self._tools.read_only:
            self._detach(f"failed call {call.tool!r} may have changed the state")
        return Result(decode_output(blob), False, time.perf_counter() - start, "executed", error=True)

    def _detach(self, why: str) -> None:
        log.info("rollout of %s detached: %s", self._scope.task, why)
        self._detached = True
        self._ctx.stats.detached += 1

    async def _execute(self, box: Sandbox, call: ToolCall) -> tuple[Outcome, bytes, float]:
        """Run one call in the live sandbox; return the outcome, its encoded output and the seconds it took.

        If the sandbox raises or answers with something that is not an Outcome of a str, bytes or JSON
        output, it is in an unknown state: drop it (the next call rebuilds one at the cursor) and let the
        error reach the caller."""
        stats = self._ctx.stats
        stats.executions += 1
        t0 = time.perf_counter()
        try:
            outcome = await box.execute(call)
            seconds = time.perf_counter() - t0
            if not isinstance(outcome, Outcome):
                raise SandboxError(f"Sandbox.execute must return an Outcome, got {type(outcome).__name__}")
            blob = encode_output(outcome.output)
        except BaseException:
            stats.failures += 1
            await self._drop_box()
            raise
        stats.seconds_executing += seconds
        return outcome, blob, seconds

    # -- bringing a live sandbox to the cursor's state -------------------------------------------------

    async def _sandbox_at_cursor(self, use_store: bool) -> Sandbox:
        """The rollout's live sandbox at the cursor's state, by the cheapest route: catch up its own sandbox
        by replaying the edges it skipped as hits, restore the deepest snapshot on the path and replay from
        there, or start fresh and replay everything. Warm (prefetched) sandboxes cost nothing to obtain."""
        target = len(self._steps)
        if self._box is not None and self._box_depth == target:
            return self._box
        if self._detached:
            raise SandboxError("a detached rollout lost its sandbox; its state cannot be rebuilt")
        costs = self._costs

        def replay_cost(depth: int) -> float:
            return self._replay_seconds(target, depth)

        catch_up = replay_cost(self._box_depth) if self._box is not None else float("inf")
        fresh_warm = self._ctx.warm.fresh_count(self._sandboxes, self._scope_key) > 0
        fresh = (0.0 if fresh_warm else costs.create) + replay_cost(0)
        lease: Lease | None = None
        if use_store and target > 0 and min(catch_up, fresh) > costs.restore:
            lease = await self._lease(self._box_depth + 1 if self._box is not None else 1, target)
        try:
            if lease is not None:
                depth = self._depth_of(lease.node)
                warm = self._ctx.warm.fork_count(self._sandboxes, lease.snapshot_id) > 0
                restore = (0.0 if warm else costs.restore) + replay_cost(depth)
                if restore < min(catch_up, fresh):
                    restored = await self._restore(lease)
                    if restored is not None:
                        await self._replace_box(restored, depth)
                        self._known_snapshot_depth = max(self._known_snapshot_depth, depth)
                        return await self._replay_to(target)
        finally:
            if lease is not None:
                await self._quietly(self._ctx.store.unlease(self._scope_key, lease.token))
        if catch_up > fresh:
            await self._replace_box(await self._create(), 0)
        return await self._replay_to(target)

    async def _lease(self, first_depth: int, target: int) -> Lease | None:
        nodes = [step.node for step in self._steps[first_depth - 1 : target]]
        try:
            return await self._ctx.store.lease(self._scope_key, self._origin, nodes, self._ctx.lease_ttl)
        except Exception as exc:
            self._store_failed(exc)
            return None

    def _depth_of(self, node: bytes) -> int:
        for depth in range(len(self._steps), 0, -1):
            if self._steps[depth - 1].node == node:
                return depth
        raise SandboxError("the store leased a snapshot that is not on this rollout's path")

    async def _restore(self, lease: Lease) -> Sandbox | None:
        stats = self._ctx.stats
        box = self._ctx.warm.take_fork(self._sandboxes, lease.snapshot_id)
        if box is not None:
            stats.warm += 1
            return box
        t0 = time.perf_counter()
        try:
            box = await self._sandboxes.restore(lease.snapshot_id)
        except Exception as exc:
            # Gone (deleted by another process, lost in a restart): forget it and take another route.
            log.warning("restore of snapshot %s failed (%s); falling back", lease.snapshot_id, exc)
            drop = self._ctx.store.drop_snapshot(self._scope_key, self._origin, lease.node, lease.snapshot_id)
            await self._quietly(drop)
            return None
        self._costs.measured_restore.add(time.perf_counter() - t0)
        stats.restores += 1
        return box

    async def _create(self) -> Sandbox:
        box = self._ctx.warm.take_fresh(self._sandboxes, self._scope_key)
        if box is not None:
            self._ctx.stats.warm += 1
            return box
        t0 = time.perf_counter()
        box = await self._sandboxes.create()
        self._costs.measured_create.add(time.perf_counter() - t0)
        self._ctx.stats.creates += 1
        return box

    async def _replace_box(self, box: Sandbox, depth: int) -> None:
        await self._drop_box()
        self._box, self._box_depth = box, depth

    async def _replay_to(self, target: int) -> Sandbox:
        """Re-execute the edges between the live sandbox and the cursor, checking each output against the
        recorded one. A difference means a tool is not deterministic: the rebuilt state may not be the one
        the rollout saw, so the rollout detaches rather than build on it."""
        stats = self._ctx.stats
        box = self._box
        assert box is not None
        while self._box_depth < target:
            step = self._steps[self._box_depth]
            t0 = time.perf_counter()
            try:
                outcome = await box.execute(step.call)
            except BaseException:
                await self._drop_box()
                raise
            elapsed = time.perf_counter() - t0
            stats.replays += 1
            stats.seconds_replaying += elapsed
            self._box_depth += 1
            if outcome.error or not _same_output(outcome.output, step.output):
                stats.mismatches += 1
                log.warning("replay of %r gave a different result than recorded", step.call)
                self._detach(f"replay of {step.call.tool!r} did not reproduce its recorded result")
                # Stay in this sandbox: from now on it *is* the rollout's state, as without a cache.
                self._box_depth = target
                break
        return box

    async def _maybe_snapshot(self, box: Sandbox) -> None:
        depth = len(self._steps)
        base = self._known_snapshot_depth
        rebuild = self._replay_seconds(depth, base)
        rebuild += self._costs.restore if base else self._costs.create
        if not should_snapshot(rebuild, self._costs):
            return
        t0 = time.perf_counter()
        try:
            snapshot_id = await box.snapshot()
        except Exception as exc:
            log.warning("snapshot failed: %s", exc)
            await self._drop_box()
            return
        self._costs.measured_snapshot.add(time.perf_counter() - t0)
        stats = self._ctx.stats
        stats.snapshots += 1
        path = [self._root, *(s.node for s in self._steps)]
        try:
            doomed = await self._ctx.store.add_snapshot(
                self._scope_key, self._origin, path, snapshot_id, self._ctx.snapshot_budget
            )
        except Exception as exc:
            self._store_failed(exc)
            doomed = [snapshot_id]
        if snapshot_id not in doomed:
            self._known_snapshot_depth = depth
        for victim in doomed:
            stats.evictions += victim != snapshot_id
            await self._ctx.warm.forget(self._sandboxes, victim)
            await self._quietly(self._sandboxes.delete(victim))

    # -- plumbing ----------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _holding_claim(self, node: bytes, digest: bytes, token: str) -> AsyncIterator[None]:
        """Keep our claim alive while a long call runs, so waiters do not take it over as abandoned."""
        ttl = self._ctx.claim_ttl

        async def refresh() -> None:
            while True:
                await asyncio.sleep(ttl / 3)
                with contextlib.suppress(Exception):
                    await self._ctx.store.refresh(self._scope_key, node, digest, token, ttl)

        task = asyncio.create_task(refresh())
        try:
            yield
        finally:
            task.cancel()

    def _store_failed(self, exc: BaseException) -> None:
        self._ctx.stats.store_errors += 1
        log.warning("cache store failed (%s: %s); executing without the cache", type(exc).__name__, exc)

    async def _quietly(self, awaitable: Any) -> None:
        """Cleanup that must not mask the outcome it cleans up after (and runs even when cancelled)."""
        try:
            await asyncio.shield(awaitable)
        except Exception as exc:
            log.debug("cleanup step failed: %s", exc)

    async def _drop_box(self) -> None:
        box, self._box = self._box, None
        if box is not None:
            await self._quietly(box.close())

    async def close(self) -> None:
        await self._drop_box()


def _same_output(output: Any, recorded: bytes) -> bool:
    try:
        return encode_output(output) == recorded or decode_output(encode_output(output)) == decode_output(recorded)
    except TypeError:
        return False
