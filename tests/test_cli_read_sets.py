"""Reuse by what a call read, switched on from the command line: `tvcache replay ... --read-sets` and
`tvcache sandbox-server ... --read-sets`, and a remote factory closed before the cache keeps its read sets.

Real workspace sandboxes (traced with eBPF where it runs, else strace), a real sandbox server in a subprocess on
a loopback port, real HTTP. The rollouts: one `cat`s a file; another first changes an unrelated file, then runs
the same `cat`, which only a read set can answer (its history differs).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tvcache
from server_helpers import HERE, SandboxServer
from test_remote_reads_later import delay_fetches
from test_replay import cli
from tvcache_bench.traces import Trace, TraceCall, write_traces

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="workspace sandboxes need bubblewrap")

CAT = {"command": "cat /testbed/a.txt"}
EDIT = {"command": "echo edited > /testbed/b.txt"}


@pytest.fixture
def base(tmp_path: Path) -> Iterator[Path]:
    base = tmp_path / "project"
    base.mkdir()
    (base / "a.txt").write_text("A\n")
    (base / "b.txt").write_text("B\n")
    yield base


# -- tvcache replay --read-sets ------------------------------------------------------------------------------------


def replay(tmp_path: Path, base: Path, *options: str) -> dict[str, Any]:
    """Two rollouts of one task, one after the other: `cat a.txt`; then an edit of b.txt and the same `cat`."""
    traces = tmp_path / "t.jsonl"
    write_traces(
        traces,
        [
            Trace("t", "r0", "", [TraceCall("bash", CAT)]),
            Trace("t", "r1", "", [TraceCall("bash", EDIT), TraceCall("bash", CAT)]),
        ],
    )
    out = tmp_path / "out.json"
    argv = [str(traces), "--sandbox", "workspace", "--base", str(base), "--strategies", "none,naive,tvcache"]
    # One rollout at a time, with a model's turn between calls: the first `cat`'s read set is kept before the
    # second asks.
    argv += ["--concurrency", "1", "--turn-time", "fixed:0.3", "--no-prefetch", "--no-progress", "--json", str(out)]
    assert cli(["replay", *argv, *options]) == 0
    figures: dict[str, Any] = json.loads(out.read_text())["strategies"]
    return figures


def test_replay_with_read_sets_reuses_a_cat_after_an_unrelated_edit(tmp_path: Path, base: Path) -> None:
    traced = replay(tmp_path, base, "--read-sets")["tvcache"]
    assert traced["read_set_hits"] == 1 and traced["incorrect_hits"] == 0 == traced["incorrect_read_set_hits"]
    assert replay(tmp_path, base)["tvcache"]["read_set_hits"] == 0


def test_replay_with_read_sets_traces_only_the_strategies_that_reuse_by_them(tmp_path: Path, base: Path) -> None:
    """tvcache's sandboxes are traced; naive's and the oracle's are another, untraced, factory of the same base."""
    from tvcache_bench.workload import load_workload

    traces = tmp_path / "t.jsonl"
    write_traces(traces, [Trace("t", "r0", "", [TraceCall("bash", CAT)])])

    async def main() -> tuple[bool, bool]:
        workload = await load_workload(traces, "workspace", base=base, read_sets=True)
        try:
            assert workload.untraced is not None
            return workload.sandboxes("t").read_sets, workload.untraced("t").read_sets  # type: ignore[attr-defined]
        finally:
            await workload.close()

    assert asyncio.run(main()) == (True, False)


@pytest.mark.parametrize(
    ("sandbox", "said"),
    [
        (["sqlite", "--base", "db.sqlite"], "SQLite sandboxes always tell what a query read"),
        (["docker", "--image", "debian"], "Docker containers cannot tell what a call read"),
        (["python:tvcache_bench.workloads.synthetic:make_sandboxes"], "a python: factory decides itself"),
        (["workspace", "--base", ".", "--setup", "true"], "--read-sets does not work with --setup yet"),
    ],
)
def test_replay_read_sets_on_other_sandboxes_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sandbox: list[str], said: str
) -> None:
    traces = tmp_path / "t.jsonl"
    write_traces(traces, [Trace("t", "r0", "", [TraceCall("sql", {"query": "SELECT 1"})])])
    assert cli(["replay", str(traces), "--sandbox", *sandbox, "--read-sets", "--no-progress"]) == 2
    assert said in capsys.readouterr().err


