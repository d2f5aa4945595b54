"""The replay engine: schedule, concurrency, comparison with the oracle, failures, reports, CLI, quick."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import random
import re
import sqlite3
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal

import pytest
from rich.console import Console

from tvcache import PythonSandboxes, Result, Tools
from tvcache.rollout import RolloutStats
from tvcache.sandboxes.base import Sandboxes
from tvcache_bench import cli as replay_cli
from tvcache_bench.data import workload_path
from tvcache_bench.replay import PARTS, ReplayOptions, percentile, replay, replay_strategies, schedule
from tvcache_bench.report import format_seconds, print_table, write_charts, write_json
from tvcache_bench.strategies import NoCacheStrategy, Strategy, StrategyRollout
from tvcache_bench.traces import Trace, TraceCall, write_traces
from tvcache_bench.turns import TurnTime
from tvcache_bench.workload import Workload
from tvcache_bench.workloads import quick, synthetic
from wrapped import Wrapped


def traces_of(shape: list[tuple[str, int]], calls: int = 2) -> list[Trace]:
    """Rollouts (task, count) in this file order, each with `calls` reads."""
    out = []
    for task, count in shape:
        for r in range(count):
            out.append(Trace(task, f"r{r}", "", [TraceCall("read", {"key": "a"}) for _ in range(calls)]))
    return out


# -- schedule -------------------------------------------------------------------------------------------


def test_schedule_batches_tasks_in_order_of_appearance_and_repeats_epochs() -> None:
    traces = [Trace(t, r) for t, r in [("b", "0"), ("a", "0"), ("c", "0"), ("b", "1"), ("d", "0"), ("e", "0")]]
    steps = schedule(traces, batch=2, epochs=2)
    assert [(s.epoch, s.index, s.tasks) for s in steps] == [
        (0, 0, ("b", "a")),
        (0, 1, ("c", "d")),
        (0, 2, ("e",)),
        (1, 0, ("b", "a")),
        (1, 1, ("c", "d")),
        (1, 2, ("e",)),
    ]
    assert steps[0].rollouts == (0, 3, 1)  # task-major: both rollouts of b, then a
    assert steps[1].rollouts == (2, 4)
    assert schedule(traces, batch=10, epochs=1)[0].rollouts == (0, 3, 1, 2, 4, 5)
    with pytest.raises(ValueError):
        schedule(traces, batch=0, epochs=1)
    with pytest.raises(ValueError):
        schedule(traces, batch=1, epochs=0)


class Recorder(Strategy):
    """No cache, recording when rollouts start and end and in what order calls arrive."""

    name = "none"

    def __init__(self, delay: float = 0.002):
        self.inner = NoCacheStrategy()
        self.delay = delay
        self.events: list[tuple[str, str, int]] = []  # (start|end, task, rollout id)
        self.live = self.peak = 0
        self.calls: dict[int, list[int]] = {}

    @contextlib.asynccontextmanager
    async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools) -> AsyncIterator[StrategyRollout]:
        me = len(self.calls)
        self.calls[me] = []
        self.live += 1
        self.peak = max(self.peak, self.live)
        self.events.append(("start", task, me))
        recorder = self

        class Wrapped:
            @property
            def stats(self) -> RolloutStats:
                return inner.stats

            async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result:
                recorder.calls[me].append(int((args or {})["i"]))
                await asyncio.sleep(recorder.delay)
                return await inner.call(tool, args)

        try:
            async with self.inner.rollout(task, sandboxes, tools) as inner:
                yield Wrapped()
        finally:
            self.live -= 1
            self.events.append(("end", task, me))

    def stats(self) -> dict[str, float]:
        return self.inner.stats()


def numbered_workload(tasks: int, rollouts: int, calls: int) -> Workload:
    factory = synthetic.make_sandboxes()
    traces = [
        Trace(f"t{t}", f"r{r}", "", [TraceCall("read", {"key": "a", "i": i}) for i in range(calls)])
        for t in range(tasks)
        for r in range(rollouts)
    ]
    return Workload("numbered", traces, lambda task: factory, Tools(read_only={"read"}))


def test_steps_run_in_order_with_bounded_concurrency_and_calls_in_order() -> None:
    workload = numbered_workload(tasks=5, rollouts=3, calls=4)
    recorder = Recorder()
    asyncio.run(replay(workload, [recorder], ReplayOptions(batch=2, epochs=2, concurrency=4, progress=False)))
    assert recorder.peak == 4  # six rollouts per full step, at most four at once
    assert all(order == [0, 1, 2, 3] for order in recorder.calls.values())
    assert len(recorder.calls) == 2 * 15
    # Steps are barriers: every rollout of a step ends before the next step's first one starts.
    steps = [("t0", "t1"), ("t2", "t3"), ("t4",)] * 2
    position = 0
    for tasks in steps:
        window = recorder.events[position : position + 2 * 3 * len(tasks)]
        assert {task for _, task, _ in window} == set(tasks), (tasks, window)
        position += len(window)
    assert position == len(recorder.events)


def test_strategies_take_turns_step_by_step() -> None:
    """A machine whose load drifts during a long run must not favour the strategies that ran in the quiet part:
    every strategy runs step 1 before any runs step 2."""
    log: list[tuple[str, str]] = []

    class Logging(Recorder):
        def __init__(self, name: str):
            super().__init__(delay=0)
            self.name = name

        @contextlib.asynccontextmanager
        async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools) -> AsyncIterator[StrategyRollout]:
            log.append((self.name, task))
            async with super().rollout(task, sandboxes, tools) as r:
                yield r

    def changes(turns: Literal["step", "strategy"]) -> list[tuple[str, str]]:
        log.clear()
        strategies = [Logging("later"), Logging("none")]
        options = ReplayOptions(batch=2, progress=False, turns=turns)
        asyncio.run(replay(numbered_workload(4, 2, 1), strategies, options))
        seen = [(name, "step 1" if task in ("t0", "t1") else "step 2") for name, task in log]
        return [turn for i, turn in enumerate(seen) if i == 0 or turn != seen[i - 1]]

    assert changes("step") == [("none", "step 1"), ("later", "step 1"), ("none", "step 2"), ("later", "step 2")]
    # By strategy (for big snapshots): each runs its whole schedule, the oracle first.
    assert changes("strategy") == [("none", "step 1"), ("none", "step 2"), ("later", "step 1"), ("later", "step 2")]


def test_concurrency_one_runs_rollouts_one_by_one() -> None:
    recorder = Recorder(delay=0)
    asyncio.run(replay(numbered_workload(2, 3, 2), [recorder], ReplayOptions(concurrency=1, progress=False)))
    assert recorder.peak == 1
    kinds = [kind for kind, _, _ in recorder.events]
    assert kinds == ["start", "end"] * 6


# -- comparison with the oracle ----------------------------------------------------------------------------


class Liar(Strategy):
    """No cache, but plants wrong answers at chosen (rollout number, call) positions, as hits or not."""

    def __init__(self, name: str, plant: dict[tuple[int, int], bool]):
        self.name = name
        self.inner = NoCacheStrategy()
        self.plant = plant
        self.rollouts = 0

    @contextlib.asynccontextmanager
    async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools) -> AsyncIterator[StrategyRollout]:
        me = self.rollouts
        self.rollouts += 1
        plant = self.plant
        count = [0]

        class Lying:
            @property
            def stats(self) -> RolloutStats:
                return inner.stats

            async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result:
                result = await inner.call(tool, args)
                position = (me, count[0])
                count[0] += 1
                if position in plant:
                    return Result(f"{result.output} (planted)", plant[position], result.seconds, "memo")
                return Result(result.output, True, result.seconds, "memo")  # right answers, claimed as hits

        async with self.inner.rollout(task, sandboxes, tools) as inner:
            yield Lying()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()


def test_a_planted_wrong_hit_is_counted() -> None:
    workload = numbered_workload(tasks=2, rollouts=2, calls=3)
    liar = Liar("liar", {(1, 2): True, (3, 0): False})  # one wrong hit, one wrong executed answer
    result = asyncio.run(replay(workload, [NoCacheStrategy(), liar], ReplayOptions(progress=False)))
    run = result.strategies["liar"]
    assert run.compared == 12
    assert run.incorrect_hits == 1 and run.wrong_answers == 2 and run.nondeterministic == 0
    hit, executed = sorted(run.examples, key=lambda e: not e["hit"])
    assert hit["task"] == "t0" and hit["rollout"] == "r1" and hit["call"] == 2 and hit["hit"]
    assert executed["task"] == "t1" and executed["rollout"] == "r1" and executed["call"] == 0
    assert not executed["hit"] and "planted" in hit["got"] and "planted" in executed["got"]
    honest = Liar("honest", {})
    result = asyncio.run(replay(workload, [NoCacheStrategy(), honest], ReplayOptions(progress=False)))
    assert result.strategies["honest"].incorrect_hits == 0 and result.strategies["honest"].hit_rate == 1.0


def test_an_answer_that_depends_on_the_pace_of_calls_is_not_counted_as_wrong() -> None:
    """A strategy that pauses between calls (snapshots, waits) gets another answer from a tool that looks at
    the time between calls, as git does with file times: a paced uncached re-execution reproduces it."""
    import time

    def tick(state: dict[str, float], call: Any) -> str:
        now, last = time.monotonic(), state.get("last")
        state["last"] = now
        return "first" if last is None else ("slow" if now - last > 1.0 else "fast")

    boxes = PythonSandboxes(make=dict, run=tick, fingerprint="tick")
    traces = [Trace("t", "r", "", [TraceCall("tick", {"i": i}) for i in range(3)])]
    workload = Workload("ticks", traces, lambda task: boxes, Tools())

    async def pause(tool: str, args: Mapping[str, Any]) -> Mapping[str, Any]:
        await asyncio.sleep(1.2)
        return args

    result = asyncio.run(replay(workload, [NoCacheStrategy(), Wrapped("slow", pause)], ReplayOptions(progress=False)))
    run = result.strategies["slow"]
    assert run.compared == 3 and run.nondeterministic == 2 and run.wrong_answers == 0


def test_a_reexecution_that_agrees_with_the_oracle_by_chance_does_not_make_an_answer_wrong() -> None:
    """A tool printing something that varies little (a process id, a file's inode) can give the oracle's answer
    again on one re-execution by chance: a single re-execution counted tvcache's correct answer as wrong (1
    incorrect hit here); a second re-execution that differs from the oracle shows the tool is not deterministic."""
    # In turn: the oracle's epoch 1, tvcache's execution, the oracle's epoch 2 (tvcache hits), the re-executions.
    printed = iter(["pid 41", "pid 41", "pid 42", "pid 42"])  # then "pid 41" for ever

    def timed(state: dict[str, str], call: Any) -> str:
        return next(printed, "pid 41")

    boxes = PythonSandboxes(make=dict, run=timed, fingerprint="timed")
    traces = [Trace("t", "r", "", [TraceCall("pid", {})])]
    workload = Workload("timed", traces, lambda task: boxes, Tools(read_only={"pid"}))
    options = ReplayOptions(progress=False, epochs=2, prefetch=False)
    result = asyncio.run(replay_strategies(workload, ["none", "tvcache"], options))
    run = result.strategies["tvcache"]
    assert run.hits == 1 and run.compared == 2
    assert run.incorrect_hits == 0 and run.wrong_answers == 0 and run.nondeterministic == 1


def test_answers_that_differ_only_in_a_printed_duration_are_the_same_answer() -> None:
    """Test runners print how long they took ("Ran 9 tests in 0.004s", "3 passed in 0.12s"): one run of the same
    command in the same state prints 0.003s alone and 0.009s among eight others. The check against the oracle
    compares answers with such durations masked; every other difference still counts."""
    # In turn: the oracle, the strategy; the oracle, the strategy (whose answer differs in more than the duration).
    printed = iter(["Ran 9 tests in 0.003s\nOK", "Ran 9 tests in 0.009s\nOK", "in 0.003s\nOK", "in 0.012s\nFAILED"])

    def timed(state: dict[str, str], call: Any) -> str:
        return next(printed)

    boxes = PythonSandboxes(make=dict, run=timed, fingerprint="durations")
    traces = [Trace("t", "r", "", [TraceCall("unittest", {})])]
    workload = Workload("durations", traces, lambda task: boxes, Tools(read_only={"unittest"}))
    options = ReplayOptions(progress=False, prefetch=False, verify=False)
    result = asyncio.run(replay(workload, [NoCacheStrategy(), Renamed("again")], options))
    assert result.strategies["again"].compared == 1 and result.strategies["again"].wrong_answers == 0
    result = asyncio.run(replay(workload, [NoCacheStrategy(), Renamed("third")], options))
    assert result.strategies["third"].wrong_answers == 1


def test_a_wrong_answer_whose_recheck_failed_says_it_is_unchecked() -> None:
    """A mismatch counts as wrong unless an uncached re-execution explains it; when the re-execution itself fails
    before the call (here it times out; under load a 60 s test run can), nothing could explain it, and the report
    says so instead of passing it off as a checked wrong answer."""
    answers = iter(["a", "b"])  # the oracle's answer, the strategy's; every re-execution then hangs

    async def hangs_later(state: dict[str, str], call: Any) -> str:
        answer = next(answers, None)
        if answer is None:
            await asyncio.sleep(5)
        return answer or "never"

    boxes = PythonSandboxes(make=dict, run=hangs_later, fingerprint="hangs-later")
    traces = [Trace("t", "r", "", [TraceCall("ask", {})])]
    workload = Workload("hangs", traces, lambda task: boxes, Tools(read_only={"ask"}))
    result = asyncio.run(
        replay(workload, [NoCacheStrategy(), Renamed("again")], ReplayOptions(progress=False, timeout=0.05))
    )
    run = result.strategies["again"]
    assert run.wrong_answers == 1 and run.unchecked == 1
    assert run.first_unchecked is not None and run.first_unchecked.startswith("t/r call 0: TimeoutError")
    assert any("wrong answers are unchecked" in p for p in run.problems())
    assert result.summary()["strategies"]["again"]["unchecked_wrong_answers"] == 1


class Renamed(NoCacheStrategy):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def test_without_an_oracle_nothing_is_compared() -> None:
    result = asyncio.run(
        replay(numbered_workload(1, 2, 2), [Liar("liar", {(0, 0): True})], ReplayOptions(progress=False))
    )
    assert result.strategies["liar"].incorrect_hits is None
    assert result.summary()["strategies"]["liar"]["speedup_total"] is None


def random_token(state: dict[str, str], call: Any) -> str:
    return f"{random.random():.12f}"  # a tool that is not deterministic


def test_nondeterministic_tools_are_told_apart_from_wrong_answers() -> None:
    factory = PythonSandboxes(make=dict, run=random_token, fingerprint="random")
    traces = [Trace("t", f"r{r}", "", [TraceCall("token", {})]) for r in range(3)]
    workload = Workload("random", traces, lambda task: factory, Tools(read_only={"token"}))
    verified = asyncio.run(replay_strategies(workload, ["none", "tvcache"], ReplayOptions(progress=False, epochs=2)))
    run = verified.strategies["tvcache"]
    assert run.hits == 5 and run.incorrect_hits == 0 and run.nondeterministic == 6
    assert verified.oracle_nondeterministic == 3  # the oracle's own answers differ between epochs
    unverified = asyncio.run(
        replay_strategies(workload, ["none", "tvcache"], ReplayOptions(progress=False, verify=False))
    )
    assert unverified.strategies["tvcache"].incorrect_hits == 2


# -- failures -----------------------------------------------------------------------------------------------


async def slow_or_broken(state: dict[str, str], call: Any) -> str:
    if call.tool == "sleep":
        await asyncio.sleep(float(call.args["seconds"]))
    if call.tool == "crash":
        raise RuntimeError("the tool crashed")
    return "ok"


def test_timeouts_and_crashes_end_the_rollout_and_are_reported() -> None:
    factory = PythonSandboxes(make=dict, run=slow_or_broken, fingerprint="slow")
    calls = [TraceCall("ok", {}), TraceCall("sleep", {"seconds": 5}), TraceCall("ok", {}), TraceCall("ok", {"n": 1})]
    traces = [
        Trace("t", "slow", "", calls),
        Trace("t", "crash", "", [TraceCall("ok", {}), TraceCall("crash", {}), TraceCall("ok", {})]),
    ]
    workload = Workload("faulty", traces, lambda task: factory, Tools())
    result = asyncio.run(replay_strategies(workload, ["none", "tvcache"], ReplayOptions(timeout=0.05, progress=False)))
    for run in result.strategies.values():
        assert run.timeouts == 1 and run.failed_rollouts == 1, run.name
        assert run.errors == 2 and run.skipped == 3 and run.calls == 4
        timed_out = "t/slow call 1 (sleep): timed out after 0.05 s"
        crashed = "t/crash call 1 (crash): RuntimeError: the tool crashed"
        assert run.first_error in (timed_out, crashed)  # whichever came first
        assert run.tool_errors == {"sleep": 1, "crash": 1}
        assert sorted(run.problems()) == [
            f"every call of the tool 'crash' under {run.name} failed (1 calls); the first: {crashed}",
            f"every call of the tool 'sleep' under {run.name} failed (1 calls); the first: {timed_out}",
        ]
    assert result.strategies["tvcache"].incorrect_hits == 0
    assert result.strategies["tvcache"].lost == 0  # it failed only where the uncached run failed


# -- reports and the command line ------------------------------------------------------------------------------


def test_percentile() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0], 0.9) == pytest.approx(2.8)


def test_reports(tmp_path: Path) -> None:
    workload = synthetic.build_workload(synthetic.Params(tasks=2, rollouts=3, calls=5, cost_ms=1, capacity=0))
    try:
        result = asyncio.run(
            replay_strategies(workload, ["none", "naive", "paper", "tvcache"], ReplayOptions(epochs=2, progress=False))
        )
    finally:
        asyncio.run(workload.close())
    out = io.StringIO()
    print_table(result, Console(file=out, width=200))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 100  # at a glance in a 100-column terminal
    tables, legend = text.split("reading the tables:")
    headers = re.findall(r"┃([^┃\n]+)", tables)  # the header cells of both tables (some over two lines)
    columns = {" ".join(h.split()) for h in headers} - {""}
    assert {"hit rate", "snapshots", "peak memory", "p90 call", "replayed", "median speedup"} <= columns
    terms = re.findall(r"^  ([a-z0-9 ]+) =", legend, re.M)
    for column in columns - {"strategy", "incorrect", "hits"}:
        assert column in terms, f"the legend does not explain {column!r}"
    assert "incorrect hits" in terms
    assert "arXiv:2602.10986" in " ".join(legend.split())  # the published system, cited
    write_json(result, tmp_path / "out.json")
    figures = json.loads((tmp_path / "out.json").read_text())
    for row in figures["strategies"].values():
        for key in ("hit_rate", "incorrect_hits", "executions", "median_call_seconds", "total_tool_seconds"):
            assert key in row
    assert figures["strategies"]["none"]["executions"] == 2 * 2 * 3 * 5
    assert figures["strategies"]["none"]["paired"] is None  # the baseline of the others' paired cost
    for name in ("naive", "paper", "tvcache"):
        pairs = figures["strategies"][name]["paired"]
        assert pairs["baseline"] == "none" and pairs["commands"] > 0 and pairs["median_ratio"] > 0
        assert pairs["cpu_commands"] == 0 and pairs["median_cpu_ratio"] is None  # Python sandboxes measure no CPU
    assert "paired commands: the same calls executed by the strategy and by none" in tables
    assert len(figures["strategies"]["tvcache"]["epoch_hit_rates"]) == 2
    charts = write_charts(result, tmp_path / "charts")
    assert len(charts) == 4
    for chart in charts:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tvcache")
    replay_cli.add_commands(parser.add_subparsers(dest="command", required=True))
    return replay_cli.run_command(parser.parse_args(argv))


def test_replay_command_on_sqlite(tmp_path: Path) -> None:
    rng = random.Random(0)
    traces = [Trace(f"q{t}", f"r{r}", "test", quick.chinook_rollout(t, rng)) for t in range(3) for r in range(3)]
    write_traces(tmp_path / "sql.jsonl", traces)
    out = tmp_path / "out.json"
    chinook = str(workload_path("sql", "chinook", "chinook.sqlite"))
    argv = [str(tmp_path / "sql.jsonl"), "--sandbox", "sqlite", "--base", chinook, "--tasks", "2", "--epochs", "2"]
    code = cli(
        ["replay", *argv, "--strategies", "none,tvcache", "--json", str(out), "--no-progress", "--turn-time", "none"]
    )
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["tasks"] == 2 and figures["rollouts"] == 6 and set(figures["strategies"]) == {"none", "tvcache"}
    assert figures["strategies"]["tvcache"]["incorrect_hits"] == 0
    assert figures["strategies"]["tvcache"]["hit_rate"] > 0.5


def test_replay_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "t", "rollout": "r", "calls": []}\n{"task": "t"\n')
    assert cli(["replay", str(bad), "--sandbox", "sqlite", "--base", "x"]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    write_traces(good, [Trace("t", "r", "", [TraceCall("sql", {"query": "SELECT 1"})])])
    assert cli(["replay", str(good), "--sandbox", "podman"]) == 2
    assert "unknown sandbox 'podman'" in capsys.readouterr().err
    assert cli(["replay", str(good), "--sandbox", "docker"]) == 2
    assert "--sandbox docker needs --image IMAGE" in capsys.readouterr().err
    assert cli(["replay", str(good), "--sandbox", "sqlite", "--base", "x", "--image", "y"]) == 2
    assert "--image applies to --sandbox workspace or docker" in capsys.readouterr().err
    assert cli(["replay", str(good), "--sandbox", "sqlite"]) == 2
    assert "--base" in capsys.readouterr().err
    assert cli(["replay", str(good), "--sandbox", "python:no_such_module_xyz:f"]) == 2
    assert "cannot import" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["replay", str(good), "--sandbox", "sqlite", "--strategies", "none,magic"])
    assert "unknown strategy magic" in capsys.readouterr().err


def test_replay_command_with_a_python_factory(tmp_path: Path) -> None:
    traces = synthetic.generate(synthetic.Params(tasks=2, rollouts=3, calls=4, cost_ms=0))
    write_traces(tmp_path / "kv.jsonl", traces)
    out = tmp_path / "out.json"
    argv = [
        "replay",
        str(tmp_path / "kv.jsonl"),
        "--sandbox",
        "python:tvcache_bench.workloads.synthetic:make_sandboxes",
    ]
    assert cli([*argv, "--read-only", "read", "--json", str(out), "--no-progress", "--turn-time", "none"]) == 0
    figures = json.loads(out.read_text())
    assert figures["strategies"]["tvcache"]["incorrect_hits"] == 0
    assert figures["strategies"]["naive"]["compared"] == 24


def test_prefetch_warms_sandboxes_for_the_next_step() -> None:
    def warm(prefetch: bool) -> float:
        workload = synthetic.build_workload(synthetic.Params(tasks=6, rollouts=4, calls=4, cost_ms=2, capacity=0))
        try:
            options = ReplayOptions(batch=2, prefetch=prefetch, progress=False)
            result = asyncio.run(replay_strategies(workload, ["tvcache"], options))
        finally:
            asyncio.run(workload.close())
        return result.strategies["tvcache"].stats["warm"]

    assert warm(True) > 0
    assert warm(False) == 0


def test_quick_reduced() -> None:
    figures = quick.run(small=True)
    strategies = figures["strategies"]
    assert strategies["tvcache"]["incorrect_hits"] == 0
    assert strategies["paper"]["incorrect_hits"] == 0
    assert strategies["naive"]["incorrect_hits"] > 0


def test_where_the_time_goes_adds_up_on_a_real_replay(tmp_path: Path) -> None:
    """The quick mix (SQLite databases) with rollouts in flight together, so tvcache waits on identical calls:
    per strategy, every part of the breakdown was measured inside some call, so they add up to at most the
    calls' time, and a part is there exactly when the work it times was done."""

    async def run() -> Any:
        workload = await quick.build("small")
        try:
            options = ReplayOptions(batch=2, epochs=2, concurrency=6, progress=False)
            return await replay_strategies(workload, ["none", "paper", "tvcache"], options)
        finally:
            await workload.close()

    result = asyncio.run(run())
    write_json(result, tmp_path / "out.json")
    rows = json.loads((tmp_path / "out.json").read_text())["strategies"]
    for name, row in rows.items():
        parts = row["time_breakdown"]
        assert set(parts) == {*PARTS, "overhead"}
        assert all(parts[p] >= 0 for p in PARTS)
        measured = sum(parts[p] for p in PARTS)
        assert measured <= row["total_tool_seconds"] * (1 + 1e-9), name  # inside the calls' time
        assert parts["overhead"] == pytest.approx(row["total_tool_seconds"] - measured)
        assert parts["executing"] > 0
        for part, count in (("creating", "creates"), ("restoring", "restores"), ("replaying", "replays")):
            assert (parts[part] > 0) == (row[count] > 0), (name, part)
        assert (parts["snapshotting"] > 0) == (row["snapshots"] > 0), name
    assert rows["none"]["time_breakdown"]["snapshotting"] == rows["none"]["time_breakdown"]["store"] == 0
    tvcache = rows["tvcache"]
    assert tvcache["stats"]["waits"] > 0 and tvcache["time_breakdown"]["waiting"] > 0
    assert tvcache["time_breakdown"]["store"] > 0
    out = io.StringIO()
    print_table(result, Console(file=out, width=200))
    table = out.getvalue().split("where the tool time goes")[1].split("reading the tables:")[0]
    for name, row in rows.items():
        line = next(line for line in table.splitlines() if line.startswith(f"│ {name} "))
        cells = [c.strip() for c in line.strip("│ ").split("│")][1:]
        seconds = [row["time_breakdown"][p] for p in (*PARTS, "overhead")]
        assert cells == [format_seconds(s) if s else "-" for s in seconds]
    charts = write_charts(result, tmp_path / "charts")
    assert (tmp_path / "charts" / "quick-time-breakdown.png") in charts


