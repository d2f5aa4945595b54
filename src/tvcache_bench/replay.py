"""Replaying a workload the way a GRPO training step runs it, under several caching strategies.

The schedule: the tasks (in the order they first appear) are cut into steps of `batch` tasks. In a step all
rollouts of all its tasks run concurrently (at most `concurrency` at a time: rollout workers), each rollout
issuing its calls in order. `epochs` repeats the whole sequence of steps, as training does with a dataset,
which is where a cache reuses most. While a step runs, the strategy is told the next step's tasks (tvcache
prefetches sandboxes for them in the background).

Every strategy runs the same schedule, step by step: all strategies run step 1, one after the other so they do
not compete for the CPU, then all run step 2, and so on, so that a machine whose load changes during a long
run does not favour one strategy (`turns="strategy"` runs each strategy's whole schedule in turn instead, for
sandboxes whose snapshots are too big to hold every strategy's at once). `none` (no cache) runs each step
first and its answers are the oracle: every answer of a cached strategy is compared with `none`'s answer for
the same epoch, rollout and call. A hit that differs is an incorrect hit; an executed answer can be wrong
too, when a naive cache left the sandbox in the wrong state (`wrong_answers`). Before an answer that differs
is counted, the rollout is executed once more, uncached, in a fresh sandbox: if that answer differs from the
oracle's as well, the tool is not deterministic there (`ls -la` printing times) and the answer is counted as
`nondeterministic` instead. Answers of `none` that differ between epochs are reported as
`oracle_nondeterministic`.

Per call the engine times the wall seconds the rollout waits for the call (including any sandbox creation,
restore, replay and snapshot the strategy does for it). Peak memory is what a strategy's steps grew the process
by: per step, the peak resident set size during the step above the resident size at its start (Linux
`VmHWM`, reset through `/proc/self/clear_refs` before each step; elsewhere `ru_maxrss`, which cannot be
reset, so only a step that sets a new peak shows growth), summed over the strategy's steps. It counts
everything the strategy holds in this process: cache entries and in-process snapshots (PythonSandboxes);
snapshot files on tmpfs (SQLite, workspace layers) are not in it and show in the snapshot counts instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import os
import re
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tvcache.graph import encode_output
from tvcache.rollout import Result
from tvcache.sandboxes.base import Sandboxes

from .paired import Execution, Key, paired
from .strategies import Strategy, StrategyRollout, as_cached, make_strategy
from .traces import Trace, task_order
from .turns import TurnTime
from .workload import Workload

__all__ = [
    "PARTS",
    "ReplayOptions",
    "ReplayResult",
    "Step",
    "StrategyRun",
    "percentile",
    "replay",
    "replay_strategies",
    "resident_kb",
    "schedule",
]


@dataclass(frozen=True, slots=True)
class Step:
    """One training step: `tasks`, and the rollouts (indices into the workload's traces) to run at once."""

    epoch: int
    index: int  # within the epoch
    tasks: tuple[str, ...]
    rollouts: tuple[int, ...]


def schedule(traces: Sequence[Trace], batch: int, epochs: int) -> list[Step]:
    """Steps of `batch` tasks each, in order of first appearance, repeated for `epochs`."""
    if batch < 1 or epochs < 1:
        raise ValueError(f"batch and epochs must be at least 1, got batch={batch}, epochs={epochs}")
    by_task: dict[str, list[int]] = {}
    for i, trace in enumerate(traces):
        by_task.setdefault(trace.task, []).append(i)
    tasks = task_order(traces)
    batches = [tuple(tasks[i : i + batch]) for i in range(0, len(tasks), batch)]
    return [
        Step(epoch, index, group, tuple(r for task in group for r in by_task[task]))
        for epoch in range(epochs)
        for index, group in enumerate(batches)
    ]


# Where the calls' time goes, in the order the reports stack it: each part is a strategy's `seconds_<part>`
# counter; the cache's own overhead is what the calls took beyond them all (lookups in memory, bookkeeping,
# closing replaced sandboxes, deleting evicted snapshots, waiting for the CPU).
PARTS = ("executing", "waiting", "creating", "restoring", "replaying", "snapshotting", "store")


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    batch: int = 4  # tasks per step
    epochs: int = 1
    concurrency: int = 8  # rollouts in flight at once
    timeout: float | None = None  # per call; a call that overruns ends its rollout
    prefetch: bool = True  # tell the strategy the next step's tasks while a step runs
    progress: bool = True  # rich progress bars on stderr
    verify: bool = True  # re-execute rollouts with wrong-looking answers to rule out nondeterministic tools
    # "step": the strategies take turns step by step (load drift falls on all alike); "strategy": each runs the
    # whole schedule in turn and is closed before the next starts, so only one strategy's snapshots exist at a
    # time (for sandboxes whose snapshots are big: SQLite copies whole databases).
    turns: Literal["step", "strategy"] = "step"
    # The model's turn before each call but a rollout's first (see `turns.py`): none by default, so that a
    # replay measures tool time alone; the commands default to a realistic one.
    turn_time: TurnTime = field(default_factory=TurnTime)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.turns not in ("step", "strategy"):
            raise ValueError(f"turns must be 'step' or 'strategy', got {self.turns!r}")


@dataclass
class StrategyRun:
    """What one strategy did over the whole schedule."""

    name: str
    epochs: int
    calls: int = 0
    hits: int = 0
    read_set_hits: int = 0  # of `hits`: answered by what the call read (tvcache's second lookup phase)
    errors: int = 0  # answers marked error (sandbox or tool failure, timeout)
    timeouts: int = 0
    failed_rollouts: int = 0  # rollouts ended by an exception
    skipped: int = 0  # calls not issued because their rollout ended early
    compared: int | None = None  # answers checked against the oracle (None: no oracle in this run)
    incorrect_hits: int | None = None
    incorrect_read_set_hits: int | None = None  # of `incorrect_hits`
    wrong_answers: int | None = None
    nondeterministic: int | None = None  # answers that differed from the oracle's, as did a re-execution
    samples: list[float] = field(default_factory=list)  # per-call seconds, in completion order
    hit_samples: list[float] = field(default_factory=list)  # the seconds of the hits among them
    executed: dict[Key, Execution] = field(default_factory=dict)  # the calls it executed, for their paired cost
    epoch_calls: list[int] = field(default_factory=list)
    epoch_hits: list[int] = field(default_factory=list)
    tool_calls: dict[str, int] = field(default_factory=dict)  # per tool name: calls answered or failed
    tool_hits: dict[str, int] = field(default_factory=dict)  # per tool name: hits among them
    tool_errors: dict[str, int] = field(default_factory=dict)  # per tool name: failed calls among them
    tool_first_errors: dict[str, str] = field(default_factory=dict)  # per tool name: its first failure
    lost: int | None = None  # calls that failed where the uncached run (none) answered them
    first_lost: str | None = None
    unchecked: int = 0  # wrong answers whose rollout's uncached re-execution failed before reaching them
    first_unchecked: str | None = None
    wall_seconds: float = 0.0
    turn_seconds: float = 0.0  # the model's turns the rollouts waited between their calls
    rollout_seconds: float = 0.0  # every rollout's time from its first call to its end: turns and tool time
    peak_memory_bytes: int | None = None
    stats: dict[str, float] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)  # a few wrong answers, for people
    first_error: str | None = None  # the first failed call or rollout, and what it said

    def problems(self) -> list[str]:
        """Why this run measured nothing worth a table: every call failed; a tool failed on every call (it
        cannot run here at all: a missing interpreter, a wrong --sandbox); calls failed that the uncached run
        answered (the strategy broke them). Empty when there is none of these."""
        if self.calls and self.errors == self.calls:
            first = f"; the first: {self.first_error}" if self.first_error else ""
            return [
                f"every call of {self.name} failed ({self.calls} calls, {self.timeouts} timeouts{first}), so "
                "nothing was measured"
            ]
        problems = [
            f"every call of the tool {tool!r} under {self.name} failed ({failed} calls); the first: "
            f"{self.tool_first_errors[tool]}"
            for tool, failed in self.tool_errors.items()
            if failed == self.tool_calls[tool]
        ]
        if self.lost:
            problems.append(
                f"{self.name} failed {self.lost} calls that the uncached run answered; the first: {self.first_lost}"
            )
        if self.unchecked:
            problems.append(
                f"{self.unchecked} of {self.name}'s wrong answers are unchecked: re-executing their rollouts "
                f"uncached failed before reaching them (a nondeterministic tool cannot be told apart); the first: "
                f"{self.first_unchecked}"
            )
        return problems

    @property
    def hit_rate(self) -> float:
        return self.hits / self.calls if self.calls else 0.0

    @property
    def total_tool_seconds(self) -> float:
        return sum(self.samples)

    def breakdown(self) -> dict[str, float]:
        """Seconds of the calls' time per part (`PARTS`), and `overhead`: the calls' time beyond the parts."""
        parts = {part: float(self.stats.get(f"seconds_{part}", 0.0)) for part in PARTS}
        return {**parts, "overhead": self.total_tool_seconds - sum(parts.values())}

    def epoch_hit_rates(self) -> list[float]:
        return [h / c if c else 0.0 for h, c in zip(self.epoch_hits, self.epoch_calls, strict=True)]

    def tool_hit_rates(self) -> dict[str, dict[str, Any]]:
        """Per tool, in order of first call: calls, hits and hit rate (the published paper's Figure 12)."""
        return {
            tool: {
                "calls": calls,
                "hits": self.tool_hits.get(tool, 0),
                "hit_rate": self.tool_hits.get(tool, 0) / calls,
                "errors": self.tool_errors.get(tool, 0),
            }
            for tool, calls in self.tool_calls.items()
        }

    def summary(self, baseline: StrategyRun | None) -> dict[str, Any]:
        ordered = sorted(self.samples)
        median = percentile(ordered, 0.5)
        total = self.total_tool_seconds
        speedup_total = speedup_median = None
        if baseline is not None and baseline.samples:
            base_median = percentile(sorted(baseline.samples), 0.5)
            speedup_total = baseline.total_tool_seconds / total if total > 0 else None
            speedup_median = base_median / median if median > 0 else None
        return {
            "strategy": self.name,
            "calls": self.calls,
            "hits": self.hits,
            "hit_rate": self.hit_rate,
            "incorrect_hits": self.incorrect_hits,
            "read_set_hits": self.read_set_hits,
            "incorrect_read_set_hits": self.incorrect_read_set_hits,
            "wrong_answers": self.wrong_answers,
            "nondeterministic_answers": self.nondeterministic,
            "compared": self.compared,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "failed_rollouts": self.failed_rollouts,
            "skipped_calls": self.skipped,
            "executions": int(self.stats.get("executions", 0)),
            "replays": int(self.stats.get("replays", 0)),
            "snapshots": int(self.stats.get("snapshots", 0)),
            "restores": int(self.stats.get("restores", 0)),
            "creates": int(self.stats.get("creates", 0)),
            "warm": int(self.stats.get("warm", 0)),
            "median_call_seconds": median,
            "p90_call_seconds": percentile(ordered, 0.9),
            "p99_call_seconds": percentile(ordered, 0.99),
            "mean_call_seconds": total / len(ordered) if ordered else 0.0,
            "median_hit_seconds": percentile(sorted(self.hit_samples), 0.5) if self.hit_samples else None,
            "total_tool_seconds": total,
            "time_breakdown": self.breakdown(),
            "turn_seconds": self.turn_seconds,
            "rollout_seconds": self.rollout_seconds,
            "wall_seconds": self.wall_seconds,
            "speedup_total": speedup_total,
            "speedup_median": speedup_median,
            "paired": None if baseline in (None, self) else paired(self.executed, baseline.executed, "none"),
            "peak_memory_bytes": self.peak_memory_bytes,
            "epoch_hit_rates": self.epoch_hit_rates(),
            "tool_hit_rates": self.tool_hit_rates(),
            "stats": self.stats,
            "wrong_examples": self.examples,
            "first_error": self.first_error,
            "failed_where_uncached_answered": self.lost,
            "unchecked_wrong_answers": self.unchecked,
            "problems": self.problems(),
        }


