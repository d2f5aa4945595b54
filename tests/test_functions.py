"""Plain Python tool functions through the cache (`tvcache.ToolFunctions`).

The workload is real: tau-bench's airline tools over its database, as plain functions taking the database as
their first parameter, replayed on the GPT-4o rollouts of `traces/tau-airline.jsonl`. The oracle is each
rollout's calls executed in order on a fresh copy of the database, without any cache.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
import threading
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest

import tvcache
from tvcache_bench.workloads import airline


class Airline:
    """The tools' state: the database, forked the cheap way (its tools never change a record in place)."""

    def __init__(self, tables: airline.Db | None = None) -> None:
        self.tables = tables if tables is not None else airline.copy_db(BASE)

    def __deepcopy__(self, memo: dict[int, Any]) -> Airline:
        return Airline(airline.copy_db(self.tables))


BASE = airline.load_db()


def airline_function(name: str) -> Callable[..., str]:
    """The airline tool `name` as a function `name(db, *, <its parameters>) -> str`."""

    def tool(db: Airline, **args: Any) -> str:
        return airline.run(db.tables, tvcache.ToolCall(name, args))

    params = [inspect.Parameter("db", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Airline)]
    params += [inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY) for p in airline._REGISTRY[name].params]
    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = f"The airline tool {name}."
    tool.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    return tool


def airline_tools() -> tvcache.ToolFunctions[Airline]:
    return tvcache.ToolFunctions(
        [airline_function(name) for name in airline.TOOLS],
        state=Airline,
        # A failed write ("Error: ...") leaves the database as it was; reads never change it.
        changed=lambda call, output: call.tool in airline.WRITES and not str(output).startswith("Error"),
    )


def test_the_wrappers_show_frameworks_the_tool_without_its_state() -> None:
    def search(db: Airline, origin: str, destination: str, date: str = "2024-05-16") -> str:
        """Search direct flights between two airports."""
        args = {"origin": origin, "destination": destination, "date": date}
        return airline.run(db.tables, tvcache.ToolCall("search_direct_flight", args))

    (wrapped,) = tvcache.ToolFunctions([search], state=Airline).cached()
    assert wrapped.__name__ == "search" and wrapped.__doc__ == search.__doc__
    assert list(inspect.signature(wrapped).parameters) == ["origin", "destination", "date"]
    assert typing.get_type_hints(wrapped) == {"origin": str, "destination": str, "date": str, "return": str}
    assert not inspect.iscoroutinefunction(wrapped)
    # A schema builder that reads signatures (pydantic's, as many frameworks use) sees the model-facing tool.
    schema = pydantic.TypeAdapter(wrapped).json_schema()
    assert schema["required"] == ["origin", "destination"] and set(schema["properties"]) == {
        "origin",
        "destination",
        "date",
    }


def test_rollouts_of_real_traces_match_uncached_execution_and_later_epochs_hit() -> None:
    traces = airline.read_traces()
    tasks = sorted({t.task for t in traces})[:6]
    group = [t for t in traces if t.task in tasks]
    tools = airline_tools()

    async def rollout(cache: tvcache.ToolCache, trace: airline.TraceRollout) -> list[str]:
        outputs = []
        async with cache.rollout(trace.task, tools.sandboxes):
            for call in trace.calls:
                assert isinstance(call.args, dict)
                outputs.append(await asyncio.to_thread(tools[call.tool], **call.args))
        return outputs

    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            for epoch in range(2):
                before = cache.stats()
                got = await asyncio.gather(*(rollout(cache, t) for t in group))
                for trace, outputs in zip(group, got, strict=True):
                    assert outputs == airline.replay(airline.copy_db(BASE), trace.calls), trace.rollout
                after = cache.stats()
                calls = sum(len(t.calls) for t in group)
                assert after["calls"] - before["calls"] == calls
                if epoch == 0:
                    assert 0 < after["hits"] - before["hits"] < calls
                else:
                    assert after["hits"] - before["hits"] == calls  # every call of the second epoch hits
                    assert after["executions"] == before["executions"]

    asyncio.run(main())


def test_model_emitted_arguments_valid_invalid_and_huge() -> None:
    tools = airline_tools()
    huge = "x" * 2_000_000

    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            for attempt in range(2):
                async with cache.rollout("args", tools.sandboxes) as r:
                    a = await r.call("get_user_details", '{"user_id": "mia_li_3668"}')
                    b = await r.call("get_user_details", ' { "user_id" :"mia_li_3668" } ')
                    assert a.output == b.output == airline.run(BASE, tvcache.ToolCall("get_user_details", a_args()))
                    assert b.hit  # equal JSON in another layout is the same call
                    bad = await r.call("get_user_details", '{"user_id": "mia_li_3668"')
                    assert bad.output.startswith("error: the arguments of get_user_details are not a JSON object")
                    assert bad.hit == (attempt == 1)  # the same error text, cached like any output
                    missing = await r.call("get_user_details", "{}")
                    assert missing.output == "error: get_user_details: missing a required argument: 'user_id'"
                    extra = await r.call("get_user_details", {"user_id": "x", "verbose": True})
                    assert extra.output == "error: get_user_details: unexpected arguments: 'verbose'"
                    thought = await r.call("think", json.dumps({"thought": huge}))
                    assert thought.output == "" and thought.hit == (attempt == 1)

    asyncio.run(main())


