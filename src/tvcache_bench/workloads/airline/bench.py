"""`tvcache bench airline`: the 200 real tau-bench airline rollouts, replayed on the 14 airline tools.

**Data.** `traces/tau-airline.jsonl`: sierra-research/tau-bench's `historical_trajectories/gpt-4o-airline.json`
(MIT), 50 tasks x 4 GPT-4o rollouts, 1,164 tool calls, against the airline database of
`tvcache_bench/data/tau-airline/` (shipped with tvcache). The tools are `tvcache_bench.workloads.airline`
(written for this project); before replaying, the bench checks them against the outputs the traces recorded and
prints the match rate (`airline.conformance()`).

**Sandboxes.** `PythonSandboxes` over an in-memory copy of the database: reads (`get_*`, `search_*`,
`list_all_airports`, `calculate`, `think`, `transfer_to_human_agents`) are annotated read-only; whether a
write changed the database is what the tool itself reports (a refused booking changes nothing). A copy of
the database (fresh state, snapshot, restore) is `airline.copy_db`: new tables sharing the records, which
the tools never change in place, so it takes microseconds where a deep copy takes half a second.

**What a call read.** The sandboxes are `ObservedPythonSandboxes`: each call runs on a view of the tables that
notes the records it looked up (found or not) and stored, `users/<id>`, `reservations/<id>`, `flights/<number>`,
and a whole table it went through (`flights`, which the searches scan); a record's digest is a hash of its JSON
(key order included, as outputs show it). So tvcache also reuses a result recorded in another state when the
records it read are the same there, a booking or a cancellation with its writes too. The tools are pure functions
of the records they touch (ids are the first free ones, which a booking looks up; the booking time is fixed).

**Latency model.** The tools run in-process in microseconds, where a deployed agent's tools are calls to a
booking service. Each tool execution therefore waits a fixed `latency` (default 50 ms, `--latency`, 0 to
turn it off) before running: a stand-in for the round trip to that service, paid by every execution
whatever the strategy (including the re-executions tvcache and the published strategy do to rebuild a state),
never by a cache hit. Snapshots and restores cost what copying the tables costs (microseconds): the state
lives with the trainer, as tau-bench's does. Tool-time speedups therefore measure executions avoided at
50 ms each; with `--latency 0` they measure Python overheads only and mean little.

**Final states.** Besides checking every answer against the uncached one, the bench checks the state each
rollout ends in. Under tvcache a rollout that only hit never had a sandbox, so what is checked is the state
the cache *believes* the rollout is in: its path, the calls that moved its cursor (edges). Re-executing
just those calls on a fresh database must give the same database as executing all of the rollout's calls
uncached; any call the cache took for a read (a memo) that really changed the database would show here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import (
    AsyncIterator,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    MutableMapping,
    Sequence,
    ValuesView,
)
from dataclasses import dataclass, field
from typing import Any, cast

from tvcache.calls import ToolCall, Tools
from tvcache.rollout import Result
from tvcache.sandboxes.base import Sandboxes
from tvcache.sandboxes.python import Observed, ObservedPythonSandboxes

from ...data import workload_path
from ...replay import ReplayOptions, ReplayResult, replay
from ...report import print_table, wide_console, write_charts
from ...strategies import STRATEGIES, Strategy, StrategyRollout, make_strategy
from ...traces import read_traces, task_order
from ...workload import Workload, first_tasks
from .. import airline

__all__ = [
    "LATENCY",
    "AirlineState",
    "FinalStates",
    "PathRecorder",
    "RolloutPath",
    "bench",
    "build_workload",
    "check_final_states",
    "describe",
    "make_sandboxes",
    "run",
]

#: Seconds every tool execution waits, standing in for the round trip to a booking service.
LATENCY = 0.05


class AirlineState:
    """The database a sandbox holds. Copies (snapshots, restores) are `airline.copy_db`: new tables sharing
    the records, which tools replace rather than change, so a copy is independent of later calls."""

    __slots__ = ("db",)

    def __init__(self, db: airline.Db):
        self.db = db

    def __deepcopy__(self, memo: dict[int, Any]) -> AirlineState:
        return AirlineState(airline.copy_db(self.db))


def make_sandboxes(
    latency: float = LATENCY, initial: airline.Db | None = None
) -> ObservedPythonSandboxes[AirlineState]:
    """Sandboxes over fresh copies of `initial` (default: the shared database), each execution waiting
    `latency` seconds first (see the module docstring)."""
    if not latency >= 0:
        raise ValueError(f"latency must be >= 0 seconds, got {latency!r}")
    db = initial if initial is not None else airline.load_db()
    # The tool says whether it changed the database; `changed` below is asked right after `run` returns,
    # with the same call object, so the answer is passed along by the call's identity.
    said: dict[int, bool] = {}

    async def run(state: AirlineState, call: ToolCall) -> Observed:
        if latency > 0:
            await asyncio.sleep(latency)
        reads: set[str] = set()
        writes: set[str] = set()
        view = {table: _Touched(table, rows, reads, writes) for table, rows in state.db.items()}
        output, changed = airline.execute(cast(airline.Db, view), call)  # the tools use mapping methods only
        said[id(call)] = changed
        return Observed(output, reads, writes)

    def changed(call: ToolCall, output: Any) -> bool | None:
        return said.pop(id(call), None)

    fingerprint = "tvcache-airline-bench/2 " + (airline.fingerprint() if initial is None else _db_hash(db))
    return ObservedPythonSandboxes(
        lambda: AirlineState(airline.copy_db(db)), run, fingerprint, digest=_TableDigests().of, changed=changed
    )


class _Touched(MutableMapping[str, Any]):
    """A table of the database as a tool sees it, noting the keys it reads and writes: a record looked up (found
    or not: `table/key`) or stored, and the whole table (`table`) when the tool goes through it."""

    def __init__(self, name: str, rows: dict[str, Any], reads: set[str], writes: set[str]):
        self._name, self._rows, self._reads, self._writes = name, rows, reads, writes

    def __getitem__(self, key: str) -> Any:
        self._reads.add(f"{self._name}/{key}")
        return self._rows[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._writes.add(f"{self._name}/{key}")
        self._rows[key] = value

    def __delitem__(self, key: str) -> None:
        self._writes.add(f"{self._name}/{key}")
        del self._rows[key]

    def _whole(self) -> dict[str, Any]:
        self._reads.add(self._name)
        return self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._whole())

    def __len__(self) -> int:
        return len(self._whole())

    # The table's own views, at C speed: a search scans every flight, twice over for one-stop flights.
    def keys(self) -> KeysView[str]:
        return self._whole().keys()

    def values(self) -> ValuesView[Any]:
        return self._whole().values()

    def items(self) -> ItemsView[str, Any]:
        return self._whole().items()


class _TableDigests:
    """Digests of the keys `_Touched` names: a hash of a record's JSON ("" when absent), or of a whole table's. The
    flights table is shared by every copy of the database and never written (`airline.copy_db`): its digest is
    computed once per table object."""

    def __init__(self) -> None:
        self._shared: dict[int, tuple[dict[str, Any], str]] = {}

    def of(self, state: AirlineState, key: str) -> str:
        table, slash, row = key.partition("/")
        rows = state.db[table]
        if slash:
            record = rows.get(row)
            return "" if record is None else _hash_json(record)
        if table != "flights":
            return _hash_json(rows)
        kept = self._shared.get(id(rows))
        if kept is None or kept[0] is not rows:
            kept = self._shared[id(rows)] = (rows, _hash_json(rows))
        return kept[1]


def _hash_json(value: Any) -> str:
    return hashlib.blake2b(json.dumps(value).encode(), digest_size=16).hexdigest()


def _db_hash(db: airline.Db) -> str:
    return hashlib.sha256(json.dumps(db, sort_keys=True).encode()).hexdigest()


def build_workload(tasks: int | None = None, *, latency: float = LATENCY) -> Workload:
    """The airline workload: the rollouts of the first `tasks` tasks of the traces (all 50 when None)."""
    traces = first_tasks(read_traces(workload_path("traces", "tau-airline.jsonl")), tasks)
    factory = make_sandboxes(latency)
    calls = sum(len(t.calls) for t in traces)
    return Workload(
        name="airline",
        traces=traces,
        sandboxes=lambda task: factory,
        tools=Tools(read_only=airline.READ_ONLY),
        close=factory.close,
        notes=f"{len(traces)} GPT-4o rollouts ({calls} calls) of {len(task_order(traces))} tau-bench airline tasks "
        "from traces/tau-airline.jsonl (sierra-research/tau-bench, MIT) on the 14 airline tools over "
        f"tau-airline/, {latency * 1000:g} ms simulated service latency per tool execution",
    )


# -- final states -----------------------------------------------------------------------------------------


@dataclass
class RolloutPath:
    """One rollout as a cached strategy saw it: its calls in order, and which of them moved its cursor."""

    task: str
    calls: list[ToolCall] = field(default_factory=list)
    moved: list[bool] = field(default_factory=list)
    detached: bool = False

    @property
    def edges(self) -> list[ToolCall]:
        return [call for call, moved in zip(self.calls, self.moved, strict=True) if moved]


class PathRecorder(Strategy):
    """tvcache (or any strategy whose rollouts expose `cursor` and `detached`), remembering each rollout's
    path: which calls moved its cursor."""

    def __init__(self, inner: Strategy):
        self.inner = inner
        self.name = inner.name
        self.paths: list[RolloutPath] = []

    @contextlib.asynccontextmanager
    async def rollout(self, task: str, sandboxes: Sandboxes, tools: Tools) -> AsyncIterator[StrategyRollout]:
        async with self.inner.rollout(task, sandboxes, tools) as r:
            path = RolloutPath(task)
            self.paths.append(path)
            try:
                yield _Recording(r, path, tools)
            finally:
                path.detached = bool(getattr(r, "detached", False))

    async def prefetch(self, tasks: Mapping[str, int], sandboxes: Mapping[str, Sandboxes]) -> None:
        await self.inner.prefetch(tasks, sandboxes)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()


class _Recording:
    def __init__(self, inner: Any, path: RolloutPath, tools: Tools):
        if not hasattr(inner, "cursor"):
            raise TypeError(f"{type(inner).__name__} has no cursor: only tvcache's rollouts can be recorded")
        self._inner = inner
        self._path = path
        self._tools = tools
        self.stats = inner.stats

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result:
        before = self._inner.cursor
        result: Result = await self._inner.call(tool, args)
        self._path.calls.append(self._tools.call(tool, args))
        self._path.moved.append(self._inner.cursor != before)
        return result


@dataclass
class FinalStates:
    rollouts: int = 0  # rollouts compared
    equal: int = 0
    detached: int = 0  # ran on in their own sandbox, uncached: nothing the cache believes to compare
    distinct: int = 0  # distinct call sequences among the compared
    differ: list[dict[str, Any]] = field(default_factory=list)  # a few that did not match, for people

    @property
    def ok(self) -> bool:
        return self.equal == self.rollouts

    def summary(self) -> dict[str, Any]:
        return {
            "rollouts": self.rollouts,
            "equal": self.equal,
            "detached": self.detached,
            "distinct": self.distinct,
            "differ": self.differ,
        }

    def line(self) -> str:
        if self.rollouts == 0:
            return "final states: no rollout to compare"
        verdict = "[green]all equal[/]" if self.ok else f"[bold red]{self.rollouts - self.equal} DIFFER[/]"
        return (
            f"final states: {verdict}: for {self.equal} of {self.rollouts} tvcache rollouts ({self.distinct} distinct "
            "call sequences), re-executing only the calls that moved the cursor gives the database that executing "
            "every call uncached gives"
            + (
                f"; {self.detached} detached rollouts (run uncached in their own sandbox) not compared"
                if self.detached
                else ""
            )
        )


def check_final_states(paths: Iterable[RolloutPath], initial: airline.Db) -> FinalStates:
    """Compare, for each path, the database its edges lead to with the one all its calls lead to."""
    out = FinalStates()
    truth: dict[tuple[str, ...], str] = {}
    for path in paths:
        if path.detached:
            out.detached += 1
            continue
        out.rollouts += 1
        key = tuple(call.key for call in path.calls)
        if key not in truth:
            truth[key] = _changes_digest(airline.final_state(path.calls, initial), initial)
        believed = _changes_digest(airline.final_state(path.edges, initial), initial)
        if believed == truth[key]:
            out.equal += 1
        elif len(out.differ) < 5:
            memos = [c.key[:120] for c, moved in zip(path.calls, path.moved, strict=True) if not moved]
            out.differ.append({"task": path.task, "calls": len(path.calls), "memos": memos})
    out.distinct = len(truth)
    return out


def _changes_digest(db: airline.Db, initial: airline.Db) -> str:
    """A hash of how `db` differs from `initial`, from which it was derived by `copy_db` and tool calls:
    every table's keys in order and, as JSON text, every record that is not the initial one (tools replace
    the records they change). Milliseconds, where hashing the whole database takes 0.16 s."""
    h = hashlib.blake2b(digest_size=16)
    for table, rows in db.items():
        before = initial.get(table, {})
        h.update(f"\0table\0{table}\0{len(rows)}\0".encode())
        h.update("\0".join(rows).encode())
        for key, record in rows.items():
            if before.get(key) is not record:
                h.update(f"\0{key}\0{json.dumps(record)}".encode())
    return h.hexdigest()


# -- the bench --------------------------------------------------------------------------------------------


async def bench(
    *,
    tasks: int | None = None,
    latency: float = LATENCY,
    options: ReplayOptions | None = None,
    strategies: Sequence[str] = STRATEGIES,
    store: str | None = None,
) -> tuple[ReplayResult, FinalStates | None]:
    """Replay the airline rollouts under `strategies`; with tvcache among them, also check final states."""
    options = options or ReplayOptions()
    if len(set(strategies)) != len(strategies) or not strategies:
        raise ValueError(f"name each strategy once, got {list(strategies)}")
    workload = build_workload(tasks, latency=latency)
    made = [make_strategy(name, store=store) for name in strategies]
    recorder = None
    if "tvcache" in strategies:
        at = list(strategies).index("tvcache")
        recorder = PathRecorder(made[at])
        made[at] = recorder
    try:
        result = await replay(workload, made, options)
    finally:
        await workload.close()
    if recorder is None:
        return result, None
    return result, check_final_states(recorder.paths, airline.load_db())


def run(
    *,
    tasks: int | None = None,
    latency: float = LATENCY,
    options: ReplayOptions | None = None,
    strategies: Sequence[str] = STRATEGIES,
    store: str | None = None,
    charts: str | None = None,
) -> dict[str, Any]:
    """`tvcache bench airline`: conformance of the tools, then the replay; prints both, returns the figures."""
    console = wide_console()
    report = airline.conformance()
    console.print(
        f"airline tools vs the outputs recorded in traces/tau-airline.jsonl: {report.exact} of {report.total} calls "
        f"exact ({report.rate:.2%})",
        highlight=False,
    )
    for line in report.summary().splitlines()[1:]:
        console.print(line, highlight=False, markup=False)
    result, states = asyncio.run(
        bench(tasks=tasks, latency=latency, options=options, strategies=strategies, store=store)
    )
    print_table(result, console)
    console.print(
        f"latency model: every tool execution waits {latency * 1000:g} ms (a simulated booking-service round trip; "
        "the tools themselves take microseconds); hits wait nothing; snapshots and restores copy tables in "
        "microseconds. --latency 0 turns it off.",
        highlight=False,
    )
    if states is not None:
        console.print(states.line(), highlight=False)
    if charts:
        for path in write_charts(result, charts):
            console.print(f"chart: {path}")
    summary = result.summary()
    summary["latency_seconds"] = latency
    summary["conformance"] = {
        "calls": report.total,
        "exact": report.exact,
        "rate": report.rate,
    }
    summary["final_states"] = states.summary() if states is not None else None
    return summary


def describe(latency: float = LATENCY) -> str:
    """Where the workload's data comes from, for the README."""
    return (
        "**airline** — `traces/tau-airline.jsonl`: tau-bench's historical GPT-4o trajectories "
        "(sierra-research/tau-bench, MIT), 50 airline tasks x 4 rollouts, 1,164 tool calls, replayed on the 14 "
        "airline tools written for tvcache (`tvcache_bench.workloads.airline`) over tau-bench's airline database "
        "(`tau-airline/`), in `PythonSandboxes`; read tools annotated read-only. The tools match the recorded "
        "outputs exactly on every call whose recorded output is its own (70 calls carry a later call's output, "
        "an artefact of the trace conversion). The tools run in microseconds, so each execution waits a "
        f"simulated service latency of {latency * 1000:g} ms (`--latency`); hits do not. Besides every answer, "
        "the bench checks that the state tvcache believes each rollout ends in equals the uncached final state."
    )