@dataclass
class ReplayResult:
    workload: str
    notes: str
    options: ReplayOptions
    tasks: int
    rollouts: int
    calls_per_epoch: int
    steps: int
    strategies: dict[str, StrategyRun]
    oracle_nondeterministic: int | None = None  # oracle answers that differed between epochs
    load_average: tuple[float, float] | None = None  # the machine's 1-minute load average at the start and end

    @property
    def baseline(self) -> StrategyRun | None:
        return self.strategies.get("none")

    def summary(self) -> dict[str, Any]:
        """Everything but the raw samples, as JSON values: what `--json` writes."""
        o = self.options
        return {
            "workload": self.workload,
            "notes": self.notes,
            "options": {
                "batch": o.batch,
                "epochs": o.epochs,
                "concurrency": o.concurrency,
                "timeout": o.timeout,
                "turn_time": str(o.turn_time),
            },
            "tasks": self.tasks,
            "rollouts": self.rollouts,
            "calls_per_epoch": self.calls_per_epoch,
            "steps": self.steps,
            "oracle_nondeterministic": self.oracle_nondeterministic,
            "load_average": self.load_average,
            "memory_measure": _memory_method(),
            "strategies": {name: run.summary(self.baseline) for name, run in self.strategies.items()},
        }


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted samples, interpolating linearly between neighbours; 0 for no samples."""
    if not ordered:
        return 0.0
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# -- the engine ----------------------------------------------------------------------------------------

Oracle = dict[tuple[int, int, int], bytes | None]  # (epoch, rollout, call) -> digest of none's answer


async def replay_strategies(
    workload: Workload,
    names: Sequence[str],
    options: ReplayOptions,
    *,
    store: str | None = None,
    namespace: str | None = None,
) -> ReplayResult:
    """Replay `workload` under the named strategies (see `strategies.STRATEGIES`)."""
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"name each strategy once, got {list(names)}")
    strategies = [make_strategy(n, store=store, namespace=namespace) for n in names]
    return await replay(workload, strategies, options)


async def replay(workload: Workload, strategies: Sequence[Strategy], options: ReplayOptions) -> ReplayResult:
    """Replay `workload` under each strategy (`none` first: it is the oracle) on the same schedule, step by
    step: every strategy runs step 1, then every strategy runs step 2, and so on, so that a machine getting
    busier or quieter during a long run shifts all strategies alike instead of favouring the ones that ran
    in the quiet part. Closes the strategies; the workload stays open (its owner closes it)."""
    steps = schedule(workload.traces, options.batch, options.epochs)
    load_start = _load_average()
    order = sorted(strategies, key=lambda p: p.name != "none")
    factories = {task: workload.sandboxes(task) for task in task_order(workload.traces)}
    untraced = factories if workload.untraced is None else {t: workload.untraced(t) for t in factories}
    calls_per_epoch = sum(len(t.calls) for t in workload.traces)
    oracle: Oracle | None = {} if order[0].name == "none" else None
    progress = _progress(options.progress)
    engines: list[_Engine] = []
    for strategy in order:
        run = StrategyRun(strategy.name, options.epochs, epoch_calls=[0] * options.epochs)
        run.epoch_hits = [0] * options.epochs
        run.peak_memory_bytes = 0
        record = strategy.name == "none"
        boxes = factories if strategy.read_sets else untraced
        engine = _Engine(workload, boxes, strategy, options, run, None if record else oracle)
        engine.oracle_out = oracle if record else None
        engines.append(engine)
    try:
        with progress or _nothing():
            if progress is not None:
                for engine in engines:
                    engine.advance = _bar(progress, engine.strategy.name, calls_per_epoch * options.epochs, "calls")
            every = range(len(steps))
            if options.turns == "step":
                turns = [(engine, i) for i in every for engine in engines]
            else:
                turns = [(engine, i) for engine in engines for i in every]
            for engine, i in turns:
                await engine.timed_step(steps, i)
                if i == len(steps) - 1:  # its last step: free what it holds before others go on
                    await engine.strategy.flush()
                    engine.run_.stats = dict(engine.strategy.stats())
                    engine.closed = True
                    await engine.strategy.close()
    finally:
        for engine in engines:
            if not engine.closed:
                with contextlib.suppress(Exception):
                    await engine.strategy.close()
    runs = {engine.strategy.name: engine.run_ for engine in engines}
    if oracle is not None:
        verifier = _Verifier(workload, untraced, options) if options.verify else None
        checks = _progress(options.progress)  # re-executions take seconds: a bar, not a silent wait
        with checks or _nothing():
            for engine in engines[1:]:
                await _judge(workload, engine.mismatches, engine.run_, oracle, verifier, checks)
    return ReplayResult(
        workload=workload.name,
        notes=workload.notes,
        options=options,
        tasks=len(factories),
        rollouts=len(workload.traces),
        calls_per_epoch=calls_per_epoch,
        steps=len(steps),
        strategies=runs,
        oracle_nondeterministic=_nondeterministic(oracle, options.epochs) if oracle is not None else None,
        load_average=None if load_start is None else (load_start, _load_average() or 0.0),
    )


class _Engine:
    """One strategy's pass over the schedule."""

    def __init__(
        self,
        workload: Workload,
        factories: dict[str, Sandboxes],
        strategy: Strategy,
        options: ReplayOptions,
        run: StrategyRun,
        oracle: Oracle | None,
    ):
        self.workload = workload
        self.factories = factories
        self.strategy = strategy
        self.options = options
        self.run_ = run
        self.oracle = oracle
        self.oracle_out: Oracle | None = None
        self.advance: Callable[[], None] = lambda: None
        self.mismatches: list[_Mismatch] = []
        self.closed = False
        if oracle is not None:
            run.compared = run.incorrect_hits = run.wrong_answers = run.nondeterministic = run.lost = 0
            run.incorrect_read_set_hits = 0

    async def timed_step(self, steps: Sequence[Step], i: int) -> None:
        """Run step `i`, adding its wall time to the run's and the memory it grew by to the run's peak."""
        with _PeakMemory() as memory:
            start = time.perf_counter()
            await self.step(steps, i)
            self.run_.wall_seconds += time.perf_counter() - start
        assert self.run_.peak_memory_bytes is not None and memory.peak is not None
        self.run_.peak_memory_bytes += memory.peak

    async def step(self, steps: Sequence[Step], i: int) -> None:
        if self.options.prefetch and i + 1 < len(steps):
            upcoming = steps[i + 1]
            tasks = [self.workload.traces[r].task for r in upcoming.rollouts]
            counts = {t: tasks.count(t) for t in upcoming.tasks}
            await self.strategy.prefetch(counts, self.factories)
        slots = asyncio.Semaphore(self.options.concurrency)
        step = steps[i]
        await asyncio.gather(*(self.rollout(slots, step.epoch, r) for r in step.rollouts))

    async def rollout(self, slots: asyncio.Semaphore, epoch: int, index: int) -> None:
        trace = self.workload.traces[index]
        answered = 0  # calls of this rollout that got an answer, a timeout or a failure
        async with slots:
            start = began = time.perf_counter()
            try:
                async with self.strategy.rollout(trace.task, self.factories[trace.task], self.workload.tools) as r:
                    for i, c in enumerate(trace.calls):
                        turn = self.options.turn_time.before(trace, i, epoch, index)
                        if turn > 0:  # the model generates its next turn: background work is free meanwhile
                            await asyncio.sleep(turn)
                            self.run_.turn_seconds += turn
                        start = time.perf_counter()
                        before = _executing(r)
                        try:
                            result = await asyncio.wait_for(r.call(c.tool, c.args), self.options.timeout)
                        except TimeoutError:
                            self.run_.timeouts += 1
                            why = f"timed out after {self.options.timeout:g} s"
                            self.count(epoch, index, i, None, time.perf_counter() - start, why)
                            answered = i + 1
                            break  # the sandbox's state is unknown now: the rollout ends, as it would in training
                        seconds = time.perf_counter() - start
                        self.count(epoch, index, i, result, seconds, execution=_execution(before, _executing(r)))
                        answered = i + 1
            except Exception as exc:
                self.run_.failed_rollouts += 1
                why = f"{type(exc).__name__}: {exc}"
                if answered < len(trace.calls):  # the call that raised is a failed answer
                    self.count(epoch, index, answered, None, time.perf_counter() - start, why)
                    answered += 1
                elif self.run_.first_error is None:  # raised on the way out, after its last call
                    self.run_.first_error = f"{trace.task}/{trace.rollout} after its last call: {why}"
            self.run_.rollout_seconds += time.perf_counter() - began
        self.run_.skipped += len(trace.calls) - answered
        for _ in range(len(trace.calls) - answered):
            self.advance()

    def count(
        self,
        epoch: int,
        index: int,
        call: int,
        result: Result | None,
        seconds: float,
        why: str = "",
        execution: tuple[float, float | None] | None = None,
    ) -> None:
        """Count call `call` of rollout `index`: its answer `result`, or None when it failed with `why`; `execution`
        is the wall and CPU seconds (None: unmeasured) of the call's execution, when it was executed."""
        run = self.run_
        run.calls += 1
        run.epoch_calls[epoch] += 1
        run.samples.append(seconds)
        tool = self.workload.traces[index].calls[call].tool
        run.tool_calls[tool] = run.tool_calls.get(tool, 0) + 1
        self.advance()
        if result is None or result.error:
            self.failed(epoch, index, call, why if result is None else str(result.output))
            return
        if result.hit:
            run.hits += 1
            run.epoch_hits[epoch] += 1
            run.tool_hits[tool] = run.tool_hits.get(tool, 0) + 1
            run.hit_samples.append(seconds)
            run.read_set_hits += result.source == "reads"
        answer = _digest(result.output)
        if execution is not None and not result.hit:
            run.executed[(epoch, index, call)] = Execution(*execution, answer)
        if self.oracle_out is not None:
            self.oracle_out[(epoch, index, call)] = answer
        if self.oracle is None:
            return
        expected = self.oracle.get((epoch, index, call))
        if expected is None:
            return  # the oracle failed here (or never got this far): nothing to compare with
        assert run.compared is not None
        run.compared += 1
        if answer != expected:
            self.mismatches.append(
                _Mismatch(epoch, index, call, result.hit, answer, str(result.output)[:200], result.source == "reads")
            )

    def failed(self, epoch: int, index: int, call: int, why: str) -> None:
        run = self.run_
        trace = self.workload.traces[index]
        tool = trace.calls[call].tool
        where = f"{trace.task}/{trace.rollout} call {call} ({tool}): {why[:500]}"
        run.errors += 1
        run.tool_errors[tool] = run.tool_errors.get(tool, 0) + 1
        run.tool_first_errors.setdefault(tool, where)
        if run.first_error is None:
            run.first_error = where
        if self.oracle_out is not None:
            self.oracle_out[(epoch, index, call)] = None
        if self.oracle is not None and self.oracle.get((epoch, index, call)) is not None:
            assert run.lost is not None
            run.lost += 1
            if run.first_lost is None:
                run.first_lost = where


