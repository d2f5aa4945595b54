"""The blocking wrapper: same results and the same cleanup as the async API, from several threads."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import kv
import tvcache
from faults import FaultySandboxes

CALLS = [("write", {"key": "a", "value": "x"}), ("read", {"key": "a"}), ("append", {"key": "a", "value": "y"})]


def test_sync_rollouts_from_threads_share_the_cache() -> None:
    boxes = FaultySandboxes(kv.sandboxes())
    results: list[list[Any]] = []
    with tvcache.SyncToolCache() as cache:

        def rollout() -> None:
            with cache.rollout("t", boxes, kv.TOOLS) as r:
                results.append([r.call(tool, args).output for tool, args in CALLS])

        threads = [threading.Thread(target=rollout) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = cache.stats()
    assert results == [["ok", "x", 2]] * 4
    assert (stats["executions"], stats["hits"]) == (3, 9)
    assert not boxes.open


def test_sync_rollout_closes_its_sandbox_when_the_agent_raises() -> None:
    boxes = FaultySandboxes(kv.sandboxes())
    with tvcache.SyncToolCache() as cache:
        with pytest.raises(KeyError), cache.rollout("t", boxes, kv.TOOLS) as r:
            r.call("write", {"key": "a", "value": "x"})
            raise KeyError("agent crashed")
        assert not boxes.open


def test_an_open_rollout_lives_across_threads_until_closed() -> None:
    # A SkyRL-style environment: opened at the first step, stepped from a thread pool, closed at the end.
    boxes = FaultySandboxes(kv.sandboxes())
    with tvcache.SyncToolCache() as cache:
        rollout = cache.open("t", boxes, kv.TOOLS)
        with ThreadPoolExecutor(2) as pool:
            assert pool.submit(rollout.call, "write", '{"key": "a", "value": "x"}').result().output == "ok"
            assert pool.submit(rollout.call, "read", {"key": "a"}).result().output == "x"
        assert (rollout.stats.calls, rollout.stats.executions) == (2, 2)
        rollout.close()
        rollout.close()  # idempotent
        assert not boxes.open
        with pytest.raises(RuntimeError, match="closed"):
            rollout.call("read", {"key": "a"})


def test_an_open_async_rollout_spans_tasks_and_is_not_the_current_one() -> None:
    # A framework's hooks: opened in its setup task, called and closed from others.
    boxes = FaultySandboxes(kv.sandboxes())

    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            rollout = await asyncio.create_task(cache.open("t", boxes, kv.TOOLS))
            assert tvcache.current_rollout() is None
            write = await asyncio.create_task(rollout.call("write", {"key": "a", "value": "x"}))
            assert (write.output, write.hit) == ("ok", False)
            await asyncio.create_task(rollout.close())
            await rollout.close()  # idempotent
            assert not boxes.open
            async with cache.rollout("t", boxes, kv.TOOLS) as again:
                assert tvcache.current_rollout() is again
                assert (await again.call("write", {"key": "a", "value": "x"})).hit
            assert tvcache.current_rollout() is None

    asyncio.run(main())
