"""The paired cost of a command in replay reports: each strategy's executions against no cache's executions of the
same calls (`tvcache_bench.paired`), on real workspace sandboxes whose commands' CPU time their cgroups measure."""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tvcache import PythonSandboxes, Tools
from tvcache_bench.paired import Execution, paired
from tvcache_bench.replay import ReplayOptions, ReplayResult, replay, replay_strategies
from tvcache_bench.report import print_table, write_json
from tvcache_bench.strategies import NoCacheStrategy, TvCacheStrategy
from tvcache_bench.traces import Trace, TraceCall, write_traces
from tvcache_bench.workload import Workload, load_workload
from wrapped import Wrapped

# About 60 ms of CPU in bash before the command, printing nothing: the same answers at a much higher cost.
BURN = "i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done; "


async def burn(tool: str, args: Mapping[str, Any]) -> Mapping[str, Any]:
    """A command that burns CPU first: a strategy whose commands cost more than none's, with the same answers."""
    return {"command": BURN + args["command"]}


def test_pairs_are_the_same_calls_executed_without_error_and_answered_alike() -> None:
    base = {
        (0, 0, 0): Execution(1.0, 0.5, b"a"),
        (0, 0, 1): Execution(2.0, None, b"b"),
        (0, 0, 2): Execution(1.0, 1.0, b"c"),
        (0, 1, 0): Execution(4.0, 2.0, b"d"),
    }
    mine = {
        (0, 0, 0): Execution(2.0, 1.5, b"a"),  # paired: wall 2x, CPU 3x
        (0, 0, 1): Execution(3.0, 1.0, b"b"),  # paired; CPU unmeasured on the baseline's side
        (0, 0, 2): Execution(9.0, 9.0, b"other"),  # answered otherwise: left out
        (1, 0, 0): Execution(5.0, 5.0, b"a"),  # another epoch, which the baseline never executed: left out
        (0, 1, 0): Execution(2.0, 1.0, b"d"),  # paired: wall and CPU 0.5x
    }
    figures = paired(mine, base, "none")
    assert figures["baseline"] == "none"
    assert (figures["commands"], figures["unpaired"], figures["different_answers"]) == (3, 1, 1)
    assert figures["seconds"] == 7.0 and figures["baseline_seconds"] == 7.0
    assert figures["median_ratio"] == pytest.approx(1.5)  # of 2, 1.5 and 0.5
    assert figures["cpu_commands"] == 2
    assert figures["cpu_seconds"] == 2.5 and figures["baseline_cpu_seconds"] == 2.5
    assert figures["median_cpu_ratio"] == pytest.approx((3.0 + 0.5) / 2)
    nothing = paired({}, base, "none")
    assert nothing["commands"] == 0 and nothing["median_ratio"] is None and nothing["median_cpu_ratio"] is None


def workspace_replay(tmp_path: Path, strategies: list[Any]) -> ReplayResult:
    """Two tasks of two rollouts each in real workspace sandboxes; one command prints the time, so its answers
    differ between strategies (never the same work as far as the answers can tell)."""
    base = tmp_path / "project"
    base.mkdir()
    (base / "a.txt").write_text("alpha\n")
    commands = ["cat /testbed/a.txt", "echo $((6 * 7)) > /tmp/n && cat /tmp/n", "date +%s%N", "ls /tmp"]
    traces = [
        Trace(f"t{t}", f"r{r}", "", [TraceCall("bash", {"command": c}) for c in commands])
        for t in range(2)
        for r in range(2)
    ]
    write_traces(tmp_path / "t.jsonl", traces)

    async def run() -> ReplayResult:
        workload = await load_workload(tmp_path / "t.jsonl", "workspace", base=base, timeout=60)
        try:
            return await replay(workload, strategies, ReplayOptions(concurrency=2, progress=False))
        finally:
            await workload.close()

    return asyncio.run(run())


