"""`tvcache bench server`: lookups/s and latency of `tvcache serve` over loopback.

The server runs in its own process pinned to one core; the load comes from another process pinned to the
other core, so the two do not compete for a CPU. Every lookup is a hit on one of 1,000 recorded entries with
200-byte outputs (what most lookups of a warm cache are). Two clients make the load:

- `raw`: pre-encoded HTTP/1.1 requests on keep-alive connections, responses parsed with httptools, the way
  wrk-style load generators work. It costs the client so little that the figures are the server's.
- `HTTPStore`: the client rollouts use (aiohttp, msgspec), so the figures are what a rollout process sees;
  at high concurrency its one core, not the server, is the limit.

Closed loop: N clients each send a lookup as soon as the previous one is answered. Open loop: lookups are
sent at a fixed rate whatever the answers do (the published system's operating point is 256 requests/s),
and latency counts from when each was due, so a stalled server cannot hide its queue.

Side by side with the published server: `--published DIR` (or `TVCACHE_PUBLISHED_SERVER=DIR`) names a checkout of
the published system's repository (github.com/TVCache/TVCache; DIR may be its root or its `tvcache/server`
folder). Its server (`tvcache_server.py`: Flask's threaded server over its prefix trees, started as its README
says, `python tvcache_server.py`, bound to 127.0.0.1) then runs in the same place under the same raw load, in
the same run: the same 1,000 entries with 200-byte values (stored with its `PUT /put`), looked up one exact
history each (`GET /get`). It closes the connection after every answer, so the raw client opens a new one per
lookup there, as its own client (`requests`) does. At 32 clients, where the ratio is taken, the two servers' runs
alternate (both are up, the one not under load idle), so that other work on the machine weighs on both alike.
Nothing of it is copied into tvcache: it runs from the checkout, with Flask from the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec
from rich.console import Console
from rich.table import Table

from .procs import free_port, pin

__all__ = ["run"]

SCOPE = "5e" * 16
NODE = b"\x01" * 16
ENTRIES = 1000
OUTPUT = b"x" * 200
CONCURRENCY = (1, 8, 32)
PAPER_RATE = 256.0


PUBLISHED_ENV = "TVCACHE_PUBLISHED_SERVER"
PUBLISHED_TASK = "bench"


def _digest(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _published_call(i: int) -> str:
    """A tool call as the published client keys it: one string per call of the history."""
    return json.dumps({"name": "bash", "arguments": {"command": f"cat file{i}.txt"}}, separators=(",", ":"))


def published_script(path: str | os.PathLike[str]) -> Path:
    """The published server's `tvcache_server.py` in a checkout of its repository; `ValueError` saying what was
    expected otherwise."""
    root = Path(path).expanduser()
    for candidate in (root / "tvcache" / "server" / "tvcache_server.py", root / "tvcache_server.py"):
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"{root} holds no tvcache/server/tvcache_server.py: name a checkout of the published system's repository "
        "(git clone https://github.com/TVCache/TVCache)"
    )


# -- the load process --------------------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request in flight at a time. Each answer goes to `answered` (a hit or
    not), a connection lost before its answer to `failed`."""

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpResponseParser(self)
        self._size = 0
        self._waiting = False
        self.transport: asyncio.Transport | None = None
        self.reusable = True  # False once the server said it closes the connection after its answer
        self.answered: Callable[[bool], None] = _ignore
        self.failed: Callable[[Exception], None] = _ignore

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"connection" and value.lower() == b"close":
            self.reusable = False

    def on_body(self, body: bytes) -> None:
        self._size += len(body)

    def on_message_complete(self) -> None:
        if self._waiting:
            self._waiting = False
            # A hit carries the entry; a 200 with "{}" would be a miss, which this benchmark must not count.
            self.answered(self._parser.get_status_code() == 200 and self._size > len(OUTPUT))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiting:
            self._waiting = False
            self.failed(ConnectionError("the server closed the connection"))

    def write(self, payload: bytes) -> None:
        assert self.transport is not None
        self._size = 0
        self._waiting = True
        self.transport.write(payload)

    async def send(self, payload: bytes) -> bool:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.answered, self.failed = done.set_result, done.set_exception
        self.write(payload)
        return await done


def _ignore(_: object) -> None:
    pass


