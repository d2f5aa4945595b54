"""Grading on the final state, a live sandbox at the rollout's state, and the rollout carried by a context
variable: what every framework integration builds on. On real workspace sandboxes (overlayfs, bash)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

import tvcache

TMP = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None

# A task: fix add() so the hidden test passes. The test file is uploaded only when grading.
HIDDEN = {"/testbed/test_calc.py": "from calc import add\nassert add(2, 3) == 5, 'add is wrong'\nprint('PASSED')\n"}
GRADER = {"command": "cd /testbed && python3 test_calc.py >/dev/null 2>&1 && echo 1 || echo 0"}
FIX = {"command": "cd /testbed && sed -i 's/a - b/a + b/' calc.py"}
NOISE = {"command": "ls /testbed"}  # reads only: a memo, the state does not move


@pytest.fixture(scope="module")
def boxes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    task = tmp_path_factory.mktemp("task")
    (task / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    factory = tvcache.WorkspaceSandboxes(str(task), tmp=TMP, timeout=20)
    yield factory
    asyncio.run(factory.close())


def reward(result: tvcache.Result) -> int:
    assert not result.error, result.output
    return int(result.output["output"].strip())


async def uncached_reward(boxes: Any, commands: list[dict[str, str]]) -> int:
    """The oracle: the same rollout and grading, executed in one fresh sandbox without a cache."""
    box = await boxes.create()
    try:
        for command in commands:
            await box.execute(tvcache.ToolCall("bash", command))
        for path, content in HIDDEN.items():
            await box.execute(tvcache.ToolCall("write_file", {"path": path, "content": content}))
        out = (await box.execute(tvcache.ToolCall("bash", GRADER))).output
        return int(out["output"].strip())
    finally:
        await box.close()


def test_rollouts_ending_in_the_same_state_are_graded_once(boxes: Any) -> None:
    # Four rollouts: two fix the bug (one after an `ls`, a read-only memo, so both end in the same state), two
    # do not. Each gets its own correct reward; the grader runs once per distinct final state.
    plans = [[FIX], [NOISE, FIX], [NOISE], []]

    async def main() -> None:
        expected = [await uncached_reward(boxes, plan) for plan in plans]
        assert expected == [1, 1, 0, 0]
        async with tvcache.ToolCache() as cache:
            got = []
            for plan in plans:
                async with cache.rollout("fix-add", boxes) as r:
                    for command in plan:
                        await r.call("bash", command)
                    graded = await r.grade("bash", GRADER, files=HIDDEN)
                    got.append((reward(graded), graded.hit))
            assert [g[0] for g in got] == expected
            # The first of each final state executes the grader; the second rollout into it hits.
            assert [g[1] for g in got] == [False, True, False, True]

    asyncio.run(main())


def test_a_failing_grader_is_not_cached(tmp_path: Path) -> None:
    async def main() -> None:
        quick = tvcache.WorkspaceSandboxes(str(tmp_path), tmp=TMP, timeout=1)
        async with quick, tvcache.ToolCache() as cache:
            for _ in range(2):
                async with cache.rollout("slow-grader", quick) as r:
                    graded = await r.grade("bash", {"command": "sleep 30"}, files=HIDDEN)
                    assert graded.error and not graded.hit  # a timeout: the sandbox's 1 s limit
            assert cache.stats()["failures"] == 2

    asyncio.run(main())


def test_a_live_sandbox_at_the_rollouts_state_cannot_corrupt_the_cache(boxes: Any) -> None:
    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("live", boxes) as r:
                await r.call("bash", FIX)
            async with cache.rollout("live", boxes) as r:
                assert (await r.call("bash", FIX)).hit  # no sandbox yet: the rollout only hit
                async with r.sandbox() as box:
                    # Materialised at the rollout's state (the fix applied by replay), then vandalised.
                    seen = await box.execute(tvcache.ToolCall("bash", {"command": "grep -c 'a + b' /testbed/calc.py"}))
                    assert seen.output["output"].strip() == "1"
                    await box.execute(tvcache.ToolCall("bash", {"command": "echo broken > /testbed/calc.py"}))
                graded = await r.grade("bash", GRADER, files=HIDDEN)
                assert reward(graded) == 1  # the rollout's state is the graph's, not what the block left
            async with cache.rollout("live", boxes) as r:
                await r.call("bash", FIX)
                assert reward(await r.grade("bash", GRADER, files=HIDDEN)) == 1

    asyncio.run(main())


def test_current_rollout_is_the_innermost_rollout_of_this_task(boxes: Any) -> None:
    async def tool() -> Any:
        rollout = tvcache.current_rollout()
        assert rollout is not None
        return (await rollout.call("bash", {"command": "echo hi"})).output["output"]

    async def main() -> None:
        assert tvcache.current_rollout() is None
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("a", boxes) as a:
                assert tvcache.current_rollout() is a
                async with cache.rollout("b", boxes) as b:
                    assert tvcache.current_rollout() is b
                    assert await asyncio.create_task(tool()) == "hi\n"  # tasks inherit it
                assert tvcache.current_rollout() is a
            assert tvcache.current_rollout() is None

    asyncio.run(main())


def test_the_blocking_api_sets_the_current_rollout_in_the_calling_thread(boxes: Any, tmp_path: Path) -> None:
    with tvcache.SyncToolCache() as cache:
        with cache.rollout("sync", boxes) as r:
            current = tvcache.current_rollout()
            assert current is not None and current.loop.is_running()  # the cache's loop, in its own thread
            future = asyncio.run_coroutine_threadsafe(current.call("bash", {"command": "echo sync"}), current.loop)
            assert future.result().output["output"] == "sync\n"
            assert r.call("bash", {"command": "echo sync"}).hit
        assert tvcache.current_rollout() is None
