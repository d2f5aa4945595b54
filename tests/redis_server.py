"""Real Redis servers for the tests: one server, or a 3-node cluster, on free ports in a temporary directory.

Each is started once per test session (the `redis_server` and `redis_cluster` fixtures) as the README says to
run Redis for tvcache: with AOF and an fsync per write (`appendonly yes`, `appendfsync always`; free on
tmpfs), so every acknowledged write survives `kill -9`. Each is stopped at the end. Tests that need
`redis-server` are skipped, saying so, where it is not installed (`apt-get install redis-server`).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = ["RedisServer", "redis_cluster", "redis_server", "start_cluster", "start_server"]

MISSING = "redis-server is not installed (apt-get install redis-server)"


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free TCP port; for a cluster node also its bus port (port + 10000) must be free."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 < 65536 and _bindable(port + 10000):
            return port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # up, if only for clients with a password
    except OSError:
        return False


class RedisServer:
    """Redis server processes (one, or the nodes of a cluster) and the URL to reach them."""

    def __init__(
        self,
        url: str,
        ports: list[int],
        procs: list[subprocess.Popen[bytes]],
        workdir: Path,
        commands: list[list[str]] | None = None,
    ):
        self.url = url
        self.ports = ports
        self.procs = procs
        self.workdir = workdir
        self.commands = commands or [[str(a) for a in p.args] for p in procs]

    def cli(self, *args: str, port: int | None = None) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(port or self.ports[0]), *args], capture_output=True, text=True, timeout=10
        )
        return out.stdout

    def flush(self) -> None:
        for port in self.ports:
            self.cli("FLUSHALL", port=port)

    def pause(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL every process, as a crash would: nothing is flushed on the way out. Files stay."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGKILL's exit otherwise
                proc.kill()
                proc.wait()

    def restart(self) -> None:
        """Kill, then start the same servers on the same ports and files; return once they answer."""
        self.kill()
        self.procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in self.commands]
        for port in self.ports:
            _await(lambda port=port: _answers(port), f"redis-server on port {port}")

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _spawn(port: int, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A server on `port` keeping its files in `workdir` under names of its own (a cluster's nodes share it).
    Later options override earlier ones: `extra` can turn AOF off or bind elsewhere."""
    files = ["--dir", str(workdir), "--logfile", f"redis-{port}.log", "--dbfilename", f"dump-{port}.rdb"]
    durable = ["--save", "", "--appendonly", "yes", "--appendfsync", "always", "--appenddirname", f"aof-{port}"]
    return subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", *files, *durable, *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _exited(proc: subprocess.Popen[bytes], port: int) -> bool:
    if proc.poll() is None:
        return False
    raise RuntimeError(f"redis-server on port {port} exited ({proc.returncode}): was the port taken meanwhile?")


def _await(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout} s")
        time.sleep(0.02)


def start_server(*extra: str) -> RedisServer:
    """One server; `extra` options go to redis-server (`"--appendonly", "no"` for Redis's defaults)."""
    if shutil.which("redis-server") is None:
        pytest.skip(MISSING)
    return _started_anew(lambda: _start_server(*extra))


def _start_server(*extra: str) -> RedisServer:
    workdir = Path(tempfile.mkdtemp(prefix="tvcache-redis-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    port = free_port()
    server = RedisServer(f"redis://127.0.0.1:{port}/0", [port], [_spawn(port, workdir, *extra)], workdir)
    try:
        _await(lambda: _answers(port) or _exited(server.procs[0], port), f"redis-server on port {port}")
    except BaseException:
        server.stop()
        raise
    return server


def start_cluster(nodes: int = 3) -> RedisServer:
    """A cluster of `nodes` primaries, no replicas: `redis-cli --cluster create` splits the slots."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip(MISSING)
    return _started_anew(lambda: _start_cluster(nodes))


def _start_cluster(nodes: int) -> RedisServer:
    workdir = Path(tempfile.mkdtemp(prefix="tvcache-cluster-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    ports = [free_port(cluster=True) for _ in range(nodes)]
    procs = [_spawn(p, workdir, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{p}.conf") for p in ports]
    server = RedisServer(f"redis+cluster://127.0.0.1:{ports[0]}", ports, procs, workdir)
    try:
        for p, proc in zip(ports, procs, strict=True):
            _await(lambda p=p, proc=proc: _answers(p) or _exited(proc, p), f"cluster node on port {p}")
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        for p in ports:
            _await(lambda p=p: "cluster_state:ok" in server.cli("CLUSTER", "INFO", port=p), "the cluster")
    except BaseException:
        server.stop()
        raise
    return server


# One server of each kind per session, however many test modules import these fixtures.
_started: dict[str, RedisServer] = {}


def _started_anew(start: Callable[[], RedisServer], attempts: int = 3) -> RedisServer:
    """`start()`, again on fresh ports if a server did not come up: a port found free may be taken before the
    server binds it (the other test worker starts servers too), and then the server exits at once."""
    for _ in range(attempts - 1):
        with contextlib.suppress(RuntimeError):
            return start()
    return start()


def _shared(kind: str, start: Callable[[], RedisServer]) -> Iterator[RedisServer]:
    server = _started.get(kind)
    if server is None:
        server = _started[kind] = start()
    try:
        yield server
    finally:
        with contextlib.suppress(KeyError):
            _started.pop(kind).stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    yield from _shared("server", start_server)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisServer]:
    yield from _shared("cluster", start_cluster)
