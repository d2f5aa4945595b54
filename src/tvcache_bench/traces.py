"""The trace format: recorded agent rollouts, one per line of a JSONL file.

Each line is one rollout (see `tvcache_bench/data/README.md`):

    {"task": str, "rollout": str, "source": str,
     "calls": [{"tool": str, "args": {...}, "output": str | null, "started": float, "ended": float}]}

`task` groups rollouts of the same prompt, which is what the cache scopes by; `calls` are the tool calls in
the order the agent issued them. `output` is what the original run observed: replays produce their own
outputs, so it is only for reference and conformance checks, and may be left out (read as null). `source`
says where the rollout comes from and may be left out too (read as ""). `started` and `ended` (optional) are
when the original run issued the call and got its answer, in seconds on any one clock (Unix time, say): the
gap between a call's `ended` and the next one's `started` is the model's turn, which replays wait
(`turns.TurnTime`). Blank lines are skipped.

A malformed line is an error that names the file and the line, so a bad trace file is fixed in a minute.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Trace", "TraceCall", "TraceError", "read_traces", "task_order", "write_traces"]


class TraceError(ValueError):
    """A trace file that does not follow the format; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceCall:
    tool: str
    args: dict[str, Any]
    output: str | None = None
    started: float | None = None  # seconds on the original run's clock
    ended: float | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    task: str
    rollout: str
    source: str = ""
    calls: list[TraceCall] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "rollout": self.rollout,
            "source": self.source,
            "calls": [_call_json(c) for c in self.calls],
        }


def _call_json(call: TraceCall) -> dict[str, Any]:
    times = {"started": call.started, "ended": call.ended}
    return {"tool": call.tool, "args": call.args, "output": call.output} | {
        k: v for k, v in times.items() if v is not None
    }


def read_traces(path: str | Path) -> list[Trace]:
    """Every rollout of a JSONL trace file, in file order. Raises `TraceError` naming the bad line."""
    path = Path(path)
    traces = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                traces.append(_parse(line))
            except _Bad as exc:
                raise TraceError(f"{path}:{number}: {exc}") from None
    return traces


def write_traces(path: str | Path, traces: Iterable[Trace]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for trace in traces:
            f.write(json.dumps(trace.to_json(), ensure_ascii=False) + "\n")


def task_order(traces: Iterable[Trace]) -> list[str]:
    """The tasks in the order they first appear: what `--tasks N` takes the first N of."""
    return list(dict.fromkeys(t.task for t in traces))


class _Bad(Exception):
    """What is wrong with one line, before the line number is added."""


def _parse(line: str) -> Trace:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _Bad(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise _Bad(f"a rollout must be a JSON object, got {_kind(row)}")
    task = _field(row, "task", str, "a rollout")
    if not task:
        raise _Bad('"task" must not be empty')
    rollout = _field(row, "rollout", str, "a rollout")
    source = row.get("source", "")
    if not isinstance(source, str):
        raise _Bad(f'"source" must be a string, got {_kind(source)}')
    calls = _field(row, "calls", list, "a rollout")
    return Trace(task, rollout, source, [_call(c, i) for i, c in enumerate(calls)])


def _call(value: Any, index: int) -> TraceCall:
    where = f"call {index}"
    if not isinstance(value, dict):
        raise _Bad(f"{where} must be a JSON object, got {_kind(value)}")
    tool = _field(value, "tool", str, where)
    if not tool or any(c.isspace() for c in tool):
        raise _Bad(f'{where}: "tool" must be a non-empty name without whitespace, got {tool!r}')
    args = _field(value, "args", dict, where)
    output = value.get("output")
    if output is not None and not isinstance(output, str):
        raise _Bad(f'{where}: "output" must be a string or null, got {_kind(output)}')
    started, ended = (_seconds(value, name, where) for name in ("started", "ended"))
    return TraceCall(tool, args, output, started, ended)


def _seconds(row: dict[str, Any], name: str, where: str) -> float | None:
    value = row.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Bad(f'{where}: "{name}" must be a number of seconds, got {_kind(value)}')
    return float(value)


def _field(row: dict[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in row:
        raise _Bad(f'{where} has no "{name}" key')
    value = row[name]
    if not isinstance(value, kind):
        raise _Bad(f'{where}: "{name}" must be {_NAMES[kind]}, got {_kind(value)}')
    return value


_NAMES: dict[type, str] = {str: "a string", list: "a list", dict: "an object"}


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
