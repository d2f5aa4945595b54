"""Workspace sandboxes: a directory tree plus a shell, forked in about a millisecond with overlayfs.

    boxes = WorkspaceSandboxes("path/to/task")          # the task appears at /testbed, the host's / below
    box = await boxes.create()
    await box.execute(ToolCall("bash", {"command": "cd /testbed && make test"}))
    snap = await box.snapshot()                         # freezes the diff into a shared read-only layer
    other = await boxes.restore(snap)                   # a new upper dir over the same layers

**Filesystem.** A sandbox's root is overlayfs: read-only lower layers (the system root, by default the host's
`/`, and the workspace directories at their mount points) under private upper dirs on a tmpfs of the
sandbox's own (its disk quota). `snapshot()` copies the upper dirs into a new read-only layer and the sandbox goes
on in them: after the first, only the entries changed since the snapshot before, as a delta on it (see _deltas);
`restore()` copies a snapshot's layers into the upper dirs of a fresh tmpfs. Files thus stay in the layer where
the uncached history put them, which commands can see (see _isolation). Layers are reference-counted (snapshots and
live sandboxes hold them). See _isolation for the three isolation modes.

**Tools.** Every call returns a JSON-able dict:

- `bash {"command"}` -> `{"output": str, "exit_code": int}`. stdout and stderr are interleaved as they were
  written; beyond `max_output` bytes the middle is replaced by a line `[... N bytes of output omitted ...]`.
  Each command runs in a fresh bash in a jail (see _jail): new PID, mount, IPC, UTS and (unless
  `network=True`) network namespaces, the sandbox's root as `/`, Docker's /proc protections, default
  capabilities and seccomp filter. The working directory and exported variables carry over to the next
  command and into snapshots (shell functions, options and unexported variables do not, as with a new
  terminal).
- `read_file {"path"}` -> `{"content"}`, `write_file {"path", "content"}` -> `{"written"}` (parents are
  created), `list_dir {"path"}` -> `{"entries"}` (sorted, directories end in "/"); failures give `{"error"}`.
  These run in this process through the mounted root: microseconds instead of a process. They touch only
  regular files and directories.

**Failures** are `Outcome(error=True)`, never cached: a timeout (which kills the command's whole PID
namespace), a command that hit the sandbox's memory limit (an OOM kill), its process limit (a refused fork)
or filled its disk quota, and a command the machinery could not start.

**Change detection.** `Outcome.changed` is False when the kernel reported no change to the sandbox's files
during the call (fanotify on the tmpfs the sandbox writes into, see _changes: O(changes), not O(files)) and
the working directory and exports are unchanged. Where fanotify is unavailable (no root), the files' listing
(path, inode, size, mtime, ctime, mode) is compared instead, which walks them.

**The system root.** Workspace directories are rarely complete root filesystems, so by default the host's
`/` lies beneath them, read-only: bash, Python and the rest of the machine's tools work inside, writes to them
land in the sandbox's upper dir (`pip install` works), and the host never changes. Sandboxes can therefore
read what the host's root filesystem holds (not its other mounts such as /dev/shm or /home; /tmp and /run
start empty). Pass `system=` another directory (a prepared rootfs), or map "/" in `base`, to use your own.

**Limits.** As with Docker's overlay2 driver: renaming a directory that comes from a lower layer copies it
(`mv` falls back on EXDEV), and a hard link between files of a lower layer is broken when one of them is
written after a snapshot (overlayfs without its `index` feature copies up one name, not the inode).

**Fingerprint.** A hash of the layout (mount points, options that shape outputs, limits) and, for every lower
directory but the host's `/`, a listing of its tree: relative paths, types, modes, owners, sizes, mtimes and
symlink targets, not file contents (see `_layers.listing_digest`). The host's `/` counts by its
/etc/os-release only. Computed once per factory, on first use.

**Shell state.** Captured by an EXIT trap: a command that replaces the shell (`exec prog`) or sets its own
EXIT trap leaves the working directory and exports as they were before it.

**Cleanup.** Closing a sandbox unmounts and removes its upper dirs and cgroups; closing the factory removes
everything it created. All of it lives in a run directory per process, `<tmp>/tvcache-workspace/run-<pid>-*`,
which the next factory reaps (unmounting what is left) when its process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from ...calls import ToolCall
from .. import _fastpaths as fast
from .. import _syscalls as sc
from .._cgroup2 import frozen
from .._layers import listing_digest
from .._shell import CommandResult, ShellState, run_bash, unfinished
from ..base import Outcome, SandboxError, settled
from ..lifecycle import ManagedSandbox, ManagedSandboxes
from . import _ebpf, _isolation, _reads, _writes
from ._cgroups import Cgroups, SandboxCgroup
from ._changes import Batch, Watcher
from ._isolation import Snapshot
from ._jail import Jail, find_bwrap
from ._mounts import Mounter
from ._rundir import RunDir
from ._seccomp import bpf_program
from ._tracing_plan import TracingPlan

__all__ = ["DEFAULT_ENV", "TOOLS", "Isolation", "WorkspaceSandbox", "WorkspaceSandboxes"]

log = logging.getLogger("tvcache")

Isolation = Literal["auto", "overlay", "userns", "copy"]
PathLike = str | os.PathLike[str]
BaseSpec = PathLike | Sequence[PathLike] | Mapping[str, PathLike | Sequence[PathLike]]

TOOLS = fast.TOOLS
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}
GiB = 1 << 30
_FINGERPRINT_VERSION = "tvcache-workspace/2"
#: Filesystems that are views of the kernel, not trees of files: never a workspace.
_PSEUDO_FILESYSTEMS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs"}


def _filesystem_types() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, deepest last."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            found.append((fields[4].encode().decode("unicode_escape"), fields[fields.index("-") + 1]))
    return found


def _fstype(path: str, mounts: list[tuple[str, str]]) -> str:
    best = ("", "")
    for point, fstype in mounts:
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, fstype)
    return best[1]


def _normalize_base(base: BaseSpec, workdir: str) -> dict[str, tuple[str, ...]]:
    """{mount point: (host directories, bottom first)}, each directory checked."""
    mounts = _filesystem_types()

    def dirs(value: PathLike | Sequence[PathLike]) -> tuple[str, ...]:
        items = [value] if isinstance(value, str | os.PathLike) else list(value)
        if not items:
            raise ValueError("a workspace mount needs at least one directory")
        out = []
        for item in items:
            if not isinstance(item, str | os.PathLike):
                raise TypeError(f"a workspace directory must be a path, got {type(item).__name__}")
            path = os.path.realpath(item)
            if not os.path.isdir(path):
                raise ValueError(f"workspace directory {os.fspath(item)!r} does not exist or is not a directory")
            fstype = _fstype(path, mounts)
            if fstype in _PSEUDO_FILESYSTEMS:
                raise ValueError(
                    f"workspace directory {os.fspath(item)!r} is on a pseudo filesystem ({fstype}), not a tree of "
                    "files a sandbox could start from"
                )
            out.append(path)
        return tuple(out)

    if isinstance(base, Mapping):
        spec = dict(base)
        if not spec:
            raise ValueError("base maps no directories")
    elif isinstance(base, str | os.PathLike | Sequence):
        spec = {workdir: base}
    else:
        raise TypeError(f"base must be a path, a list of paths or a mapping, got {type(base).__name__}")
    out = {}
    for point, value in spec.items():
        if not isinstance(point, str) or not (
            point == "/" or (point.startswith("/") and os.path.normpath(point) == point)
        ):
            raise ValueError(f"mount points must be absolute, normalized paths like '/testbed', got {point!r}")
        if point.split("/")[1:2] and point.split("/")[1] in ("proc", "sys", "dev", "tmp", "run"):
            raise ValueError(f"cannot mount a workspace at {point}: the sandbox manages /proc, /sys, /dev, /tmp, /run")
        out[point] = dirs(value)
    return out


def _check_size(name: str, value: int | None, least: int) -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        raise ValueError(f"{name} must be None or an int >= {least}, got {value!r}")


@dataclass(frozen=True, slots=True)
class _Shared:
    """What every sandbox of a factory shares: how its root is made and how its commands run."""

    isolation: _isolation.Isolation
    jail: Jail
    cgroups: Cgroups
    seccomp_fd: int | None
    env: dict[str, str]
    network: bool
    timeout: float
    max_output: int
    memory: int | None
    max_processes: int | None
    boxes: Path

    @property
    def mounter(self) -> Mounter:
        return self.isolation.mounter


class WorkspaceSandboxes(ManagedSandboxes["WorkspaceSandbox", Snapshot]):
    """A factory of workspace sandboxes over one base; see the module docstring.

    - `base`: the workspace: a directory (mounted at `workdir`), a list of directories (stacked there, later
      ones on top), or a mapping {mount point: directory or list}. Mapping "/" replaces the system root
      (e.g. an image's layer directories, bottom first).
    - `system`: the root filesystem beneath the workspace (default: the host's `/`).
    - `tmp`: where upper dirs, layers and copies live; a tmpfs (default /dev/shm), which alone keeps a
      directory's listing order through a copy.
    - `network`: False gives every command a private network namespace with only loopback.
    - `timeout`: seconds per tool call; `max_output`: bytes of output kept per call.
    - `cwd`: the shell's initial directory (default: the first workspace mount point); `env`: its initial
      exported environment (default: a minimal PATH, HOME, LANG and TERM).
    - `memory`: bytes a sandbox may use (default 2 GiB): its processes, and the files it wrote itself, which live
      in RAM (a cgroup; an OOM kill is a failed call).
    - `disk`: bytes of files a sandbox may write (default 1 GiB; one file per KiB of it): the size of the
      tmpfs its upper dirs live on. A call that ends with it full is a failed call.
    - `max_processes`: processes and threads a sandbox may run at once (default 1,024; a cgroup; a refused
      fork is a failed call).
    - `read_sets`: trace what each call reads and record what it writes (`Outcome.reads`, `Outcome.writes`),
      for reuse by what a call read; needs strace in the sandbox's root (see _reads). Off by default.

    None lifts a limit. Together, all sandboxes on the machine use at most 3/4 of its memory and half its
    process ids (a shared cgroup), so 64 sandboxes at their limits at once leave the host working. A limit
    this machine cannot enforce (no root, no cgroup controller, no libseccomp) is listed in `degraded` and
    logged once.
    """

    #: Trace reads with eBPF where it works (see _ebpf), else with strace; the benchmark turns it off to compare.
    _use_ebpf = True

    kind = "ws"

    def __init__(
        self,
        base: BaseSpec,
        *,
        tmp: PathLike | None = None,
        network: bool = False,
        timeout: float = 120.0,
        isolation: Isolation = "auto",
        workdir: str = "/testbed",
        system: PathLike = "/",
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output: int = 1 << 16,
        max_processes: int | None = 1024,
        memory: int | None = 2 * GiB,
        disk: int | None = 1 * GiB,
        read_sets: bool = False,
    ):
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not (isinstance(max_output, int) and max_output >= 64):
            raise ValueError(f"max_output must be an int >= 64, got {max_output!r}")
        _check_size("max_processes", max_processes, 8)
        _check_size("memory", memory, 16 << 20)
        _check_size("disk", disk, 1 << 20)
        self.workspace = _normalize_base(base, workdir)
        self.system = None if "/" in self.workspace else os.path.realpath(system)
        if self.system is not None and not os.path.isfile(os.path.join(self.system, "bin/sh")):
            raise ValueError(f"system root {system!r} has no /bin/sh: pass a root filesystem, e.g. '/'")
        self.network = network
        self.timeout = float(timeout)
        self.max_output = max_output
        self.max_processes = max_processes
        self.memory = memory
        self.disk = disk
        self.env = dict(DEFAULT_ENV if env is None else env)
        points = [p for p in self.workspace if p != "/"]
        self.cwd = cwd if cwd is not None else (points[0] if points else "/")
        tmp_path = Path(tmp if tmp is not None else "/dev/shm")
        if not tmp_path.is_dir():
            raise ValueError(f"tmp directory {os.fspath(tmp_path)!r} does not exist")
        if sc.filesystem_type(os.fspath(tmp_path)) != sc.TMPFS_MAGIC:
            # Layers and copies are made in the reverse of the order tmpfs lists a directory in, so that a restored
            # directory lists as the sandbox's did; another filesystem lists in an order of its own (ext4: by a
            # hash of the names), and a restore would print another listing order than the uncached run.
            raise ValueError(
                f"tmp {os.fspath(tmp_path)!r} is not on a tmpfs: snapshots live there, and only tmpfs keeps the "
                "order a directory lists in through a copy; pick one (the default /dev/shm is), or mount a tmpfs "
                "of the size you need (mount -t tmpfs -o size=20g tmpfs DIR)"
            )
        find_bwrap()

        super().__init__()
        self._run = RunDir(tmp_path.resolve())
        self._cleanup_with(_cleanup, self._run, None)
        try:
            iso = _isolation.choose(isolation, self._run.path, self.workspace, self.system, disk=disk)
            self._cleanup_with(_cleanup, self._run, iso.mounter, iso.changes)
            if iso.mode != "copy":
                self._check_tmp(iso, tmp_path.resolve())
            cgroups = Cgroups(self._run.name)
            self._run.record_cgroups(cgroups.run_dirs)
            empty = self._run.path / "empty"
            empty.touch(mode=0o444)
            jail = Jail(str(empty))
        except BaseException:
            _cleanup(self._run, None)
            raise
        self.mode = iso.mode
        seccomp_fd, no_seccomp = bpf_program()
        self.degraded = _degraded(cgroups, no_seccomp, memory=memory, processes=max_processes)
        boxes = self._run.path / "boxes"
        boxes.mkdir()
        self._ctx = _Shared(
            isolation=iso,
            jail=jail,
            cgroups=cgroups,
            seccomp_fd=seccomp_fd,
            env=self.env,
            network=network,
            timeout=self.timeout,
            max_output=max_output,
            memory=None if "memory" in self.degraded else memory,
            max_processes=None if "processes" in self.degraded else max_processes,
            boxes=boxes,
        )
        self._counter = itertools.count()
        self._initial: Snapshot | None = None
        self._setup_lock = asyncio.Lock()
        self._fingerprint: str | None = None
        self.read_sets = read_sets
        #: strace and bash inside the sandbox root, found on first use when read_sets is on (None: untraced).
        self._tracer: tuple[str, str] | None = None
        #: The eBPF tracer, used instead of strace where it works (see _ebpf).
        self._ebpf: _ebpf.Tracer | None = None
        self._ebpf_release: Callable[[], object] = lambda: None
        #: Which commands the eBPF tracer watches (strace traces all: an untraced command's PIDs would differ).
        self._plan = TracingPlan()
        self._digest_cache: dict[tuple[int, ...], str] = {}
        self._base_box: WorkspaceSandbox | None = None
        self._base_lock = asyncio.Lock()
        self._base_keys: dict[str, str] = {}

    @staticmethod
    def _check_tmp(iso: _isolation.Isolation, tmp: Path) -> None:
        dev = tmp.stat().st_dev
        for lower in {d for mnt in iso.layout.overlays for d in mnt.lowers}:
            if (str(tmp) + "/").startswith(lower.rstrip("/") + "/") and os.stat(lower).st_dev == dev:
                raise ValueError(
                    f"tmp {str(tmp)!r} lies inside the lower layer {lower!r} on the same filesystem, which "
                    "overlayfs refuses: pick a tmp on another filesystem (the default /dev/shm usually is)"
                )

    # -- the Sandboxes protocol --------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(_FINGERPRINT_VERSION.encode())
            options = (sorted(self.env.items()), self.cwd, self.network, self.max_output)
            h.update(repr((*options, self.memory, self.disk, self.max_processes)).encode())
            if self.read_sets:  # traced commands' children get other PIDs (see _reads)
                h.update(b"\0read-sets")
            for point, dirs in sorted(self.workspace.items()):
                h.update(f"\0mount\0{point}\0{listing_digest(dirs)}".encode())
            if self.system == "/":
                try:
                    h.update(b"\0host-root\0" + Path("/etc/os-release").read_bytes())
                except OSError:
                    h.update(b"\0host-root\0")
            elif self.system is not None:
                h.update(f"\0system\0{listing_digest([self.system])}".encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    async def create(self) -> WorkspaceSandbox:
        self._check_open()
        return await self._open(await self._initial_snapshot())

    async def restore(self, snapshot_id: str) -> WorkspaceSandbox:
        return await self._open(self._lookup(snapshot_id))

    async def delete(self, snapshot_id: str) -> None:
        snap = self._forget(snapshot_id)
        if snap is not None:
            await self._ctx.isolation.remove(self._ctx.isolation.release(snap))

    async def _close(self) -> None:
        self._ebpf = None
        await asyncio.to_thread(self._ebpf_release)  # the last holder's detaches the tracer (joins its thread)

    @classmethod
    async def from_image(cls, image: str | os.PathLike[str], **options: Any) -> WorkspaceSandboxes:
        """Sandboxes whose root filesystem is a Docker or OCI image's own layers, started with its Env and
        WorkingDir; `options` as for the constructor. See images.py."""
        from ..images import workspace_from_image

        return await workspace_from_image(image, **options)

    def __repr__(self) -> str:
        return f"WorkspaceSandboxes({self.workspace!r}, mode={self.mode!r})"

    @property
    def layer_count(self) -> int:
        layers = getattr(self._ctx.isolation, "layers", None)
        return 0 if layers is None else len(layers)

    @property
    def _mounter(self) -> Mounter:
        return self._ctx.mounter

    # -- internals -------------------------------------------------------------------------------------

    async def _initial_snapshot(self) -> Snapshot:
        """First use: the isolation's starting files, and the initial shell state learnt from a sandbox."""
        async with self._setup_lock:
            if self._initial is None:
                start = await self._ctx.isolation.prepare()
                # `export -p` in bash's own words, so a later read-only command compares equal to it.
                box = await self._open(replace(start, state=ShellState(cwd=os.fsencode(self.cwd))))
                try:
                    result = await box._run(":")
                    if not result.started or result.exit_code != 0 or result.state.exports is None:
                        raise SandboxError(f"a first command in a new sandbox failed: {result.output.strip()!r}")
                    if self.read_sets:
                        self._tracer = await self._probe_tracer(box)
                finally:
                    await box.close()
                self._initial = replace(start, state=result.state)
            return self._initial

    async def _probe_tracer(self, box: WorkspaceSandbox) -> tuple[str, str] | None:
        """The eBPF tracer if it works here (then None), else strace and bash in the sandbox's root, if a traced
        command works there; else None, listed in `degraded` and logged once."""
        core = box._cgroup.core if box._cgroup is not None else None
        if self._use_ebpf and _ebpf.available() and core is not None:
            try:
                self._ebpf = await asyncio.to_thread(_ebpf.hold)
                # Given back when the factory closes or is collected, so that its programs leave the machine.
                self._ebpf_release = weakref.finalize(self, _ebpf.release, self._ebpf)
                if (await settled(await box.execute(ToolCall("bash", {"command": ":"})))).reads is not None:
                    return None
            except OSError as exc:
                log.debug("no eBPF tracer: %s", exc)
            self._ebpf = None
            self._ebpf_release()
        found = await asyncio.to_thread(_reads.find_strace, box.root)
        why = "no strace in the sandbox's root (apt-get install strace)"
        if found is not None:
            self._tracer = found
            result = await box._run(":")
            trace = _reads.parse_trace(result.trace) if result.trace is not None else None
            if result.exit_code == 0 and trace is not None and trace.complete:
                return found
            why = f"a traced command failed here: {result.output.strip()[-500:]!r}"
        self.degraded = {**self.degraded, "read_sets": why}
        _degraded_once("read sets", why)
        return None

    async def base_digests(self, keys: Collection[str]) -> Mapping[str, str]:
        """The digests of state keys (see _reads) in the starting state, read from an idle sandbox that never
        runs a command; cached per factory."""
        missing = [k for k in keys if k not in self._base_keys]
        if missing:
            snap = await self._initial_snapshot()
            for key in missing:
                if key == "shell:":
                    self._base_keys[key] = _reads.shell_digest(snap.state)
            files = [k for k in missing if k != "shell:"]
            if files:
                async with self._base_lock:
                    if self._base_box is None:
                        self._base_box = await self._open(snap)
                    root, cache = self._base_box.root, self._digest_cache
                    self._base_keys.update(await asyncio.to_thread(_reads.base_digests, files, root, cache))
        return {k: self._base_keys[k] for k in keys}

    async def _open(self, snap: Snapshot) -> WorkspaceSandbox:
        self._check_open()
        box = WorkspaceSandbox(self, self._ctx, self._ctx.boxes / str(next(self._counter)), snap.state)
        try:
            await box._fs.start(snap)
        except BaseException as exc:
            await box.close()
            if isinstance(exc, OSError):  # e.g. no room in `tmp` for its upper dirs: the machinery, not the task
                raise SandboxError(f"could not make a sandbox: {exc}") from exc
            raise
        return box


def _degraded(cgroups: Cgroups, no_seccomp: str, *, memory: int | None, processes: int | None) -> dict[str, str]:
    """What this machine cannot enforce of what was asked, and why; logged once per process and reason."""
    degraded = {}
    if no_seccomp:
        degraded["seccomp"] = no_seccomp
    if memory is not None and "memory" in cgroups.missing:
        degraded["memory"] = cgroups.missing["memory"]
    if processes is not None and "pids" in cgroups.missing:
        degraded["processes"] = cgroups.missing["pids"]
    if "cpu" in cgroups.missing:
        degraded["cpu"] = cgroups.missing["cpu"]
    for what, why in degraded.items():
        _degraded_once(f"{what} protection", why)
    return degraded


def _degraded_once(what: str, why: str) -> None:
    if (what, why) not in _warned:
        _warned.add((what, why))
        log.warning("workspace sandboxes here run without their %s: %s", what, why)


_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True, slots=True)
class _Watch:
    """A command's eBPF window, open from the command's start until its events are collected or abandoned."""

    tracer: _ebpf.Tracer
    window: _ebpf.Window
    group: str  # the command's group in the factory's tracing plan, told whether the run left the files alone


class WorkspaceSandbox(ManagedSandbox):
    """One live sandbox; made by `WorkspaceSandboxes.create()` or `.restore()`."""

    def __init__(self, factory: WorkspaceSandboxes, ctx: _Shared, box: Path, state: ShellState):
        super().__init__(factory)
        self._factory = factory
        self._ctx = ctx
        self._fs = ctx.isolation.root(box)
        self._state = state
        self._cgroup: SandboxCgroup | None = None
        self._netns: str | None = None
        self._watch: _Watch | None = None
        #: Keys of reads digested since the files last changed (see _reads.Digester): a new one at every change.
        self._known: _reads.Known = {}

    @property
    def root(self) -> str:
        """The sandbox's root as this process sees it (read-only use, e.g. in tests)."""
        return self._fs.view

    # -- tools -------------------------------------------------------------------------------------------

    async def _run(self, command: str) -> CommandResult:
        ctx = self._ctx
        found = self._factory._tracer
        tracer = None if found is None else (lambda fd: _reads.strace_argv(*found, fd))
        mark = tracer is not None or self._factory._ebpf is not None
        # Made on first use (about a millisecond each): a fork that only serves file tools never needs them.
        if not ctx.network and self._netns is None:
            self._netns = ctx.mounter.new_netns()
        self._made_cgroup()
        seccomp = [] if ctx.seccomp_fd is None else [os.open(f"/proc/self/fd/{ctx.seccomp_fd}", os.O_RDONLY)]
        space = self._fs.space
        return await run_bash(
            ctx.jail.argv(self._fs.path, seccomp[0] if seccomp else None),
            command,
            self._state,
            env=ctx.env,
            timeout=ctx.timeout,
            max_output=ctx.max_output,
            cgroups=self._cgroup.procs if self._cgroup else (),
            pass_fds=seccomp,
            spawn=lambda argv, **popen: space.spawn(argv, self._netns, **popen),
            kill=self._cgroup.kill if self._cgroup else None,
            tracer=tracer,
            mark=mark,
        )

    async def _run_watched(self, command: str) -> CommandResult:
        """`_run`, watched by the eBPF tracer when it traces this factory's commands and the command is worth it
        (see _tracing_plan): its window stays open in `_watch` until `_observed` collects it or `execute` abandons
        it (its events are not wanted)."""
        ebpf = self._factory._ebpf
        cgroup = self._made_cgroup() if ebpf is not None else None  # made first, to watch the command in it
        group = cgroup.id() if cgroup is not None else None
        if ebpf is not None and group is not None and (name := self._factory._plan.wanted(command)) is not None:
            self._watch = _Watch(ebpf, ebpf.begin(group), name)
        return await self._run(command)

    def _unwatch(self) -> None:
        """Abandon the command's window, if still open (see `_run_watched`)."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.tracer.abandon(watch.window)

    def _made_cgroup(self) -> SandboxCgroup | None:
        if self._cgroup is None:
            ctx = self._ctx
            self._cgroup = ctx.cgroups.sandbox(f"{self._fs.box.name}", memory=ctx.memory, processes=ctx.max_processes)
        return self._cgroup

    async def execute(self, call: ToolCall) -> Outcome:
        tool, args = call.tool, fast.checked_args(call, "workspace")
        if isinstance(args, Outcome):
            return args
        async with self._turn():
            try:
                state = self._state
                root = self.root
                failure = None
                trace: bytes | None = None
                tail = b""
                cpu = None
                if tool == "bash":
                    cgroup = self._made_cgroup()
                    hits = cgroup.hits() if cgroup else (0, 0)
                    used = cgroup.cpu_seconds() if cgroup else None
                    try:
                        result = await self._run_watched(args["command"])
                    except OSError as exc:  # the machinery failed (e.g. a missing binary): not the command
                        return Outcome({"error": f"could not start the command: {exc}"}, None, True)
                    if cgroup and used is not None:
                        cpu = (cgroup.cpu_seconds() or 0.0) - used
                    if not result.started:
                        why = f"the sandbox could not start the command: {result.output.strip()[-2000:]}"
                        return Outcome({"error": why}, None, True)
                    if result.timed_out:
                        return unfinished(result.output, f"timed out after {self._ctx.timeout:g} s")
                    output: dict[str, Any] = {"output": result.output, "exit_code": result.exit_code}
                    state = result.state
                    failure = self._limit_hit(hits)
                    trace, tail = result.trace, result.trace_tail
                elif tool == "read_file":
                    output = fast.read_file(root, state.cwd, args["path"], self._ctx.max_output)
                elif tool == "write_file":
                    output = fast.write_file(root, state.cwd, args["path"], args["content"])
                else:
                    output = fast.list_dir(root, state.cwd, args["path"], self._ctx.max_output)
                if failure is None and tool != "read_file" and tool != "list_dir" and self._fs.full():
                    failure = f"the sandbox's disk quota ({_size(self._ctx.isolation.disk)}) is full"
                files_changed = await self._fs.changed()
                if files_changed:
                    self._known = {}  # a new one: a digest still running in a cancelled call's thread fills the old
                recent = self._fs.take_recent() if isinstance(self._fs, _isolation.LayeredRoot) else None
                before, self._state = self._state, state
                changed = files_changed or state != before
                if failure is not None:
                    return Outcome({**output, "error": failure}, changed, True)
                if not self._factory.read_sets:
                    return Outcome(output, changed, cpu_seconds=cpu)
                observed = await self._observed(call, output, changed, files_changed, recent, before, trace, tail)
                return replace(observed, cpu_seconds=cpu)
            finally:
                self._unwatch()

    async def _observed(
        self,
        call: ToolCall,
        output: dict[str, Any],
        changed: bool,
        files_changed: bool,
        recent: Batch | None,
        before: ShellState,
        trace: bytes | None,
        tail: bytes,
    ) -> Outcome:
        """The outcome with its read set (see _reads) and, for a state-changing call, its write set (see _writes)
        from `recent`, the kernel's account of what it changed (None: none kept). A traced command's read set is
        digested after the answer (`Outcome.reads_later`): the files it names are read, hashed and resolved in a
        thread while the model generates its next turn, and the sandbox runs nothing else meanwhile."""
        reads: Mapping[str, str] | None = None
        later: tuple[Callable[..., Any], tuple[Any, ...]] | None = None  # a digest to make after the answer
        root, cache, known = self.root, self._factory._digest_cache, self._known
        args = call.args if isinstance(call.args, dict) else {}
        path = args.get("path", "")
        if call.tool == "bash" and self._factory._ebpf is not None:
            watch = self._watch
            if watch is not None:
                self._factory._plan.traced(watch.group, useful=not files_changed)
            if watch is not None and not files_changed:  # else `execute` abandons it: its events are not wanted
                self._watch = None
                later = _ebpf.read_set, (watch.tracer, watch.window, root, cache, known)
        elif call.tool == "bash" and self._factory._tracer is not None:
            parsed = None if trace is None else await asyncio.to_thread(_reads.parse_trace, trace)
            if not (parsed.complete if parsed is not None else _reads.shell_ended(tail)):
                # The tracer died before the shell (killed by the command?): traced system calls after its death
                # failed with ENOSYS, so the output may be unlike an untraced run's; never cache it.
                why = "the read tracer ended before the command did (was it killed?)"
                return Outcome({**output, "error": why}, changed, True)
            if parsed is not None and not files_changed:
                later = _reads.read_set, (parsed, root, cache, known)
        elif call.tool in ("read_file", "list_dir") and not files_changed:
            listing = call.tool == "list_dir"  # a file tool's read set is a path or two: made before the answer
            reads = await _read_set(
                _reads.file_tool_reads, (root, before.cwd, path, listing, cache, known), call, before
            )
        writes: dict[str, str] | None = {}
        if files_changed:
            writes = None if recent is None or recent.entries is None else await self._write_set(recent.entries)
        if writes is not None and self._state != before:
            writes["shell:"] = _reads.shell_digest(self._state)
        pending = None if later is None else self._after_answer(_read_set(*later, call, before))
        return Outcome(output, changed, reads=reads, writes=writes if changed else None, reads_later=pending)

    async def _write_set(self, entries: dict[tuple[bytes, bytes], int]) -> dict[str, str] | None:
        fs = self._fs
        assert isinstance(fs, _isolation.LayeredRoot)
        overlays = [(m.point, fs._upper(k)) for k, m in enumerate(self._ctx.isolation.layout.overlays)]
        where = (fs.scratch(), fs._scratch_mount(), overlays, self.root, self._factory._digest_cache)
        return await asyncio.to_thread(_writes.write_set, entries, *where)

    def _limit_hit(self, before: tuple[int, int]) -> str | None:
        """Why the command just run is a failure of the sandbox's limits, if it is."""
        if self._cgroup is None:
            return None
        ooms, forks = self._cgroup.hits()
        if ooms > before[0]:
            return f"a process was killed: the sandbox's memory limit ({_size(self._ctx.memory)}) was reached"
        if forks > before[1]:
            return f"a fork was refused: the sandbox's process limit ({self._ctx.max_processes}) was reached"
        return None

    # -- snapshots and cleanup ---------------------------------------------------------------------------

    async def snapshot(self) -> str:
        async with self._turn():
            # Nothing runs between commands (each one's PID namespace dies with it); frozen all the same, so
            # that nothing could change the files while they are copied. (A sandbox that has run no command yet
            # has no group, and nothing to freeze.)
            core = None if self._cgroup is None else self._cgroup.core
            self._known = {}  # the files stay, but may come back from the snapshot's layer with other metadata
            async with contextlib.nullcontext() if core is None else frozen(core, "workspace sandbox"):
                try:
                    snap = await self._fs.freeze(self._state)
                except OSError as exc:  # e.g. no room for the layer in tmp: the sandbox itself goes on unchanged
                    raise SandboxError(f"could not snapshot the sandbox: {exc}") from exc
            self._ctx.isolation.acquire(snap)
            return self._factory._keep(snap)

    async def _release(self) -> None:
        try:
            await self._fs.remove()
        finally:
            if self._cgroup is not None:
                self._cgroup.remove()
            if self._netns is not None:
                self._ctx.mounter.close_netns(self._netns)


async def _read_set(
    fn: Callable[..., Any], args: tuple[Any, ...], call: ToolCall, before: ShellState
) -> Mapping[str, str] | None:
    """A call's read set, `fn(*args)` in a thread (see `_observed`), with the shell state it started in."""
    reads: dict[str, str] | None
    reads, why = await _digests(fn, *args)
    if why:
        log.debug("no read set for %r: %s", call.key[:200], why)
    if reads is not None:
        reads["shell:"] = _reads.shell_digest(before)
    return reads


async def _digests(fn: Callable[..., Any], *args: Any) -> tuple[Any, str]:
    """`fn(*args)` in a thread: (its result, or its first item if a tuple, and why not), or None when the files
    could not be read (a read or write set then stays unknown: only exact history for that call)."""
    try:
        found = await asyncio.to_thread(fn, *args)
    except OSError as exc:
        log.warning("could not digest a workspace call's reads or writes: %s", exc)
        return None, str(exc)
    return found if isinstance(found, tuple) else (found, "")


def _size(n: int | None) -> str:
    if n is None:
        return "none"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} bytes"


def _cleanup(run: RunDir, mounter: Mounter | None, changes: Watcher | None = None) -> None:
    """Remove a factory's run dir (unmounting what is left, removing its cgroups), stop its mount helper and its
    watch of changes."""
    try:
        run.remove()
    finally:
        if changes is not None:
            changes.close()
        if mounter is not None:
            mounter.close()