def a_args() -> dict[str, str]:
    return {"user_id": "mia_li_3668"}


class Counter:
    """A registry written as a class, as agent frameworks' tool classes are: public methods are the tools."""

    def __init__(self) -> None:
        self.value = 0
        self.log: list[str] = []

    def add(self, amount: int) -> int:
        """Add to the counter."""
        self.value += amount
        self.log.append(f"+{amount}")
        return self.value

    def read(self) -> dict[str, Any]:
        """Read the counter."""
        return {"value": self.value, "log": self.log}

    def fail(self) -> None:
        """Raise (a bug in a tool)."""
        raise KeyError("no such thing")


def test_a_class_registry_blocking_wrappers_from_threads_and_errors() -> None:
    tools = tvcache.ToolFunctions(Counter)
    assert tools.names == ("add", "read", "fail")
    add, read, fail = tools.cached()
    assert list(inspect.signature(add).parameters) == ["amount"]

    with tvcache.SyncToolCache() as cache:
        for _ in range(2):
            with cache.rollout("counter", tools.sandboxes) as r:
                assert add(2) == 2 and add(amount=3) == 5
                assert read() == {"value": 5, "log": ["+2", "+3"]}
                with pytest.raises(KeyError, match="no such thing"):
                    fail()
                assert not r.detached
        stats = cache.stats()
        assert stats["hits"] == 3  # the second rollout's add, add and read; the failing call is never cached
        assert stats["failures"] == 2

        # Many threads at once, each in its own rollout of the same task (as a thread-pool env runs them).
        results: list[Any] = []

        def worker(k: int) -> None:
            with cache.rollout("counter", tools.sandboxes):
                add(2)
                results.append(add(k))

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [2 + k for k in range(6)]


def test_misuse_is_a_clear_error() -> None:
    tools = tvcache.ToolFunctions(Counter)
    add = tools["add"]
    with pytest.raises(RuntimeError, match="outside a rollout"):
        add(1)
    with pytest.raises(TypeError, match="missing a required argument"):
        add()  # bound like the function itself: nothing reaches the cache

    async def on_the_loop() -> None:
        async with tvcache.ToolCache() as cache, cache.rollout("t", tools.sandboxes):
            with pytest.raises(RuntimeError, match="worker thread"):
                add(1)
            assert await asyncio.to_thread(add, 1) == 1

    asyncio.run(on_the_loop())
    with pytest.raises(TypeError, match="first parameter"):
        tvcache.ToolFunctions({"f": lambda: 1}, state=dict)
    with pytest.raises(TypeError, match="needs a name"):
        tvcache.ToolFunctions([lambda state: 1])
    with pytest.raises(ValueError, match="no tool functions"):
        tvcache.ToolFunctions([])


def test_the_fingerprint_follows_the_code() -> None:
    def one(x: int) -> int:
        return x + 1

    def other(x: int) -> int:
        return x + 2

    assert (
        tvcache.ToolFunctions({"f": one}).sandboxes.fingerprint
        != tvcache.ToolFunctions({"f": other}).sandboxes.fingerprint
    )
    assert (
        tvcache.ToolFunctions({"one": one}).sandboxes.fingerprint == tvcache.ToolFunctions([one]).sandboxes.fingerprint
    )
    assert tvcache.ToolFunctions([one], fingerprint="v7").sandboxes.fingerprint == "v7"


def test_the_fingerprint_follows_what_a_tool_captures() -> None:
    """Tools made per task by a function, over the task's data: the same source over other data must not share
    results (it did: the second inbox got the first one's answer); a capture that cannot be told apart is refused."""
    import threading

    def make(inbox: list[str]) -> Any:
        def search(keyword: str) -> list[str]:
            return [subject for subject in inbox if keyword in subject]

        return search

    async def main() -> list[Any]:
        async with tvcache.ToolCache() as cache:
            found = []
            for inbox in (["offsite friday"], ["offsite monday"]):
                tools = tvcache.ToolFunctions([make(inbox)])
                async with cache.rollout("inbox", tools.sandboxes) as r:
                    found.append((await r.call("search", {"keyword": "offsite"})).output)
            return found

    assert asyncio.run(main()) == [["offsite friday"], ["offsite monday"]]
    lock = threading.Lock()

    def guarded(x: int) -> int:
        with lock:
            return x

    with pytest.raises(TypeError, match=r"guarded captures .*lock.*fingerprint="):
        tvcache.ToolFunctions([guarded])
    assert tvcache.ToolFunctions([guarded], fingerprint="v1").sandboxes.fingerprint == "v1"


