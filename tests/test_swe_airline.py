"""The `airline` and `swe` workloads: airline rollouts replayed under tvcache against the uncached oracle
(answers and final database states), and a real swe base built from a PyPI sdist running traced commands.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from typing import Any

import pytest

import tvcache as tvcache_mod
from tvcache.calls import ToolCall
from tvcache.sandboxes.base import settled
from tvcache_bench import cli as replay_cli
from tvcache_bench.data import workload_path
from tvcache_bench.replay import ReplayOptions
from tvcache_bench.traces import read_traces
from tvcache_bench.workloads import airline, swe
from tvcache_bench.workloads.airline import bench as airline_bench

TMP = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


# -- airline ------------------------------------------------------------------------------------------


def test_airline_rollouts_under_tvcache_match_the_uncached_answers_and_final_states() -> None:
    options = ReplayOptions(batch=2, epochs=2, concurrency=8, progress=False)
    result, states = asyncio.run(
        airline_bench.bench(tasks=6, latency=0.0, options=options, strategies=["none", "naive", "tvcache"])
    )
    tvcache = result.strategies["tvcache"]
    assert result.rollouts == 24 and tvcache.calls == 2 * result.calls_per_epoch
    assert tvcache.compared == tvcache.calls and tvcache.incorrect_hits == 0 and tvcache.wrong_answers == 0
    assert tvcache.errors == 0 and tvcache.failed_rollouts == 0
    # The second epoch repeats the first: every call of it is answered from the graph.
    assert tvcache.epoch_hits[1] == tvcache.epoch_calls[1]
    assert states is not None and states.rollouts == 48 and states.ok and states.detached == 0
    # The reference run was worth having: the naive cache did serve a stale answer on these tasks.
    assert (result.strategies["naive"].incorrect_hits or 0) > 0


def test_airline_sandboxes_report_the_records_a_call_read_and_wrote() -> None:
    """A booking looks up its user, its flights and the reservation ids it probes for the first free one, and
    stores the new reservation and the user; a search goes through the whole flights table."""
    from test_airline import USER, booking

    async def go() -> list[Any]:
        boxes = airline_bench.make_sandboxes(latency=0.0)
        try:
            box = await boxes.create()
            booked = await box.execute(booking())
            search = await box.execute(ToolCall("search_direct_flight", {"origin": "JFK", "destination": "SEA",
                                                                           "date": "2024-05-20"}))  # fmt: skip
            base = await boxes.base_digests(["reservations/HATHAT", f"users/{USER}"])
            return [booked, search, base]
        finally:
            await boxes.close()

    booked, search, base = asyncio.run(go())
    assert booked.changed and booked.reads is not None and booked.writes is not None
    assert {f"users/{USER}", "flights/HAT136", "flights/HAT039", "reservations/HATHAT"} <= set(booked.reads)
    assert set(booked.writes) == {"reservations/HATHAT", f"users/{USER}"}
    assert base["reservations/HATHAT"] == "" and booked.writes["reservations/HATHAT"] != ""
    assert base[f"users/{USER}"] != booked.writes[f"users/{USER}"]
    assert search.changed is False and search.reads is not None and set(search.reads) == {"flights"}


def test_an_airline_write_is_reused_after_a_write_to_another_user() -> None:
    """Two rollouts cancel the same reservation, the second after a certificate sent to another user: exact
    history shares nothing after the root, but the cancellation read only its reservation, so the second takes the
    first's answer and writes, and its next read of the reservation is answered by what it read too."""
    from test_airline import RESERVATION

    other = next(u for u in airline.load_db()["users"] if u != "omar_davis_3817")
    cancel = ToolCall("cancel_reservation", {"reservation_id": RESERVATION})
    details = ToolCall("get_reservation_details", {"reservation_id": RESERVATION})
    certificate = ToolCall("send_certificate", {"user_id": other, "amount": 100})

    async def go() -> tuple[list[list[Any]], list[list[str]], dict[str, float]]:
        boxes = airline_bench.make_sandboxes(latency=0.0)
        tools = airline.tool_annotations()
        got: list[list[Any]] = []
        expected: list[list[str]] = []
        try:
            async with tvcache_mod.ToolCache() as cache:
                for calls in ([cancel, details], [certificate, cancel, details]):
                    async with cache.rollout("t", boxes, tools=tools) as r:
                        got.append([await r.call(c.tool, c.args) for c in calls])
                    db = airline.load_db()
                    expected.append([airline.run(db, c) for c in calls])
                return got, expected, cache.stats()
        finally:
            await boxes.close()

    got, expected, stats = asyncio.run(go())
    assert [[r.output for r in results] for results in got] == expected
    assert [r.source for r in got[1]] == ["executed", "reads", "reads"]
    assert stats["read_set_edges"] == 1