_Counted = tuple[int, float, int, float]  # a rollout's executions, their seconds, CPU-measured ones, CPU seconds


def _executing(rollout: StrategyRollout) -> _Counted:
    s = rollout.stats
    return (s.executions, s.seconds_executing, s.cpu_executions, s.cpu_seconds)


def _execution(before: _Counted, after: _Counted) -> tuple[float, float | None] | None:
    """The wall and CPU seconds (None: unmeasured) of the one execution a call made between two counts of its
    rollout's executions; None when it made none (a hit) or more (not one command's cost)."""
    if after[0] != before[0] + 1:
        return None
    cpu = after[3] - before[3] if after[2] == before[2] + 1 else None
    return after[1] - before[1], cpu


@dataclass(frozen=True, slots=True)
class _Mismatch:
    """An answer that differed from the oracle's; `_judge` decides whether it was wrong."""

    epoch: int
    index: int
    call: int
    hit: bool
    answer: bytes  # digest of the strategy's answer
    preview: str
    read_set: bool = False  # a hit by what the call read

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.epoch, self.index, self.call)


class _Verifier:
    """Re-executes rollouts uncached, each in a fresh sandbox, to tell a wrong answer from a tool that is
    not deterministic: if re-executing a rollout's history gives an answer that differs from the oracle's
    too (`ls -la` showing times, a random temp name), the oracle itself is not reproducible there.

    Some tools depend on timing instead, which a second run at the same pace reproduces faithfully: git
    compares file times in whole seconds, so `git checkout FILE` right after a rewrite of FILE with the
    same content says "Updated 0 paths" and a second later "Updated 1 path". A strategy's answers come at
    another pace (it snapshots, waits and restores between calls), so an executed answer (not a hit) whose
    mismatch the first re-execution does not explain is re-executed once more with `PACE` seconds before
    every call; if that gives the strategy's own answer, an uncached execution produced that answer too and
    it is not counted as wrong. Pacing costs a second a call, so it is done for at most `paced_rollouts`
    rollouts per strategy (the shortest); the mismatches of the others count as wrong.

    One re-execution can agree with the oracle by chance where a tool prints a time of a few milliseconds
    (`unittest`'s "Ran 9 tests in 0.003s" came out equal in one re-execution of three), which would count a
    correct answer as wrong: a mismatch the first re-execution does not explain is re-executed up to `ROUNDS`
    times in all, and any uncached execution that gave an answer other than the oracle's, or the strategy's own
    answer, explains it."""

    PACE = 1.1  # seconds: more than the one-second granularity of file times in git's index
    ROUNDS = 3  # unpaced re-executions of a rollout whose mismatch the earlier ones did not explain, at most

    def __init__(self, workload: Workload, factories: dict[str, Sandboxes], options: ReplayOptions):
        self.paced_rollouts = options.concurrency  # paced re-executions per strategy, at most
        self._workload = workload
        self._factories = factories
        self._options = options
        # (rollout, paced, round) -> digests of its re-executed calls
        self._answers: dict[tuple[int, bool, int], list[bytes | None]] = {}
        self.failures: dict[int, str] = {}  # rollout -> why its first re-execution that failed did

    def answer(self, index: int, call: int, *, paced: bool = False, round: int = 0) -> bytes | None:
        answers = self._answers.get((index, paced, round), [])
        return answers[call] if call < len(answers) else None

    def answers(self, index: int, call: int) -> set[bytes]:
        """Every answer the unpaced re-executions of rollout `index` gave to call `call`."""
        found = (self.answer(index, call, round=r) for r in range(self.ROUNDS))
        return {a for a in found if a is not None}

    async def rerun(
        self, needed: dict[int, int], *, paced: bool = False, round: int = 0, progress: Any = None, name: str = ""
    ) -> None:
        """Re-execute each rollout `index` up to call `needed[index]` (once per rollout, round and pace), with a
        progress bar named after the strategy whose answers are checked."""
        slots = asyncio.Semaphore(self._options.concurrency)
        key = (paced, round)
        todo = {i: last for i, last in needed.items() if len(self._answers.get((i, *key), [])) <= last}
        if not todo:
            return
        what = f"rollouts re-run to check {name}'s answers" + (f" ({self.PACE} s a call)" if paced else "")
        advance = _bar(progress, "check", len(todo), what)
        await asyncio.gather(*(self._one(slots, i, last, key, advance) for i, last in todo.items()))

    async def _one(
        self, slots: asyncio.Semaphore, index: int, last: int, key: tuple[bool, int], advance: Callable[[], None]
    ) -> None:
        paced = key[0]
        trace = self._workload.traces[index]
        answers: list[bytes | None] = []
        async with slots:
            box = None
            try:
                box = await self._factories[trace.task].create()
                for c in trace.calls[: last + 1]:
                    if paced:
                        await asyncio.sleep(self.PACE)
                    call = self._workload.tools.call(c.tool, c.args)
                    outcome = await asyncio.wait_for(box.execute(call), self._options.timeout)
                    answers.append(None if outcome.error else _digest(as_cached(outcome.output)))
            except Exception as exc:  # what is missing stays unverified, and the report says why
                self.failures.setdefault(index, f"{trace.task}/{trace.rollout} call {len(answers)}: {exc!r}")
            finally:
                if box is not None:
                    with contextlib.suppress(Exception):
                        await box.close()
                advance()
        self._answers[(index, *key)] = answers