def test_turn_times_come_from_timestamps_else_a_seeded_distribution() -> None:
    stamped = Trace("t", "r", "", [TraceCall("x", {}, None, 10.0, 10.5), TraceCall("x", {}, None, 12.0, 12.1)])
    bare = Trace("t", "r", "", [TraceCall("x", {}), TraceCall("x", {}), TraceCall("x", {})])
    lognormal = TurnTime.parse("lognormal:2:0.5", seed=7)
    assert lognormal.before(stamped, 1, 0, 0) == 1.5  # the trace's own gap wins
    assert lognormal.before(bare, 0, 0, 0) == 0  # the first call comes with the prompt
    draws = [lognormal.before(bare, i, e, r) for i in (1, 2) for e in (0, 1) for r in (0, 1)]
    assert draws == [
        TurnTime.parse("lognormal:2:0.5", seed=7).before(bare, i, e, r) for i in (1, 2) for e in (0, 1) for r in (0, 1)
    ]
    assert len(set(draws)) == len(draws) and all(d > 0 for d in draws)
    assert draws != [
        TurnTime.parse("lognormal:2:0.5", seed=8).before(bare, i, e, r) for i in (1, 2) for e in (0, 1) for r in (0, 1)
    ]
    assert TurnTime.parse("fixed:0.25").before(bare, 2, 0, 0) == 0.25
    assert TurnTime.parse("none").before(bare, 2, 0, 0) == 0
    assert TurnTime.parse("realistic") == TurnTime.parse("lognormal:1:0.8")
    for bad in ("fixed", "fixed:-1", "lognormal:1:2:3", "gamma:1", "none:1", "fixed:nan"):
        with pytest.raises(ValueError, match="use none, fixed:SECONDS"):
            TurnTime.parse(bad)