class _Client:
    """One client of the closed loop. It sends its next lookup from the parser's callback for the last answer,
    with no task or future per lookup: a load generator must cost less per lookup than the server it measures,
    or it measures itself (with tasks this one cost about as much as tvcache's server)."""

    def __init__(self, host: str, port: int, payloads: list[bytes], first: int, rec: _Recorder):
        self._host, self._port = host, port
        self._payloads = payloads
        self._i = first
        self._rec = rec
        self._stop = self._start = 0.0
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._conn = _Connection()
        self._reopening: asyncio.Future[None] | None = None

    async def open(self) -> None:
        self._conn = await _connect(self._host, self._port)
        self._conn.answered, self._conn.failed = self._answered, self._failed

    def run(self, stop: float) -> None:
        self._stop = stop
        self._send()

    def _send(self) -> None:
        self._start = time.perf_counter()
        if self._start >= self._stop:
            assert self._conn.transport is not None
            self._conn.transport.close()
            self.finished.set_result(None)
        elif self._conn.reusable:
            self._conn.write(self._payloads[self._i % ENTRIES])
        else:  # a server that closes after each answer: a new connection, timed
            self._reopening = asyncio.ensure_future(self._reopen())

    async def _reopen(self) -> None:
        assert self._conn.transport is not None
        self._conn.transport.close()
        try:
            await self.open()
        except OSError as exc:
            self._failed(exc)
            return
        self._conn.write(self._payloads[self._i % ENTRIES])

    def _answered(self, hit: bool) -> None:
        if hit:
            self._rec.latencies.append(time.perf_counter() - self._start)
        else:
            self._rec.failed += 1
        self._i += 1
        self._send()

    def _failed(self, exc: Exception) -> None:
        if not self.finished.done():
            self.finished.set_exception(exc)


