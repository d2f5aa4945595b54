"""A real `tvcache serve` on loopback in a subprocess, raw HTTP requests, and client processes for the tests.

Run as a script, this file is a client process: `python server_helpers.py MODE URL ...` (see `client_main`).
Each client process has its own ToolCache("http://...") and its own sandboxes, as rollout workers would.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m tvcache.server serve` in a subprocess; restartable on the same port and store.

    `prefix` runs it under another command (`ip netns exec NS`), listening on `host`; `nofile` lowers its limit
    of open files."""

    def __init__(
        self,
        tmp: Path,
        store: str = "memory://",
        token: str | None = None,
        *extra: str,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        nofile: int | None = None,
    ):
        self.port = free_port()
        self.nofile = nofile
        self.store = store
        self.token = token
        self.extra = extra
        self.host = host
        self.prefix = list(prefix)
        self.log_path = tmp / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return ["serve", "--store", self.store]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def token_url(self) -> str:
        return f"http://:{self.token}@{self.host}:{self.port}" if self.token else self.url

    def start(self) -> Server:
        args = [*self.prefix, sys.executable, "-m", "tvcache.server", *self.command()]
        if self.nofile is not None:  # as `ulimit -n NOFILE` would: the server's file descriptors, soft and hard
            args = ["prlimit", f"--nofile={self.nofile}:{self.nofile}", "--", *args]
        args += ["--host", self.host, "--port", str(self.port)]
        if self.token:  # as a deployment passes it: in a file only its owner reads, not on the command line
            token_file = self.log_path.with_suffix(".token")
            token_file.touch(mode=0o600)
            token_file.write_text(self.token + "\n")
            args += ["--token-file", str(token_file)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*args, *self.extra], stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()
        return self

    def _wait_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if self._healthy():
                return
            time.sleep(0.05)
        raise RuntimeError(f"server did not become healthy in {timeout} s:\n{self.log()}")

    def _healthy(self) -> bool:
        if self.prefix:  # another network namespace: ask from inside it
            probe = f"import urllib.request as u; u.urlopen('{self.url}/healthz', timeout=1)"
            return subprocess.run([*self.prefix, sys.executable, "-c", probe], capture_output=True).returncode == 0
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SandboxServer(Server):
    """`python -m tvcache.server sandbox-server SANDBOX...` in a subprocess (tests/ is on its PYTHONPATH, so
    `python:server_helpers:sandboxes` names the kv world below)."""

    def __init__(self, tmp: Path, sandbox: Sequence[str], token: str | None = None, *extra: str, **where: Any):
        super().__init__(tmp, "", token, *extra, **where)
        self.sandbox = list(sandbox)

    def command(self) -> list[str]:
        return ["sandbox-server", *self.sandbox]