def test_the_engine_waits_the_model_turns_between_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every strategy waits the same turns, before every call but a rollout's first; the report says so."""
    workload = synthetic.build_workload(synthetic.Params(tasks=2, rollouts=2, calls=3, cost_ms=0, capacity=0))
    slept: list[float] = []
    sleep = asyncio.sleep

    async def recorded(seconds: float, *args: Any) -> Any:
        if sys._getframe(1).f_globals["__name__"] != "tvcache_bench.replay":
            return await sleep(seconds, *args)  # the cache's own sleeps (claim refreshes) as they are
        slept.append(seconds)
        return await sleep(0, *args)  # the turns are counted, not waited: a test does not need the seconds

    monkeypatch.setattr("tvcache_bench.replay.asyncio.sleep", recorded)
    turn_time = TurnTime.parse("lognormal:0.5", seed=3)
    try:
        options = ReplayOptions(epochs=2, progress=False, prefetch=False, turn_time=turn_time)
        result = asyncio.run(replay_strategies(workload, ["none", "tvcache"], options))
    finally:
        asyncio.run(workload.close())
    expected = [
        turn_time.before(trace, i, epoch, index)
        for epoch in range(2)
        for index, trace in enumerate(workload.traces)
        for i in range(1, len(trace.calls))
    ]
    turns = [s for s in slept if s > 0]
    assert sorted(turns) == sorted(expected * 2)  # each strategy waited each turn once
    summary = result.summary()
    assert summary["options"]["turn_time"] == "lognormal:0.5:0.8 (seed 3)"
    for row in summary["strategies"].values():
        assert row["turn_seconds"] == pytest.approx(sum(expected))
        assert row["rollout_seconds"] >= row["total_tool_seconds"]
    out = io.StringIO()
    print_table(result, Console(file=out, width=200))
    assert "model turns: lognormal:0.5:0.8 (seed 3)" in " ".join(out.getvalue().split())


