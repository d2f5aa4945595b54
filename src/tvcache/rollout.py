"""One rollout's walk through the tool-call graph: the per-call algorithm of DESIGN.md.

A rollout holds a cursor (the node of its current state) and the history of edges that led there. A call is
looked up at the cursor; a hit returns the recorded result and, for an edge, moves the cursor. A miss is
claimed (so concurrent rollouts wait instead of executing it again), executed in the rollout's live sandbox
(`live.LiveSandbox`, brought to the cursor's state by the cheapest route), and recorded. The live sandbox is made
lazily: a rollout that only hits never starts one.

A rollout's calls run one at a time, in the order they were issued: the cursor a call is looked up at is the
state the previous call left, so overlapping calls (an `asyncio.gather` over one rollout) are queued, never
interleaved.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

from .calls import ToolCall, Tools
from .context import Context
from .graph import EDGE, MEMO, Entry, Kind, Scope, decode_output, encode_output
from .live import History, LiveSandbox, with_reads
from .reads import Candidate, Writes, base_digests_of, candidate_of, choose
from .sandboxes.base import Outcome, Sandbox, SandboxError, Sandboxes, ToolError, refusal
from .stores.base import Claim, StoreError, TaskInfo

__all__ = ["Result", "Rollout", "RolloutStats", "Source", "current_rollout"]

log = logging.getLogger("tvcache")

Source = Literal["memo", "edge", "waited", "reads", "executed"]

_current: ContextVar[Rollout | None] = ContextVar("tvcache_rollout", default=None)
# The rollouts whose `sandbox()` block this code runs in (also in tasks started inside the block).
_in_sandbox_block: ContextVar[tuple[Rollout, ...]] = ContextVar("tvcache_in_sandbox_block", default=())


def _writes_of(outcome: Outcome) -> dict[str, str] | None:
    """What a state-changing execution wrote, as a copy the rollout keeps (None: unknown)."""
    return None if outcome.writes is None else dict(outcome.writes)


def current_rollout() -> Rollout | None:
    """The rollout of the innermost `ToolCache.rollout()` block around this code (in this task or thread), if any:
    the handle tool wrappers use where a framework gives them none."""
    return _current.get()


@dataclass(frozen=True, slots=True)
class Result:
    """What `Rollout.call` returns.

    `output` is a fresh copy of the tool's output (mutate it freely). `hit` is True when it came from the cache:
    `source` says how ("memo": a call that did not change the state, "edge": one that did, "waited": another
    rollout was executing the same call and this one waited for its result, "reads": recorded by a rollout in
    another state, and everything it read is the same in this one; see `tvcache.reads`) or "executed" when it ran
    here.
    `seconds` is the wall time of the call as the caller saw it: the lookup, any wait for another rollout, and on
    a miss the sandbox's creation or restore, the replay of earlier calls and the execution itself (a snapshot of
    the state it reached is taken after it answered). `error` is True when the sandbox or tool failed (crash,
    timeout); such results are never cached.
    """

    output: Any
    hit: bool
    seconds: float
    source: Source
    error: bool = False


@dataclass(slots=True)
class RolloutStats:
    """One rollout's own counts (the cache's `stats()` sums every rollout's): for per-trace metrics."""

    calls: int = 0
    hits: int = 0
    executions: int = 0  # tool executions for this rollout's calls (replays not counted)
    seconds_executing: float = 0.0  # their wall time (the executions alone: no lookup, restore or replay)
    cpu_executions: int = 0  # of `executions`: those whose sandbox measured their CPU time (`Outcome.cpu_seconds`)
    cpu_seconds: float = 0.0  # the CPU time those used
    seconds_saved: float = 0.0  # recorded execution time of its hits

    def add_execution_time(self, seconds: float, cpu_seconds: float | None) -> None:
        """Count an execution's wall time and, where its sandbox measured it, its CPU time."""
        self.seconds_executing += seconds
        if cpu_seconds is not None:
            self.cpu_executions += 1
            self.cpu_seconds += cpu_seconds


