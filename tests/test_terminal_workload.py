"""The terminal workload (`tvcache bench terminal`): its shipped traces are what its policy generates, and a replay of
them in real workspace sandboxes gives no wrong answer while tvcache reuses work."""

from __future__ import annotations

import asyncio
import json

from tvcache.sandboxes.workspace import WorkspaceSandboxes
from tvcache_bench.replay import ReplayOptions, replay_strategies
from tvcache_bench.traces import read_traces
from tvcache_bench.workloads import terminal


def test_the_shipped_traces_are_what_the_seeded_policy_generates() -> None:
    shipped = read_traces(terminal.TRACES)
    assert [t.to_json() for t in shipped] == [t.to_json() for t in terminal.generate()]
    assert len({t.task for t in shipped}) == 6 and len(shipped) == 6 * terminal.ROLLOUTS
    first_calls = {t.task: json.dumps(t.calls[0].args) for t in shipped}
    assert len(first_calls) == 6  # every task's rollouts share some first steps, then diverge:
    for task in terminal.TASKS:
        commands = [tuple(c.args["command"] for c in t.calls) for t in shipped if t.task == task]
        assert len(set(commands)) > 1


def test_a_replay_of_one_task_in_workspace_sandboxes_has_no_wrong_answer_and_hits() -> None:
    async def go() -> dict[str, object]:
        workload = terminal.build_workload(tasks=1)
        try:
            options = ReplayOptions(epochs=2, progress=False)
            result = await replay_strategies(workload, ["none", "paper", "tvcache"], options)
        finally:
            await workload.close()
        return result.summary()

    summary = asyncio.run(go())
    rows = summary["strategies"]
    assert isinstance(rows, dict)
    assert rows["none"]["errors"] == 0
    for name in ("paper", "tvcache"):
        assert rows[name]["incorrect_hits"] == 0 and rows[name]["wrong_answers"] == 0, rows[name]["wrong_examples"]
        assert rows[name]["hit_rate"] >= 0.5  # the second epoch repeats the first
    assert rows["tvcache"]["time_breakdown"]["executing"] > 0


def test_with_read_sets_only_the_strategies_that_reuse_by_them_are_traced() -> None:
    """`tvcache bench terminal --read-sets`: tvcache's sandboxes trace their commands' reads, the others run
    untraced (so the paired cost against none is what tracing costs), and no read-set hit is wrong."""

    async def go() -> dict[str, object]:
        workload = terminal.build_workload(tasks=1, read_sets=True)
        try:
            task = workload.traces[0].task
            assert workload.untraced is not None
            traced, untraced = workload.sandboxes(task), workload.untraced(task)
            assert isinstance(traced, WorkspaceSandboxes) and isinstance(untraced, WorkspaceSandboxes)
            assert traced.read_sets and not untraced.read_sets
            result = await replay_strategies(workload, ["none", "exact", "tvcache"], ReplayOptions(progress=False))
        finally:
            await workload.close()
        return result.summary()

    rows = asyncio.run(go())["strategies"]
    assert isinstance(rows, dict)
    for name in ("exact", "tvcache"):
        assert rows[name]["incorrect_hits"] == 0 and rows[name]["wrong_answers"] == 0, rows[name]["wrong_examples"]
    assert rows["exact"]["read_set_hits"] == 0
    assert rows["tvcache"]["incorrect_read_set_hits"] == 0
    assert rows["tvcache"]["paired"]["commands"] > 0  # its traced commands were paired with none's untraced ones