async def _judge(
    workload: Workload,
    mismatches: list[_Mismatch],
    run: StrategyRun,
    oracle: Oracle,
    verifier: _Verifier | None,
    progress: Any = None,
) -> None:
    """Count each mismatch as a wrong answer, unless an uncached re-execution of its rollout disagreed with
    the oracle as well, or gave the strategy's answer when paced (see `_Verifier`). Unverifiable mismatches
    count as wrong."""
    if verifier is not None and mismatches:
        await verifier.rerun(_furthest(mismatches), progress=progress, name=run.name)
        for round in range(1, verifier.ROUNDS):
            left = [m for m in mismatches if not _explained(m, oracle[m.key], verifier)]
            await verifier.rerun(_furthest(left), round=round, progress=progress, name=run.name)
        executed = [m for m in mismatches if not m.hit and not _explained(m, oracle[m.key], verifier)]
        unexplained = _furthest(executed)
        # Pacing is slow (a second a call): at most one batch of rollouts, the shortest first.
        cheapest = sorted(unexplained, key=unexplained.__getitem__)[: verifier.paced_rollouts]
        await verifier.rerun({i: unexplained[i] for i in cheapest}, paced=True, progress=progress, name=run.name)
    assert run.wrong_answers is not None and run.incorrect_hits is not None and run.nondeterministic is not None
    for m in mismatches:
        expected = oracle[m.key]
        paced = verifier.answer(m.index, m.call, paced=True) if verifier is not None else None
        if (verifier is not None and _explained(m, expected, verifier)) or (paced is not None and paced == m.answer):
            run.nondeterministic += 1
            continue
        run.wrong_answers += 1
        if verifier is not None and m.index in verifier.failures and not verifier.answers(m.index, m.call):
            run.unchecked += 1
            run.first_unchecked = run.first_unchecked or verifier.failures[m.index]
        run.incorrect_hits += m.hit
        assert run.incorrect_read_set_hits is not None
        run.incorrect_read_set_hits += m.read_set
        if len(run.examples) < 8:
            trace = workload.traces[m.index]
            c = trace.calls[m.call]
            run.examples.append(
                {
                    "task": trace.task,
                    "rollout": trace.rollout,
                    "epoch": m.epoch,
                    "call": m.call,
                    "hit": m.hit,
                    "read_set_hit": m.read_set,
                    "tool": c.tool,
                    "args": str(c.args)[:200],
                    "got": m.preview,
                }
            )


