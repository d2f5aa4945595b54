"""The edges of an object's life, each reproduced as a failing test before it was fixed: a call cancelled
between making a sandbox and keeping it, a rollout cancelled and closed between making a snapshot and recording
it, a prefetch that fails or is cancelled, a call inside the rollout's own `sandbox()` block, use after close, a
restore that fails once, a store that fails after a call ran, a `SyncToolCache` whose constructor fails, a
detached rollout after a bad call."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

import kv
import tvcache
from faults import FaultySandboxes, FlakyStore
from tvcache.stores.memory import MemoryStore

SLOW = 0.03  # a call this slow is dearer to redo than to snapshot: the graph keeps a snapshot after it
PATH = [("write", {"key": k, "value": "v", "delay": SLOW}) for k in "ab"]


async def record_path(cache: tvcache.ToolCache, boxes: Any) -> None:
    async with cache.rollout("t", boxes, kv.TOOLS) as r:
        for tool, args in PATH:
            await r.call(tool, args)
    await cache.flush()  # the path's snapshots are in the graph


async def recorded(cache: tvcache.ToolCache, boxes: Any) -> set[str]:
    return {r.snapshot_id for r in await cache.store.snapshots(cache.scope("t", boxes).key)}


async def cancel_when(reached: asyncio.Event, work: Any) -> None:
    task = asyncio.ensure_future(work)
    await reached.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_call_cancelled_after_its_restore_during_the_unlease_leaks_no_sandbox() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        store = FlakyStore(MemoryStore())
        async with tvcache.ToolCache(store=store) as cache:
            await record_path(cache, boxes)
            store.hold("unlease")
            r = await cache.open("t", boxes, kv.TOOLS)
            for tool, args in PATH:
                assert (await r.call(tool, args)).hit
            # The miss restores the snapshot; the reply to the unlease is slow, and the caller gives up there.
            await cancel_when(store.reached["unlease"], r.call("read", {"key": "a"}))
            store.held["unlease"].set()
            assert (await r.call("list", {})).output == ["a", "b"]  # the restored sandbox was kept
            await r.close()
            assert boxes.restored == 1
        assert not boxes.open

    asyncio.run(main())


def test_a_rollout_cancelled_and_closed_while_its_snapshot_is_recorded_leaves_it_recorded_or_deleted() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        store = FlakyStore(MemoryStore())
        async with tvcache.ToolCache(store=store) as cache:
            store.hold("add_snapshot", before=True)
            r = await cache.open("t", boxes, kv.TOOLS)
            await r.call(*PATH[0])  # answered; its snapshot is recorded in the background
            await store.reached["add_snapshot"].wait()
            waiting = asyncio.ensure_future(r.call(*PATH[1]))  # a miss: it waits for the snapshot under way
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await r.close()  # does not wait for the snapshot: its sandbox is closed after it
            store.held["add_snapshot"].set()
            made = set(boxes.snapshots)
            assert len(made) == 1
            for _ in range(1000):  # recording it goes on in the background, for a few turns of the loop
                if made <= await recorded(cache, boxes) | set(boxes.deleted):
                    break
                await asyncio.sleep(0.001)
            assert made <= await recorded(cache, boxes) | set(boxes.deleted)
        assert not boxes.open

    asyncio.run(main())


def test_a_prefetch_that_failed_or_was_cancelled_does_not_hold_later_ones_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        store = FlakyStore(MemoryStore())
        async with tvcache.ToolCache(store=store, on_store_error="raise") as cache:
            store.failing.add("snapshots")
            with pytest.raises(tvcache.StoreError):
                await cache.prefetch(["t"], boxes, rollouts=2)
            store.failing.clear()
            await (await cache.prefetch(["t"], boxes, rollouts=2))
            assert boxes.created == 2  # by one prefetch or the other, not by neither
            # Cancelled while it looks up the task's snapshots: its fresh sandboxes are made all the same.
            store.hold("snapshots")
            await cancel_when(store.reached["snapshots"], cache.prefetch(["u"], boxes, rollouts=2))
            store.held.clear()
            assert await (await cache.prefetch(["u"], boxes, rollouts=4)) == 2
            assert boxes.created == 2 + 4
            # A prefetch whose sandboxes cannot be made says so.
            boxes.failing_creates = 1
            with caplog.at_level(logging.WARNING, "tvcache"):
                assert await (await cache.prefetch(["v"], boxes, rollouts=1)) == 0
            assert "prefetch could not make a sandbox" in caplog.text
        assert not boxes.open

    asyncio.run(main())


def test_prefetch_of_a_fork_whose_unlease_fails_leaks_nothing() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        store = FlakyStore(MemoryStore())
        async with tvcache.ToolCache(store=store) as cache:
            await record_path(cache, boxes)
            store.failing.add("unlease")
            made = await (await cache.prefetch(["t"], boxes, rollouts=0))
            assert made == len(await recorded(cache, boxes)) == boxes.restored
        assert not boxes.open

    asyncio.run(main())


def test_a_call_inside_the_rollouts_own_sandbox_block_raises_at_once() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache() as cache, cache.rollout("t", boxes, kv.TOOLS) as r:
            async with r.sandbox():
                with pytest.raises(RuntimeError, match="after the block"):
                    await asyncio.wait_for(
                        r.call("read", {"key": "a"}), 10
                    )  # the bound only keeps a bug from hanging CI
                with pytest.raises(RuntimeError, match="after the block"):  # also from a task started in the block
                    await asyncio.wait_for(asyncio.create_task(r.call("read", {"key": "a"})), 10)
            assert (await r.call("read", {"key": "a"})).output == "<missing>"  # after it, calls work
        assert not boxes.open

    asyncio.run(main())


def test_a_closed_cache_refuses_use_and_closes_twice_quietly() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        cache = tvcache.ToolCache()
        assert cache.state.value == "unopened"
        async with cache:
            assert cache.state.value == "opened"
            with pytest.raises(RuntimeError, match="once"):
                async with cache:
                    pass
            r = await cache.open("t", boxes, kv.TOOLS)
            await r.call("write", {"key": "a", "value": "x"})
        assert cache.state.value == "closed"
        assert not boxes.open  # the open rollout was closed with the cache
        for use in (
            lambda: cache.open("t", boxes, kv.TOOLS),
            lambda: cache.prefetch(["t"], boxes),
            lambda: cache.check(),
            lambda: r.call("read", {"key": "a"}),
        ):
            with pytest.raises(RuntimeError, match="closed"):
                await use()
        with pytest.raises(RuntimeError, match="closed"):
            async with cache.rollout("t", boxes, kv.TOOLS):
                pass
        with pytest.raises(RuntimeError, match="reopened"):
            async with cache:
                pass
        await cache.close()  # a second close does nothing
        assert boxes.created == 1 and not boxes.open

    asyncio.run(main())


def test_a_restore_that_fails_once_keeps_its_snapshot_and_a_gone_one_is_dropped_and_deleted() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache() as cache:
            await record_path(cache, boxes)
            snapshots = await recorded(cache, boxes)
            boxes.failing_restores = 1
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                for tool, args in PATH:
                    await r.call(tool, args)
                assert (await r.call("list", {})).output == ["a", "b"]
            assert boxes.restored == 1  # the second try restored it
            assert await recorded(cache, boxes) == snapshots
            # A restore that keeps failing makes the snapshot suspect; the rollout takes another route.
            boxes.failing_restores = 2
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                for tool, args in PATH:
                    await r.call(tool, args)
                assert (await r.call("read", {"key": "b"})).output == "v"
            assert await recorded(cache, boxes) == snapshots
            # The backend's word that it is gone drops it from the graph and deletes its files.
            deepest = max(snapshots, key=lambda s: int(s.rsplit("-", 1)[1]))
            boxes.inner._forget(deepest)
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                for tool, args in PATH:
                    await r.call(tool, args)
                assert (await r.call("read", {"key": "a"})).output == "v"
            assert deepest not in await recorded(cache, boxes)
            assert deepest in boxes.deleted
        assert not boxes.open

    asyncio.run(main())


def test_with_on_store_error_raise_a_call_that_ran_returns_its_result() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        store = FlakyStore(MemoryStore())
        cache = tvcache.ToolCache(store=store, on_store_error="raise")
        async with cache, cache.rollout("t", boxes, kv.TOOLS) as r:
            store.failing.update({"record", "add_snapshot", "register"})
            # It ran: a framework told it failed would retry it and append twice.
            assert (await r.call("append", {"key": "a", "value": "1", "delay": SLOW})).output == 1
            assert cache.stats()["store_errors"] >= 1
            store.failing.clear()
            assert (await r.call("read", {"key": "a"})).output == "1"
            store.failing.add("lookup")
            with pytest.raises(tvcache.StoreError):  # before a call runs, the failure is the caller's to see
                await r.call("append", {"key": "a", "value": "1"})
            store.failing.clear()
            assert (await r.call("read", {"key": "a"})).output == "1"
        assert not boxes.open

    asyncio.run(main())


def _loop_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "tvcache-loop")


def test_a_sync_cache_whose_constructor_fails_leaves_no_thread_and_use_after_close_raises() -> None:
    before = _loop_threads()
    with pytest.raises(ValueError, match="on_store_error"):
        tvcache.SyncToolCache(on_store_error="sometimes")  # type: ignore[arg-type]
    assert _loop_threads() == before
    cache = tvcache.SyncToolCache()
    with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
        assert r.call("write", {"key": "a", "value": "x"}).output == "ok"
    cache.close()
    cache.close()  # a second close does nothing
    assert _loop_threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        cache.open("t", kv.sandboxes(), kv.TOOLS)
    with pytest.raises(RuntimeError, match="closed"):
        r.call("read", {"key": "a"})


def test_a_detached_rollout_survives_a_bad_call_and_goes_on() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        boxes.fault = lambda call: "error" if call.args.get("fail") else None
        async with tvcache.ToolCache() as cache, cache.rollout("t", boxes, kv.TOOLS) as r:
            await r.call("write", {"key": "a", "value": "x"})
            assert (await r.call("append", {"key": "a", "value": "y", "fail": 1})).error  # a timeout, say
            assert r.detached
            with pytest.raises(ValueError, match="unknown tool"):  # the model asked for a tool that does not exist
                await r.call("no_such_tool", {})
            # The rollout goes on in its own sandbox, as it would without a cache.
            assert (await r.call("append", {"key": "a", "value": "z"})).output == 3
            assert (await r.call("read", {"key": "a"})).output == "xyz"
        assert not boxes.open

    asyncio.run(main())


def test_the_public_api_names_its_types_and_the_command_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    from tvcache.cli import main

    async def stats() -> Any:
        async with tvcache.ToolCache() as cache, cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
            return r.stats

    assert type(asyncio.run(stats())) is tvcache.RolloutStats
    for error in (tvcache.ToolError, tvcache.SandboxError, tvcache.StoreError, tvcache.SnapshotGone):
        assert issubclass(error, tvcache.TVCacheError)
    assert issubclass(tvcache.ToolError, ValueError)  # what a refused call raised before, still caught
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"tvcache {tvcache.__version__}"


def test_remote_sandboxes_raise_what_local_ones_do_and_refuse_use_after_close(tmp_path: Path) -> None:
    """A real sandbox server on loopback serving the kv world."""
    from server_helpers import SandboxServer

    async def main(url: str) -> None:
        boxes = tvcache.RemoteSandboxes(url)
        box = await boxes.create()
        with pytest.raises(tvcache.ToolError, match="unknown tool"):  # was a private _Refused
            await box.execute(tvcache.ToolCall("no_such_tool", {}))
        assert (await box.execute(tvcache.ToolCall("write", {"key": "a", "value": "x"}))).output == "ok"
        snapshot = await box.snapshot()
        await boxes.delete(snapshot)
        with pytest.raises(tvcache.SnapshotGone):
            await boxes.restore(snapshot)
        await box.close()
        # Through the cache, a refused call is an error result, as a built-in sandbox answers one, attached or
        # detached, and the rollout goes on.
        async with tvcache.ToolCache() as cache, cache.rollout("t", boxes, kv.TOOLS) as r:
            for _ in range(2):
                refused = await r.call("no_such_tool", {})
                assert refused.error and refused.output.startswith("Error: ") and "unknown tool" in refused.output
                assert (await r.call("append", {"key": "a", "value": "x"})).output in (1, 2)
                assert not r.detached
            assert (await r.call("read", {"key": "a"})).output == "xx"
        await boxes.close()
        await boxes.close()  # a second close does nothing
        with pytest.raises(RuntimeError, match="closed"):
            await boxes.create()

    with SandboxServer(tmp_path, ["--sandbox", "python:server_helpers:sandboxes"]) as server:
        asyncio.run(main(server.url))


def test_the_http_store_refuses_use_after_close(tmp_path: Path) -> None:
    """A real `tvcache serve` on loopback."""
    from server_helpers import Server
    from tvcache.stores.http import HTTPStore

    async def main(url: str) -> None:
        store = HTTPStore(url)
        await store.ping()
        await store.close()
        await store.close()  # a second close does nothing
        with pytest.raises(RuntimeError, match="closed"):
            await store.ping()

    with Server(tmp_path, "memory://", None) as server:
        asyncio.run(main(server.url))
