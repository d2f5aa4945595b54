"""The GRPO run's tasks: questions about the Chinook database, asked with the tool format in the prompt.

Questions and gold queries are the `sql` workload's `CHINOOK_QUESTIONS` (written for tvcache), over the real
Chinook database read in place from the shared workloads directory. A prompt is one dataset row for TRL:

- a system message saying how the `sql` tool is used (the chat template adds the tool list and format after it);
- one worked example, a question answered with a `sql` call whose result is the real output of that call
  (executed when the rows are built);
- the question, with the columns of the tables its gold query uses (a 135M model cannot explore a schema).

Rows carry `task` (e.g. `chinook/3`), `database` and `gold` besides `prompt`; the reward reads `gold`.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ...data import workload_path
from ..sql import CHINOOK_QUESTIONS

__all__ = ["EXAMPLE_QUERY", "SYSTEM", "SQLTask", "chinook", "database_path", "rows"]

SYSTEM = (
    "You answer questions about a SQLite database with the sql tool: each of your turns is one SQL statement, and "
    "you see its result rows. Your answer is the result of your last statement."
)
EXAMPLE_QUESTION = "How many artists are there?"
EXAMPLE_QUERY = "SELECT count(*) FROM Artist"
EXAMPLE_TABLES = ("Artist",)


@dataclass(frozen=True, slots=True)
class SQLTask:
    task: str  # "chinook/3": the question's place in CHINOOK_QUESTIONS
    database: str
    question: str
    gold: str
    tables: str  # "Track(TrackId, Name, ...)", one line per table the gold query uses


def database_path(database: str) -> Path:
    if database != "chinook":
        raise ValueError(f"unknown database {database!r}")
    return workload_path("sql", "chinook", "chinook.sqlite")


def chinook(count: int) -> list[SQLTask]:
    """The first `count` Chinook questions."""
    columns = _columns(database_path("chinook"))
    return [
        SQLTask(f"chinook/{i}", "chinook", question, gold, _tables(columns, gold))
        for i, (question, gold) in enumerate(CHINOOK_QUESTIONS[:count])
    ]


def rows(tasks: list[SQLTask], example_output: str) -> list[dict[str, Any]]:
    """TRL dataset rows; `example_output` is the sandbox's output of `EXAMPLE_QUERY` on the example's database."""
    columns = _columns(database_path("chinook"))
    example_tables = "\n".join(f"{t}({', '.join(columns[t])})" for t in EXAMPLE_TABLES)
    example = [
        {"role": "user", "content": f"Tables:\n{example_tables}\nQuestion: {EXAMPLE_QUESTION}"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "sql", "arguments": {"query": EXAMPLE_QUERY}}}],
        },
        {"role": "tool", "name": "sql", "content": example_output},
    ]
    return [
        {
            "prompt": [
                {"role": "system", "content": SYSTEM},
                *example,
                {"role": "user", "content": f"Tables:\n{t.tables}\nQuestion: {t.question}"},
            ],
            "task": t.task,
            "database": t.database,
            "gold": t.gold,
        }
        for t in tasks
    ]


def _columns(path: Path) -> dict[str, tuple[str, ...]]:
    conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rowid")]
        return {n: tuple(r[1] for r in conn.execute(f'PRAGMA table_info("{n}")')) for n in names}
    finally:
        conn.close()


def _tables(columns: dict[str, tuple[str, ...]], gold: str) -> str:
    words = {w.lower() for w in re.findall(r"\w+", gold)}
    return "\n".join(f"{t}({', '.join(cols)})" for t, cols in columns.items() if t.lower() in words)