def _explained(m: _Mismatch, expected: bytes | None, verifier: _Verifier) -> bool:
    """Did an uncached re-execution give an answer other than the oracle's, or this very answer?"""
    again = verifier.answers(m.index, m.call)
    return m.answer in again or bool(again - {expected})


def _furthest(mismatches: Sequence[_Mismatch]) -> dict[int, int]:
    """Rollout -> the last of its calls with a mismatch."""
    needed: dict[int, int] = {}
    for m in mismatches:
        needed[m.index] = max(needed.get(m.index, -1), m.call)
    return needed


# A duration a command printed about itself ("Ran 9 tests in 0.004s", "3 passed in 0.12s"):
# the same command in the same state prints another one on a busier machine.
_DURATION = re.compile(rb"\b\d+\.\d+ ?(?:s|ms|us|\xc2\xb5s|sec|secs|seconds)\b")


def _digest(output: Any) -> bytes:
    """What answers are compared by: the output's bytes, durations it printed masked (`_DURATION`)."""
    try:
        blob = encode_output(output)
    except TypeError:
        blob = repr(output).encode()
    return hashlib.blake2b(_DURATION.sub(b"<duration>", blob), digest_size=16).digest()


def _nondeterministic(oracle: Oracle, epochs: int) -> int:
    """Oracle answers of later epochs that differ from the first epoch's answer to the same call."""
    differ = 0
    for (epoch, index, call), answer in oracle.items():
        if epoch:
            first = oracle.get((0, index, call))
            differ += answer is not None and first is not None and answer != first
    return differ


