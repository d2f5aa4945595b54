"""A rollout's live sandbox: made only when a call must execute, brought to the rollout's state by the cheapest
route, and snapshotted where rebuilding that state later would cost more than saving it now.

The rollout owns its `History` (the edges it took from the root, with their recorded outputs); `LiveSandbox`
owns the one sandbox that applies them. The sandbox may lag behind the history (the rollout hit edges without
executing them); `at_cursor()` closes the gap by one of three routes (see `policy.Route`): replay the skipped
edges in it, restore the deepest snapshot on the path and replay from there, or start a fresh sandbox and replay
everything. Every replayed output is compared with the recorded one: a difference means a tool is not
deterministic, and the caller learns that the state it now holds is the sandbox's own, not the graph's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from .calls import ToolCall
from .context import Context, Factory
from .graph import child_id, decode_output, encode_output
from .policy import Reuse, Route, cheapest_route, should_snapshot, worth_leasing
from .sandboxes.base import (
    Outcome,
    Sandbox,
    SandboxBusy,
    SandboxError,
    Sandboxes,
    SnapshotGone,
    no_room,
    settled,
)
from .stores.base import Lease, StoreError

__all__ = ["History", "LiveSandbox", "Step", "with_reads"]

log = logging.getLogger("tvcache")

#: Consecutive failed snapshots after which a live sandbox stops trying: its backend cannot save this state, and
#: dropping the sandbox after each failure would make every later call replay the whole history.
MAX_SNAPSHOT_FAILURES = 2

#: Snapshots a miss tries to restore, deepest first, when restores fail (their host is gone).
MAX_RESTORE_ATTEMPTS = 3

#: Restores of one snapshot (each tried twice) that may fail, without the backend saying it is gone, before the
#: snapshot is dropped from the graph and deleted: one transient failure must not lose a costly state.
MAX_SUSPECT_FAILURES = 3

#: Seconds a live sandbox waits, after a snapshot failed for want of room (a full disk or quota: the machine, which
#: may pass, not the sandbox), before it tries another; a full `tmp` is not retried after every call.
NO_ROOM_RETRY = 10.0


@dataclass(frozen=True, slots=True)
class Step:
    """An edge a rollout took: the call, the state it led to, the recorded output and writes (to check replays
    against), and the recorded execution seconds of all edges from the root up to and including this one."""

    node: bytes
    call: ToolCall
    output: bytes
    total: float
    writes: dict[str, str] | None = None


class History:
    """The edges a rollout took from the root of its scope, in order; the last one's node is its cursor."""

    def __init__(self, root: bytes):
        self.root = root
        self.steps: list[Step] = []

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def cursor(self) -> bytes:
        return self.steps[-1].node if self.steps else self.root

    def advance(self, call: ToolCall, output: bytes, seconds: float, writes: dict[str, str] | None) -> None:
        total = self.seconds(len(self.steps)) + seconds
        self.steps.append(Step(child_id(self.cursor, call.digest), call, output, total, writes))

    def seconds(self, depth: int, start: int = 0) -> float:
        """Recorded execution time of the edges from depth `start` to depth `depth`: what replaying them costs."""
        total = self.steps[depth - 1].total if depth else 0.0
        return total - (self.steps[start - 1].total if start else 0.0)

    def depth_of(self, node: bytes) -> int:
        for depth in range(len(self.steps), 0, -1):
            if self.steps[depth - 1].node == node:
                return depth
        raise SandboxError("the store leased a snapshot that is not on this rollout's path")


