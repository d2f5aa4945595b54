"""Who performs the mounts, and where they live.

- `HostMounter`: this process, as root, in its own mount namespace (kernel overlayfs with trusted xattrs).
- `NamespaceMounter`: a helper process started in a new user + mount namespace (`unshare -Urm`), for callers
  without CAP_SYS_ADMIN; its overlays use `userxattr`. The mounts exist only in the helper's namespace: this
  process reaches them through `/proc/<helper>/root`, and commands join it with `nsenter`. The helper exits
  when its stdin closes, so a crashed parent leaves no mounts behind.

Both offer the same few operations. They are synchronous: each is a system call or two (well under a
millisecond), cheaper than a hop to a thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from . import _syscalls as sc
from .base import SandboxError

__all__ = ["HostMounter", "Mounter", "NamespaceMounter"]


def _escape_option(path: str) -> str:
    # mount(2) option strings split on "," and overlay's lowerdir on ":"; both escape with a backslash.
    return path.replace("\\", "\\\\").replace(",", "\\,").replace(":", "\\:")


class Mounter(ABC):
    #: Overlays use user.overlay.* xattrs (required inside a user namespace) instead of trusted.overlay.*.
    userxattr: bool

    @property
    def opaque_xattr(self) -> str:
        return "user.overlay.opaque" if self.userxattr else "trusted.overlay.opaque"

    @abstractmethod
    def overlay(self, target: str, lowers: list[str], upper: str, work: str) -> None:
        """Mount an overlay on `target`; `lowers` are topmost first."""

    @abstractmethod
    def bind(self, source: str, target: str, *, readonly: bool) -> None: ...

    @abstractmethod
    def tmpfs(self, target: str, *, size: int | None, inodes: int | None) -> None:
        """Mount a tmpfs of at most `size` bytes and `inodes` files on `target` (None: no such limit)."""

    @abstractmethod
    def detach(self, target: str) -> None:
        """Lazily unmount `target` and everything mounted below it."""

    @abstractmethod
    def new_netns(self) -> str:
        """A new network namespace with loopback up, as a path `nsenter --net=` accepts."""

    @abstractmethod
    def close_netns(self, path: str) -> None: ...

    @abstractmethod
    def enter(self, netns: str | None) -> tuple[list[str], int | None]:
        """How a command starts in the namespace holding the mounts and in `netns`: an argv prefix, and a
        network namespace descriptor to spawn it from (see `_syscalls.spawning_in`), one or the other."""

    @abstractmethod
    def view(self, path: str) -> str:
        """The path under which this process sees `path` of the mounts' namespace."""

    def close(self) -> None:
        return None


class HostMounter(Mounter):
    def __init__(self, *, userxattr: bool = False):
        self.userxattr = userxattr
        self._new_api = True
        self._netns: dict[str, int] = {}

    def overlay(self, target: str, lowers: list[str], upper: str, work: str) -> None:
        # Layers never get redirect or metacopy xattrs, so a layer is plain files plus whiteouts and opaque
        # dirs (what _layers.merge understands); renaming a lower directory then copies it (EXDEV for mv).
        options: dict[str, str | None] = {"redirect_dir": "nofollow", "index": "off"}
        if self.userxattr:
            options["userxattr"] = None
        else:
            options["metacopy"] = "off"
        if self._new_api:
            try:
                sc.overlay_mount(target, lowers, upper, work, options)
                return
            except sc.LowerdirPlusUnsupported:
                self._new_api = False
        data = ",".join(
            [
                "lowerdir=" + ":".join(_escape_option(p) for p in lowers),
                "upperdir=" + _escape_option(upper),
                "workdir=" + _escape_option(work),
                *(k if v is None else f"{k}={v}" for k, v in options.items()),
            ]
        )
        if len(data) >= 4096:
            raise SandboxError(f"overlay options for {target} exceed mount(2)'s 4 KiB page; merge layers sooner")
        sc.mount("overlay", target, "overlay", sc.MS_NOSUID | sc.MS_NODEV, data)

    def bind(self, source: str, target: str, *, readonly: bool) -> None:
        sc.bind_mount(source, target, readonly=readonly)

    def tmpfs(self, target: str, *, size: int | None, inodes: int | None) -> None:
        sc.tmpfs_mount(target, size=size, inodes=inodes)

    def detach(self, target: str) -> None:
        sc.umount(target, sc.MNT_DETACH)

    def new_netns(self) -> str:
        fd = sc.new_netns()
        path = f"/proc/{os.getpid()}/fd/{fd}"
        self._netns[path] = fd
        return path

    def close_netns(self, path: str) -> None:
        fd = self._netns.pop(path, None)
        if fd is not None:
            os.close(fd)

    def enter(self, netns: str | None) -> tuple[list[str], int | None]:
        # Spawned straight into the network namespace: an nsenter would cost a process more per command.
        return [], None if netns is None else self._netns[netns]

    def view(self, path: str) -> str:
        return path

    def close(self) -> None:
        for path in list(self._netns):
            self.close_netns(path)