class _Claim:
    """Our claim on a miss: kept alive while the call runs, and ended exactly once (recorded or released)."""

    def __init__(self, ctx: Context, scope_key: str, node: bytes, digest: bytes, token: str):
        self.ctx, self.scope_key, self.node, self.digest, self.token = ctx, scope_key, node, digest, token
        self.ended = False

    async def record(self, entry: Entry, reused: bool = False) -> None:
        with self.ctx.stats.timing("store"):
            await self.ctx.store.record(self.scope_key, self.node, self.digest, entry, self.token, reused=reused)
        self.ended = True

    async def release(self) -> None:
        if not self.ended:
            self.ended = True
            with self.ctx.stats.timing("store"):
                await self.ctx.tasks.cleanup(self.ctx.store.release(self.scope_key, self.node, self.digest, self.token))

    async def _refresh(self) -> None:
        ttl = self.ctx.claim_ttl
        while True:  # so waiters do not take a long call over as abandoned
            await asyncio.sleep(ttl / 3)
            with contextlib.suppress(Exception):
                await self.ctx.store.refresh(self.scope_key, self.node, self.digest, self.token, ttl)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[_Claim]:
        refresher = self.ctx.tasks.spawn(self._refresh(), background=True)
        try:
            yield self
        finally:
            refresher.cancel()
            await self.release()  # a no-op once recorded