@pytest.mark.skipif(os.geteuid() != 0, reason="a command's CPU time comes from its sandbox's cgroup: needs root")
def test_paired_cost_on_workspace_commands_shows_a_strategy_whose_commands_cost_more(tmp_path: Path) -> None:
    result = workspace_replay(tmp_path, [NoCacheStrategy(), TvCacheStrategy(), Wrapped("burning", burn)])
    write_json(result, tmp_path / "out.json")
    rows = json.loads((tmp_path / "out.json").read_text())["strategies"]
    assert rows["none"]["paired"] is None  # the baseline itself
    for name in ("tvcache", "burning"):
        row, figures = rows[name], rows[name]["paired"]
        assert figures["baseline"] == "none"
        executed = len(result.strategies[name].executed)
        assert executed == row["executions"] - row["errors"] > 0  # every executed call is measured, no hit
        assert figures["commands"] + figures["unpaired"] + figures["different_answers"] == executed
        assert figures["unpaired"] == 0  # none executed every call without error
        assert figures["cpu_commands"] == figures["commands"] > 0  # the sandboxes' cgroups measured every command
        assert figures["cpu_seconds"] > 0 and figures["baseline_cpu_seconds"] > 0
    burning = rows["burning"]["paired"]
    assert burning["different_answers"] == 4  # `date` in each rollout, executed by both and answered otherwise
    assert burning["commands"] == 12
    assert burning["median_cpu_ratio"] > 2  # about 60 ms of CPU against a few
    assert burning["median_ratio"] > 1
    assert burning["cpu_seconds"] > burning["baseline_cpu_seconds"]
    tvcache = rows["tvcache"]
    assert tvcache["hits"] > 0 and tvcache["paired"]["commands"] < burning["commands"]  # hits are no work: no pairs
    out = io.StringIO()
    print_table(result, Console(file=out, width=200))
    table = out.getvalue().split("paired commands: the same calls")[1].split("\n\n")[0]
    line = next(line for line in table.splitlines() if line.startswith("│ burning "))
    cells = [c.strip() for c in line.strip("│ ").split("│")]
    assert cells[1:3] == ["12", "4"]
    assert cells[5] == f"{burning['median_ratio']:.2f}" and cells[8] == f"{burning['median_cpu_ratio']:.2f}"


def test_without_no_cache_there_is_no_baseline(tmp_path: Path) -> None:
    result = workspace_replay(tmp_path, [TvCacheStrategy()])
    assert result.summary()["strategies"]["tvcache"]["paired"] is None
    out = io.StringIO()
    print_table(result, Console(file=out, width=200))
    assert "paired cost of commands: no baseline" in out.getvalue()


def test_only_strategies_that_reuse_by_reads_get_the_traced_sandboxes() -> None:
    """A workload with untraced sandboxes (`bench swe --read-sets`) gives the traced ones to tvcache alone: no cache,
    exact history and the oracle's re-executions run untraced, so the paired cost against none is the tracing's.
    Here the two factories answer with their own name, so every answer shows which one ran it."""

    def factory(kind: str) -> PythonSandboxes[list[str]]:
        return PythonSandboxes(make=list, run=lambda state, call: kind, fingerprint="same")

    traced, untraced = factory("traced"), factory("untraced")
    traces = [Trace("t", f"r{r}", "", [TraceCall("which", {"i": i}) for i in range(3)]) for r in range(2)]
    workload = Workload("kinds", traces, lambda task: traced, Tools(), untraced=lambda task: untraced)
    result = asyncio.run(
        replay_strategies(workload, ["none", "exact", "tvcache"], ReplayOptions(progress=False, concurrency=1))
    )
    answers = {name: run.executed for name, run in result.strategies.items()}
    assert {e.answer for e in answers["none"].values()} == {e.answer for e in answers["exact"].values()}
    assert {e.answer for e in answers["none"].values()} != {e.answer for e in answers["tvcache"].values()}
    assert result.strategies["exact"].wrong_answers == 0
    assert result.strategies["tvcache"].wrong_answers == 6  # every answer it executed or hit says "traced"
