"""Who performs a sandbox's mounts, where they live, and how this process and its commands reach them.

Every command's jail (bubblewrap) reads the mount table of the namespace it starts from once per mount it
makes, so that table must stay small: a mount namespace holding every sandbox of a busy process (hundreds
of mounts) made each command several times slower. Hence:

- `PrivateMounter` (root): each sandbox gets a mount namespace of its own, a private copy of the host's,
  made by a worker thread (`unshare(CLONE_NEWNS)`) and kept alive by a descriptor. Its mounts exist only
  there; the host's table never sees them, and they vanish with the descriptor (also when this process dies).
  Mount operations run on a pool of worker threads, each of which enters the sandbox's namespace first; this
  process reaches the sandbox's files through a descriptor of its box directory opened in that namespace
  (`/proc/PID/fd/N/...`); its commands are spawned by such a thread, straight into its namespaces.
- `HelperMounter` (no root): a helper process in a user + mount namespace of its own (`unshare -Urm`)
  holds every sandbox's mounts, with `userxattr` overlays; this process reaches them through
  `/proc/<helper>/root`, and commands join the helper's namespaces with `nsenter`. The helper exits when its
  stdin closes, so a crashed parent leaves no mounts behind.

A `MountSpace` is where one sandbox's mounts live. Its mount operations (`overlay`, `bind`, `tmpfs`,
`detach`) take paths as they are in the space and may only be called inside `run()`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .. import _syscalls as sc
from ..base import SandboxError

__all__ = ["HelperMounter", "MountSpace", "Mounter", "PrivateMounter"]

T = TypeVar("T")
Spawn = Callable[..., subprocess.Popen[bytes]]


def _escape_option(path: str) -> str:
    # mount(2) option strings split on "," and overlay's lowerdir on ":"; both escape with a backslash.
    return path.replace("\\", "\\\\").replace(",", "\\,").replace(":", "\\:")


class _Ops:
    """The mount operations themselves: system calls, made in whatever mount namespace the caller is in."""

    def __init__(self, *, userxattr: bool):
        self.userxattr = userxattr
        self.new_api = True

    def overlay(self, target: str, lowers: list[str], upper: str, work: str) -> None:
        """Mount an overlay on `target`; `lowers` are topmost first."""
        # Layers never get redirect or metacopy xattrs, so a layer is plain files plus whiteouts and opaque
        # dirs (what _layers.merge understands); renaming a lower directory then copies it (EXDEV for mv).
        # xino: every entry shows its own layer's inode number (a directory too, where overlayfs would otherwise
        # number it from a counter of the mount's, in the order directories were looked up: not the same after a
        # restore); a lower file's is the base's, an upper one's the sandbox's tmpfs's (see _isolation._scramble).
        options: dict[str, str | None] = {"redirect_dir": "nofollow", "index": "off", "xino": "on"}
        if self.userxattr:
            options["userxattr"] = None
        else:
            options["metacopy"] = "off"
        if self.new_api:
            try:
                sc.overlay_mount(target, lowers, upper, work, options)
                return
            except sc.LowerdirPlusUnsupported:
                self.new_api = False
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
        """Mount a tmpfs of at most `size` bytes and `inodes` files on `target` (None: no such limit)."""
        sc.tmpfs_mount(target, size=size, inodes=inodes)

    def detach(self, target: str) -> None:
        """Lazily unmount `target` and everything mounted below it."""
        sc.umount(target, sc.MNT_DETACH)


class MountSpace(ABC):
    """Where one sandbox's mounts live (see the module docstring)."""

    def __init__(self, ops: _Ops, box: str):
        self._ops = ops
        self.box = box

    def overlay(self, target: str, lowers: list[str], upper: str, work: str) -> None:
        self._ops.overlay(target, lowers, upper, work)

    def bind(self, source: str, target: str, *, readonly: bool) -> None:
        self._ops.bind(source, target, readonly=readonly)

    def tmpfs(self, target: str, *, size: int | None, inodes: int | None) -> None:
        self._ops.tmpfs(target, size=size, inodes=inodes)

    def detach(self, target: str) -> None:
        self._ops.detach(target)

    @abstractmethod
    async def run(self, fn: Callable[[], T]) -> T:
        """Call `fn` where the mount operations work (and paths of the space mean what they say)."""

    @abstractmethod
    def view(self, path: str) -> str:
        """The path under which this process, and processes it starts, reach `path` (in the box) of the space."""

    @abstractmethod
    async def spawn(self, argv: Sequence[str | bytes], netns: str | None, **popen: Any) -> subprocess.Popen[bytes]:
        """Start `argv` in the space's mount namespace and in `netns` (None: the host's network)."""

    async def close(self) -> None:
        """Let the space go (its mounts with it, where it is a namespace of its own)."""
        return None


