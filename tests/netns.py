"""Hosts on one machine for tests: network namespaces on one bridge, each reached only over its veth pair.

    with Network(["sandbox-1", "sandbox-2", "redis", "worker-1", "worker-2"]) as net:
        net.address("redis")                       # 10.231.0.3: the third host's address
        net.spawn("worker-1", [sys.executable, "worker.py"], stdout=subprocess.PIPE)

The bridge lives in a namespace of its own, so the hosts share a private network (10.231.0.0/24, with only
loopback besides) that neither the machine's own network nor any other test's can see: two runs at once do
not collide, since only the namespace names differ. Needs root and iproute2; `Network.check()` says why not.
Everything is torn down on exit: the processes started in the namespaces (killed), then the namespaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["Network"]

SUBNET = "10.231.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Network:
    def __init__(self, hosts: Sequence[str]):
        self.tag = f"tvc{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.hosts = list(hosts)
        self.procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []

    @staticmethod
    def check() -> str | None:
        """Why namespaces cannot be made here, or None if they can."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "iproute2 (ip) is not installed"
        return None

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{self.hosts.index(host)}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program on `host`."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def spawn(self, host: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """A process on `host`; killed when the network is torn down, if it is still running."""
        proc = subprocess.Popen([*self.prefix(host), *argv], **popen)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Network:
        try:
            hub = f"{self.tag}-hub"
            self._add_namespace(hub)
            _ip("-n", hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", hub, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                ns = self.namespace(host)
                self._add_namespace(ns)
                # One end in the host, the other on the bridge; interface names are per namespace.
                _ip("link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", hub)
                _ip("-n", hub, "link", "set", f"p{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()