def request(
    server: Server,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    auth: bool = True,
) -> tuple[int, Any]:
    """One raw HTTP request. `body` is sent as is if bytes, else as JSON. Returns (status, decoded JSON or text)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    sent = dict(headers or {})
    if auth and server.token and "Authorization" not in sent:
        sent["Authorization"] = f"Bearer {server.token}"
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else msgspec.json.encode(body)
        sent.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    kind = response.getheader("content-type") or ""
    return response.status, json.loads(raw) if kind.startswith("application/json") else raw.decode(errors="replace")


def stats(server: Server) -> dict[str, Any]:
    status, body = request(server, "GET", "/v1/stats")
    assert status == 200, body
    return dict(body)


def spawn_client(*args: str, start_at: float = 0.0) -> subprocess.Popen[str]:
    """A client process (see `client_main`); with `start_at` (a time.time()), its work begins then."""
    return subprocess.Popen(
        [sys.executable, str(HERE / "server_helpers.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=HERE,
        env={**os.environ, "START_AT": str(start_at)},
    )


def finish_client(proc: subprocess.Popen[str], timeout: float = 60.0) -> Any:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"client failed ({proc.returncode}):\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def read_until_closed(server: Server, chunks: Sequence[bytes] = (), pause: float = 0.0) -> bytes:
    """Open a connection to `server`, send `chunks` `pause` seconds apart (until the server hangs up), and return
    all the server sent before it closed the connection. A server that never closes it fails the caller after
    60 s (the socket's timeout)."""
    received = b""
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except OSError:  # closed on us: that is what the caller waits for
                break
            time.sleep(pause)
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            received += data
    return received


def assert_slow_clients_are_cut_off(server: Server, path: str) -> None:
    """For a server started with `--read-timeout 1`: connections that send nothing, send their headers a byte at
    a time, or stop sending their body are closed (the last with a 408), and so is the connection of a request
    refused before its body was read or answered before its body arrived; the server still answers after."""
    idle = [socket.create_connection((server.host, server.port), timeout=60) for _ in range(100)]
    for sock in idle:  # each closed by the server, not by us: recv() sees the end of the stream
        with sock:
            assert sock.recv(1) == b""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
    assert read_until_closed(server, [head + b"X-Slow: ", *[b"a"] * 40], pause=0.1) == b""
    auth = f"Authorization: Bearer {server.token}\r\n".encode() if server.token else b""
    answer = read_until_closed(server, [head + auth + b"Content-Length: 100\r\n\r\n{", b'"s'], pause=0.1)
    assert answer.startswith(b"HTTP/1.1 408") and b"not received within 1 s" in answer
    if server.token:
        answer = read_until_closed(server, [head + b"Content-Length: 100\r\n\r\n{", *[b" "] * 30], pause=0.1)
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer
    # A body nobody reads (a GET's), trickled after the answer: the connection is closed all the same.
    get = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    assert read_until_closed(server, [get, *[b" "] * 40], pause=0.1).startswith(b"HTTP/1.1 200")
    assert request(server, "GET", "/healthz", auth=False)[0] == 200


def slowloris(server: Server, connections: int, seconds: float, requests: int, slow: str = "head") -> tuple[int, int]:
    """Attack `server` from loopback for `seconds` with `connections` unauthenticated clients (in another
    process, `_slowloris`; `slow`: what they trickle, "head" or "body") and meanwhile send `requests`
    legitimate GET /healthz from this one, evenly spaced over the attack's last three quarters (once the
    attackers have connected), each with 5 s to be answered. Returns (answered with a 200, sent). Stops by
    itself: the attacker process ends after `seconds` and holds at most `connections` sockets at a time."""
    start = time.monotonic()
    attack = spawn_client("slowloris", server.url, str(connections), str(seconds), slow)
    try:
        ramp = seconds / 4
        time.sleep(ramp)
        answers = []
        for i in range(requests):
            answers.append(_healthy_within(server, 5.0))
            time.sleep(max(0.0, ramp + (i + 1) * (seconds - ramp) / requests - (time.monotonic() - start)))
        finish_client(attack, timeout=seconds + 30)
    finally:
        if attack.poll() is None:
            attack.kill()
            attack.wait()
    return sum(answers), requests


def _healthy_within(server: Server, timeout: float) -> bool:
    """One legitimate request, as a client sends it: the whole request at once on a new connection."""
    try:
        with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            return answer.startswith(b"HTTP/1.1 200")
    except OSError:
        return False


async def _slowloris(url: str, connections: int, seconds: float, slow: str) -> None:
    """`connections` clients that each send a request head a header line a second (`slow` "head"), or a whole
    head and then a body a byte a second ("body"), and when the server hangs up connect again, for `seconds`."""
    first, then = b"GET /healthz HTTP/1.1\r\nHost: x\r\n", b"X-Slow: x\r\n"
    if slow == "body":
        first = b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        first += b"Content-Length: 9999\r\n\r\n{"
        then = b" "
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stop = asyncio.get_running_loop().time() + seconds

    async def attacker() -> None:
        while asyncio.get_running_loop().time() < stop:
            writer = None
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(first)
                while asyncio.get_running_loop().time() < stop and not reader.at_eof():
                    await asyncio.sleep(1.0)
                    writer.write(then)
                    await writer.drain()
            except OSError:
                await asyncio.sleep(0.05)  # refused or reset: connect again, not in a hot loop
            finally:
                if writer is not None:
                    writer.close()

    await asyncio.gather(*(attacker() for _ in range(connections)))


def assert_schemathesis_finds_nothing(server: Server, workdir: Path) -> None:
    """Fuzz every operation of `server` from its OpenAPI document: no 5xx, every status documented, every reply
    valid against its schema, invalid input rejected, valid input accepted, auth enforced. Settings beyond
    these (a `schemathesis.toml`) go in `workdir`, where schemathesis also keeps its state."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json", "--checks", "all"]
    command += ["--max-examples", "5", "--phases", "coverage,fuzzing", "--request-timeout", "10"]
    if server.token:
        command += ["-H", f"Authorization: Bearer {server.token}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=workdir)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert not [line for line in server.log().splitlines() if '"status": 5' in line]


def _kv_with_extras() -> Any:
    import kv

    async def run(state: dict[str, str], call: Any) -> Any:
        if call.tool == "big":
            return "x" * int(call.args["bytes"])
        if call.tool == "sleep":
            await asyncio.sleep(float(call.args["seconds"]))
            return "slept"
        return await kv.run(state, call)

    return run


def sandboxes() -> Any:
    """The kv world of kv.py, plus `big {"bytes"}` (an output that long) and `sleep {"seconds"}`: what a sandbox
    server serves as `python:server_helpers:sandboxes`."""
    import tvcache

    return tvcache.PythonSandboxes(make=dict, run=_kv_with_extras(), fingerprint="kv-extras-v1")


def sqlite_in_tmp(base: str) -> Any:
    """SQLite sandboxes of the database `base` whose files live in $TVCACHE_TEST_TMP (a test's own small tmpfs):
    what a sandbox server serves as `python:server_helpers:sqlite_in_tmp --base FILE`."""
    import tvcache

    return tvcache.SQLiteSandboxes(base, tmp=os.environ["TVCACHE_TEST_TMP"])


# -- client processes --------------------------------------------------------------------------------------


async def _oracle(url: str, seeds: list[int]) -> dict[str, Any]:
    import kv
    import tvcache
    from test_oracle import check_against_oracle, kv_plan

    wrong = 0
    async with tvcache.ToolCache(url, namespace="oracle") as cache:
        boxes = kv.sandboxes()
        for seed in seeds:
            wrong += await check_against_oracle(cache, boxes, kv_plan(seed, 6, 8), kv.TOOLS)
        return {"wrong": wrong, "stats": cache.stats()}


FLIGHT_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("write", {"key": "a", "value": "x", "delay": 0.05}),
    ("read", {"key": "a", "delay": 0.05}),
    ("append", {"key": "b", "value": "y", "delay": 0.05}),
    ("list", {"delay": 0.05}),
    ("delete", {"key": "a", "delay": 0.05}),
    ("read", {"key": "a", "delay": 0.05}),
]


async def _flight(url: str, rollouts: int) -> dict[str, Any]:
    import kv
    import tvcache

    async with tvcache.ToolCache(url, namespace="flight") as cache:
        boxes = kv.sandboxes()

        async def one() -> list[Any]:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                return [(await r.call(tool, args)).output for tool, args in FLIGHT_CALLS]

        outputs = await asyncio.gather(*(one() for _ in range(rollouts)))
        return {"outputs": outputs, "stats": cache.stats()}


async def _hang(url: str, ttl: float) -> None:
    """Claim a call and never finish it: the test kills this process mid-call."""
    import kv
    import tvcache

    async with (
        tvcache.ToolCache(url, namespace="hang", claim_ttl=ttl) as cache,
        cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r,
    ):
        await r.call("write", {"key": "a", "value": "x", "delay": 3600})


async def _slow(url: str, seconds: float) -> dict[str, Any]:
    """Execute one call that takes `seconds`, with a claim that outlives it by far."""
    import kv
    import tvcache

    async with tvcache.ToolCache(url, namespace="slow", claim_ttl=60) as cache:
        async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
            result = await r.call("write", {"key": "a", "value": "x", "delay": seconds})
        return {"source": result.source, "recorded_at": time.time()}


async def _writer(url: str, workers: int) -> None:
    """Record entries as fast as the server takes them, printing `ack I` for each one acknowledged, until
    killed. Failures (the server is down) print `err` and go on, as a rollout would."""
    from tvcache.graph import Entry
    from tvcache.stores import StoreError
    from tvcache.stores.http import HTTPStore

    store = HTTPStore(url)
    counter = iter(range(10**9))

    async def work() -> None:
        for i in counter:
            try:
                await store.record(
                    WRITER_SCOPE, WRITER_NODE, i.to_bytes(16, "big"), Entry("edge", b"%d" % i, 0.1), None
                )
                print("ack", i, flush=True)
            except StoreError:
                print("err", i, flush=True)
                await asyncio.sleep(0.01)

    await asyncio.gather(*(work() for _ in range(workers)))


WRITER_SCOPE = "ab" * 16
WRITER_NODE = b"n" * 16


def client_main(argv: list[str]) -> int:
    mode, url, *rest = argv
    start_at = float(os.environ.get("START_AT", "0"))
    if start_at:  # line the processes up, so their rollouts really run at the same time
        time.sleep(max(0.0, start_at - time.time()))
    result: Any = None
    if mode == "oracle":
        result = asyncio.run(_oracle(url, [int(s) for s in rest]))
    elif mode == "flight":
        result = asyncio.run(_flight(url, int(rest[0])))
    elif mode == "hang":
        asyncio.run(_hang(url, float(rest[0])))
    elif mode == "slow":
        result = asyncio.run(_slow(url, float(rest[0])))
    elif mode == "writer":
        asyncio.run(_writer(url, int(rest[0])))
    elif mode == "slowloris":
        asyncio.run(_slowloris(url, int(rest[0]), float(rest[1]), rest[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(client_main(sys.argv[1:]))