def test_the_final_state_check_catches_a_write_taken_for_a_read() -> None:
    initial = airline.load_db()
    trace = next(t for t in airline.read_traces() if any(c.tool == "cancel_reservation" for c in t.calls))
    calls = list(trace.calls)
    assert airline.final_state(calls, initial)["reservations"] != initial["reservations"]  # it does write
    honest = airline_bench.RolloutPath(trace.task, calls, [c.tool in airline.WRITES for c in calls])
    planted = airline_bench.RolloutPath(trace.task, calls, [False] * len(calls))  # every call a memo
    checked = airline_bench.check_final_states([honest, planted], initial)
    assert checked.rollouts == 2 and checked.equal == 1 and not checked.ok
    assert checked.differ[0]["task"] == trace.task


def test_airline_snapshots_are_independent_of_later_calls() -> None:
    async def go() -> None:
        boxes = airline_bench.make_sandboxes(latency=0.0)
        box = await boxes.create()
        cancel = ToolCall("cancel_reservation", {"reservation_id": "JG7FMM"})
        details = ToolCall("get_reservation_details", {"reservation_id": "JG7FMM"})
        before = (await box.execute(details)).output
        snapshot = await box.snapshot()
        outcome = await box.execute(cancel)
        assert outcome.changed is True and "cancelled" in str(outcome.output)
        refused = await box.execute(ToolCall("book_reservation", {"user_id": "nobody"}))
        assert refused.changed is False and str(refused.output).startswith("Error")
        restored = await boxes.restore(snapshot)
        assert (await restored.execute(details)).output == before
        assert (await box.execute(details)).output != before
        await boxes.close()

    asyncio.run(go())


def test_bench_options_that_do_not_apply_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(workload="airline", charts=None, rollouts=3)
    with pytest.raises(SystemExit) as exit_:
        replay_cli.run_bench(args)
    assert exit_.value.code == 2 and "--rollouts does not apply to airline" in capsys.readouterr().err


# -- swe: the parts that need no network ------------------------------------------------------------------


def test_closest_version() -> None:
    assert swe.closest_version("2.12", ["2.11.0", "2.12.0", "2.12.1"]) == "2.12.0"
    assert swe.closest_version("0.7.0a8", ["0.6.9", "0.7.0a7", "0.7.0", "0.7.0a9"]) == "0.7.0a7"
    assert swe.closest_version("1.0", ["2.0", "3.0"]) == "2.0"  # nothing older: the oldest newer one
    assert swe.closest_version("1.0", ["not a version", "0.9"]) == "0.9"
    with pytest.raises(ValueError):
        swe.closest_version("one", ["1.0"])


def test_every_instance_has_a_version() -> None:
    instances = swe.read_instances()
    traces = read_traces(workload_path("traces", "swe-dev.jsonl"))
    assert {t.task for t in traces} == set(instances)
    assert instances["pylint-dev__astroid-1978"].version == "2.14"
    assert instances["pylint-dev__astroid-1978"].version_from == "SWE-bench"
    assert instances["marshmallow-code__marshmallow-1343"] == swe.Instance(
        "marshmallow-code__marshmallow-1343", "marshmallow", "2.20.0", "traces"
    )


def test_mask_durations() -> None:
    text = "==== 1 failed, 7 passed, 1 warning in 0.34s ====\n5 passed in 61.20s (0:01:01)\nRan 3 tests in 0.004s\n"
    assert swe.mask_durations(text) == (
        "==== 1 failed, 7 passed, 1 warning in N.NNs ====\n5 passed in N.NNs\nRan 3 tests in N.NNNs\n"
    )
    assert swe.mask_durations("sleep in 3s\n") == "sleep in 3s\n"  # only test summaries


