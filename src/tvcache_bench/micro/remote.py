"""`tvcache bench remote`: what a sandbox costs through `tvcache sandbox-server`, against the same backend in
the caller's process.

The backend is `SQLiteSandboxes` over a small generated database; each call is a primary-key lookup that takes
tens of microseconds, so what differs between the sides is the path to the sandbox, not the work in it. The
server runs in its own process on one core, the client in another process on the other core (as a rollout
worker would). Over loopback, and over a veth pair between two network namespaces (as root: a real network
stack between two "hosts", without a wire), the client measures a remote factory and a local one of the same
database, taking turns call by call so that both see the same moments of the machine's other work:

- per-call latency of `execute`; the overhead of a remote call is its p50 minus the local p50;
- create, snapshot, restore and close;
- calls per second with 32 concurrent rollouts, each executing in its own sandbox back to back.

Then, over loopback, short commands in a workspace traced for read sets (`WorkspaceSandboxes(read_sets=True)`,
eBPF where it works, else strace), on a server of its own: two sandboxes taking turns, one asking for its read
sets inline (as clients before `reads_later` do: the server waits for the digest), one asking for them after the
answer (`Outcome.reads_later`, fetched from /v1/reads); per call, the time to the answer and to the read set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table

from tvcache.sandboxes.reclaim import scratch_dir

from .procs import free_port, pin

__all__ = ["run"]

T = TypeVar("T")

ROWS = 2000  # rows of the generated table
CALLS = 2000  # sequential calls per latency figure
OPS = 150  # creates, snapshots, restores, closes per latency figure
ROLLOUTS = 32
SECONDS = 3.0  # per throughput figure
ROUNDS = 3
TRACED_CALLS = 150  # per command and side
VETH = "10.232.0"  # the two namespaces' private /30: .1 the server, .2 the client


# -- the client process ------------------------------------------------------------------------------------


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {"p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99), "n": len(ordered)}


class _Side:
    """One factory under measurement (the local one or the remote one) and its samples, in seconds."""

    def __init__(self, factory: Any):
        self.factory = factory
        self.samples: dict[str, list[float]] = {}

    async def timed(self, op: str, work: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        result = await work
        self.samples.setdefault(op, []).append(time.perf_counter() - t0)
        return result

    def figures(self) -> dict[str, Any]:
        return {op: _percentiles(samples) for op, samples in self.samples.items()}


def _call(i: int) -> Any:
    from tvcache import ToolCall

    return ToolCall("sql", {"query": f"SELECT v FROM t WHERE id = {i % ROWS + 1}"})


def _write() -> Any:
    from tvcache import ToolCall

    return ToolCall("sql", {"query": "UPDATE t SET v = v + 1 WHERE id = 1"})


async def _latencies(local: _Side, remote: _Side) -> None:
    """Every operation on both sides, taking turns call by call, so both see the same moments of the
    machine's other work and the difference between them is the remote path's own."""
    sides = (local, remote)
    boxes = [await side.factory.create() for side in sides]
    for i in range(200):  # warm up: connections, caches, the server's first requests
        for box in boxes:
            await box.execute(_call(i))
    for i in range(CALLS):
        for side, box in zip(sides, boxes, strict=True):
            await side.timed("execute", box.execute(_call(i)))
    for box in boxes:
        await box.execute(_write())  # a written database, so a snapshot copies it
    for _ in range(OPS):
        for side, box in zip(sides, boxes, strict=True):
            made = await side.timed("create", side.factory.create())
            await side.timed("close", made.close())
            snapshot = await side.timed("snapshot", box.snapshot())
            restored = await side.timed("restore", side.factory.restore(snapshot))
            await restored.close()
            await side.factory.delete(snapshot)
    for box in boxes:
        await box.close()


async def _throughput(factory: Any) -> float:
    """Calls per second of ROLLOUTS concurrent rollouts, each executing in its own sandbox back to back."""
    boxes = [await factory.create() for _ in range(ROLLOUTS)]
    done = 0
    stop = time.perf_counter() + SECONDS

    async def rollout(k: int) -> None:
        nonlocal done
        i = k * 61
        while time.perf_counter() < stop:
            await boxes[k].execute(_call(i))
            done += 1
            i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(rollout(k) for k in range(ROLLOUTS)))
    elapsed = time.perf_counter() - t0
    for box in boxes:
        await box.close()
    return done / elapsed


async def _client(url: str, db: str, token: str | None) -> dict[str, Any]:
    import tvcache

    local, remote = _Side(tvcache.SQLiteSandboxes(db)), _Side(tvcache.RemoteSandboxes(url, token=token))
    try:
        await _latencies(local, remote)
        result: dict[str, Any] = {}
        for name, side in (("in-process", local), ("remote", remote)):
            result[name] = side.figures() | {"calls_per_second": await _throughput(side.factory)}
        return result
    finally:
        await local.factory.close()
        await remote.factory.close()


async def _traced_client(url: str, token: str | None) -> dict[str, Any]:
    import tvcache
    from tvcache.sandboxes.base import settled

    from .read_sets import PLAIN_COMMANDS

    factory = tvcache.RemoteSandboxes(url, token=token)
    result: dict[str, Any] = {}
    try:
        boxes = {"inline": await factory.create(), "after": await factory.create()}
        boxes["inline"]._reads_later = False  # as a client before reads_later asks
        for command in PLAIN_COMMANDS[:2]:
            call = tvcache.ToolCall("bash", {"command": command})
            samples: dict[str, list[float]] = {}
            for i in range(20 + TRACED_CALLS):  # 20 to warm up: the page cache, the factory's digests
                for name, box in boxes.items():
                    t0 = time.perf_counter()
                    outcome = await box.execute(call)
                    answered = time.perf_counter()
                    if (await settled(outcome)).reads is None:
                        raise RuntimeError(f"{command!r} gave no read set: is the server's workspace traced?")
                    if i >= 20:
                        samples.setdefault(f"{name} answer", []).append(answered - t0)
                        samples.setdefault(f"{name} reads", []).append(time.perf_counter() - t0)
            result[command] = {k: _percentiles(v) for k, v in samples.items()}
    finally:
        await factory.close()
    return result


def traced_workspace(base: str) -> Any:
    """The traced case's server factory (`--sandbox python:tvcache_bench.micro.remote:traced_workspace`)."""
    from tvcache.sandboxes.workspace import WorkspaceSandboxes

    return WorkspaceSandboxes(base, read_sets=True)