def test_the_replay_command_takes_a_turn_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = synthetic.generate(synthetic.Params(tasks=1, rollouts=2, calls=2, cost_ms=0))
    write_traces(tmp_path / "kv.jsonl", traces)
    out = tmp_path / "out.json"
    argv = [
        "replay",
        str(tmp_path / "kv.jsonl"),
        "--sandbox",
        "python:tvcache_bench.workloads.synthetic:make_sandboxes",
    ]
    assert cli([*argv, "--turn-time", "fixed:0.01", "--turn-seed", "4", "--json", str(out), "--no-progress"]) == 0
    figures = json.loads(out.read_text())
    assert figures["options"]["turn_time"] == "fixed:0.01 (seed 4)"
    assert figures["strategies"]["none"]["turn_seconds"] == pytest.approx(0.01 * 2)
    with pytest.raises(SystemExit):
        cli([*argv, "--turn-time", "weibull:1"])
    assert "--turn-time 'weibull:1': use none" in capsys.readouterr().err


def test_synthetic_scale_reduced() -> None:
    rows = asyncio.run(synthetic.scale(tasks=4, rollouts=4, calls=10, checkpoints=2, probes=4))
    assert [r["rollouts"] for r in rows] == [8, 16]
    assert 0 < rows[0]["entries"] < rows[1]["entries"] <= 16 * 10
    assert rows[1]["nodes"] > rows[0]["nodes"]
    assert all(r["hit_p50_us"] > 0 for r in rows)