class LiveSandbox:
    def __init__(
        self, ctx: Context, sandboxes: Sandboxes, factory: Factory, scope_key: str, history: History, reuse: Reuse
    ):
        self._ctx = ctx
        self._reuse = reuse
        self._sandboxes = sandboxes
        self._costs = factory.costs
        self._origin = factory.origin
        self._scope_key = scope_key
        self._history = history
        self._box: Sandbox | None = None
        self._depth = 0  # how many of the history's edges the sandbox has applied
        self._snapshot_depth = 0  # the deepest depth known to hold a snapshot (0: the fresh root)
        self._snapshot_failures = 0
        self._no_room_until = 0.0  # no snapshot before then: the last one found no room (see NO_ROOM_RETRY)
        self._saving: asyncio.Task[None] | None = None  # a snapshot being taken after its call answered

    @property
    def exists(self) -> bool:
        return self._box is not None

    async def at_cursor(self, use_store: bool) -> tuple[Sandbox, bool]:
        """The sandbox at the history's cursor, and whether it reproduced every replayed edge exactly.

        `use_store=False` (the store is down, or the rollout records nothing) rules out restoring snapshots.
        Every sandbox and lease it obtains is owned (assigned to the live sandbox, or released) before the next
        `await`, so cancelling it at any point leaks nothing."""
        await self._saved()
        target = len(self._history)
        if self._box is not None and self._depth == target:
            return self._box, True
        costs, warm, replay = self._costs, self._ctx.warm, self._history.seconds
        catch_up = replay(target, self._depth) if self._box is not None else float("inf")
        fresh_warm = warm.count(("fresh", self._origin, self._scope_key)) > 0
        fresh = (0.0 if fresh_warm else costs.create) + replay(target)
        route = cheapest_route(catch_up, fresh, None)
        await self._await_snapshot_under_way(catch_up, fresh)
        # A snapshot the backend says is gone is dropped from the graph, so asking again yields the next
        # shallower one; a few attempts bound the round trips.
        for _ in range(MAX_RESTORE_ATTEMPTS if use_store and target > 0 else 0):
            if not worth_leasing(catch_up, fresh, costs.restore):
                break
            lease = await self._lease(self._depth + 1 if self._box is not None else 1, target)
            if lease is None:
                break
            restored = False
            try:
                depth = self._history.depth_of(lease.node)
                forked = warm.count(("fork", self._origin, lease.snapshot_id)) > 0
                restore = (0.0 if forked else costs.restore) + replay(target, depth)
                if cheapest_route(catch_up, fresh, restore) != Route.RESTORE:
                    break
                box = await self._restore(lease)
                if box is not None:
                    await self._replace(box, depth)
                    restored = True
            except _TakeAnotherRoute as exc:
                log.info("restore of snapshot %s deferred (%s); taking another route", lease.snapshot_id, exc)
                break
            finally:
                with self._ctx.stats.timing("store"):
                    await self._ctx.tasks.cleanup(self._ctx.store.unlease(self._scope_key, lease.token))
            if restored:
                self._snapshot_depth = max(self._snapshot_depth, depth)
                return await self._replay_to(target)
        if route == Route.FRESH:
            await self._replace(await self._create(), 0)
        return await self._replay_to(target)

    async def _await_snapshot_under_way(self, catch_up: float, fresh: float) -> None:
        """Wait for the deepest snapshot on the rollout's path that another rollout is taking in this process (of
        the state it just reached, while this one waited for that call), when waiting for it and restoring it
        costs less than rebuilding the state another way. The lease that follows finds it in the graph."""
        done = self._depth if self._box is not None else 0
        depths = {step.node: depth for depth, step in enumerate(self._history.steps[done:], done + 1)}
        saving = self._ctx.saving.items()
        under_way = [(depths[node], task) for task, (key, node) in saving if key == self._scope_key and node in depths]
        if not under_way:
            return
        depth, task = max(under_way, key=lambda pair: pair[0])
        target, costs = len(self._history), self._costs
        restore = costs.snapshot + costs.restore + self._history.seconds(target, depth)
        if cheapest_route(catch_up, fresh, restore) == Route.RESTORE:
            with self._ctx.stats.timing("snapshotting"):
                await asyncio.wait([task])

    def applied(self) -> None:
        """The sandbox just executed the history's newest edge itself."""
        self._depth = len(self._history)

    async def execute(self, call: ToolCall) -> Any:
        """Run `call` in the sandbox (which must exist)."""
        assert self._box is not None
        return await self._box.execute(call)

    def maybe_snapshot(self) -> None:
        """Snapshot the sandbox at the cursor, off the critical path, where the rebuilds it is expected to save pay
        for it: rebuilding this state later (restore the nearest snapshot, or create, then replay) costs more than
        restoring it, times the restores the task's rollouts so far let one expect (`policy.Reuse`), more than
        saving it now.

        The call that led here answers at once; the snapshot is taken while the model generates its next turn, in
        a task of the cache (`ToolCache.flush` waits for it). Hits go on meanwhile; whatever needs the sandbox (the
        next miss, `drop`) waits for the snapshot first, since the sandbox must hold still while it is saved.
        Rollouts that waited for the call find the state in the graph once it is recorded, and rebuild it (as from
        any other state) if they miss there before. Taking the snapshot and recording it (or deleting it) runs to
        its end even if the rollout is cancelled or closed meanwhile: a snapshot the backend made is always either
        in the graph or deleted."""
        box = self._box
        if box is None or self._snapshot_failures >= MAX_SNAPSHOT_FAILURES or time.monotonic() < self._no_room_until:
            return
        depth, base = len(self._history), self._snapshot_depth
        rebuild = self._history.seconds(depth, base) + (self._costs.restore if base else self._costs.create)
        if not should_snapshot(rebuild, self._costs, self._reuse.expected(depth)):
            if should_snapshot(rebuild, self._costs):  # it would pay if one rollout came back: reuse decided
                self._ctx.stats.snapshots_skipped += 1
            return
        path = [self._history.root, *(s.node for s in self._history.steps)]
        saving = self._saving = self._ctx.tasks.spawn(self._snapshot_in_background(box, path))
        self._ctx.saving[saving] = (self._scope_key, path[-1])
        saving.add_done_callback(self._ctx.saving.pop)

    async def _saved(self) -> None:
        """Wait for a snapshot being taken of the sandbox (on the critical path now: counted as snapshotting)."""
        saving = self._saving
        if saving is not None and not saving.done():
            with self._ctx.stats.timing("snapshotting"):
                await asyncio.wait([saving])  # a cancelled waiter leaves the snapshot to finish (and pending)
        self._saving = None

    async def _snapshot_in_background(self, box: Sandbox, path: list[bytes]) -> None:
        try:
            with self._ctx.stats.timing("background"):
                await self._snapshot(box, path)
        except Exception as exc:  # nobody awaits this task: say what went wrong
            log.warning("recording a snapshot failed: %r", exc)

    async def _snapshot(self, box: Sandbox, path: list[bytes]) -> None:
        t0 = time.perf_counter()
        try:
            snapshot_id = await box.snapshot()
        except SandboxError as exc:
            # The backend's word that the sandbox is as it was: keep it. Out of room, try again later (room may be
            # freed); otherwise it cannot save this state: save no more.
            if no_room(exc):
                self._no_room_until = time.monotonic() + NO_ROOM_RETRY
                log.warning("snapshot failed for want of room (%s); trying again in %g s", exc, NO_ROOM_RETRY)
                return
            self._snapshot_failures = MAX_SNAPSHOT_FAILURES
            log.warning("snapshot failed (%s); this sandbox takes no more snapshots", exc)
            return
        except Exception as exc:
            self._snapshot_failures += 1
            log.warning("snapshot failed (%s); this sandbox is closed and rebuilt on the next call", exc)
            if self._box is box:  # a failure the backend did not expect may have left the sandbox half-saved
                self._box = None
                await self._ctx.tasks.cleanup(box.close())
            return
        self._snapshot_failures = 0
        self._costs.measured_snapshot.add(time.perf_counter() - t0)
        stats, tasks = self._ctx.stats, self._ctx.tasks
        stats.snapshots += 1
        self._reuse.taken += 1
        try:
            doomed = await self._ctx.store.add_snapshot(
                self._scope_key, self._origin, path, snapshot_id, self._ctx.snapshot_budget
            )
        except StoreError as exc:
            await tasks.cleanup(self._sandboxes.delete(snapshot_id))  # the store never heard of it
            self._ctx.store_failed(exc, took_effect=True)
            return
        if snapshot_id not in doomed and self._box is box:
            self._snapshot_depth = len(path) - 1
        for victim in doomed:
            stats.evictions += victim != snapshot_id
            self._ctx.warm.forget(self._origin, victim)
            await tasks.cleanup(self._sandboxes.delete(victim))

    async def drop(self) -> None:
        """Close the sandbox; one being snapshotted is closed by a task of the cache once the snapshot is done."""
        box, self._box = self._box, None
        saving, self._saving = self._saving, None
        if box is None:
            return
        if saving is not None and not saving.done():
            self._ctx.finish_later(self._ctx.tasks.cleanup_soon(_close_after(saving, box)))
        else:
            await self._ctx.tasks.cleanup(box.close())

    # -- routes ------------------------------------------------------------------------------------------

    async def _lease(self, first_depth: int, target: int) -> Lease | None:
        nodes = [step.node for step in self._history.steps[first_depth - 1 : target]]
        store, scope_key = self._ctx.store, self._scope_key

        async def unlease(lease: Lease | None) -> None:
            if lease is not None:
                await store.unlease(scope_key, lease.token)

        try:
            with self._ctx.stats.timing("store"):
                return await self._ctx.tasks.acquire(
                    store.lease(scope_key, self._origin, nodes, self._ctx.lease_ttl), unlease
                )
        except StoreError as exc:
            self._ctx.store_failed(exc)
            return None

    async def _restore(self, lease: Lease) -> Sandbox | None:
        """A sandbox restored from the leased snapshot; None if the snapshot is gone (dropped from the graph, its
        files deleted: ask for the next one); `_TakeAnotherRoute` if it is still there but cannot be restored
        now. A restore that fails without the backend saying the snapshot is gone is tried once more; if that
        fails too the snapshot is suspect, and dropped only once it failed `MAX_SUSPECT_FAILURES` times."""
        ctx = self._ctx
        box = ctx.warm.take(("fork", self._origin, lease.snapshot_id))
        if box is not None:
            ctx.stats.warm += 1
            self._reuse.restored += 1
            return box
        for attempt in (1, 2):
            t0 = time.perf_counter()
            try:
                with ctx.stats.timing("restoring"):
                    box = await ctx.tasks.acquire(self._sandboxes.restore(lease.snapshot_id), _close)
            except SandboxBusy as exc:
                raise _TakeAnotherRoute(str(exc)) from exc  # still there: come back to it later
            except SnapshotGone as exc:
                log.warning("snapshot %s is gone (%s); falling back", lease.snapshot_id, exc)
                break
            except Exception as exc:
                if no_room(exc):  # the machine's fault, not the snapshot's: it must not count against it
                    raise _TakeAnotherRoute(f"no room to restore it: {exc}") from exc
                log.warning("restore of snapshot %s failed (attempt %d: %s)", lease.snapshot_id, attempt, exc)
                continue
            ctx.suspects.pop(lease.snapshot_id, None)
            self._costs.measured_restore.add(time.perf_counter() - t0)
            ctx.stats.restores += 1
            self._reuse.restored += 1
            return box
        else:
            ctx.suspects[lease.snapshot_id] += 1
            if ctx.suspects[lease.snapshot_id] < MAX_SUSPECT_FAILURES:
                raise _TakeAnotherRoute("its restores failed; it is suspect")
        ctx.suspects.pop(lease.snapshot_id, None)
        await ctx.tasks.cleanup(ctx.store.drop_snapshot(self._scope_key, self._origin, lease.node, lease.snapshot_id))
        await ctx.tasks.cleanup(self._sandboxes.delete(lease.snapshot_id))
        return None

    async def _create(self) -> Sandbox:
        box = self._ctx.warm.take(("fresh", self._origin, self._scope_key))
        if box is not None:
            self._ctx.stats.warm += 1
            return box
        t0 = time.perf_counter()
        with self._ctx.stats.timing("creating"):
            box = await self._ctx.tasks.acquire(self._sandboxes.create(), _close)
        self._costs.measured_create.add(time.perf_counter() - t0)
        self._ctx.stats.creates += 1
        return box

    async def _replace(self, box: Sandbox, depth: int) -> None:
        old, self._box, self._depth = self._box, box, depth
        if old is not None:
            await self._ctx.tasks.cleanup(old.close())

    async def _replay_to(self, target: int) -> tuple[Sandbox, bool]:
        """Re-execute the edges between the sandbox and the cursor, checking each output against the recorded
        one, and its writes against the recorded ones where the sandbox vouches for them (it reported reads: see
        `Outcome`; an edge reused by what it read was recorded without executing it here). On a difference the
        rebuilt state may not be the one the rollout saw: stop there and say so (the sandbox now *is* the
        rollout's state, as it would be without a cache). A replay that raises leaves the sandbox in an unknown
        state: it is dropped and the exception reaches the caller."""
        stats = self._ctx.stats
        box = self._box
        assert box is not None
        while self._depth < target:
            step = self._history.steps[self._depth]
            t0 = time.perf_counter()
            try:
                outcome = await self.execute(step.call)
                if step.writes is not None:  # checked against what it read, which may come after the answer
                    outcome = await with_reads(outcome, step.call)
            except BaseException:
                await self.drop()
                raise
            elapsed = time.perf_counter() - t0
            stats.replays += 1
            stats.seconds_replaying += elapsed
            self._depth += 1
            if outcome.error or not _same_output(outcome.output, step.output) or _wrote_otherwise(outcome, step):
                stats.mismatches += 1
                log.warning("replay of %r gave a different result or wrote otherwise than recorded", step.call)
                self._depth = target
                return box, False
        return box, True