# -- tvcache sandbox-server --read-sets ----------------------------------------------------------------------------


async def two_rollouts(url: str) -> tuple[list[str], dict[str, float]]:
    """The two rollouts through a remote workspace: the sources of the second `cat`, and the cache's stats."""
    tools = tvcache.Tools()
    async with tvcache.ToolCache() as cache:
        async with await asyncio.to_thread(tvcache.RemoteSandboxes, url) as boxes:
            async with cache.rollout("t", boxes, tools=tools) as r:
                first = await r.call("bash", CAT)
            await cache.flush()
            async with cache.rollout("t", boxes, tools=tools) as r:
                await r.call("bash", EDIT)
                second = await r.call("bash", CAT)
        assert first.output == second.output == {"output": "A\n", "exit_code": 0}
        return [first.source, second.source], cache.stats()


def test_sandbox_server_with_read_sets_gives_remote_rollouts_read_set_hits(tmp_path: Path, base: Path) -> None:
    with SandboxServer(tmp_path, ["--sandbox", "workspace", "--base", str(base), "--read-sets"]) as server:
        sources, stats = asyncio.run(two_rollouts(server.url))
    assert sources == ["executed", "reads"] and stats["read_set_hits"] == 1
    with SandboxServer(tmp_path, ["--sandbox", "workspace", "--base", str(base)]) as server:
        sources, stats = asyncio.run(two_rollouts(server.url))
    assert sources == ["executed", "executed"] and stats["read_set_hits"] == 0


@pytest.mark.parametrize(
    ("sandbox", "said"),
    [
        (["sqlite", "--base", "db.sqlite"], "SQLite sandboxes always tell what a query read"),
        (["docker", "--image", "debian"], "Docker containers cannot tell what a call read"),
        (["python:server_helpers:sandboxes"], "a python: factory decides itself"),
    ],
)
def test_sandbox_server_read_sets_on_other_sandboxes_is_an_error(sandbox: list[str], said: str) -> None:
    command = [sys.executable, "-m", "tvcache.server", "sandbox-server", "--sandbox", *sandbox, "--read-sets"]
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))  # server_helpers
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode != 0 and "tvcache sandbox-server: --read-sets applies to --sandbox workspace" in done.stderr
    assert said in done.stderr


# -- the order of shutdown -----------------------------------------------------------------------------------------


def test_remote_sandboxes_closed_before_the_cache_keep_the_read_sets_being_fetched(
    tmp_path: Path, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout still open (`cache.open`, an environment not cleaned up yet) has its answer, and its read set is
    still being fetched (the request leaves late, as on a slow network) when the remote factory is closed, before
    the cache flushes: closing the factory waits for it, as closing a sandbox does, so it is kept, and another
    rollout reuses the answer by it. (Before, the factory closed the sandbox on its server at once, which dropped
    the read set: the fetch gave None.)"""
    delay_fetches(monkeypatch)
    tools = tvcache.Tools()

    async def main() -> tuple[str, dict[str, float]]:
        async with tvcache.ToolCache() as cache:
            boxes = await asyncio.to_thread(tvcache.RemoteSandboxes, server.url)
            open_one = await cache.open("t", boxes, tools)
            await open_one.call("bash", CAT)
            await boxes.close()
            await cache.flush()
            again = await asyncio.to_thread(tvcache.RemoteSandboxes, server.url)
            async with again, cache.rollout("t", again, tools=tools) as r:
                await r.call("bash", EDIT)
                second = await r.call("bash", CAT)
            await open_one.close()
            return second.source, cache.stats()

    with SandboxServer(tmp_path, ["--sandbox", "workspace", "--base", str(base), "--read-sets"]) as server:
        source, stats = asyncio.run(main())
    assert source == "reads" and stats["read_set_hits"] == 1
