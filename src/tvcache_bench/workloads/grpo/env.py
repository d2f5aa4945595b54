"""The TRL environment of the GRPO run, and its reward.

`SQLEnvironment` is what a TRL user writes without tvcache: one tool, `sql(query)`, answered by a private copy of
the row's database (a `SQLiteSandboxes` sandbox made at the rollout's first call, closed at the next `reset`).
With tvcache the same class goes through `tvcache.integrations.trl.cached_environment`, which keeps its `sql`
signature and docstring (the schema the model sees) and sends the calls to the same sandboxes through the cache.

**Reward** (`Reward`), the published text-to-SQL scheme: -1 for a malformed tool call (the model's first turn did
not close its code block, so no statement ran); else 1 when the rows of the last statement's result equal the
rows of the gold query, run on the rollout's final state through the environment's own `sql` (with tvcache: a
cached step, so rollouts that end in the same state are graded once), and 0 otherwise (an SQL error included).
Rows are compared as the sandbox prints them, in order, without the header line (column names differ with
spelling, `count(*)` against `COUNT(*)`) and without the padding that aligns columns to their names. The answer is
taken from what the environment ran, not from TRL's messages: TRL leaves a result out of the conversation when it
would overflow the completion's token budget.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tvcache.calls import ToolCall
from tvcache.integrations.trl import results
from tvcache.sandboxes.base import Sandbox
from tvcache.sandboxes.sqlite import SQLiteSandboxes

__all__ = ["BackgroundLoop", "Reward", "SQLEnvironment", "StepTally", "grade"]

T = TypeVar("T")


class BackgroundLoop:
    """An event loop on a daemon thread, for the uncached environment's sandbox calls from TRL's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="grpo-sandboxes", daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class SQLEnvironment:
    """A text-to-SQL rollout: the model queries its own copy of the row's database."""

    def __init__(self, databases: Mapping[str, SQLiteSandboxes], loop: BackgroundLoop) -> None:
        self._databases, self._loop = databases, loop
        self._database = ""
        self._box: Sandbox | None = None
        self.outputs: list[str] = []  # this rollout's results, in order
        self.tool_seconds = 0.0

    def reset(self, **row: Any) -> None:
        self._close()
        self._database = row["database"]
        self.outputs = []
        self.tool_seconds = 0.0

    def sql(self, query: str) -> str:
        """Run one SQLite statement on the database and return its result rows.

        Args:
            query: One SQLite statement, for example SELECT Name FROM Artist LIMIT 3
        """
        start = time.perf_counter()
        try:
            if self._box is None:
                self._box = self._loop.run(self._databases[self._database].create())
            outcome = self._loop.run(self._box.execute(ToolCall("sql", {"query": query})))
        finally:
            self.tool_seconds += time.perf_counter() - start
        self.outputs.append(str(outcome.output))
        return self.outputs[-1]

    def _close(self) -> None:
        box, self._box = self._box, None
        if box is not None:
            self._loop.run(box.close())


def grade(outputs: list[str], run_gold: Callable[[], Any]) -> float:
    """The reward of a rollout whose statements answered `outputs`; `run_gold` runs the gold query on its final
    state."""
    if not outputs:
        return -1.0
    answer = outputs[-1]
    if answer.startswith("Error:"):
        return 0.0
    return 1.0 if _rows(answer) == _rows(str(run_gold())) else 0.0


def _rows(table: str) -> list[str]:
    """The rows of a sandbox's table, each with its padding dropped (columns are padded to their header's width)."""
    return [" ".join(line.split()) for line in table.split("\n")[1:]]


@dataclass
class StepTally:
    """What one training step's rollouts did, read by the reward function once per step."""

    rewards: list[float] = field(default_factory=list)
    model_calls: int = 0  # well-formed tool calls the model wrote (TRL runs at most TOOL_TURNS of each rollout's)
    tool_calls: int = 0  # calls that reached the environment's sql (the gold queries included)
    hits: int = 0
    tool_seconds: float = 0.0


class Reward:
    """TRL reward function: `grade` per rollout, with what each step did kept in `steps`."""

    __name__ = "sql_reward"

    def __init__(self, cached: bool) -> None:
        self.cached = cached
        self.steps: list[StepTally] = []

    def __call__(
        self, completions: list[list[dict[str, Any]]], environments: list[Any], gold: list[str], **_: Any
    ) -> list[float | None]:
        tally = StepTally()
        for messages, env, query in zip(completions, environments, gold, strict=True):
            ran = [str(r.output) for r in results(env)] if self.cached else list(env.outputs)
            tally.rewards.append(grade(ran, functools.partial(env.sql, query)))
            tally.model_calls += sum(len(m.get("tool_calls") or []) for m in messages if m["role"] == "assistant")
            if self.cached:
                done = results(env)
                tally.tool_calls += len(done)
                tally.hits += sum(r.hit for r in done)
                tally.tool_seconds += sum(r.seconds for r in done)
            else:
                tally.tool_calls += len(env.outputs)
                tally.tool_seconds += env.tool_seconds
        self.steps.append(tally)
        return list(tally.rewards)
