"""The cancellation fuzzer: calls, whole rollouts and prefetches cancelled at random points leak nothing and
never change an answer.

Each round runs a real cache (a SQLite store file, whose every operation is a hop to its own thread, so a
cancellation can land while a lease or a record is half-way) over a real sandbox backend: Python objects,
SQLite databases, workspace directories, and workspace directories traced for their reads (results reused by
read sets, digested after the answer). Rollouts of two tasks run two at a time (so they share entries, claims,
snapshots and leases) and are cancelled after a random number of event-loop turns or a random fraction of a
millisecond. After the round, with the cache closed:

- every sandbox created or restored was closed exactly once (`FaultyBox.close` asserts once);
- every snapshot made is recorded in the store or deleted, and the backend holds exactly the recorded ones;
- no claim is held and no lease is left in the store; the cache's task group is empty;
- every answer any rollout got, before or after a cancelled call, equals the output of the same calls
  executed uncached in a fresh sandbox (a cancelled call that moved the rollout's cursor took effect, and
  the oracle executes it too; one that did not never happened).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import kv
import tvcache
from faults import FaultyReadingSandboxes, FaultySandboxes
from tvcache.stores.sqlite import SQLiteStore

TMP = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
TASKS = ["t0", "t1"]

Call = tuple[str, dict[str, Any]]


@dataclass
class World:
    """One sandbox backend and a small random workload for it."""

    factory: Callable[[Path], contextlib.AbstractAsyncContextManager[Any]]
    random_call: Callable[[random.Random], Call]
    tools: tvcache.Tools = field(default_factory=tvcache.Tools)
    rounds: int = 10
    trials: int = 30  # per round
    patience: float = 0.004  # the longest a cancellation waits: about what a call of the backend takes


# -- the worlds ------------------------------------------------------------------------------------------


def kv_call(rng: random.Random) -> Call:
    tool, args = kv.random_call(rng)
    if rng.random() < 0.5:  # a call that suspends half-way, so cancellation can land inside the tool
        args["delay"] = rng.choice([0.0005, 0.002])  # also makes replays dear: misses restore snapshots
    return tool, args


@contextlib.asynccontextmanager
async def python_factory(tmp: Path) -> AsyncIterator[Any]:
    async with kv.sandboxes() as boxes:
        yield boxes


def sql_call(rng: random.Random) -> Call:
    key, value = rng.choice("abc"), rng.choice("xy")
    query = rng.choice(
        [
            f"INSERT INTO t VALUES ('{key}', '{value}')",
            f"UPDATE t SET v = v || '{value}' WHERE k = '{key}'",
            f"DELETE FROM t WHERE k = '{key}'",
            "SELECT k, v FROM t ORDER BY rowid",
            "SELECT count(*) FROM t",
        ]
    )
    return "sql", {"query": query}


@contextlib.asynccontextmanager
async def sqlite_factory(tmp: Path) -> AsyncIterator[Any]:
    db = tmp / "base.sqlite"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TABLE t (k TEXT, v TEXT)")
        conn.commit()
    async with tvcache.SQLiteSandboxes(db, tmp=TMP) as boxes:
        yield boxes


def shell_call(rng: random.Random) -> Call:
    name, word = rng.choice("ab"), rng.choice(["x", "y"])
    return rng.choice(
        [
            ("bash", {"command": f"echo {word} >> {name}.txt; wc -l < {name}.txt"}),
            ("bash", {"command": f"cat {name}.txt 2>&1; ls"}),
            ("write_file", {"path": f"{name}.txt", "content": f"{word}\n"}),
            ("read_file", {"path": f"{name}.txt"}),
        ]
    )


@contextlib.asynccontextmanager
async def workspace_factory(tmp: Path) -> AsyncIterator[Any]:
    from tvcache.sandboxes.workspace import WorkspaceSandboxes

    base = tmp / "base"
    base.mkdir()
    (base / "README").write_text("the task\n")
    async with WorkspaceSandboxes(base, tmp=TMP, timeout=30) as boxes:
        yield boxes


def traced_shell_call(rng: random.Random) -> Call:
    """`shell_call`, and a command that reads only what no call changes: its read set matches in every state, so
    rollouts in other states get read-set hits."""
    return ("bash", {"command": "cat README; wc -c README"}) if rng.random() < 0.25 else shell_call(rng)


@contextlib.asynccontextmanager
async def traced_workspace_factory(tmp: Path) -> AsyncIterator[Any]:
    """Workspaces whose commands are traced: a read-only command's read set is digested after its answer
    (`Outcome.reads_later`) and kept in a task of the cache, so a cancellation can also land while the sandbox
    holds still for a digest, or while a rollout looks among candidates for one whose reads match."""
    from tvcache.sandboxes.workspace import WorkspaceSandboxes

    base = tmp / "base"
    base.mkdir()
    (base / "README").write_text("the task\n")
    async with WorkspaceSandboxes(base, tmp=TMP, timeout=30, read_sets=True) as boxes:
        yield boxes


WORLDS = {
    "python": World(python_factory, kv_call, kv.TOOLS, rounds=20, trials=40),
    "sqlite": World(sqlite_factory, sql_call, rounds=8, trials=30),
    "workspace": World(workspace_factory, shell_call, rounds=5, trials=20, patience=0.05),
    "workspace-traced": World(traced_workspace_factory, traced_shell_call, rounds=3, trials=20, patience=0.05),
}


# -- one round -------------------------------------------------------------------------------------------


@dataclass
class Transcript:
    """A rollout's calls that took effect, and the outputs it was given."""

    task: str
    effective: list[Call] = field(default_factory=list)
    answers: dict[int, Any] = field(default_factory=dict)  # index in `effective` -> output returned


