"""Snapshots off the critical path: a call answers before the snapshot of the state it reached is taken; the sandbox
holds still until it is; `flush()` waits for it; a closed or cancelled rollout leaks neither the snapshot nor its
sandbox. (Answers stay those of the uncached oracle: tests/test_oracle.py, with snapshots in the background.)"""

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
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r, _opened_at_the_end(gate):
                first = await asyncio.wait_for(r.call(*WRITES[0]), GUARD)  # answered, the snapshot still blocked
                assert first.source == "executed" and boxes.snapshots == []
                async with cache.rollout("t", boxes, kv.TOOLS) as other, _opened_at_the_end(gate):
                    # The entry is there: others hit it.
                    assert (await asyncio.wait_for(other.call(*WRITES[0]), GUARD)).source == "edge"
                    # A miss there: waiting for the snapshot under way and restoring it costs less than replaying
                    # the write in a new sandbox, so it waits.
                    other_read = asyncio.create_task(other.call("read", {"key": "a"}))
                    # The rollout's next state-changing miss needs its sandbox, which must hold still while saved.
                    second = asyncio.create_task(r.call(*WRITES[1]))
                    await asyncio.sleep(0.2)
                    assert not second.done() and not other_read.done() and boxes.snapshots == []
                    boxes.snapshot_gate.set()
                    assert (await asyncio.wait_for(second, GUARD)).source == "executed"
                    read = await asyncio.wait_for(other_read, GUARD)
                    assert (read.source, read.output) == ("executed", "v")
                    assert (cache.stats()["restores"], boxes.created) == (1, 1)  # the other restored the snapshot
            async with cache.rollout("t", boxes, kv.TOOLS) as r:  # a fresh rollout rebuilds the state
                for write in WRITES:
                    assert (await r.call(*write)).hit
                assert (await r.call("list", {})).output == ["a", "b"]
        assert not boxes.open  # every sandbox closed, the one closed while it was being saved too
        return cache.stats()  # after close(), which waited for the snapshots under way

    stats = asyncio.run(main())
    assert stats["snapshots"] >= 1  # (the blocked one measured as dear, so the second may not be worth saving)
    assert stats["seconds_background"] > 0 and stats["seconds_snapshotting"] > 0  # the misses waited


def test_a_rollout_closed_during_its_snapshot_closes_its_sandbox_after_it() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        boxes.snapshot_gate = gate = asyncio.Event()
        async with tvcache.ToolCache() as cache, _opened_at_the_end(gate):
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await asyncio.wait_for(r.call(*WRITES[0]), GUARD)
            assert len(boxes.open) == 1 and boxes.snapshots == []  # the block ended; the snapshot holds the box
            boxes.snapshot_gate.set()
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                assert (await r.call(*WRITES[0])).hit
                await r.call("list", {})
        assert not boxes.open and len(boxes.snapshots) == 1

    asyncio.run(main())


def test_flush_waits_for_the_snapshots_under_way_and_stats_count_them() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        boxes.snapshot_gate = gate = asyncio.Event()
        async with tvcache.ToolCache() as cache, _opened_at_the_end(gate), cache.rollout("t", boxes, kv.TOOLS) as r:
            await asyncio.wait_for(r.call(*WRITES[0]), GUARD)
            flushed = asyncio.create_task(cache.flush())
            await asyncio.sleep(0.2)
            assert not flushed.done() and cache.stats()["snapshots"] == 0  # still blocked: not counted yet
            gate.set()
            await asyncio.wait_for(flushed, GUARD)
            assert cache.stats()["snapshots"] == 1 and len(boxes.snapshots) == 1
            snapshots = await cache.store.snapshots(cache.scope("t", boxes).key, cache._ctx.factories[boxes].origin)
            assert [s.snapshot_id for s in snapshots] == boxes.snapshots  # recorded in the graph, not only made
            await cache.flush()  # nothing under way: returns at once

    asyncio.run(main())


def test_a_rollout_cancelled_during_its_snapshot_leaks_nothing() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        boxes.snapshot_gate = gate = asyncio.Event()
        boxes.close_delay = 0.2
        answered = asyncio.Event()

        async def rollout(cache: tvcache.ToolCache) -> None:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call(*WRITES[0])
                answered.set()
                await r.call(*WRITES[1])  # waits for the blocked snapshot: cancelled there

        async with tvcache.ToolCache() as cache, _opened_at_the_end(gate):
            task = asyncio.create_task(rollout(cache))
            await asyncio.wait_for(answered.wait(), GUARD)
            await asyncio.sleep(0.1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert len(boxes.open) == 1  # held by the snapshot under way, closed once it is done
            gate.set()
            await asyncio.wait_for(cache.flush(), GUARD)  # the snapshot, and the sandbox's close after it
            assert not boxes.open and len(boxes.snapshots) == 1 and cache.stats()["snapshots"] == 1
            async with cache.rollout("t", boxes, kv.TOOLS) as r:  # the snapshot is usable: restored, not rebuilt
                assert (await r.call(*WRITES[0])).hit
                assert (await r.call("list", {})).output == ["a"]
            assert cache.stats()["restores"] == 1

    asyncio.run(main())