def test_setup_runs_once_before_every_rollout(tmp_path: Path) -> None:
    """`--setup` on SQLite: a script run on a private copy (the base file stays as it was)."""
    base = tmp_path / "base.sqlite"
    conn = sqlite3.connect(base)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    before = base.read_bytes()
    traces = tmp_path / "t.jsonl"
    write_traces(traces, [Trace("t", f"r{r}", "", [TraceCall("sql", {"query": "SELECT x FROM t"})]) for r in range(2)])
    out = tmp_path / "out.json"
    argv = ["replay", str(traces), "--sandbox", "sqlite", "--base", str(base), "--no-progress", "--json", str(out)]
    assert cli([*argv, "--setup", "INSERT INTO t VALUES (42);", "--strategies", "none,tvcache"]) == 0
    figures = json.loads(out.read_text())
    assert (
        figures["strategies"]["tvcache"]["hit_rate"] == 0.5 and figures["strategies"]["tvcache"]["incorrect_hits"] == 0
    )
    assert base.read_bytes() == before
    assert cli([*argv, "--setup", "INSERT INTO nowhere VALUES (1);"]) == 2


def test_workspace_setup(tmp_path: Path) -> None:
    """`--setup` on a workspace: a shell command run once in a sandbox, whose snapshot every rollout starts from."""
    from tvcache_bench.workload import load_workload

    base = tmp_path / "project"
    base.mkdir()
    (base / "a.txt").write_text("from the base\n")
    traces = tmp_path / "t.jsonl"
    write_traces(traces, [Trace("t", "r0", "", [TraceCall("bash", {"command": "cat /testbed/a.txt /testbed/b.txt"})])])

    async def main() -> Any:
        workload = await load_workload(
            traces, "workspace", base=base, setup="cd /testbed && echo from setup > b.txt", timeout=30
        )
        try:
            box = await workload.sandboxes("t").create()
            try:
                return await box.execute(workload.tools.call("bash", {"command": "cat /testbed/a.txt /testbed/b.txt"}))
            finally:
                await box.close()
        finally:
            await workload.close()

    outcome = asyncio.run(main())
    assert outcome.output["output"] == "from the base\nfrom setup\n" and outcome.output["exit_code"] == 0
    assert not (base / "b.txt").exists()
    with pytest.raises(Exception, match="setup"):
        asyncio.run(load_workload(traces, "workspace", base=base, setup="exit 3"))


def test_the_check_of_wrong_looking_answers_shows_its_progress(capsys: pytest.CaptureFixture[str]) -> None:
    """Re-executing rollouts to check the naive cache's answers takes seconds: it has a progress bar."""
    workload = synthetic.build_workload(synthetic.Params(tasks=2, rollouts=3, calls=5, cost_ms=1, capacity=0))
    try:
        result = asyncio.run(replay_strategies(workload, ["none", "naive"], ReplayOptions(epochs=2, progress=True)))
    finally:
        asyncio.run(workload.close())
    assert result.strategies["naive"].wrong_answers
    err = capsys.readouterr().err
    assert "rollouts re-run to check naive's answers" in err