async def drive(cache: tvcache.ToolCache, boxes: Any, world: World, transcript: Transcript, calls: list[Call]) -> None:
    rollout = await cache.open(transcript.task, boxes, world.tools)
    try:
        for tool, args in calls:
            cursor = rollout.cursor
            try:
                result = await rollout.call(tool, args)
            except asyncio.CancelledError:
                if rollout.cursor != cursor:  # recorded before the cancellation reached it: it took effect
                    transcript.effective.append((tool, args))
                raise
            transcript.effective.append((tool, args))
            transcript.answers[len(transcript.effective) - 1] = result.output
    finally:
        await rollout.close()


async def cancel_soon(rng: random.Random, task: asyncio.Task[Any], patience: float) -> None:
    """Cancel `task` after a random number of loop turns or of seconds up to `patience`, and wait for it."""
    if rng.random() < 0.6:
        for _ in range(rng.randrange(60)):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(rng.uniform(0, patience))
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def one_round(world: World, seed: int, tmp: Path) -> None:
    rng = random.Random(seed)
    path = tmp / "store.db"
    transcripts: list[Transcript] = []
    async with world.factory(tmp) as inner:
        boxes = (FaultyReadingSandboxes if getattr(inner, "read_sets", False) else FaultySandboxes)(inner)
        store = SQLiteStore(path)
        cache = tvcache.ToolCache(store=store, snapshot_budget=3, warm_limit=4)
        for _ in range(world.trials):
            kind = rng.choice(["rollouts", "rollouts", "prefetch"])
            if kind == "prefetch":
                starting = asyncio.ensure_future(cache.prefetch(rng.sample(TASKS, 1), boxes, rollouts=2))
                await cancel_soon(rng, starting, world.patience)
                if starting.done() and not starting.cancelled() and rng.random() < 0.5:
                    await cancel_soon(rng, starting.result(), world.patience)
                continue
            runs = []
            for _ in range(2):
                transcript = Transcript(rng.choice(TASKS))
                transcripts.append(transcript)
                calls = [world.random_call(rng) for _ in range(rng.randint(1, 8))]
                runs.append(asyncio.ensure_future(drive(cache, boxes, world, transcript, calls)))
            victim = rng.choice(runs)
            await cancel_soon(rng, victim, world.patience)
            await asyncio.gather(*runs, return_exceptions=True)
        await cache.close()

        # Nothing leaked.
        assert len(getattr(cache._ctx, "tasks", ())) == 0
        assert not boxes.open, f"{len(boxes.open)} sandboxes never closed"
        assert len(store._flights) == 0, "a claim is still held"
        check = SQLiteStore(path)
        try:
            recorded = {r.snapshot_id for task in TASKS for r in await check.snapshots(cache.scope(task, boxes).key)}
        finally:
            await check.close()
        with contextlib.closing(sqlite3.connect(path)) as db:
            assert db.execute("SELECT count(*) FROM leases").fetchone() == (0,), "a lease was never released"
        made, deleted = set(boxes.snapshots), set(boxes.deleted)
        assert made <= recorded | deleted, f"snapshots neither recorded nor deleted: {made - recorded - deleted}"
        assert not recorded & deleted, "a recorded snapshot was deleted"
        assert inner.snapshot_count == len(recorded), "the backend holds snapshots the graph does not know"

        # No answer changed.
        for transcript in transcripts:
            expected = await oracle(inner, transcript.effective, world.tools)
            for i, output in transcript.answers.items():
                assert output == expected[i], (transcript.effective[: i + 1], output, expected[i])


async def oracle(factory: Any, calls: list[Call], tools: tvcache.Tools) -> list[Any]:
    """The calls' outputs in a fresh sandbox, uncached. A run where the backend itself failed (`error=True`:
    once in a long while, under load, a workspace sandbox's bwrap fails to start) is not an answer to compare
    with: it is run again."""
    for _ in range(3):
        box = await factory.create()
        try:
            outcomes = [await box.execute(tools.call(tool, args)) for tool, args in calls]
        finally:
            await box.close()
        if not any(o.error for o in outcomes):
            return [o.output for o in outcomes]
    raise AssertionError(f"the oracle's sandbox failed three times: {outcomes}")


def fuzz(world: World) -> None:
    for seed in range(world.rounds):
        with tempfile.TemporaryDirectory(dir=TMP) as tmp:
            asyncio.run(one_round(world, seed, Path(tmp)))


@pytest.mark.parametrize("name", list(WORLDS))
def test_cancellation_at_random_points_leaks_nothing_and_changes_no_answer(name: str) -> None:
    fuzz(WORLDS[name])
