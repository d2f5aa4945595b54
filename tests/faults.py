"""Wrappers that inject faults we cannot cause in the real thing on demand: a sandbox that raises or dies
mid-call, and a store that goes away. Everything else they pass through to the real backends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from typing import Any

from tvcache import Outcome, SandboxError, ToolCall
from tvcache.stores import StoreError


class FaultyBox:
    def __init__(self, factory: FaultySandboxes, inner: Any):
        self.factory, self.inner, self.dead, self.closed = factory, inner, False, False

    async def execute(self, call: ToolCall) -> Outcome:
        if self.dead:
            raise SandboxError("sandbox is dead")
        fault = self.factory.fault(call) if self.factory.fault else None
        if fault == "raise":  # the tool raised after doing (part of) its work
            await self.inner.execute(call)
            raise RuntimeError(f"tool blew up on {call.tool}")
        if fault == "die":  # the sandbox process went away mid-call, after part of the work
            await self.inner.execute(call)
            self.dead = True
            raise SandboxError("sandbox died")
        if fault == "error":
            outcome = await self.inner.execute(call)
            return Outcome(f"timeout after partial work: {outcome.output}", changed=True, error=True)
        return await self.inner.execute(call)

    async def snapshot(self) -> str:
        if self.factory.snapshot_gate is not None:  # a snapshot that takes as long as the test says
            await self.factory.snapshot_gate.wait()
        await asyncio.sleep(self.factory.snapshot_delay)  # what saving a bigger state costs (a layer, a commit)
        snapshot_id = await self.inner.snapshot()
        self.factory.snapshots.append(snapshot_id)
        return str(snapshot_id)

    async def close(self) -> None:
        assert not self.closed, "sandbox closed twice"
        self.closed = True
        await asyncio.sleep(self.factory.close_delay)  # what removing a container costs
        self.factory.open.discard(self)
        await self.inner.close()


class FaultySandboxes:
    def __init__(self, inner: Any):
        self.inner = inner
        self.fault: Callable[[ToolCall], str | None] | None = None
        self.snapshot_gate: asyncio.Event | None = None
        self.snapshot_delay = 0.0
        self.close_delay = 0.0
        self.open: set[FaultyBox] = set()
        self.deleted: list[str] = []
        self.snapshots: list[str] = []  # every snapshot its sandboxes made
        self.created = 0
        self.restored = 0
        self.failing_restores = 0
        self.failing_creates = 0

    @property
    def fingerprint(self) -> str:
        return str(self.inner.fingerprint)

    async def create(self) -> FaultyBox:
        if self.failing_creates:
            self.failing_creates -= 1
            raise SandboxError("no room for another sandbox")
        self.created += 1
        box = FaultyBox(self, await self.inner.create())
        self.open.add(box)
        return box

    async def restore(self, snapshot_id: str) -> FaultyBox:
        if self.failing_restores:  # a restore that fails for a reason that may pass (a host restarting)
            self.failing_restores -= 1
            raise OSError("connection reset while restoring")
        box = FaultyBox(self, await self.inner.restore(snapshot_id))
        self.restored += 1
        self.open.add(box)
        return box

    async def delete(self, snapshot_id: str) -> None:
        self.deleted.append(snapshot_id)
        await self.inner.delete(snapshot_id)


class FaultyReadingSandboxes(FaultySandboxes):
    """`FaultySandboxes` over a factory whose sandboxes report what calls read (`BaseDigests`): the cache then
    reuses results by their read sets through it too."""

    async def base_digests(self, keys: Collection[str]) -> Mapping[str, str]:
        return await self.inner.base_digests(keys)  # type: ignore[no-any-return]


class FlakyStore:
    """Delegates to a real store; while `down`, every operation raises as an unreachable server would, and so
    does every operation named in `failing`. An operation named in `held` waits, before or after doing its
    work, until the test sets the event (`reached[name]` is set once it got there): a network store whose
    request or reply is slow, where a cancellation lands before or after the server acted."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.down = False
        self.failing: set[str] = set()
        self.held: dict[str, asyncio.Event] = {}
        self.reached: dict[str, asyncio.Event] = {}
        self.before: set[str] = set()

    def hold(self, name: str, before: bool = False) -> asyncio.Event:
        self.reached[name] = asyncio.Event()
        self.held[name] = asyncio.Event()
        if before:
            self.before.add(name)
        return self.held[name]

    async def _wait(self, name: str) -> None:
        self.reached[name].set()
        await self.held[name].wait()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            if (self.down or name in self.failing) and name != "close":
                raise StoreError("connection refused")
            if name in self.held and name in self.before:
                await self._wait(name)
            result = await method(*args, **kwargs)
            if name in self.held and name not in self.before:
                await self._wait(name)
            return result

        return call