# -- progress and memory ---------------------------------------------------------------------------------


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description:>8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


def _bar(progress: Any, description: str, total: int, unit: str) -> Callable[[], None]:
    """A bar of `progress` (None: no bars) and the function that advances it by one."""
    if progress is None:
        return lambda: None
    task = progress.add_task(description, total=total, unit=unit)
    return functools.partial(progress.advance, task)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_STATUS = "/proc/self/status"


def _load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _memory_method() -> str:
    return "VmHWM" if _can_reset_peak() else "ru_maxrss"


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def resident_kb(field_name: str) -> int | None:
    try:
        with open(_STATUS) as f:
            match = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


class _PeakMemory:
    """Peak resident memory above the level at entry, in bytes (see the module docstring)."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._start = 0
        self._reset = False

    def __enter__(self) -> _PeakMemory:
        gc.collect()
        self._reset = _can_reset_peak()
        rss = resident_kb("VmRSS") if self._reset else None
        self._start = rss if rss is not None else self._maxrss_kb()
        return self

    def __exit__(self, *exc: object) -> None:
        peak = resident_kb("VmHWM") if self._reset else None
        if peak is None:
            peak = self._maxrss_kb()
        self.peak = max(0, peak - self._start) * 1024

    @staticmethod
    def _maxrss_kb() -> int:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss // 1024 if sys.platform == "darwin" else maxrss