class Mounter(ABC):
    """Makes the mount spaces of one factory's sandboxes, and their network namespaces."""

    #: Overlays use user.overlay.* xattrs (required inside a user namespace) instead of trusted.overlay.*.
    userxattr: bool

    @property
    def opaque_xattr(self) -> str:
        return "user.overlay.opaque" if self.userxattr else "trusted.overlay.opaque"

    @abstractmethod
    async def space(self, box: Path) -> MountSpace:
        """A mount space for the sandbox whose files live under the existing directory `box`."""

    @abstractmethod
    def probe(self, probe_dir: Path, *, overlay: bool) -> None:
        """A test mount (an overlay, or a bind, of one file, on a tmpfs like every sandbox's upper dirs) under
        the new directory `probe_dir`; raises if it does not work here."""

    @abstractmethod
    def new_netns(self) -> str:
        """A new network namespace with loopback up, named by a path that `close_netns` takes."""

    @abstractmethod
    def close_netns(self, path: str) -> None: ...

    def close(self) -> None:
        return None


# -- root: a mount namespace per sandbox ------------------------------------------------------------------


@functools.cache
def _host_namespaces() -> tuple[int, int]:
    """Descriptors of this process's own mount and network namespaces, to which worker threads return."""
    return (
        os.open(f"/proc/{os.getpid()}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC),
        os.open(f"/proc/{os.getpid()}/ns/net", os.O_RDONLY | os.O_CLOEXEC),
    )


def _own_filesystem_attributes() -> None:
    # A thread may change mount namespaces only once it no longer shares its root and cwd with the others.
    sc.unshare(sc.CLONE_FS)


@functools.cache
def _workers() -> concurrent.futures.ThreadPoolExecutor:
    _host_namespaces()
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=4, thread_name_prefix="tvcache-mounts", initializer=_own_filesystem_attributes
    )


# A forked child has none of its parent's threads: the pool it inherited would take work and never run it.
os.register_at_fork(after_in_child=_workers.cache_clear)