def _payloads(host: str, port: int, target: str = "tvcache") -> list[bytes]:
    out = []
    if target == "published":
        for i in range(ENTRIES):
            query = urllib.parse.urlencode({"task_name": PUBLISHED_TASK, "tool_calls": _published_call(i)})
            out.append(f"GET /get?{query} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        return out
    for i in range(ENTRIES):
        body = msgspec.json.encode({"scope_key": SCOPE, "node": NODE, "digest": _digest(i)})
        head = (
            f"POST /v1/lookup HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        out.append(head.encode() + body)
    return out


class _Recorder:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.failed = 0
        self._cpu = 0.0

    def begin(self) -> None:
        """The load starts now: its own CPU time counts from here (not its start-up or connecting)."""
        self._cpu = time.process_time()

    def summary(self, seconds: float) -> dict[str, float]:
        cpu = time.process_time() - self._cpu
        lat = sorted(self.latencies)

        def pick(q: float) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")

        return {
            "lookups": len(lat),
            "failed": self.failed,
            "per_second": len(lat) / seconds,
            "p50_ms": pick(0.50),
            "p95_ms": pick(0.95),
            "p99_ms": pick(0.99),
            "load_cpu_us": cpu / max(len(lat) + self.failed, 1) * 1e6,
        }


async def _connect(host: str, port: int) -> _Connection:
    return (await asyncio.get_running_loop().create_connection(_Connection, host, port))[1]


async def _reconnect(old: _Connection, host: str, port: int) -> _Connection:
    if old.transport is not None:
        old.transport.close()
    return await _connect(host, port)


async def _raw_closed(host: str, port: int, clients: int, seconds: float, target: str) -> dict[str, float]:
    payloads = _payloads(host, port, target)
    rec = _Recorder()
    load = [_Client(host, port, payloads, k * 31, rec) for k in range(clients)]
    for client in load:
        await client.open()
    rec.begin()
    t0 = time.perf_counter()
    for client in load:
        client.run(t0 + seconds)
    await asyncio.gather(*(client.finished for client in load))
    return rec.summary(time.perf_counter() - t0)


async def _store_closed(url: str, clients: int, seconds: float) -> dict[str, float]:
    from tvcache.graph import Entry
    from tvcache.stores.http import HTTPStore

    store = HTTPStore(url)
    rec = _Recorder()
    stop = time.perf_counter() + seconds

    async def client(offset: int) -> None:
        i = offset
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            found = await store.lookup(SCOPE, NODE, _digest(i % ENTRIES))
            if isinstance(found, Entry):
                rec.latencies.append(time.perf_counter() - t0)
            else:
                rec.failed += 1
            i += 1

    await store.lookup(SCOPE, NODE, _digest(0))  # open the pool
    rec.begin()
    t0 = time.perf_counter()
    await asyncio.gather(*(client(k * 31) for k in range(clients)))
    elapsed = time.perf_counter() - t0
    await store.close()
    return rec.summary(elapsed)


async def _open_loop(
    url: str, host: str, port: int, client: str, rate: float, seconds: float, target: str
) -> dict[str, float]:
    """Send at `rate` per second on schedule; latency counts from each request's due time."""
    from tvcache.graph import Entry
    from tvcache.stores.http import HTTPStore

    rec = _Recorder()
    payloads = _payloads(host, port, target)
    idle: asyncio.Queue[_Connection] = asyncio.Queue()
    for _ in range(8):
        idle.put_nowait(await _connect(host, port))
    store = HTTPStore(url)
    if client != "raw":
        await store.lookup(SCOPE, NODE, _digest(0))

    async def one(i: int, due: float) -> None:
        if client == "raw":
            conn = await idle.get()  # a request that finds every connection busy queues, and that counts
            if not conn.reusable:
                conn = await _reconnect(conn, host, port)
            ok = await conn.send(payloads[i % ENTRIES])
            idle.put_nowait(conn)
        else:
            ok = isinstance(await store.lookup(SCOPE, NODE, _digest(i % ENTRIES)), Entry)
        if ok:
            rec.latencies.append(time.perf_counter() - due)
        else:
            rec.failed += 1

    tasks = []
    rec.begin()
    start = time.perf_counter() + 0.05
    for i in range(int(rate * seconds)):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    await store.close()
    return rec.summary(elapsed)


def _load_main(argv: list[str]) -> None:
    import uvloop

    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--client", choices=["raw", "store"], required=True)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--target", choices=["tvcache", "published"], default="tvcache")
    args = parser.parse_args(argv)
    host, port = args.url.removeprefix("http://").split(":")
    if args.rate:
        coro = _open_loop(args.url, host, int(port), args.client, args.rate, args.seconds, args.target)
    elif args.client == "raw":
        coro = _raw_closed(host, int(port), args.clients, args.seconds, args.target)
    else:
        coro = _store_closed(args.url, args.clients, args.seconds)
    print(json.dumps(uvloop.run(coro)))


# -- the benchmark -----------------------------------------------------------------------------------------


def _start_server(port: int, floor: bool = False, published: Path | None = None) -> subprocess.Popen[bytes]:
    """tvcache's server, the uvicorn floor or the published server (its script), pinned to core 0, once it answers."""
    command = ["-m", "tvcache.server", "serve", "--port", str(port), "--log-level", "warning"]
    health, cwd, env = f"http://127.0.0.1:{port}/healthz", None, None
    if floor:
        command = ["-m", "tvcache_bench.micro.server", "floor", str(port)]
    if published is not None:  # from its own folder, so that `import tvcache` there is its package, not ours
        command = [published.name, "--host", "127.0.0.1", "--port", str(port)]
        health = f"http://127.0.0.1:{port}/get?task_name={PUBLISHED_TASK}"
        cwd, env = published.parent, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [sys.executable, *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd, env=env
    )
    pin(proc.pid, 0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(health, timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("the server exited at start") from None
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the server did not start within 30 s")


def _populate_published(url: str) -> None:
    """The same 1,000 entries in the published server: one history of one call each, a 200-byte value."""
    for i in range(ENTRIES):
        body: dict[str, Any] = {"task_name": PUBLISHED_TASK, "history": [_published_call(i)], "env_id": None}
        body |= {"values": [OUTPUT.decode()], "tool_exec_times": [1.0]}
        request = urllib.request.Request(
            f"{url}/put", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="PUT"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            if not json.loads(response.read()).get("success"):
                raise RuntimeError(f"the published server did not store entry {i}")


async def _populate(url: str) -> None:
    from tvcache.graph import Entry
    from tvcache.stores.http import HTTPStore

    store = HTTPStore(url)
    for i in range(ENTRIES):
        await store.record(SCOPE, NODE, _digest(i), Entry("edge", OUTPUT, 1.0, f"bench {i}"), None)
    await store.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux), to tell the server's own cost per lookup apart
    from time it spent waiting for a core that other work on the machine held."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load(server: subprocess.Popen[bytes], url: str, *args: str) -> dict[str, float]:
    cpu = _cpu_seconds(server.pid)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tvcache_bench.micro.server", "load", url, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pin(proc.pid, 1)
    out, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"load process failed:\n{err[-2000:]}")
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    # Includes the load process's start and connection set-up (idle for the server): an upper bound.
    result["server_cpu_us"] = (_cpu_seconds(server.pid) - cpu) / max(result["lookups"], 1) * 1e6
    return result


async def _floor_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The least an ASGI app on uvicorn can do per request: answer a fixed hit-sized reply. What the real
    server costs beyond this is tvcache's own work."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": _FLOOR_HEADERS})
    await send({"type": "http.response.body", "body": _FLOOR_BODY})


_FLOOR_BODY = msgspec.json.encode({"entry": {"kind": "edge", "output": OUTPUT, "seconds": 1.0, "call": "bench 1"}})
_FLOOR_HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_FLOOR_BODY))]