def _client_main(argv: list[str]) -> None:
    import uvloop

    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--db")
    args = parser.parse_args(argv)
    token = os.environ.get("TVCACHE_TOKEN")
    work = _client(args.url, args.db, token) if args.db else _traced_client(args.url, token)
    print(json.dumps(uvloop.run(work)))


# -- the benchmark -----------------------------------------------------------------------------------------


def _make_db(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER, name TEXT)")
    conn.executemany("INSERT INTO t (v, name) VALUES (?, ?)", ((i * 7 % 1000, f"row {i}") for i in range(ROWS)))
    conn.commit()
    conn.close()


@contextlib.contextmanager
def _server(base: Path, host: str, prefix: list[str], token: str, kind: str = "sqlite") -> Iterator[str]:
    """A sandbox server of `kind` over `base` on `host` (run under `prefix`), pinned to the first core; its URL."""
    port = free_port()
    command = [*prefix, sys.executable, "-m", "tvcache.server", "sandbox-server", "--sandbox", kind]
    command += ["--base", str(base), "--host", host, "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "TVCACHE_TOKEN": token}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    pin(proc.pid, 0)
    url = f"http://{host}:{port}"
    try:
        _await_health(proc, url, prefix, token)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _await_health(proc: subprocess.Popen[bytes], url: str, prefix: list[str], token: str) -> None:
    probe = f"import urllib.request as u; u.urlopen('{url}/healthz', timeout=1)"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"the sandbox server exited at start:\n{err[-2000:]}")
        if prefix:
            if subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True).returncode == 0:
                return
        else:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/healthz", timeout=1):
                return
        time.sleep(0.05)
    raise RuntimeError("the sandbox server did not start within 30 s")


