"""The four strategies on a small stateful world (PythonSandboxes over a key-value store).

The oracle is independent of every strategy and sandbox: each rollout's calls applied in order to a plain dict.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tvcache import ToolCall, Tools
from tvcache_bench.replay import ReplayOptions, _Verifier, replay_strategies
from tvcache_bench.strategies import NaiveStrategy, NoCacheStrategy, PaperStrategy, Strategy, TvCacheStrategy
from tvcache_bench.workload import Workload
from tvcache_bench.workloads import synthetic

Calls = list[tuple[str, dict[str, Any]]]


def oracle(calls: Calls) -> list[str]:
    state: dict[str, str] = {}
    return [asyncio.run(synthetic.run_tool(state, ToolCall(tool, args))) for tool, args in calls]


async def run_rollouts(
    strategy: Strategy, plan: list[Calls], tools: Tools, concurrent: bool = False
) -> list[list[Any]]:
    """Run rollouts of one task, one after the other (or all at once); each a list of results."""
    factory = synthetic.make_sandboxes()

    async def one(calls: Calls) -> list[Any]:
        async with strategy.rollout("task", factory, tools) as r:
            return [await r.call(tool, args) for tool, args in calls]

    try:
        if concurrent:
            return list(await asyncio.gather(*(one(c) for c in plan)))
        return [await one(c) for c in plan]
    finally:
        await strategy.close()
        await factory.close()


def append(key: str, value: str) -> tuple[str, dict[str, Any]]:
    return ("append", {"key": key, "value": value})


def read(key: str) -> tuple[str, dict[str, Any]]:
    return ("read", {"key": key})


def test_every_strategy_on_a_generated_workload_against_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """tvcache and the published strategy are exact; the naive cache gives wrong answers, and hits."""
    # The naive cache's wrong answers are re-executed once more with a pause before each call (for tools that
    # depend on the clock, `_Verifier.PACE`): these read and append to a dict, so the pause changes no answer, and
    # at 1.1 s a call it was 9 of this test's 12 s. The paced re-execution still runs; test_replay.py tests pacing.
    monkeypatch.setattr(_Verifier, "PACE", 0.0)
    params = synthetic.Params(tasks=3, rollouts=6, calls=10, branching=3, read_fraction=0.5, cost_ms=0, seed=3)
    workload = synthetic.build_workload(params)
    try:
        result = asyncio.run(
            replay_strategies(
                workload,
                ["none", "naive", "paper", "tvcache"],
                ReplayOptions(batch=2, epochs=2, concurrency=6, progress=False),
            )
        )
    finally:
        asyncio.run(workload.close())
    runs = result.strategies
    # The oracle strategy itself agrees with the plain-dict oracle (checked through a fresh replay below).
    assert runs["none"].hits == 0 and runs["none"].stats["executions"] == runs["none"].calls
    for name in ("paper", "tvcache"):
        assert runs[name].incorrect_hits == 0 and runs[name].wrong_answers == 0, name
        assert runs[name].compared == runs[name].calls == 2 * sum(len(t.calls) for t in workload.traces)
        assert runs[name].hit_rate > 0.3, name
    assert runs["naive"].incorrect_hits is not None and runs["naive"].incorrect_hits > 0
    assert runs["naive"].nondeterministic == 0  # the world is deterministic: every mismatch is a real error
    # Second epoch: the exact caches answer everything from the graph.
    assert runs["tvcache"].epoch_hit_rates()[1] == 1.0 and runs["paper"].epoch_hit_rates()[1] == 1.0


def test_none_matches_the_plain_oracle() -> None:
    plan = [[append("a", "x"), read("a"), append("a", "y"), read("a"), read("b")]]
    (results,) = asyncio.run(run_rollouts(NoCacheStrategy(), plan, Tools()))
    assert [r.output for r in results] == oracle(plan[0])
    assert not any(r.hit for r in results)


def test_naive_returns_stale_answers_and_skips_execution_on_hits() -> None:
    first = [append("a", "x"), read("a")]
    second = [read("a"), append("a", "x"), read("a")]
    strategy = NaiveStrategy()
    got = asyncio.run(run_rollouts(strategy, [first, second], Tools()))
    # The second rollout's first read hits the first rollout's "a=x": wrong in its fresh state.
    assert got[1][0].hit and got[1][0].output == "a=x" != oracle(second)[0]
    assert strategy.counters.executions == 2  # nothing of the second rollout executed
    assert [r.hit for r in got[1]] == [True, True, True]


def test_naive_executes_in_a_sandbox_that_missed_hit_effects() -> None:
    first = [append("a", "x")]
    second = [append("a", "x"), read("a")]
    got = asyncio.run(run_rollouts(NaiveStrategy(), [first, second], Tools()))
    assert got[1][0].hit and not got[1][1].hit
    assert got[1][1].output == "a=" != oracle(second)[1]  # executed in a state without the hit's append


def test_paper_keys_on_the_full_history_unless_annotated() -> None:
    first = [read("b"), append("a", "x"), read("a")]
    second = [append("a", "x"), read("a")]
    # Without annotations a read is part of the prefix: the second rollout's history differs, so it misses.
    got = asyncio.run(run_rollouts(PaperStrategy(), [first, second], Tools()))
    assert [r.hit for r in got[1]] == [False, False]
    # Annotated read-only, reads are memos at their prefix and do not extend it: the append hits.
    got = asyncio.run(run_rollouts(PaperStrategy(), [first, second], Tools(read_only={"read"})))
    assert [r.hit for r in got[1]] == [True, True]
    assert [r.output for r in got[1]] == oracle(second)
    # tvcache sees by itself that the read left the state alone (no annotation needed).
    got = asyncio.run(run_rollouts(TvCacheStrategy(), [first, second], Tools()))
    assert [r.hit for r in got[1]] == [True, True]


def test_paper_snapshots_every_state_change_and_restores_the_deepest() -> None:
    first = [append("a", "x"), append("b", "y"), read("a")]
    second = [append("a", "x"), append("b", "y"), append("a", "z"), read("a")]
    strategy = PaperStrategy()
    got = asyncio.run(run_rollouts(strategy, [first, second], Tools(read_only={"read"})))
    assert [r.hit for r in got[1]] == [True, True, False, False]
    assert [r.output for r in got[1]] == oracle(second)
    counters = strategy.counters
    assert counters.snapshots == 3  # after each executed append: x, y, then z
    assert counters.restores == 1 and counters.replays == 0  # the miss restored the snapshot after "y"


def test_paper_has_no_single_flight_and_tvcache_does() -> None:
    plan = [[("append", {"key": "a", "value": "x", "cost_ms": 20})]] * 4
    paper, tv = PaperStrategy(), TvCacheStrategy()
    asyncio.run(run_rollouts(paper, plan, Tools(), concurrent=True))
    asyncio.run(run_rollouts(tv, plan, Tools(), concurrent=True))
    assert paper.counters.executions == 4
    assert tv.stats()["executions"] == 1 and tv.stats()["waits"] == 3


def test_strategies_close_their_snapshots() -> None:
    factory = synthetic.make_sandboxes()
    plan = [append("a", "x"), append("b", "y"), ("append", {"key": "c", "value": "z", "cost_ms": 5})]

    async def go(strategy: Strategy) -> int:
        async with strategy.rollout("task", factory, Tools()) as r:
            for tool, args in plan:
                await r.call(tool, args)
        await strategy.flush()  # tvcache's snapshots are taken after their calls answered
        made = factory.snapshot_count
        await strategy.close()
        return made

    for strategy in (PaperStrategy(), TvCacheStrategy()):
        assert asyncio.run(go(strategy)) > 0
        assert factory.snapshot_count == 0, strategy.name


def test_workload_interface_accepts_per_task_factories() -> None:
    """A workload may give each task its own factory; strategies and the replay use the right one."""
    factories: dict[str, Any] = {}

    def boxes(task: str) -> Any:
        return factories.setdefault(task, synthetic.make_sandboxes())

    traces = synthetic.generate(synthetic.Params(tasks=2, rollouts=2, calls=4, cost_ms=0))
    workload = Workload("two", traces, boxes, synthetic.TOOLS)
    result = asyncio.run(replay_strategies(workload, ["none", "tvcache"], ReplayOptions(progress=False)))
    assert sorted(factories) == ["synthetic-0", "synthetic-1"]
    assert result.strategies["tvcache"].incorrect_hits == 0
