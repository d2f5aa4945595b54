"""The trace reader: the format of src/tvcache_bench/data/README.md, and clear errors naming the bad line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tvcache_bench.data import workload_path
from tvcache_bench.traces import Trace, TraceCall, TraceError, read_traces, task_order, write_traces
from tvcache_bench.workload import first_tasks

GOOD = {
    "task": "t1",
    "rollout": "r1",
    "source": "s",
    "calls": [{"tool": "sql", "args": {"query": "SELECT 1"}, "output": "1"}],
}


def write_lines(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_round_trip(tmp_path: Path) -> None:
    traces = [
        Trace("t1", "r1", "here", [TraceCall("bash", {"command": "ls"}, "a\nb"), TraceCall("bash", {"command": "x"})]),
        Trace("t2", "r1", "", []),
        Trace("t3", "r1", "", [TraceCall("bash", {}, None, 1.5, 2.0), TraceCall("bash", {}, None, 7.25)]),
    ]
    path = tmp_path / "out.jsonl"
    write_traces(path, traces)
    assert read_traces(path) == traces


def test_blank_lines_and_optional_fields(tmp_path: Path) -> None:
    row = {"task": "t", "rollout": "r", "calls": [{"tool": "bash", "args": {}}]}
    path = write_lines(tmp_path, ["", json.dumps(row), "   "])
    (trace,) = read_traces(path)
    assert trace.source == "" and trace.calls == [TraceCall("bash", {}, None)]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got a list"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "task"}), 'no "task" key'),
        (json.dumps({**GOOD, "task": 7}), '"task" must be a string, got a number'),
        (json.dumps({**GOOD, "task": ""}), '"task" must not be empty'),
        (json.dumps({**GOOD, "rollout": None}), '"rollout" must be a string, got null'),
        (json.dumps({**GOOD, "calls": {}}), '"calls" must be a list, got an object'),
        (json.dumps({**GOOD, "source": 3}), '"source" must be a string'),
        (json.dumps({**GOOD, "calls": ["ls"]}), "call 0 must be a JSON object, got a string"),
        (json.dumps({**GOOD, "calls": [{"args": {}}]}), 'call 0 has no "tool" key'),
        (json.dumps({**GOOD, "calls": [{"tool": "a b", "args": {}}]}), "non-empty name without whitespace"),
        (
            json.dumps({**GOOD, "calls": [{"tool": "x", "args": {}}, {"tool": "x", "args": []}]}),
            'call 1: "args" must be an object',
        ),
        (json.dumps({**GOOD, "calls": [{"tool": "x", "args": {}, "output": 5}]}), '"output" must be a string or null'),
        (json.dumps({**GOOD, "calls": [{"tool": "x", "args": {}, "started": "9:00"}]}), '"started" must be a number'),
        (json.dumps({**GOOD, "calls": [{"tool": "x", "args": {}, "ended": True}]}), '"ended" must be a number'),
    ],
)
def test_malformed_line_names_its_number(tmp_path: Path, bad: str, message: str) -> None:
    path = write_lines(tmp_path, [json.dumps(GOOD), "", json.dumps(GOOD), bad, json.dumps(GOOD)])
    with pytest.raises(TraceError) as info:
        read_traces(path)
    text = str(info.value)
    assert text.startswith(f"{path}:4: "), text
    assert message in text


def test_task_order_and_first_tasks() -> None:
    traces = [Trace(t, r) for t, r in [("b", "1"), ("a", "1"), ("b", "2"), ("c", "1"), ("a", "2")]]
    assert task_order(traces) == ["b", "a", "c"]
    assert [(t.task, t.rollout) for t in first_tasks(traces, 2)] == [("b", "1"), ("a", "1"), ("b", "2"), ("a", "2")]
    assert first_tasks(traces, None) == traces
    assert first_tasks(traces, 10) == traces
    with pytest.raises(ValueError, match="at least 1"):
        first_tasks(traces, 0)


def test_shared_trace_files_parse() -> None:
    airline = read_traces(workload_path("traces", "tau-airline.jsonl"))
    assert len(airline) == 200 and len(task_order(airline)) == 50
    assert sum(len(t.calls) for t in airline) == 1164
    swe = read_traces(workload_path("traces", "swe-dev.jsonl"))
    assert len(swe) == 46 and sum(len(t.calls) for t in swe) == 3835