class _PrivateSpace(MountSpace):
    """A mount namespace of one sandbox's own (see the module docstring)."""

    def __init__(self, ops: _Ops, box: str, mount_ns: int, box_fd: int, mounter: PrivateMounter):
        super().__init__(ops, box)
        self._ns = mount_ns
        self._box_fd = box_fd
        self._mounter = mounter
        self._closed = False
        # A space dropped unclosed (its factory collected) still lets its namespace, and its mounts, go.
        self._release = weakref.finalize(self, _close_all, box_fd, mount_ns)

    @classmethod
    async def create(cls, ops: _Ops, box: Path, mounter: PrivateMounter) -> _PrivateSpace:
        def make() -> tuple[int, int]:
            sc.setns(_host_namespaces()[0], sc.CLONE_NEWNS)
            sc.unshare(sc.CLONE_NEWNS)
            # Nothing mounted here reaches the host, and nothing the host mounts later shows up here.
            sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
            ns = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            return ns, os.open(box, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

        ns, box_fd = await asyncio.get_running_loop().run_in_executor(_workers(), make)
        return cls(ops, str(box), ns, box_fd, mounter)

    def _inside(self, fn: Callable[[], T]) -> T:
        if self._closed:
            raise SandboxError("the sandbox's mounts are gone")
        sc.setns(self._ns, sc.CLONE_NEWNS)
        return fn()

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(_workers(), self._inside, fn)

    def view(self, path: str) -> str:
        rel = os.path.relpath(path, self.box)
        if rel.startswith(".."):
            raise ValueError(f"{path} is not in the sandbox's box {self.box}")
        here = f"/proc/{os.getpid()}/fd/{self._box_fd}"
        return here if rel == "." else f"{here}/{rel}"

    async def spawn(self, argv: Sequence[str | bytes], netns: str | None, **popen: Any) -> subprocess.Popen[bytes]:
        net = _host_namespaces()[1] if netns is None else self._mounter.netns_fd(netns)

        def start() -> subprocess.Popen[bytes]:
            sc.setns(net, sc.CLONE_NEWNET)
            return subprocess.Popen(argv, **popen)

        return await self.run(start)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            # The last reference to the namespace: the kernel unmounts everything in it (which can wait on RCU).
            await asyncio.to_thread(self._release)


def _close_all(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


class PrivateMounter(Mounter):
    def __init__(self) -> None:
        self.userxattr = False
        self._ops = _Ops(userxattr=False)
        self._netns: dict[str, int] = {}

    async def space(self, box: Path) -> MountSpace:
        return await _PrivateSpace.create(self._ops, box, self)

    def probe(self, probe_dir: Path, *, overlay: bool) -> None:
        def in_a_new_namespace() -> None:
            sc.setns(_host_namespaces()[0], sc.CLONE_NEWNS)
            sc.unshare(sc.CLONE_NEWNS)
            try:
                sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
                _probe(self._ops, probe_dir, overlay=overlay, view=lambda path: path)
            finally:
                sc.setns(_host_namespaces()[0], sc.CLONE_NEWNS)  # the namespace and its mounts are gone

        _workers().submit(in_a_new_namespace).result()

    def new_netns(self) -> str:
        fd = sc.new_netns()
        path = f"/proc/{os.getpid()}/fd/{fd}"
        self._netns[path] = fd
        return path

    def netns_fd(self, path: str) -> int:
        return self._netns[path]

    def close_netns(self, path: str) -> None:
        fd = self._netns.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for path in list(self._netns):
            self.close_netns(path)


# -- no root: one helper process in a user namespace -------------------------------------------------------


class _HelperSpace(MountSpace):
    """A sandbox's corner of the helper's namespace: operations go to the helper, files through its root."""

    def __init__(self, mounter: HelperMounter, box: str):
        super().__init__(_Ops(userxattr=True), box)
        self._mounter = mounter

    def overlay(self, target: str, lowers: list[str], upper: str, work: str) -> None:
        self._mounter.request(["overlay", target, lowers, upper, work])

    def bind(self, source: str, target: str, *, readonly: bool) -> None:
        self._mounter.request(["bind", source, target, readonly])

    def tmpfs(self, target: str, *, size: int | None, inodes: int | None) -> None:
        self._mounter.request(["tmpfs", target, size, inodes])

    def detach(self, target: str) -> None:
        self._mounter.request(["detach", target])

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.to_thread(fn)

    def view(self, path: str) -> str:
        return self._mounter.view(path)

    async def spawn(self, argv: Sequence[str | bytes], netns: str | None, **popen: Any) -> subprocess.Popen[bytes]:
        enter = ["nsenter", f"--target={self._mounter.pid}", "--user", "--mount", "--preserve-credentials"]
        argv = [*enter, *([f"--net={netns}"] if netns else []), "--", *argv]
        return subprocess.Popen(argv, **popen)  # noqa: ASYNC220 - a vfork+exec, cheaper than asyncio's machinery


class HelperMounter(Mounter):
    """Mounts made by a helper process living in a user + mount namespace of its own."""

    userxattr = True

    def __init__(self) -> None:
        src = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        try:
            self._proc = subprocess.Popen(
                [
                    *("unshare", "--user", "--map-root-user", "--mount", "--propagation=private", "--"),
                    # -c, not -m: the workspace package imports this module, and runpy warns of running it twice
                    *(sys.executable, "-c", "from tvcache.sandboxes.workspace._mounts import _serve; _serve()"),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
        except OSError as exc:
            raise SandboxError(f"cannot start the user-namespace mount helper: {exc}") from exc
        self._lock = threading.Lock()
        self.request(["ping"])

    @property
    def pid(self) -> int:
        return self._proc.pid

    def request(self, message: list[Any]) -> Any:
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

    async def space(self, box: Path) -> MountSpace:
        return _HelperSpace(self, str(box))

    def probe(self, probe_dir: Path, *, overlay: bool) -> None:
        _probe(_HelperSpace(self, str(probe_dir)), probe_dir, overlay=overlay, view=self.view)

    def view(self, path: str) -> str:
        return f"/proc/{self._proc.pid}/root{path}"

    def new_netns(self) -> str:
        return f"/proc/{self._proc.pid}/fd/{int(self.request(['netns']))}"

    def close_netns(self, path: str) -> None:
        self.request(["close_netns", path])

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


def _probe(ops: _Ops | MountSpace, probe_dir: Path, *, overlay: bool, view: Callable[[str], str]) -> None:
    probe_dir.mkdir()
    try:
        for sub in ("lower", "scratch", "merged"):
            (probe_dir / sub).mkdir()
        (probe_dir / "lower" / "f").write_text("x")
        scratch, target = str(probe_dir / "scratch"), str(probe_dir / "merged")
        ops.tmpfs(scratch, size=1 << 20, inodes=64)
        try:
            if overlay:
                for sub in ("upper", "work"):
                    os.mkdir(view(f"{scratch}/{sub}"))
                ops.overlay(target, [str(probe_dir / "lower")], f"{scratch}/upper", f"{scratch}/work")
            else:
                ops.bind(str(probe_dir / "lower"), target, readonly=True)
            try:
                if not os.path.exists(view(target + "/f")):
                    raise SandboxError("a test mount did not show its files")
            finally:
                ops.detach(target)
        finally:
            ops.detach(scratch)
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)


def _serve() -> None:
    """The helper's loop: one JSON request per line on stdin, one JSON reply ({"ok": ...} or {"error": ...})."""
    ops = _Ops(userxattr=True)
    netns: dict[int, int] = {}
    for line in sys.stdin.buffer:
        op, *args = json.loads(line)
        reply: dict[str, Any] = {"ok": None}
        try:
            if op == "overlay":
                ops.overlay(*args)
            elif op == "bind":
                ops.bind(args[0], args[1], readonly=args[2])
            elif op == "tmpfs":
                ops.tmpfs(args[0], size=args[1], inodes=args[2])
            elif op == "detach":
                ops.detach(args[0])
            elif op == "netns":
                fd = sc.new_netns()
                netns[fd] = fd
                reply = {"ok": fd}
            elif op == "close_netns":
                fd = int(args[0].rsplit("/", 1)[1])
                if netns.pop(fd, None) is not None:
                    os.close(fd)
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