def _pytest_summary(title: str, width: int = 80) -> str:
    """The summary line real pytest prints for `title` on a terminal `width` columns wide (its own writer)."""
    import io

    from _pytest._io.terminalwriter import TerminalWriter

    out = io.StringIO()
    writer = TerminalWriter(out)
    writer.fullwidth = width
    writer.sep("=", title)
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 120, 61])
def test_mask_durations_recentres_pytest_summaries(width: int) -> None:
    # Found in `bench swe`: a run of `pytest tests/ -x | tail -20` taking 10 s instead of 9 printed one `=`
    # fewer on each side of its summary, so the masked answers of the same state differed.
    quick = _pytest_summary("1 failed, 636 passed, 1 warning in 9.87s", width)
    slow = _pytest_summary("1 failed, 636 passed, 1 warning in 10.02s", width)
    slower = _pytest_summary("1 failed, 636 passed, 1 warning in 100.54s (0:01:40)", width)
    assert len({quick, slow, slower}) == 3
    masked = _pytest_summary("1 failed, 636 passed, 1 warning in N.NNs", width)
    assert swe.mask_durations(quick) == swe.mask_durations(slow) == swe.mask_durations(slower) == masked
    assert swe.mask_durations("== 5 passed ==\n") == "== 5 passed ==\n"  # no duration: left as printed


# -- swe: a real base (needs PyPI) --------------------------------------------------------------------------


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def marshmallow(tmp_path_factory: pytest.TempPathFactory) -> swe.Base:
    """marshmallow 2.20.0 (a small pure-Python sdist with its tests), built from PyPI into a fresh folder."""
    if not _pypi_reachable():
        pytest.skip("PyPI (pypi.org:443) is unreachable: the swe base is built from a PyPI sdist")
    return swe.build_base("marshmallow", "2.20.0", root=tmp_path_factory.mktemp("swe"))


def test_the_base_holds_the_sdist_as_a_git_checkout_and_an_environment(marshmallow: swe.Base) -> None:
    info = marshmallow.info()
    assert info["version"] == "2.20.0" and info["extras"] == ["tests"]
    assert any(p.startswith("pytest==") for p in info["packages"])
    assert any(p.startswith("simplejson==") for p in info["packages"])  # imported by the tests, not an extra
    assert (marshmallow.testbed / "src" / "marshmallow" / "schema.py").is_file()
    assert (marshmallow.testbed / ".git").is_dir()
    pth = next(marshmallow.env.rglob("__editable__*.pth"))
    assert pth.read_text().strip() == "/testbed/src"
    # A second call finds it without building (nor asking PyPI).
    assert swe.build_base("marshmallow", "2.20.0", root=marshmallow.root.parent) == marshmallow


def test_traced_commands_run_in_the_sandbox(marshmallow: swe.Base) -> None:
    rollout = next(t for t in read_traces(workload_path("traces", "swe-dev.jsonl")) if "marshmallow-1343" in t.task)
    traced = [c.args["command"] for c in rollout.calls]
    commands = [
        traced[0],  # pwd && ls -la
        traced[1],  # find src -type f -name "*.py" | head -20
        "python -c 'import marshmallow; print(marshmallow.__file__, marshmallow.__version__)'",
        "cd /testbed && python -m pytest tests/test_schema.py -q -x 2>&1 | tail -1",
        "grep -n 'collections.Mapping' src/marshmallow/marshalling.py",
        "sed -i 's/collections.Mapping/collections.abc.Mapping/' src/marshmallow/marshalling.py",
        "git diff --stat",
        "git status --short",
        "pip install simplejson -q; echo $?",
        "curl -s https://pypi.org >/dev/null; echo $?",
    ]

    async def go() -> list[Any]:
        boxes = swe.make_sandboxes(marshmallow, timeout=60, tmp=TMP)
        try:
            box = await boxes.create()
            outcomes = [await box.execute(ToolCall("bash", {"command": c})) for c in commands]
            fresh = await boxes.create()  # the edits stay in their sandbox
            untouched = await fresh.execute(ToolCall("bash", {"command": "git status --short"}))
            return [*outcomes, untouched]
        finally:
            await boxes.close()

    out = asyncio.run(go())
    text = [o.output["output"] for o in out]
    assert text[0].startswith("/testbed\n") and "setup.py" in text[0]
    assert "src/marshmallow/schema.py" in text[1]
    assert text[2].strip() == "/testbed/src/marshmallow/__init__.py 2.20.0"
    # The test suite runs (no "No module named ..."): this old release fails on Python 3.11 as it did for
    # the traced agent, with the duration masked.
    assert "No module named" not in text[3] and "passed" in text[3] and "in N.NNs" in text[3]
    assert "collections.Mapping" in text[4] and out[4].changed is False
    assert out[5].changed is True
    assert "src/marshmallow/marshalling.py" in text[6] and out[6].changed is False
    assert text[7].strip() == "M src/marshmallow/marshalling.py" and out[7].changed is False
    assert text[8].strip().endswith("0")  # already installed: no network needed
    assert text[9].strip() != "0"  # the network is off
    assert text[10] == ""


