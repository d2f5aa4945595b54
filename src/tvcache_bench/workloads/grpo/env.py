"""The TRL environment of the GRPO run, and its reward.

`SQLEnvironment` is what a TRL user writes without tvcache: one tool, `sql(query)`, answered by a private in-memory
copy of the row's database (`Database`, made at the rollout's first statement). With tvcache the same class goes
through `tvcache.integrations.trl.cached_environment`, which runs the same `sql` on the cache's misses, on a
sandbox whose state is the environment's attributes; `Database` pickles as its content, so that state can be
copied and snapshotted.

`sql` answers as `SQLiteSandboxes` does (the same text table, `OK, n rows affected`, `Error: ...`), except that
temporary tables, views, indexes and triggers are refused (`Error: not authorized`): they live in the connection,
not in the database's content, so a copy would lose them.

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

import functools
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvcache.integrations.trl import results
from tvcache.sandboxes.sqlite import format_rows

__all__ = ["Database", "Reward", "SQLEnvironment", "StepTally", "grade"]

#: What a statement may not create: objects of the connection's temp schema, and other attached files.
_REFUSED = {
    sqlite3.SQLITE_CREATE_TEMP_INDEX,
    sqlite3.SQLITE_CREATE_TEMP_TABLE,
    sqlite3.SQLITE_CREATE_TEMP_TRIGGER,
    sqlite3.SQLITE_CREATE_TEMP_VIEW,
    sqlite3.SQLITE_ATTACH,
    sqlite3.SQLITE_DETACH,
}


def _connect(fill: Callable[[sqlite3.Connection], None]) -> sqlite3.Connection:
    """A new in-memory database, filled by `fill` before the authorizer is set: `deserialize` runs an ATTACH of its
    own, which the authorizer refuses."""
    db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    fill(db)
    db.set_authorizer(lambda action, *_: sqlite3.SQLITE_DENY if action in _REFUSED else sqlite3.SQLITE_OK)
    return db


class Database:
    """A private in-memory copy of a SQLite file; pickles (and so copies) as its content."""

    def __init__(self, path: Path | str, timeout: float) -> None:
        self.timeout = timeout
        source = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            self._db = _connect(source.backup)
        finally:
            source.close()

    def __getstate__(self) -> tuple[float, bytes]:
        return self.timeout, self._db.serialize()

    def __setstate__(self, state: tuple[float, bytes]) -> None:
        self.timeout, content = state
        self._db = _connect(lambda db: db.deserialize(content))

    def sql(self, query: str) -> str:
        deadline = time.monotonic() + self.timeout
        self._db.set_progress_handler(lambda: time.monotonic() > deadline, 1000)
        try:
            cursor = self._db.execute(query)
            if cursor.description:
                return format_rows(cursor)
        except sqlite3.Error as exc:
            return f"Error: {exc}"
        n = cursor.rowcount
        return "OK" if n < 0 else f"OK, {n} row{'' if n == 1 else 's'} affected"


class SQLEnvironment:
    """A text-to-SQL rollout: the model queries its own copy of the row's database."""

    def __init__(self, databases: dict[str, Path], timeout: float = 10.0) -> None:
        self._databases, self._timeout = databases, timeout
        self.reset(database="")

    def reset(self, **row: Any) -> None:
        self._database = row["database"]
        self._db: Database | None = None
        self.outputs: list[str] = []  # this rollout's results, in order
        self.tool_seconds = 0.0

    def sql(self, query: str) -> str:
        """Run one SQLite statement on the database and return its result rows.

        Args:
            query: One SQLite statement, for example SELECT Name FROM Artist LIMIT 3
        """
        start = time.perf_counter()
        try:
            if self._db is None:
                self._db = Database(self._databases[self._database], self._timeout)
            self.outputs.append(self._db.sql(query))
        finally:
            self.tool_seconds += time.perf_counter() - start
        return self.outputs[-1]


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
