"""The per-call algorithm, behaviour by behaviour (DESIGN.md, "One tool call")."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

import kv
import tvcache
from faults import FaultySandboxes

W = {"key": "a", "value": "x"}


def slow(args: dict[str, Any], delay: float = 0.02) -> dict[str, Any]:
    return dict(args, delay=delay)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_rollout_that_only_hits_never_starts_a_sandbox() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache() as cache:
            for _ in range(2):
                async with cache.rollout("t", boxes, kv.TOOLS) as r:
                    await r.call("write", W)
                    await r.call("read", {"key": "a"})
            assert boxes.created == 1
            assert cache.stats()["hits"] == 2
            assert not boxes.open

    run(main())


def test_reads_become_memos_by_observation_and_hit_in_any_order() -> None:
    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            boxes = kv.sandboxes()
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                assert (await r.call("write", W)).source == "executed"
                await r.call("read", {"key": "a"})
                await r.call("read", {"key": "b"})
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                assert (await r.call("write", W)).source == "edge"
                b, a = await r.call("read", {"key": "b"}), await r.call("read", {"key": "a"})
                assert (a.output, a.source, b.output, b.source) == ("x", "memo", "<missing>", "memo")
                cursor = r.cursor
                # A write that leaves the state as it was is observed as no change: a memo, cursor stays.
                same = await r.call("write", W)
                assert (same.source, r.cursor) == ("executed", cursor)

    run(main())


def test_read_only_annotation_makes_memos_without_observation() -> None:
    async def main() -> None:
        tools = tvcache.Tools(read_only={"append"})  # a lie, to show the annotation is what decides
        async with tvcache.ToolCache() as cache, cache.rollout("t", kv.sandboxes(), tools) as r:
            before = r.cursor
            await r.call("append", {"key": "a", "value": "z"})
            assert r.cursor == before

    run(main())


def test_tool_keys_ignore_noise_but_sandboxes_see_real_args() -> None:
    seen: list[dict[str, Any]] = []

    async def record(state: dict[str, str], call: tvcache.ToolCall) -> Any:
        seen.append(call.args)
        return await kv.run(state, call)

    async def main() -> None:
        boxes = tvcache.PythonSandboxes(make=dict, run=record, fingerprint="kv")
        tools = tvcache.Tools(key={"read": lambda a: {k: v for k, v in a.items() if k != "request_id"}})
        async with tvcache.ToolCache() as cache, cache.rollout("t", boxes, tools) as r:
            assert not (await r.call("read", {"key": "a", "request_id": 1})).hit
            assert (await r.call("read", {"key": "a", "request_id": 2})).hit
        assert seen == [{"key": "a", "request_id": 1}]

    run(main())


def test_eight_concurrent_rollouts_execute_each_distinct_call_once() -> None:
    calls = [
        ("write", slow(W)),
        ("read", slow({"key": "a"})),
        ("append", slow({"key": "b", "value": "y"})),
        ("list", slow({})),
        ("delete", slow({"key": "a"})),
        ("read", slow({"key": "a"})),
    ]

    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache() as cache:

            async def one() -> list[Any]:
                async with cache.rollout("t", boxes, kv.TOOLS) as r:
                    return [(await r.call(t, a)).output for t, a in calls]

            outputs = await asyncio.gather(*(one() for _ in range(8)))
            stats = cache.stats()
        assert all(o == outputs[0] for o in outputs)
        assert outputs[0] == await kv.execute_uncached(kv.sandboxes(), calls, kv.TOOLS)
        assert stats["executions"] == len(calls)
        assert stats["hits"] == 7 * len(calls)
        assert stats["waits"] > 0
        assert boxes.created == 1

    run(main())


def test_a_miss_after_hits_catches_up_its_own_sandbox() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache(snapshot_budget=0) as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", W)
                await r.call("append", {"key": "a", "value": "1"})
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", W)  # edge hit: no sandbox yet
                await r.call("read", {"key": "c"})  # miss: fresh sandbox + replay of the write
                await r.call("append", {"key": "a", "value": "1"})  # hit
                out = await r.call("read", {"key": "a"})  # miss: catch up by replaying one append
            assert out.output == "x1"
            stats = cache.stats()
        assert boxes.created == 2
        assert stats["replays"] == 2

    run(main())


def test_deep_misses_restore_the_deepest_snapshot() -> None:
    path = [("write", slow({"key": k, "value": "v"}, 0.05)) for k in "abc"]

    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                for t, a in path:
                    await r.call(t, a)
            await cache.flush()
            assert cache.stats()["snapshots"] == 3  # each 50 ms call is dearer to redo than to save
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                for t, a in path:
                    assert (await r.call(t, a)).hit
                assert (await r.call("list", {})).output == ["a", "b", "c"]
            stats = cache.stats()
        assert (stats["restores"], stats["replays"], boxes.created) == (1, 0, 1)

    run(main())


def test_snapshots_are_taken_only_where_redoing_costs_more() -> None:
    big = {f"k{i}": "v" * 20 for i in range(100_000)}  # deep-copying this (a snapshot) takes tens of ms

    async def main() -> None:
        boxes = tvcache.PythonSandboxes(
            make=lambda: dict(big), run=kv.run, fingerprint="big", changed=lambda call, out: call.tool != "read"
        )
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", slow(W, 0.3))  # far dearer to redo than to save
                await cache.flush()
                assert cache.stats()["snapshots"] == 1
                for i in range(5):  # microseconds each: cheaper to redo than any snapshot
                    await r.call("append", {"key": "a", "value": str(i)})
            await cache.flush()
            assert cache.stats()["snapshots"] == 1

    run(main())


def test_eviction_keeps_the_budget_and_deletes_what_it_evicts() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache(snapshot_budget=2) as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                for i in range(6):
                    await r.call("append", slow({"key": "a", "value": str(i)}, 0.03))
            await cache.flush()
            records = await cache.store.snapshots(cache.scope("t", boxes).key)
            stats = cache.stats()
        assert len(records) == 2
        assert stats["snapshots"] == 6 and stats["evictions"] == 4
        assert len(boxes.deleted) == 4
        kept = {r.snapshot_id for r in records}
        assert not kept & set(boxes.deleted)

    run(main())


def test_uncacheable_tools_always_execute_and_detach_when_they_change_state() -> None:
    clock = itertools.count()

    async def world(state: dict[str, Any], call: tvcache.ToolCall) -> Any:
        if call.tool == "now":
            return next(clock)
        if call.tool == "roll":
            state["a"] = str(next(clock))
            return state["a"]
        return await kv.run(state, call)

    async def main() -> None:
        boxes = tvcache.PythonSandboxes(make=dict, run=world, fingerprint="clock")
        tools = tvcache.Tools(read_only={"now"}, uncacheable={"now", "roll"})
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, tools) as r:
                first, second = await r.call("now", {}), await r.call("now", {})
                assert (first.hit, second.hit, first.output != second.output) == (False, False, True)
                await r.call("write", W)
                assert not r.detached
                rolled = await r.call("roll", {})
                assert r.detached
                read = await r.call("read", {"key": "a"})
                assert (read.output, read.hit) == (rolled.output, False)
            async with cache.rollout("t", boxes, tools) as r:
                assert (await r.call("write", W)).hit  # recorded before the detach
                assert (await r.call("read", {"key": "a"})).output == "x"  # the detached read was not
            assert cache.stats()["detached"] == 1

    run(main())


def test_a_replay_that_differs_is_counted_and_the_rollout_detaches() -> None:
    counter = itertools.count()

    async def world(state: dict[str, Any], call: tvcache.ToolCall) -> Any:
        if call.tool == "ticket":  # nondeterministic, but nobody said so
            state["t"] = next(counter)
            return state["t"]
        return sorted(state.items())

    async def main() -> None:
        boxes = tvcache.PythonSandboxes(make=dict, run=world, fingerprint="tickets")
        async with tvcache.ToolCache(snapshot_budget=0) as cache:
            async with cache.rollout("t", boxes) as r:
                assert (await r.call("ticket", {})).output == 0
            async with cache.rollout("t", boxes) as r:
                assert (await r.call("ticket", {})).output == 0  # hit
                state = await r.call("show", {})  # miss: replaying "ticket" gives 1, not 0
                assert r.detached
                assert state.output == [["t", 1]]  # the truth of the sandbox it now runs in
            assert cache.stats()["mismatches"] == 1

    run(main())


@pytest.mark.parametrize("how", ["exception", "cancel"])
def test_sandboxes_are_closed_when_a_rollout_ends_badly(how: str) -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache() as cache:

            async def body() -> None:
                async with cache.rollout("t", boxes, kv.TOOLS) as r:
                    await r.call("write", W)
                    if how == "exception":
                        raise KeyError("agent crashed")
                    await r.call("read", slow({"key": "a"}, 10))

            task = asyncio.create_task(body())
            if how == "cancel":
                await asyncio.sleep(0.1)
                task.cancel()
            with pytest.raises((KeyError, asyncio.CancelledError)):
                await task
        assert boxes.created == 1 and not boxes.open

    run(main())


def test_prefetch_warms_fresh_sandboxes_and_forks_of_snapshots() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", slow(W, 0.05))  # snapshotted: slow to redo
            await cache.flush()
            made = await (await cache.prefetch(["t", "u"], boxes, rollouts=2))
            assert made == 5  # 2 fresh for each task + 1 fork of t's snapshot
            created, restored = boxes.created, boxes.restored
            async with cache.rollout("u", boxes, kv.TOOLS) as r:
                await r.call("read", {"key": "a"})  # miss at the root: a warm fresh sandbox
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", W)
                await r.call("read", {"key": "b"})  # miss at the snapshot: its warm fork
            assert (boxes.created, boxes.restored) == (created, restored)
            assert cache.stats()["warm"] == 2
            assert len(boxes.open) == 3  # the unused warm ones, until close
        assert not boxes.open

    run(main())


def test_the_warm_pool_is_bounded_and_closes_the_oldest_unused() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache(warm_limit=3) as cache:
            assert await (await cache.prefetch(["t"], boxes, rollouts=2)) == 2
            assert await (await cache.prefetch(["u"], boxes, rollouts=2)) == 2
            assert boxes.created == 4 and len(boxes.open) == 3  # one of t's was closed
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("read", {"key": "a"})  # t still has a warm one
            async with cache.rollout("u", boxes, kv.TOOLS) as r:
                await r.call("read", {"key": "a"})
            assert cache.stats()["warm"] == 2 and boxes.created == 4
        assert not boxes.open

    run(main())


def test_scopes_separate_tasks_and_fingerprints() -> None:
    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            for task, fp in [("t", "v1"), ("u", "v1"), ("t", "v2")]:
                async with cache.rollout(task, kv.sandboxes(fp), kv.TOOLS) as r:
                    assert not (await r.call("write", W)).hit
            async with cache.rollout("t", kv.sandboxes("v1"), kv.TOOLS) as r:
                assert (await r.call("write", W)).hit

    run(main())


def test_results_are_copies_the_caller_may_mutate() -> None:
    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            for _ in range(2):
                async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                    await r.call("write", W)
                    out = await r.call("list", {})
                    assert out.output == ["a"]
                    out.output.append("junk")

    run(main())


def test_huge_outputs_are_returned_but_not_cached() -> None:
    async def main() -> None:
        async with tvcache.ToolCache(max_output_bytes=1000) as cache:
            for _ in range(2):
                async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                    await r.call("write", {"key": "a", "value": "x" * 5000})
                    big = await r.call("read", {"key": "a"})
                    assert (len(big.output), big.hit) == (5000, False)
            assert cache.stats()["uncached"] == 2

    run(main())


def test_bad_calls_get_clear_errors() -> None:
    async def main() -> None:
        async with tvcache.ToolCache() as cache, cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
            with pytest.raises(TypeError, match="JSON values"):
                await r.call("write", {"key": object()})
            with pytest.raises(ValueError, match="NaN"):
                await r.call("write", {"key": float("nan")})
            with pytest.raises(ValueError, match="unknown tool"):
                await r.call("frobnicate", {})
            assert (await r.call("read", {"key": "a"})).output == "<missing>"  # still usable

    run(main())


def test_rollouts_that_waited_for_a_state_change_restore_its_snapshot_instead_of_replaying() -> None:
    # Eight rollouts issue the same slow write at once: one executes it, seven wait. Each then reads a key of its
    # own, a miss in the new state. The state is saved before the waiters are let go, so each restores it (a
    # snapshot that takes a while, as a workspace's or a container's does, used to come too late).
    class SlowSnapshots(FaultySandboxes):
        async def create(self) -> Any:
            box = await super().create()
            inner = box.snapshot

            async def snapshot() -> str:
                await asyncio.sleep(0.05)
                return await inner()

            box.snapshot = snapshot
            return box

    async def main() -> None:
        boxes = SlowSnapshots(kv.sandboxes())
        async with tvcache.ToolCache() as cache:

            async def rollout(i: int) -> Any:
                async with cache.rollout("t", boxes, kv.TOOLS) as r:
                    await r.call("write", slow(W, 0.1))
                    return (await r.call("read", {"key": f"k{i}"})).output

            assert await asyncio.gather(*(rollout(i) for i in range(8))) == ["<missing>"] * 8
            stats = cache.stats()
            assert (stats["executions"], stats["waits"], stats["snapshots"]) == (9, 7, 1)
            assert (stats["replays"], stats["restores"] + stats["warm"]) == (0, 7)
        assert not boxes.open

    run(main())