def test_async_tools_and_stateless_tools_are_memos() -> None:
    async def lookup(code: str) -> str:
        """Name an airport."""
        await asyncio.sleep(0)
        return airline._AIRPORTS.get(code, "unknown")

    tools = tvcache.ToolFunctions([lookup])
    (wrapped,) = tools.cached()
    assert inspect.iscoroutinefunction(wrapped)

    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            for _ in range(2):
                async with cache.rollout("airports", tools.sandboxes):
                    assert [await wrapped(c) for c in ("SFO", "JFK", "XXX", "SFO")] == [
                        "San Francisco",
                        "New York",
                        "unknown",
                        "San Francisco",
                    ]
            assert cache.stats()["executions"] == 3  # no state: each distinct call ran once, in any order

    asyncio.run(main())


# --- the custom-loop example: its main path, against the same calls executed without a cache ----------------


def test_the_custom_loop_example_matches_uncached_execution_and_grades_each_final_state_once() -> None:
    from frameworks import ScriptedLLM, load_example, plan_of

    example = load_example("custom_loop")

    def call(name: str, **args: Any) -> tuple[str, str]:
        return (name, json.dumps(args))

    details, cancel = (
        call("get_reservation_details", reservation_id="4WQ150"),
        call("cancel_reservation", reservation_id="4WQ150"),
    )
    search = call("search_direct_flight", origin="DFW", destination="LAX", date="2024-05-22")
    plans = [
        [[details], [cancel]],  # cancels
        [[details]],  # only looks
        [[("cancel_reservation", '{ "reservation_id" : "4WQ150" }')]],  # cancels, the JSON laid out otherwise
        [[("cancel_reservation", '{"reservation_id": 4WQ150}')]],  # malformed JSON: an error, nothing changes
        [[search], [cancel], [cancel]],  # cancels, then is told it is already cancelled
        [[call("cancel_reservation", reservation_id="NOSUCH")]],  # an unknown reservation
        [[details, search]],  # two calls in one turn
        [[details], [cancel]],  # plan 0 again
    ]

    async def uncached(plan: list[list[tuple[str, str]]]) -> tuple[list[Any], float]:
        box = await example.TOOLS.sandboxes.create()
        try:
            outputs = [(await box.execute(tvcache.ToolCall(n, a))).output for turn in plan for n, a in turn]
            graded = await box.execute(tvcache.ToolCall("grade_cancelled", {"reservation_id": "4WQ150"}))
            return outputs, graded.output
        finally:
            await box.close()

    async def main() -> tuple[list[list[dict[str, Any]]], list[tuple[list[Any], float]]]:
        async with ScriptedLLM(plans) as llm:
            groups = await example.main(llm.url, "scripted-policy", rollouts=len(plans), epochs=2)
        return groups, [await uncached(plan) for plan in plans]

    groups, oracle = asyncio.run(main())
    assert [reward for _, reward in oracle] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert str(oracle[3][0][0]).startswith("error: the arguments of cancel_reservation are not a JSON object")
    for epoch, group in enumerate(groups):
        by_plan = {plan_of(g["messages"][2]["content"]): g for g in group}
        assert sorted(by_plan) == list(range(len(plans)))
        for k, rollout in by_plan.items():
            assert [r.output for r in rollout["results"]] == oracle[k][0], (epoch, k)
            assert rollout["reward"] == oracle[k][1], (epoch, k)
        graded_here = [g for g in group if not g["graded"].hit]
        results = [r for g in group for r in g["results"]]
        if epoch == 0:
            assert len(graded_here) == 2  # two final states: cancelled, untouched
            assert 0 < sum(r.hit for r in results) < len(results)
        else:
            assert not graded_here and all(r.hit for r in results)


def test_the_custom_loop_example_runs_without_arguments_on_its_scripted_policy(tmp_path: Path) -> None:
    """As a newcomer runs it: no model server, from any directory; it prints each epoch's rewards and cache
    figures. The rewards are those of its plans (cancel: 1; look, an unknown reservation, malformed arguments: 0),
    and the second epoch repeats the first's calls, so everything hits."""
    script = Path(__file__).resolve().parents[1] / "examples" / "custom_loop.py"
    env = {k: v for k, v in os.environ.items() if k != "TVCACHE_WORKLOADS"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("epoch 0: rewards [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]; ")
    assert lines[0].endswith("of 12 tool calls hit; 2 of 8 gradings executed")  # two final states
    assert lines[1] == (
        "epoch 1: rewards [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]; 13 of 13 tool calls hit; 0 of 8 gradings executed"
    )
    assert lines[2].startswith("cache: 41 calls, ")