class _TakeAnotherRoute(Exception):
    """The leased snapshot exists but cannot be restored now: rebuild the state by another route."""


async def _close(box: Sandbox) -> None:
    await box.close()


async def _close_after(saving: asyncio.Task[None], box: Sandbox) -> None:
    await asyncio.wait([saving])
    await box.close()


async def with_reads(outcome: Outcome, call: ToolCall) -> Outcome:
    """`outcome` with its read set once made; without one if making it failed (a bug, not the files: digests that
    cannot be read give None), logged: the call is then one whose reads were not observed (no candidate; a replay
    leaves its writes unchecked)."""
    try:
        return await settled(outcome)
    except Exception as exc:
        log.warning("could not tell what %r read: %r", call.label()[:200], exc)
        return replace(outcome, reads_later=None)


def _same_output(output: Any, recorded: bytes) -> bool:
    try:
        blob = encode_output(output)
        return blob == recorded or decode_output(blob) == decode_output(recorded)
    except (TypeError, ValueError):
        return False


def _wrote_otherwise(outcome: Outcome, step: Step) -> bool:
    """Whether a replayed edge left other digests than recorded, where both are known and the sandbox vouches for
    its writes (they are reproducible only then: a workspace's carry times). A replay that changed nothing left
    what it read: a recorded write it did not read, or read otherwise, differs."""
    reads = outcome.reads
    if reads is None or step.writes is None:
        return False
    if outcome.changed is False:  # the state is as it was: the recorded writes must be what is there already
        return any(reads.get(key) != digest for key, digest in step.writes.items())
    return outcome.writes is not None and dict(outcome.writes) != step.writes