class NamespaceMounter(Mounter):
    """Mounts made by a helper process living in a user + mount namespace of its own."""

    userxattr = True

    def __init__(self) -> None:
        src = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        try:
            self._proc = subprocess.Popen(
                [
                    *("unshare", "--user", "--map-root-user", "--mount", "--propagation=private", "--"),
                    *(sys.executable, "-m", "tvcache.sandboxes._mounts"),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
        except OSError as exc:
            raise SandboxError(f"cannot start the user-namespace mount helper: {exc}") from exc
        self._lock = threading.Lock()
        self._request(["ping"])

    def _request(self, message: list[Any]) -> Any:
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            try:
                self._proc.stdin.write(json.dumps(message).encode() + b"\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
            except OSError:
                line = b""
            if not line:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise SandboxError(f"the user-namespace mount helper died: {err.strip() or 'no message'}")
        reply = json.loads(line)
        if "error" in reply:
            raise OSError(*reply["error"])
        return reply["ok"]

    def overlay(self, target: str, lowers: list[str], upper: str, work: str) -> None:
        self._request(["overlay", target, lowers, upper, work])

    def bind(self, source: str, target: str, *, readonly: bool) -> None:
        self._request(["bind", source, target, readonly])

    def tmpfs(self, target: str, *, size: int | None, inodes: int | None) -> None:
        self._request(["tmpfs", target, size, inodes])

    def detach(self, target: str) -> None:
        self._request(["detach", target])

    def new_netns(self) -> str:
        return f"/proc/{self._proc.pid}/fd/{int(self._request(['netns']))}"

    def close_netns(self, path: str) -> None:
        self._request(["close_netns", path])

    def enter(self, netns: str | None) -> tuple[list[str], int | None]:
        enter = ["nsenter", f"--target={self._proc.pid}", "--user", "--mount", "--preserve-credentials"]
        return [*enter, *([f"--net={netns}"] if netns else []), "--"], None

    def view(self, path: str) -> str:
        return f"/proc/{self._proc.pid}/root{path}"

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()


def _serve() -> None:
    """The helper's loop: one JSON request per line on stdin, one JSON reply ({"ok": ...} or {"error": ...})."""
    mounter = HostMounter(userxattr=True)
    for line in sys.stdin.buffer:
        op, *args = json.loads(line)
        reply: dict[str, Any] = {"ok": None}
        try:
            if op == "overlay":
                mounter.overlay(*args)
            elif op == "bind":
                mounter.bind(args[0], args[1], readonly=args[2])
            elif op == "tmpfs":
                mounter.tmpfs(args[0], size=args[1], inodes=args[2])
            elif op == "detach":
                mounter.detach(args[0])
            elif op == "netns":
                reply = {"ok": int(mounter.new_netns().rsplit("/", 1)[1])}
            elif op == "close_netns":
                mounter.close_netns(f"/proc/{os.getpid()}/fd/" + args[0].rsplit("/", 1)[1])
            elif op != "ping":
                reply = {"error": [22, f"unknown operation {op!r}"]}
        except OSError as exc:
            reply = {"error": [exc.errno or 5, str(exc)]}
        except SandboxError as exc:
            reply = {"error": [5, str(exc)]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