class Rollout:
    """One rollout of a task: a walk through the task's tool-call graph, one call at a time.

    Made by `ToolCache.rollout()` (a block) or `ToolCache.open()` (closed by hand). `call()` answers each tool
    call from the cache when the rollout's history of state-changing calls matches one recorded, and executes
    it otherwise; `grade()` grades the final state the same way; `sandbox()` lends a live sandbox at the
    rollout's state for work the cache does not see. Calls run in the order issued; `stats` counts this
    rollout's own calls and hits.

    A rollout is *detached* (`detached`) once its state can no longer be reproduced from the graph (a failed
    or uncacheable call changed it, a replay differed): from then on its calls run in its own sandbox, uncached,
    exactly as without a cache. After `close()` (or the end of its block, or the cache's close) calls raise
    `RuntimeError`.
    """

    def __init__(self, ctx: Context, scope: Scope, sandboxes: Sandboxes, tools: Tools | None):
        self._ctx = ctx
        self._scope = scope
        self._scope_key = scope.key
        if tools is not None and not isinstance(tools, Tools):
            raise TypeError(f"tools must be a tvcache.Tools(read_only=..., uncacheable=..., key=...), got {tools!r}")
        self._tools = tools or Tools()
        self._history = History(scope.root)
        self._snapshot_reuse = ctx.reuse(self._scope_key)
        self._live = LiveSandbox(
            ctx, sandboxes, ctx.factories[sandboxes], self._scope_key, self._history, self._snapshot_reuse
        )
        # Reuse by what a call read: the factory's starting state, and what the edges passed since wrote.
        self._base = base_digests_of(sandboxes) if ctx.read_sets else None
        self._writes = Writes()
        self._lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._detached = False
        self._registered = False
        self._closed = False
        self.stats = RolloutStats()
        ctx.rollouts.add(self)

    @property
    def cursor(self) -> bytes:
        """The node of the rollout's current state in the graph."""
        return self._history.cursor

    @property
    def detached(self) -> bool:
        """True once the rollout's state is its sandbox's own, not the graph's: its calls run uncached."""
        return self._detached

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the rollout runs on (for blocking wrappers calling in from other threads)."""
        return self._loop

    # -- the per-call algorithm ------------------------------------------------------------------------

    async def call(self, tool: str, args: Mapping[str, Any] | str | None = None) -> Result:
        """Call `tool` with `args` (a mapping, or a JSON string as chat models emit it) at the rollout's state.

        A tool that fails, or refuses the call (an unknown tool, bad arguments; a sandbox's `ToolError`), returns
        a result with `error=True`; `SandboxError` means the sandbox machinery failed (the next call rebuilds the
        state in a new sandbox); `StoreError` (with `on_store_error="raise"`) that the store failed before the
        call ran. A call that ran is never reported as not having run."""
        start = time.perf_counter()
        self._check_usable("call()")
        call = self._tools.call(tool, args)
        async with self._lock:
            if self._closed or self._ctx.closed:  # closed while this call waited for the one before
                self._check_usable("call()")
            self._ctx.stats.calls += 1
            self.stats.calls += 1
            if self._detached:
                return await self._execute_direct(call, start)
            if tool in self._tools.uncacheable:
                return await self._execute_uncacheable(call, start)
            try:
                found = await self._lookup(call)
            except StoreError as exc:
                self._ctx.store_failed(exc)
                return await self._execute_direct(call, start)
            if isinstance(found, str):
                return await self._execute_claimed(call, found, start)
            hit = self._hit(call, *found, start)
            return hit if hit is not None else await self._execute_direct(call, start)

    async def grade(
        self, tool: str, args: Mapping[str, Any] | str | None = None, *, files: Mapping[str, str] | None = None
    ) -> Result:
        """Grade the rollout's final state: write `files` (path -> content, e.g. the task's hidden tests) with
        the sandbox's `write_file` tool, then run the grader call (`tool`, `args`), e.g. `bash` with the test
        command. Each step is a call like any other, recorded on the state it ran in, so rollouts that end in
        the same state are graded once and the others hit; a grader that fails (`error=True`) is not cached."""
        for path, content in sorted((files or {}).items()):
            written = await self.call("write_file", {"path": path, "content": content})
            if written.error:
                return written
        return await self.call(tool, args)

    @contextlib.asynccontextmanager
    async def sandbox(self) -> AsyncIterator[Sandbox]:
        """A live sandbox at the rollout's current state, made by the cheapest route, for anything the cache does
        not see (a reward computed by hand, files to collect). The rollout's calls wait until the block ends.

        Whatever happens to it can never reach the cache: the cache records only what `call` executes, and when
        the block ends the sandbox is closed, so the rollout's next call rebuilds its state from the graph. (A
        detached rollout records nothing and cannot rebuild: its sandbox is its state, so it is handed over as it
        is and kept, with whatever the block did to it.)"""
        self._check_usable("sandbox()")
        async with self._lock:
            self._check_usable("sandbox()")
            box = await self._sandbox_at_cursor(use_store=True)
            inside = _in_sandbox_block.set((*_in_sandbox_block.get(), self))
            try:
                yield box
            finally:
                _in_sandbox_block.reset(inside)
                if not self._detached:
                    await self._live.drop()

    def _check_usable(self, what: str) -> None:
        """Raise at once for what could only fail or hang: a closed rollout or cache, or a call from inside this
        rollout's own `sandbox()` block (it would wait for the block to end, and the block for it)."""
        if self._closed:
            raise RuntimeError(f"this rollout of {self._scope.task!r} is closed; start a new one")
        self._ctx.check_open()
        if self in _in_sandbox_block.get():
            raise RuntimeError(
                f"rollout.{what} inside `async with rollout.sandbox()` of the same rollout would wait forever for "
                "the block to end: make the call after the block, or use the sandbox the block gave you directly"
            )

    async def _lookup(self, call: ToolCall) -> tuple[Entry, Source] | str:
        """The entry at the cursor and how it was found, or a claim token of ours to execute the call under."""
        store, scope_key, node, ttl = self._ctx.store, self._scope_key, self.cursor, self._ctx.claim_ttl
        found = await self._claiming_lookup(node, call.digest)
        while isinstance(found, Claim) and found.token is None:
            self._ctx.stats.waits += 1  # another rollout is executing this very call: wait for its entry
            with self._ctx.stats.timing("waiting"):
                entry = await store.wait(scope_key, node, call.digest, ttl)
            if entry is not None:
                return entry, "waited"
            found = await self._claiming_lookup(node, call.digest)  # its claim ended without an entry
        if found is None:
            raise StoreError("the store neither found nor claimed a call it was asked to claim")
        self._ctx.health.answered()
        return (found, found.kind) if isinstance(found, Entry) else str(found.token)

    async def _claiming_lookup(self, node: bytes, digest: bytes) -> Entry | Claim | None:
        ctx, scope_key = self._ctx, self._scope_key
        lookup = ctx.store.lookup(scope_key, node, digest, ctx.claim_ttl)
        with ctx.stats.timing("store"):
            if ctx.claims_in_process:  # taken after the lookup's last await: never parted from its caller
                return await lookup

            async def release(found: Entry | Claim | None) -> None:  # a claim won by a lookup whose caller is gone
                if isinstance(found, Claim) and found.token is not None:
                    await ctx.store.release(scope_key, node, digest, found.token)

            return await ctx.tasks.acquire(lookup, release)  # a task: dear next to a hit, not next to a round trip

    def _hit(self, call: ToolCall, entry: Entry, source: Source, start: float) -> Result | None:
        """The result of a recorded entry; None (counted as a store error) if the entry does not decode."""
        try:
            output = decode_output(entry.output)
        except ValueError as exc:
            # Recorded by a broken client, or damaged at rest: as useless as an unreachable store.
            self._ctx.store_failed(StoreError(f"a stored entry of {call.tool!r} does not decode: {exc}"))
            return None
        for stats in (self._ctx.stats, self.stats):
            stats.hits += 1
            stats.seconds_saved += entry.seconds
        if entry.kind == EDGE:
            self._advance(call, entry.output, entry.seconds, entry.writes)
            self._snapshot_reuse.reached(len(self._history), made=False)
        return Result(output, True, time.perf_counter() - start, source)

    def _advance(self, call: ToolCall, output: bytes, seconds: float, writes: dict[str, str] | None) -> None:
        """Move the rollout past a state-changing call that wrote `writes` (None: unknown)."""
        self._history.advance(call, output, seconds, writes)
        self._writes.apply(writes)

    def _kind(self, call: ToolCall, outcome: Outcome) -> Kind:
        """Annotation first, then what the sandbox observed, else assume the state changed."""
        if call.tool in self._tools.read_only or outcome.changed is False:
            return MEMO
        return EDGE

    async def _execute_claimed(self, call: ToolCall, token: str, start: float) -> Result:
        claim = _Claim(self._ctx, self._scope_key, self.cursor, call.digest, token)
        async with claim.held():
            reused = await self._reuse(call, claim, start)
            if reused is not None:
                return reused
            await self._sandbox_at_cursor(use_store=True)
            if self._detached:  # rebuilding the state showed a nondeterministic tool
                await claim.release()
                return await self._execute_direct(call, start)
            outcome, blob, seconds = await self._execute(call)
            if outcome.error:
                return self._failed(call, outcome, blob, start)
            kind = self._kind(call, outcome)
            writes = _writes_of(outcome) if kind == EDGE else None
            before, later = self._writes.known, outcome.reads_later is not None
            if later and before is not None and kind == EDGE:
                before = dict(before)  # its candidate is made once the reads come, after the rollout moved on
            candidate = None if later else await self._candidate(call, kind, outcome, blob, seconds, before)
            if kind == EDGE:
                self._advance(call, blob, seconds, writes)
                self._live.applied()
                self._live.maybe_snapshot()  # in the background: the answer does not wait for it
                self._snapshot_reuse.reached(len(self._history), made=True)
            if len(blob) > self._ctx.max_output_bytes:
                self._ctx.stats.uncached += 1
            else:
                await self._record(claim, Entry(kind, blob, seconds, call.label(), writes))
                if later:
                    self._keep_later(call, self._candidate(call, kind, outcome, blob, seconds, before))
                else:
                    await self._keep(call, candidate)
        return self._executed(blob, start)

    async def _reuse(self, call: ToolCall, claim: _Claim, start: float) -> Result | None:
        """The second phase of a lookup that missed (`tvcache.reads`): a result of the same call recorded in
        another state that read nothing this state holds differently, recorded here under our claim (waiters get
        it, the next identical call here hits it exactly): a memo, or for a state-changing call an edge with the
        candidate's writes, which moves the rollout on as a hit of that edge would. None if there is none, or the
        rollout's state is not known as content."""
        base, state = self._base, self._writes.known
        if base is None or state is None:
            return None
        ctx = self._ctx
        try:
            with ctx.stats.timing("store"):
                candidates = await ctx.store.candidates(self._scope_key, call.digest)
            found = await choose(candidates, state, base)
        except StoreError as exc:
            ctx.store_failed(exc)
            return None
        if found is None:
            return None
        kind = MEMO if found.writes is None else EDGE
        entry = Entry(kind, found.output, found.seconds, call.label(), found.writes)
        result = self._hit(call, entry, "reads", start)  # decoded and counted as any hit, before it is recorded
        if result is None:
            return None
        await self._record(claim, entry, reused=True)
        ctx.stats.read_set_hits += 1
        ctx.stats.read_set_edges += kind == EDGE
        return dataclasses.replace(result, seconds=time.perf_counter() - start)  # the record is the caller's wait too

    async def _candidate(
        self,
        call: ToolCall,
        kind: Kind,
        outcome: Outcome,
        blob: bytes,
        seconds: float,
        before: Mapping[str, str] | None,
    ) -> Candidate | None:
        """The candidate an execution makes for rollouts in other states, once the sandbox has worked out what the
        call read (`Outcome.reads_later`); `before` is the rollout's state before the call (a state-changing call's
        hazards are read in it)."""
        if self._base is None:
            return None
        outcome = await with_reads(outcome, call)  # reads None if making them failed: no candidate
        edge = kind == EDGE
        return await candidate_of(outcome, blob, seconds, call.label(), edge=edge, before=before, base=self._base)

    def _keep_later(self, call: ToolCall, candidate: Coroutine[Any, Any, Candidate | None]) -> None:
        """`_keep` the candidate once made, in a task of the cache that `ToolCache.flush` waits for: the answer does
        not wait for the sandbox to digest what the call read."""
        ctx = self._ctx

        async def keep() -> None:
            with ctx.stats.timing("background"):
                made = await candidate
            await self._keep(call, made)

        ctx.finish_later(ctx.tasks.spawn(keep()))

    async def _keep(self, call: ToolCall, candidate: Candidate | None) -> None:
        """Keep a result with what it read (and wrote), for rollouts in other states."""
        if candidate is None:
            return
        try:
            with self._ctx.stats.timing("store"):
                await self._ctx.store.add_candidate(self._scope_key, call.digest, candidate)
        except StoreError as exc:
            self._ctx.store_failed(exc, took_effect=True)  # the call ran: its caller gets its result

    async def _record(self, claim: _Claim, entry: Entry, reused: bool = False) -> None:
        try:
            if not self._registered:  # once per rollout, and only for rollouts that add to the graph
                s = self._scope
                with self._ctx.stats.timing("store"):
                    await self._ctx.store.register(TaskInfo(self._scope_key, s.namespace, s.task, s.fingerprint))
                self._registered = True
            await claim.record(entry, reused)
        except StoreError as exc:
            self._ctx.store_failed(exc, took_effect=True)  # the call ran: its caller gets its result

    async def _execute_direct(self, call: ToolCall, start: float) -> Result:
        """Execute without recording: the rollout is detached, or the store failed."""
        await self._sandbox_at_cursor(use_store=False)
        outcome, blob, _ = await self._execute(call)
        self._ctx.stats.uncached += 1
        if outcome.error:
            return self._failed(call, outcome, blob, start)
        if not self._detached and self._kind(call, outcome) == EDGE:
            # The store is down but the call is deterministic: keep the cursor right, so the rollout
            # can use the cache again once the store is back.
            self._advance(call, blob, 0.0, _writes_of(outcome))
            self._live.applied()
        return self._executed(blob, start)

    async def _execute_uncacheable(self, call: ToolCall, start: float) -> Result:
        await self._sandbox_at_cursor(use_store=True)
        outcome, blob, _ = await self._execute(call)
        self._ctx.stats.uncached += 1
        if outcome.error:
            return self._failed(call, outcome, blob, start)
        if self._kind(call, outcome) == EDGE:
            # The new state depends on something outside the history (the clock, the network): no later
            # call of this rollout can be answered from, or recorded into, the shared graph.
            self._detach(f"uncacheable tool {call.tool!r} changed the state")
        return self._executed(blob, start)

    def _failed(self, call: ToolCall, outcome: Outcome, blob: bytes, start: float) -> Result:
        """A failed execution (timeout, crash) is never cached. If it may have changed the state, the state
        is not reproducible, so the rollout goes on in its own sandbox exactly as it would without a cache."""
        self._ctx.stats.failures += 1
        if not self._detached and outcome.changed is not False and call.tool not in self._tools.read_only:
            self._detach(f"failed call {call.tool!r} may have changed the state")
        return self._executed(blob, start, error=True)

    def _executed(self, blob: bytes, start: float, error: bool = False) -> Result:
        return Result(decode_output(blob), False, time.perf_counter() - start, "executed", error)

    def _detach(self, why: str) -> None:
        log.info("rollout of %s detached: %s", self._scope.task, why)
        self._detached = True
        self._ctx.stats.detached += 1

    async def _sandbox_at_cursor(self, use_store: bool) -> Sandbox:
        if self._detached and not self._live.exists:
            raise SandboxError("a detached rollout lost its sandbox; its state cannot be rebuilt")
        box, reproduced = await self._live.at_cursor(use_store and not self._detached)
        if not reproduced:
            self._detach("a replayed call did not reproduce its recorded result")
        return box

    async def _execute(self, call: ToolCall) -> tuple[Outcome, bytes, float]:
        """Run one call in the live sandbox; return the outcome, its encoded output and the seconds it took.

        A sandbox that raises, or answers with something that is not an Outcome of a str, bytes or JSON output,
        is in an unknown state: it is dropped (the next call rebuilds one at the cursor) and the error reaches
        the caller; in a detached rollout, whose sandbox is its state and cannot be rebuilt, it is kept (without
        a cache, a framework would go on in that sandbox too). A `ToolError` (the sandbox refused the call before
        running it) is answered as built-in sandboxes answer a bad call: an error result, `Error: ...`."""
        stats = self._ctx.stats
        stats.executions += 1
        self.stats.executions += 1
        t0 = time.perf_counter()
        try:
            try:
                outcome = await self._live.execute(call)
            except ToolError as exc:  # refused before it ran (a remote server's 422): answered as built-ins do
                outcome = refusal(f"Error: {exc}")
            seconds = time.perf_counter() - t0
            if not isinstance(outcome, Outcome):
                raise SandboxError(f"Sandbox.execute must return an Outcome, got {type(outcome).__name__}")
            blob = encode_output(outcome.output)
        except BaseException:
            stats.failures += 1
            if not self._detached:
                await self._live.drop()
            raise
        stats.seconds_executing += seconds
        self.stats.add_execution_time(seconds, outcome.cpu_seconds)
        return outcome, blob, seconds

    async def close(self) -> None:
        """Close the rollout's sandbox; later calls raise. Waits for a call in progress to finish. Idempotent."""
        if self in _in_sandbox_block.get():
            raise RuntimeError("rollout.close() inside `async with rollout.sandbox()` would wait forever for the block")
        async with self._lock:
            self._closed = True
            await self._live.drop()
        self._ctx.rollouts.discard(self)