def test_build_workload_covers_the_tasks_asked_for(marshmallow: swe.Base) -> None:
    workload = swe.build_workload(1, root=marshmallow.root.parent, tmp=TMP)
    try:
        assert {t.task for t in workload.traces} == {"marshmallow-code__marshmallow-1343"}
        assert len(workload.traces) == 4
        boxes = workload.sandboxes("marshmallow-code__marshmallow-1343")
        assert isinstance(boxes, swe.MaskedSandboxes)
    finally:
        asyncio.run(workload.close())
    assert workload.untraced is None  # without read sets every strategy runs in the same sandboxes
    traced = swe.build_workload(1, root=marshmallow.root.parent, tmp=TMP, read_sets=True)
    try:
        assert traced.untraced is not None
        task = "marshmallow-code__marshmallow-1343"
        both = traced.sandboxes(task), traced.untraced(task)
        assert [b.inner.read_sets for b in both if isinstance(b, swe.MaskedSandboxes)] == [True, False]
    finally:
        asyncio.run(traced.close())


def test_each_command_starts_in_a_new_shell_in_testbed(marshmallow: swe.Base) -> None:
    """As mini-swe-agent ran the traced commands (`docker exec -w /testbed ... bash -lc`): a `cd` or an export in
    one command does not carry over, so a command after `cd /tmp && ...` lists /testbed, as the traces show."""
    commands = ["cd /tmp && export X=1 && pwd", "pwd; echo ${X-unset}; cd src && pwd", "exit 3", "pwd"]

    async def go() -> list[Any]:
        boxes = swe.make_sandboxes(marshmallow, timeout=60, tmp=TMP)
        try:
            box = await boxes.create()
            return [await box.execute(ToolCall("bash", {"command": c})) for c in commands]
        finally:
            await boxes.close()

    out = asyncio.run(go())
    assert [o.output["output"] for o in out] == ["/tmp\n", "/testbed\nunset\n/testbed/src\n", "", "/testbed\n"]
    assert [o.output["exit_code"] for o in out] == [0, 0, 3, 0]
    assert [o.changed for o in out] == [False, False, False, False]  # moving about is no state change


def test_a_file_made_in_testbed_leaves_the_read_set_of_a_cat_alone(marshmallow: swe.Base) -> None:
    """Starting each command in /testbed must not read /testbed: a `cd` there would see its size change with every
    file an agent makes in it, and no `cat` after one could be reused by what it read."""
    commands = ["cat setup.cfg", "touch reproduce_issue.py", "cat setup.cfg"]

    async def go() -> list[Any]:
        boxes = swe.make_sandboxes(marshmallow, timeout=60, tmp=TMP, read_sets=True)
        try:
            box = await boxes.create()
            return [await settled(await box.execute(ToolCall("bash", {"command": c}))) for c in commands]
        finally:
            await boxes.close()

    first, made, again = asyncio.run(go())
    assert made.changed is True and first.output == again.output
    assert first.reads is not None and first.reads == again.reads