def _floor_main(port: int) -> None:
    import uvicorn

    uvicorn.run(_floor_app, port=port, loop="uvloop", http="httptools", log_level="warning", access_log=False)


def _best(server: subprocess.Popen[bytes], url: str, repeat: int, *args: str) -> dict[str, float]:
    """The best of `repeat` runs: the most lookups/s in closed loop, the lowest p99 at a fixed rate. On a
    machine shared with other work, the best run is the one least disturbed by it (as `timeit` takes the
    minimum)."""
    runs = [_load(server, url, *args) for _ in range(repeat)]
    if "--rate" in args:
        return min(runs, key=lambda r: r["p99_ms"])
    return max(runs, key=lambda r: r["per_second"])


def run(
    seconds: float = 2.0, repeat: int = 3, console: Console | None = None, published: str | None = None
) -> dict[str, Any]:
    """Measure and print the table; returns the figures. 9 rows (4 more with `published`, a checkout of the
    published system: see the module docstring), each the best of `repeat` runs of `seconds`."""
    console = console or Console()
    rows: list[dict[str, Any]] = []
    script = published_script(published) if published else None
    servers = []
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = _start_server(port)
        servers.append(server)
        asyncio.run(_populate(url))
        theirs: tuple[subprocess.Popen[bytes], str] | None = None
        if script is not None:  # up from the start, idle until its turn: the head-to-head alternates the two
            their_port = free_port()
            theirs = (_start_server(their_port, published=script), f"http://127.0.0.1:{their_port}")
            servers.append(theirs[0])
            _populate_published(theirs[1])
        head_to_head: dict[str, Any] = {}
        for client in ("raw", "store"):
            for clients in CONCURRENCY:
                args = ("--client", client, "--clients", str(clients), "--seconds", str(seconds))
                if theirs is not None and client == "raw" and clients == CONCURRENCY[-1]:
                    result, head_to_head = _side_by_side((server, url), theirs, repeat, args)
                else:
                    result = _best(server, url, repeat, *args)
                rows.append({"server": "tvcache", "client": client, "load": f"{clients} clients", **result})
            args = ("--client", client, "--rate", str(PAPER_RATE), "--seconds", str(seconds))
            result = _best(server, url, repeat, *args)
            rows.append({"server": "tvcache", "client": client, "load": f"{PAPER_RATE:.0f}/s open", **result})
        if theirs is not None:
            rows += _published_rows(theirs, seconds, repeat, head_to_head)
    finally:
        for started in servers:
            started.terminate()
            started.wait(10)
    port = free_port()
    floor = _start_server(port, floor=True)
    try:
        args = ("--client", "raw", "--clients", "32", "--seconds", str(seconds))
        result = _best(floor, f"http://127.0.0.1:{port}", repeat, *args)
        rows.append({"server": "uvicorn floor", "client": "raw", "load": "32 clients", **result})
    finally:
        floor.terminate()
        floor.wait(10)
    table = Table(
        title=f"Lookups over loopback: best of {repeat} runs of {seconds:g} s, server and load on separate cores"
    )
    for column in (
        "server",
        "client",
        "load",
        "lookups/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "server CPU µs",
        "load CPU µs",
        "failed",
    ):
        table.add_column(column, justify="left" if column in ("server", "client", "load") else "right")
    for row in rows:
        table.add_row(
            row["server"],
            "raw" if row["client"] == "raw" else "HTTPStore",
            row["load"],
            f"{row['per_second']:,.0f}",
            f"{row['p50_ms']:.2f}",
            f"{row['p95_ms']:.2f}",
            f"{row['p99_ms']:.2f}",
            f"{row['server_cpu_us']:.0f}",
            f"{row['load_cpu_us']:.0f}",
            f"{row['failed']:.0f}",
        )
    console.print(table)
    ratio, cpu_ratio = _ratio(rows, "per_second"), _ratio(rows, "server_cpu_us")
    if ratio is not None and cpu_ratio is not None:
        console.print(
            f"tvcache / published at 32 clients (raw, same run): {ratio:.1f}x the lookups/s, {1 / cpu_ratio:.1f}x less "
            "server CPU per lookup"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(
        "raw: a minimal HTTP/1.1 load generator (the server's capacity); HTTPStore: the client rollouts use.\n"
        "server CPU µs: the server process's CPU time per lookup (includes idle ticks while a load process starts); "
        "load CPU µs: the load process's, while it sends (a load that costs as much as the server measures itself).\n"
        "uvicorn floor: a trivial ASGI app answering the same bytes, the most any app on uvicorn can do.\n"
        f"{os.cpu_count()} CPUs; 1-minute load average at the end: {load:.2f} (other work slows every row)"
    )
    figures = {"rows": rows, "seconds": seconds, "repeat": repeat, "cpus": os.cpu_count(), "loadavg": load}
    if script is None:
        return figures
    return figures | {"published": str(script), "ratio_32_clients": ratio, "cpu_ratio_32_clients": cpu_ratio}


def _side_by_side(
    ours: tuple[subprocess.Popen[bytes], str], theirs: tuple[subprocess.Popen[bytes], str], repeat: int, args: Any
) -> tuple[dict[str, float], dict[str, float]]:
    """The best of `repeat` runs of the raw load `args` on tvcache's server and on the published one,
    alternated (tvcache, published, tvcache, ...) so that other work on the machine weighs on both alike."""
    runs = [(_load(*ours, *args), _load(*theirs, *args, "--target", "published")) for _ in range(repeat)]
    mine, published = zip(*runs, strict=True)
    return max(mine, key=lambda r: r["per_second"]), max(published, key=lambda r: r["per_second"])


def _published_rows(
    theirs: tuple[subprocess.Popen[bytes], str], seconds: float, repeat: int, head_to_head: dict[str, Any]
) -> list[dict[str, Any]]:
    """The published server under the raw load: 1, 8 and 32 clients (measured alternately with tvcache's
    server: `head_to_head`), and its operating point."""
    rows = []
    target = ("--client", "raw", "--target", "published", "--seconds", str(seconds))
    for clients in CONCURRENCY:
        result = (
            head_to_head if clients == CONCURRENCY[-1] else _best(*theirs, repeat, *target, "--clients", str(clients))
        )
        rows.append({"server": "published", "client": "raw", "load": f"{clients} clients", **result})
    result = _best(*theirs, repeat, *target, "--rate", str(PAPER_RATE))
    rows.append({"server": "published", "client": "raw", "load": f"{PAPER_RATE:.0f}/s open", **result})
    return rows


def _ratio(rows: list[dict[str, Any]], figure: str) -> float | None:
    """tvcache's `figure` (per_second, server_cpu_us) with the raw client at 32 clients over the published
    server's, when both ran."""
    pick = {(r["server"], r["client"], r["load"]): r[figure] for r in rows}
    ours, theirs = pick.get(("tvcache", "raw", "32 clients")), pick.get(("published", "raw", "32 clients"))
    return ours / theirs if ours and theirs else None


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        _load_main(sys.argv[2:])
    elif sys.argv[1:2] == ["floor"]:
        _floor_main(int(sys.argv[2]))
    else:
        run(published=os.environ.get(PUBLISHED_ENV))