def _measure_in_client(db: Path | None, url: str, prefix: list[str], token: str) -> dict[str, Any]:
    """The client's figures, from its own process pinned to the second core (no `db`: the traced case)."""
    command = [*prefix, sys.executable, "-m", "tvcache_bench.micro.remote", "client", "--url", url]
    command += ["--db", str(db)] if db is not None else []
    env = {**os.environ, "TVCACHE_TOKEN": token}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pin(proc.pid, 1)
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the client process failed:\n{err[-3000:]}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@contextlib.contextmanager
def _veth_pair() -> Iterator[tuple[list[str], list[str]] | None]:
    """Two network namespaces joined by a veth pair (server side, client side), or None where that is not
    possible (not root, no iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield None
        return
    names = [f"tvbench{os.getpid()}-{side}" for side in ("server", "client")]
    made: list[str] = []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    try:
        for name in names:
            ip("netns", "add", name)
            made.append(name)
        ip("link", "add", "name", "eth0", "netns", names[0], "type", "veth", "peer", "name", "eth0", "netns", names[1])
        for k, name in enumerate(names):
            ip("-n", name, "addr", "add", f"{VETH}.{k + 1}/30", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield ["ip", "netns", "exec", names[0]], ["ip", "netns", "exec", names[1]]
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def run(console: Console | None = None, rounds: int = ROUNDS) -> dict[str, Any]:
    """Measure, print the tables, return the figures. The paths take turns, `rounds` times; each path is
    reported from its round with the lowest remote p50 (the least disturbed by other work on the machine)."""
    console = console or Console()
    token = secrets.token_hex(16)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    scratch = scratch_dir("bench-remote", shm)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        db = scratch / "bench.sqlite"
        _make_db(db)
        with contextlib.ExitStack() as stack:
            loopback: tuple[str, list[str]] = (stack.enter_context(_server(db, "127.0.0.1", [], token)), [])
            paths = {"loopback": loopback}
            pair = stack.enter_context(_veth_pair())
            if pair is not None:
                server_side, client_side = pair
                paths["veth"] = (stack.enter_context(_server(db, f"{VETH}.1", server_side, token)), client_side)
            for _ in range(rounds):
                for path, (url, prefix) in paths.items():
                    runs.setdefault(path, []).append(_measure_in_client(db, url, prefix, token))
        traced = _traced(token)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = {path: min(found, key=lambda r: r["remote"]["execute"]["p50_ms"]) for path, found in runs.items()}
    _print(results, console)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(
        f"local: the same SQLiteSandboxes in the client's process, measured in turns with the remote one, call by "
        f"call; overhead: remote p50 minus local p50. Best of {rounds} rounds of {CALLS} calls and {OPS} of "
        f"each operation per side, then {ROLLOUTS} rollouts for {SECONDS:g} s per side; server and client pinned to "
        f"separate cores.\n{'' if 'veth' in results else 'veth: skipped (needs root and iproute2). '}"
        f"{os.cpu_count()} CPUs; 1-minute load average at the end: {load:.2f}"
    )
    _print_traced(traced, console)
    return {"paths": results, "rounds": runs, "traced": traced, "cpus": os.cpu_count(), "loadavg": load}


def _traced(token: str) -> dict[str, Any]:
    from .read_sets import _plain_project

    base = _plain_project()
    try:
        with _server(base, "127.0.0.1", [], token, "python:tvcache_bench.micro.remote:traced_workspace") as url:
            return _measure_in_client(None, url, [], token)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _print_traced(traced: dict[str, Any], console: Console) -> None:
    table = Table(title="A traced workspace through the server (loopback), ms: read set inline / after the answer")
    for column in ("command", "inline p50", "after: answer p50", "after: read set p50", "answer saved"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for command, figures in traced.items():
        inline, answer = figures["inline answer"]["p50_ms"], figures["after answer"]["p50_ms"]
        reads = figures["after reads"]["p50_ms"]
        table.add_row(command, f"{inline:.2f}", f"{answer:.2f}", f"{reads:.2f}", f"{1 - answer / inline:.0%}")
    console.print(table)
    console.print(
        f"Two sandboxes of one traced workspace server taking turns, {TRACED_CALLS} calls each per command: one "
        "asking for its read sets inline (the server waits for the digest), one after the answer; 'read set': "
        "from the call until the read set is fetched."
    )


def _print(results: dict[str, dict[str, Any]], console: Console) -> None:
    calls = Table(title=f"SQLiteSandboxes execute, ms; calls/s of {ROLLOUTS} concurrent rollouts")
    columns = ("path", "local p50", "remote p50", "p90", "p99", "overhead", "local calls/s", "remote calls/s")
    for column in columns:
        calls.add_column(column, justify="left" if column == "path" else "right")
    for path, sides in results.items():
        local, remote = sides["in-process"], sides["remote"]
        calls.add_row(
            path,
            f"{local['execute']['p50_ms']:.3f}",
            f"{remote['execute']['p50_ms']:.3f}",
            f"{remote['execute']['p90_ms']:.3f}",
            f"{remote['execute']['p99_ms']:.3f}",
            f"{remote['execute']['p50_ms'] - local['execute']['p50_ms']:.3f}",
            f"{local['calls_per_second']:,.0f}",
            f"{remote['calls_per_second']:,.0f}",
        )
    console.print(calls)
    ops = Table(title="Sandbox operations, p50 ms: local / remote")
    names = ("create", "snapshot", "restore", "close")
    ops.add_column("path")
    for op in names:
        ops.add_column(op, justify="right")
    for path, sides in results.items():
        local, remote = sides["in-process"], sides["remote"]
        ops.add_row(path, *(f"{local[op]['p50_ms']:.2f} / {remote[op]['p50_ms']:.2f}" for op in names))
    console.print(ops)


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        _client_main(sys.argv[2:])
    else:
        run()
