"""Snapshots off the critical path (`ToolCache(background_snapshots=True)`): a call answers before the snapshot of
the state it reached is taken; the sandbox holds still until it is; answers stay those of the uncached oracle."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import kv
import tvcache
from faults import FaultySandboxes

# Dearer to redo than to save, so every one of these writes is snapshotted.
WRITES = [("write", {"key": k, "value": "v", "delay": 0.05}) for k in "ab"]
GUARD = 60.0  # seconds: a call that waited for the blocked snapshot would never return; fail instead of hanging


@contextlib.asynccontextmanager
async def _opened_at_the_end(gate: asyncio.Event) -> AsyncIterator[None]:
    """Open the gate when the block ends, also on a failure: the cache's close waits for the blocked snapshot."""
    try:
        yield
    finally:
        gate.set()


def test_the_answer_does_not_wait_for_the_snapshot_and_the_next_miss_does() -> None:
    async def main() -> dict[str, Any]:
        boxes = FaultySandboxes(kv.sandboxes())
        boxes.snapshot_gate = gate = asyncio.Event()  # every snapshot blocks until the test opens it
        async with tvcache.ToolCache(background_snapshots=True) as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r, _opened_at_the_end(gate):
                first = await asyncio.wait_for(r.call(*WRITES[0]), GUARD)  # answered, the snapshot still blocked
                assert first.source == "executed" and boxes.snapshots == []
                async with cache.rollout("t", boxes, kv.TOOLS) as other:  # the entry is there: others hit it
                    assert (await asyncio.wait_for(other.call(*WRITES[0]), GUARD)).source == "edge"
                    read = await asyncio.wait_for(other.call("read", {"key": "a"}), GUARD)  # a miss in its own box
                    assert (read.source, read.output) == ("executed", "v")
                read = await asyncio.wait_for(r.call("read", {"key": "a"}), GUARD)  # a hit needs no sandbox
                assert (read.source, read.output) == ("memo", "v") and boxes.snapshots == []
                # The rollout's next state-changing miss needs its sandbox, which must hold still while it is saved.
                second = asyncio.create_task(r.call(*WRITES[1]))
                await asyncio.sleep(0.2)
                assert not second.done() and boxes.snapshots == []
                boxes.snapshot_gate.set()
                assert (await asyncio.wait_for(second, GUARD)).source == "executed"
            async with cache.rollout("t", boxes, kv.TOOLS) as r:  # a fresh rollout rebuilds the state
                for write in WRITES:
                    assert (await r.call(*write)).hit
                assert (await r.call("list", {})).output == ["a", "b"]
        assert not boxes.open  # every sandbox closed, the one closed while it was being saved too
        return cache.stats()  # after close(), which waited for the snapshots under way

    stats = asyncio.run(main())
    assert stats["snapshots"] >= 1  # (the blocked one measured as dear, so the second may not be worth saving)
    assert stats["seconds_background"] > 0 and stats["seconds_snapshotting"] > 0  # the second write's miss waited


def test_a_rollout_closed_during_its_snapshot_closes_its_sandbox_after_it() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        boxes.snapshot_gate = gate = asyncio.Event()
        async with tvcache.ToolCache(background_snapshots=True) as cache, _opened_at_the_end(gate):
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await asyncio.wait_for(r.call(*WRITES[0]), GUARD)
            assert len(boxes.open) == 1 and boxes.snapshots == []  # the block ended; the snapshot holds the box
            boxes.snapshot_gate.set()
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                assert (await r.call(*WRITES[0])).hit
                await r.call("list", {})
        assert not boxes.open and len(boxes.snapshots) == 1

    asyncio.run(main())
