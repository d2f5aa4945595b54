"""Faults: a sandbox that raises or dies mid-call, a snapshot deleted behind the cache's back, a store that
goes away. In each case: no wrong result, nothing cached from a failure, no leaked lease or open sandbox."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kv
import tvcache
from faults import FaultySandboxes, FlakyStore
from tvcache.stores.memory import MemoryStore

W = {"key": "a", "value": "x"}
APPEND = {"key": "a", "value": "1"}


async def assert_no_leases(cache: tvcache.ToolCache, boxes: Any, task: str = "t") -> None:
    records = await cache.store.snapshots(cache.scope(task, boxes).key)
    assert not any(r.leased for r in records)


@pytest.mark.parametrize("fault", ["raise", "die"])
def test_a_sandbox_failing_mid_call_caches_nothing_and_leaks_nothing(fault: str) -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        boxes.fault = lambda call: fault if call.tool == "append" else None
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", W)
                with pytest.raises((RuntimeError, tvcache.SandboxError)):
                    await r.call("append", APPEND)
                assert not boxes.open  # the broken sandbox was dropped at once
                # The failed call did not happen as far as the cache knows: the next call runs in a
                # rebuilt sandbox at the cursor, not in the half-written one.
                assert (await r.call("read", {"key": "a"})).output == "x"
            boxes.fault = None
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", W)
                again = await r.call("append", APPEND)
                assert (again.hit, again.output) == (False, 2)
            await assert_no_leases(cache, boxes)
            assert cache.stats()["failures"] == 1
        assert not boxes.open

    asyncio.run(main())


def test_a_failed_claim_hands_over_to_a_waiting_rollout() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache() as cache:

            async def first() -> None:
                async with cache.rollout("t", boxes, kv.TOOLS) as r:
                    with pytest.raises(RuntimeError):
                        await r.call("append", {"key": "a", "value": "1", "delay": 0.05, "boom": 1})

            async def second() -> Any:
                await asyncio.sleep(0.01)
                async with cache.rollout("t", boxes, kv.TOOLS) as r:
                    return await r.call("append", {"key": "a", "value": "1", "boom": 1})

            # Both calls share a key; the first raises while the second waits on its claim.
            boxes.fault = lambda call: "raise" if call.args.get("delay") else None
            _, res = await asyncio.gather(first(), second())
            assert (res.output, res.hit, res.source) == (1, False, "executed")
            assert cache.stats()["waits"] == 1
        assert not boxes.open

    asyncio.run(main())


def test_error_outcomes_are_not_cached_and_the_rollout_keeps_its_real_state() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        boxes.fault = lambda call: "error" if call.tool == "append" else None
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", W)
                failed = await r.call("append", APPEND)
                assert failed.error and not failed.hit
                assert r.detached  # its partial effect is real but not reproducible
                assert (await r.call("read", {"key": "a"})).output == "x1"
            boxes.fault = None
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", W)
                assert (await r.call("read", {"key": "a"})).output == "x"  # the detached read was not kept
                assert not (await r.call("append", APPEND)).hit
        assert not boxes.open

    asyncio.run(main())


def test_restoring_a_deleted_snapshot_falls_back_and_forgets_it() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        slow = dict(W, delay=0.05)
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", slow)
            await cache.flush()
            (record,) = await cache.store.snapshots(cache.scope("t", boxes).key)
            await boxes.inner.delete(record.snapshot_id)  # gone behind the cache's back
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", slow)
                assert (await r.call("read", {"key": "a"})).output == "x"
            assert await cache.store.snapshots(cache.scope("t", boxes).key) == []
            stats = cache.stats()
            assert (stats["restores"], stats["replays"]) == (0, 1)
        assert not boxes.open

    asyncio.run(main())


def test_a_lost_deepest_snapshot_falls_back_to_the_next_shallower_one() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        path = [("write", {"key": k, "value": k, "delay": 0.05}) for k in "abc"]
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                for tool, args in path:
                    await r.call(tool, args)
            await cache.flush()
            records = await cache.store.snapshots(cache.scope("t", boxes).key)
            assert len(records) == 3  # one per slow write
            deepest = max(records, key=lambda rec: rec.last_used)
            await boxes.inner.delete(deepest.snapshot_id)  # lost with its host, say
            before = cache.stats()
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                for tool, args in path:
                    assert (await r.call(tool, args)).hit
                assert (await r.call("read", {"key": "c"})).output == "c"  # a memo: hit, no sandbox needed
                assert (await r.call("append", {"key": "c", "value": "!"})).output == 2  # a miss at depth 3
            stats = cache.stats()
            # The deepest restore failed and was forgotten; the one below it served, with one replayed write.
            assert (stats["restores"] - before["restores"], stats["replays"] - before["replays"]) == (1, 1)
            assert len(await cache.store.snapshots(cache.scope("t", boxes).key)) >= 2
        assert not boxes.open

    asyncio.run(main())


def test_a_busy_restore_takes_another_route_and_keeps_the_snapshot() -> None:
    class Full(FaultySandboxes):
        async def restore(self, snapshot_id: str) -> Any:
            raise tvcache.SandboxBusy("the holder is at capacity (429)")

    async def main() -> None:
        boxes = Full(kv.sandboxes())
        slow = dict(W, delay=0.05)
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", slow)
            await cache.flush()
            (record,) = await cache.store.snapshots(cache.scope("t", boxes).key)
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", slow)
                assert (await r.call("append", {"key": "a", "value": "y"})).output == 2
            kept = await cache.store.snapshots(cache.scope("t", boxes).key)
            assert record.snapshot_id in {k.snapshot_id for k in kept}  # still known, for a later restore
            assert (cache.stats()["restores"], cache.stats()["replays"]) == (0, 1)
        assert not boxes.open

    asyncio.run(main())


def test_a_store_outage_slows_rollouts_down_but_never_misleads_them() -> None:
    calls = [("write", W), ("read", {"key": "a"}), ("append", APPEND), ("read", {"key": "a"}), ("list", {})]

    async def main() -> None:
        store = FlakyStore(MemoryStore())
        boxes = FaultySandboxes(kv.sandboxes())
        expected = await kv.execute_uncached(kv.sandboxes(), calls, kv.TOOLS)
        async with tvcache.ToolCache(store=store) as cache:

            async def rollout(down_at: int | None, up_at: int | None) -> list[Any]:
                async with cache.rollout("t", boxes, kv.TOOLS) as r:
                    out = []
                    for i, (tool, args) in enumerate(calls):
                        store.down = store.down if down_at != i else True
                        store.down = store.down if up_at != i else False
                        out.append((await r.call(tool, args)).output)
                    return out

            assert await rollout(None, None) == expected  # fills the cache
            assert await rollout(0, None) == expected  # store gone from the start
            store.down = False
            assert await rollout(1, 3) == expected  # gone in the middle, back before the end
            errors = cache.stats()["store_errors"]
            assert errors >= 6
            store.down = False
            hits_before = cache.stats()["hits"]
            assert await rollout(None, None) == expected
            assert cache.stats()["hits"] - hits_before == len(calls)
        assert not boxes.open

    asyncio.run(main())


def test_a_sandbox_answering_with_a_non_json_output_fails_the_call_and_frees_its_claim() -> None:
    async def world(state: dict[str, Any], call: tvcache.ToolCall) -> Any:
        if call.tool == "weird":
            await asyncio.sleep(0.05)
            return {1, 2}  # a set has no JSON form
        return await kv.run(state, call)

    async def main() -> None:
        boxes = FaultySandboxes(tvcache.PythonSandboxes(make=dict, run=world, fingerprint="weird"))
        async with tvcache.ToolCache(claim_ttl=30) as cache:

            async def one() -> Any:
                async with cache.rollout("t", boxes, kv.TOOLS) as r:
                    return await r.call("weird", {})

            results = await asyncio.wait_for(asyncio.gather(one(), one(), return_exceptions=True), 10)
            assert all(isinstance(r, TypeError) for r in results)  # the waiter took over, did not hang
            assert cache.stats()["hits"] == 0
        assert not boxes.open

    asyncio.run(main())
