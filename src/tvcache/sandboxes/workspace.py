"""Workspace sandboxes: a directory tree plus a shell, forked in about a millisecond with overlayfs.

    boxes = WorkspaceSandboxes("path/to/task")          # the task appears at /testbed, the host's / below
    box = await boxes.create()
    await box.execute(ToolCall("bash", {"command": "cd /testbed && make test"}))
    snap = await box.snapshot()                         # freezes the diff into a shared read-only layer
    other = await boxes.restore(snap)                   # a new upper dir over the same layers

**Filesystem.** A sandbox's root is overlayfs: read-only lower layers (the system root, by default the host's
`/`, and the workspace directories at their mount points) under a private upper dir on tmpfs. `snapshot()`
unmounts, moves the upper dirs into a new layer (O(size of the diff)), and remounts on a fresh upper, so the
sandbox keeps going on top of its own snapshot. `restore()` mounts a fresh upper over a snapshot's layers.
Layers are reference-counted (snapshots and live sandboxes hold them) and deleted when unused; a stack that
grows past `max_layers` is merged into one layer, far below overlayfs's limit of 500.

**Tools.** Every call returns a JSON-able dict:

- `bash {"command"}` -> `{"output": str, "exit_code": int}`. stdout and stderr are interleaved as they were
  written; beyond `max_output` bytes the middle is replaced by a line `[... N bytes of output omitted ...]`.
  Each command runs in a fresh bash inside new mount, PID, IPC, UTS and (unless `network=True`) network
  namespaces, chrooted into the root, without the capabilities that could leave it (see _shell). The working
  directory and exported variables carry over to the next command and into snapshots (shell functions,
  options and unexported variables do not, as with a new terminal).
- `read_file {"path"}` -> `{"content"}`, `write_file {"path", "content"}` -> `{"written"}` (parents are
  created), `list_dir {"path"}` -> `{"entries"}` (sorted, directories end in "/"); failures give `{"error"}`.
  These run in this process through the mounted root: microseconds instead of a process.

A timeout kills the command's whole PID namespace and gives `Outcome(error=True)` with the partial output.

**Change detection.** `Outcome.changed` is False when the upper dirs are still empty, or their listing
(path, inode, size, mtime, ctime, mode) is unchanged, and the working directory and exports are unchanged.

**Isolation modes** (`.mode`), tried in this order by `isolation="auto"`:

- `overlay`: kernel overlayfs mounted by this process (root).
- `userns`: overlays with `userxattr` in a user namespace held by a helper process (no root needed). The host's
  `/` cannot be a lower layer there, so its top-level directories are mounted one by one.
- `copy`: no overlayfs; each sandbox and snapshot is a full copy (`cp -a --reflink=auto`) of the workspace,
  with the system directories bound read-only. Slow for big workspaces; a last resort.

**The system root.** Workspace directories are rarely complete root filesystems, so by default the host's
`/` lies beneath them, read-only: bash, Python and the rest of the machine's tools work inside, writes to them
land in the sandbox's upper dir (`pip install` works), and the host never changes. Sandboxes can therefore
read what the host's root filesystem holds (not its other mounts such as /dev/shm or /proc; /tmp and /run
start empty). Pass `system=` another directory (a prepared rootfs), or map "/" in `base`, to use your own.

**Limits.** As with Docker's overlay2 driver: renaming a directory that comes from a lower layer copies it
(`mv` falls back on EXDEV), and a hard link between files of a lower layer is broken when one of them is
written after a snapshot (overlayfs without its `index` feature copies up one name, not the inode).

**Fingerprint.** A hash of the layout (mount points, options that shape outputs) and, for every lower
directory but the host's `/`, a listing of its tree: relative paths, types, modes, owners, sizes, mtimes and
symlink targets, not file contents. The host's `/` counts by its /etc/os-release only.

**Shell state.** Captured by an EXIT trap: a command that replaces the shell (`exec prog`) or sets its own
EXIT trap leaves the working directory and exports as they were before it.

**Threat model.** Meant for accidents of agents (`rm -rf /`, fork bombs, stray background processes,
writes anywhere), which stay inside one sandbox; as root, a pids cgroup per sandbox caps its processes
(`max_processes`). Not a defence against a deliberately hostile program (root inside still sees the host's
procfs and sysctls; memory is not capped): use VMs or gVisor for that.

**Cleanup.** Closing a sandbox unmounts and removes its upper dir; closing the factory removes everything it
created. All of it lives in a run directory per process, `<tmp>/tvcache-workspace/run-<pid>-*`, which the
next factory reaps (unmounting what is left) when its process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import secrets
import shutil
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from ..calls import ToolCall
from . import _fastpaths as fast
from ._layers import LayerStore, is_empty, listing, listing_digest, merge_layers
from ._layout import DEVICES, Layout, build_layout
from ._mounts import HostMounter, Mounter, NamespaceMounter
from ._rundir import PidsCgroup, RunDir
from ._shell import ShellState, run_bash
from ._syscalls import MS_BIND, MS_PRIVATE, MS_REC, mount
from .base import Outcome, SandboxError

__all__ = ["DEFAULT_ENV", "TOOLS", "Isolation", "WorkspaceSandbox", "WorkspaceSandboxes"]

Isolation = Literal["auto", "overlay", "userns", "copy"]
PathLike = str | os.PathLike[str]
BaseSpec = PathLike | Sequence[PathLike] | Mapping[str, PathLike | Sequence[PathLike]]

TOOLS = ("bash", "read_file", "write_file", "list_dir")
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}
_FINGERPRINT_VERSION = "tvcache-workspace/1"


@dataclass(frozen=True, slots=True)
class _Snapshot:
    state: ShellState
    stack: tuple[str, ...] = ()
    """Overlay modes: the snapshot's layers, oldest first."""
    copy: Path | None = None
    """Copy mode: the snapshot's private tree."""


def _normalize_base(base: BaseSpec, workdir: str) -> dict[str, tuple[str, ...]]:
    """{mount point: (host directories, bottom first)}, each directory checked."""

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


def _probe(mounter: Mounter, probe_dir: Path, *, overlay: bool) -> None:
    probe_dir.mkdir()
    try:
        for sub in ("lower", "upper", "work", "merged"):
            (probe_dir / sub).mkdir()
        (probe_dir / "lower" / "f").write_text("x")
        target = str(probe_dir / "merged")
        if overlay:
            mounter.overlay(target, [str(probe_dir / "lower")], str(probe_dir / "upper"), str(probe_dir / "work"))
        else:
            mounter.bind(str(probe_dir / "lower"), target, readonly=True)
        try:
            if not os.path.exists(mounter.view(target + "/f")):
                raise SandboxError("a test mount did not show its files")
        finally:
            mounter.detach(target)
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)


def _choose_mode(isolation: Isolation, run: Path) -> tuple[str, Mounter]:
    if isolation not in ("auto", "overlay", "userns", "copy"):
        raise ValueError(f"isolation must be 'auto', 'overlay', 'userns' or 'copy', got {isolation!r}")
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            raise SandboxError(f"workspace sandboxes need `{tool}` (util-linux) on PATH")
    order = ["overlay", "userns", "copy"] if isolation == "auto" else [isolation]
    errors = []
    for mode in order:
        mounter: Mounter | None = None
        try:
            if mode == "overlay":
                if os.geteuid() != 0:
                    raise SandboxError("needs root (CAP_SYS_ADMIN)")
                mounter = HostMounter()
            elif mode == "userns":
                mounter = NamespaceMounter()
            else:
                mounter = HostMounter() if os.geteuid() == 0 else NamespaceMounter()
            _probe(mounter, run / f"probe-{mode}", overlay=mode != "copy")
            return mode, mounter
        except (OSError, SandboxError) as exc:
            if mounter is not None:
                mounter.close()
            errors.append(f"{mode}: {exc}")
    raise SandboxError("no workspace isolation works on this machine (" + "; ".join(errors) + ")")


async def _copy_tree(src: str, dest: str) -> None:
    """`cp -a` the contents of `src` into the (existing or new) directory `dest`."""
    proc = await asyncio.create_subprocess_exec(
        "cp", "-a", "--reflink=auto", "--", src + "/.", dest, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxError(f"copying {src} to {dest} failed: {err.decode(errors='replace').strip()}")


class WorkspaceSandboxes:
    """A factory of workspace sandboxes over one base; see the module docstring.

    - `base`: the workspace: a directory (mounted at `workdir`), a list of directories (stacked there, later
      ones on top), or a mapping {mount point: directory or list}. Mapping "/" replaces the system root.
    - `system`: the root filesystem beneath the workspace (default: the host's `/`).
    - `tmp`: where upper dirs, layers and copies live (default /dev/shm, which is tmpfs).
    - `network`: False gives every command a private network namespace with only loopback.
    - `timeout`: seconds per tool call; `max_output`: bytes of output kept per call.
    - `cwd`: the shell's initial directory (default: the first workspace mount point); `env`: its initial
      exported environment (default: a minimal PATH, HOME, LANG and TERM).
    - `max_layers`: snapshot layers a stack may have before they are merged into one.
    - `max_processes`: processes a sandbox may run at once (a pids cgroup, where available).
    """

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
        max_layers: int = 64,
        max_processes: int = 4096,
    ):
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not (isinstance(max_output, int) and max_output >= 64):
            raise ValueError(f"max_output must be an int >= 64, got {max_output!r}")
        if not (isinstance(max_layers, int) and 2 <= max_layers <= 400):
            raise ValueError(f"max_layers must be an int between 2 and 400, got {max_layers!r}")
        if not (isinstance(max_processes, int) and max_processes >= 8):
            raise ValueError(f"max_processes must be an int >= 8, got {max_processes!r}")
        self.workspace = _normalize_base(base, workdir)
        self.system = None if "/" in self.workspace else os.path.realpath(system)
        if self.system is not None and not os.path.isfile(os.path.join(self.system, "bin/sh")):
            raise ValueError(f"system root {system!r} has no /bin/sh: pass a root filesystem, e.g. '/'")
        self.network = network
        self.timeout = float(timeout)
        self.max_output = max_output
        self.max_layers = max_layers
        self.max_processes = max_processes
        self.env = dict(DEFAULT_ENV if env is None else env)
        root_fs = self.system or self.workspace["/"][-1]
        # setpriv runs inside the sandbox; without it commands keep root's full capabilities.
        self.drop_caps = any(os.path.exists(os.path.join(root_fs, p, "setpriv")) for p in ("usr/bin", "bin"))
        points = [p for p in self.workspace if p != "/"]
        self.cwd = cwd if cwd is not None else (points[0] if points else "/")
        tmp_path = Path(tmp if tmp is not None else "/dev/shm")
        if not tmp_path.is_dir():
            raise ValueError(f"tmp directory {os.fspath(tmp_path)!r} does not exist")

        self._run = RunDir(tmp_path.resolve())
        self._mounter: Mounter | None = None
        self._finalizer = weakref.finalize(self, _cleanup, self._run, None)
        try:
            self.mode, self._mounter = _choose_mode(isolation, self._run.path)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _cleanup, self._run, self._mounter)
            if self.mode != "userns" and os.geteuid() == 0:
                # A private mount of our own: nothing we mount propagates elsewhere, and one lazy unmount of
                # the run dir detaches all of it.
                mount(str(self._run.path), str(self._run.path), None, MS_BIND | MS_REC)
                mount(None, str(self._run.path), None, MS_PRIVATE | MS_REC)
            self.layout: Layout = build_layout(
                self.mode,
                self.workspace,
                self.system,
                self._run.path / "skeleton",
                opaque_xattr=self._mounter.opaque_xattr,
            )
            if self.mode != "copy":
                self._check_tmp(tmp_path.resolve())
        except BaseException:
            self._finalizer()
            raise
        self._layers = LayerStore(self._run.path / "layers")
        self._boxes_dir = self._run.path / "boxes"
        self._boxes_dir.mkdir()
        self._snapshots: dict[str, _Snapshot] = {}
        self._live: set[WorkspaceSandbox] = set()
        self._counter = itertools.count()
        self._initial: ShellState | None = None
        self._template: Path | None = None
        self._setup_lock = asyncio.Lock()
        self._fingerprint: str | None = None
        self._closed = False

    def _check_tmp(self, tmp: Path) -> None:
        dev = tmp.stat().st_dev
        for lower in {d for mnt in self.layout.overlays for d in mnt.lowers}:
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
            h.update(repr((sorted(self.env.items()), self.cwd, self.network, self.max_output)).encode())
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
        await self._ensure_setup()
        assert self._initial is not None
        return await self._open(_Snapshot(self._initial, (), self._template))

    async def restore(self, snapshot_id: str) -> WorkspaceSandbox:
        self._check_open()
        snap = self._snapshots.get(snapshot_id)
        if snap is None:
            raise SandboxError(f"snapshot {snapshot_id!r} does not exist (deleted, or from another factory)")
        return await self._open(snap)

    async def delete(self, snapshot_id: str) -> None:
        snap = self._snapshots.pop(snapshot_id, None)
        if snap is None:
            return
        dead = self._layers.release(snap.stack)
        if snap.copy is not None:
            dead.append(snap.copy)
        await _remove(dead)

    async def close(self) -> None:
        """Close every live sandbox and remove everything this factory created."""
        if self._closed:
            return
        self._closed = True
        for box in list(self._live):
            with contextlib.suppress(Exception):
                await box.close()
        self._snapshots.clear()
        await asyncio.to_thread(self._finalizer)

    async def __aenter__(self) -> WorkspaceSandboxes:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"WorkspaceSandboxes({self.workspace!r}, mode={self.mode!r})"

    @property
    def snapshot_count(self) -> int:
        return len(self._snapshots)

    @property
    def layer_count(self) -> int:
        return len(self._layers)

    # -- internals -------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("this WorkspaceSandboxes is closed")

    async def _ensure_setup(self) -> None:
        """First use: build copy mode's template tree, and learn the initial shell state from a sandbox."""
        async with self._setup_lock:
            if self._initial is not None:
                return
            if self.mode == "copy":
                template = self._run.path / "template"
                template.mkdir()
                for mnt in self.layout.overlays:
                    dest = str(template) + (mnt.point if mnt.point != "/" else "")
                    for lower in mnt.lowers:
                        await _copy_tree(lower, dest)
                self._template = template
            # `export -p` in bash's own words, so a later read-only command compares equal to it.
            box = await self._open(_Snapshot(ShellState(cwd=os.fsencode(self.cwd)), (), self._template))
            try:
                result = await box._run(":")
                if result.timed_out or result.exit_code != 0 or result.state.exports is None:
                    raise SandboxError(f"a first command in a new sandbox failed: {result.output.strip()!r}")
                self._initial = result.state
            finally:
                await box.close()

    async def _open(self, snap: _Snapshot) -> WorkspaceSandbox:
        self._check_open()
        assert self._mounter is not None
        box = WorkspaceSandbox(self, self._boxes_dir / str(next(self._counter)), snap)
        try:
            await box._start(snap)
        except BaseException:
            await box.close()
            raise
        self._live.add(box)
        return box

    def _register(self, state: ShellState, stack: tuple[str, ...] = (), copy: Path | None = None) -> str:
        snapshot_id = secrets.token_hex(8)
        self._layers.acquire(stack)
        self._snapshots[snapshot_id] = _Snapshot(state, stack, copy)
        return snapshot_id


class WorkspaceSandbox:
    """One live sandbox; made by `WorkspaceSandboxes.create()` or `.restore()`."""

    def __init__(self, factory: WorkspaceSandboxes, box: Path, snap: _Snapshot):
        self._f = factory
        self._dir = box
        self._root = str(box / "root")
        self._state = snap.state
        self._stack: tuple[str, ...] = ()
        self._gen = 0
        self._listings: list[list[Any] | None] = []
        self._mounted = False
        self._cgroup: PidsCgroup | None = None
        self._netns: str | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def root(self) -> str:
        """The sandbox's root as this process sees it (read-only use, e.g. in tests)."""
        assert self._f._mounter is not None
        return self._f._mounter.view(self._root)

    # -- set-up and tear-down ----------------------------------------------------------------------------

    async def _start(self, snap: _Snapshot) -> None:
        self._dir.mkdir()
        os.mkdir(self._root)
        self._cgroup = PidsCgroup.for_sandbox(self._f._run.name, self._dir.name, self._f.max_processes)
        if self._f.mode == "copy":
            assert snap.copy is not None
            await _copy_tree(str(snap.copy), str(self._dir / "data"))
        else:
            self._f._layers.acquire(snap.stack)
            self._stack = snap.stack
        self._mount()
        if self._f.mode == "copy":
            self._listings = [await asyncio.to_thread(listing, str(self._dir / "data"))]

    def _upper(self, k: int) -> str:
        return str(self._dir / f"u{k}.{self._gen}")

    def _mount(self) -> None:
        mounter = self._f._mounter
        assert mounter is not None
        layout = self._f.layout
        if self._f.mode == "copy":
            mounter.bind(str(self._dir / "data"), self._root, readonly=False)
            self._mounted = True
            self._listings = [None]
        else:
            for k, mnt in enumerate(layout.overlays):
                upper, work = self._upper(k), str(self._dir / f"w{k}.{self._gen}")
                os.mkdir(upper)
                os.mkdir(work)
                layers = [str(self._f._layers.dir(lid, k)) for lid in reversed(self._stack)]
                lowers = [p for p in layers if os.path.isdir(p)] + list(reversed(mnt.lowers))
                target = self._root + (mnt.point if mnt.point != "/" else "")
                mounter.overlay(target, lowers, upper, work)
                self._mounted = True  # the first mount is the root: from now on, detaching it cleans up
            self._listings = [None] * len(layout.overlays)
        for source, point in layout.ro_binds:
            mounter.bind(source, self._root + point, readonly=True)
        if layout.dev_binds:
            for name in DEVICES:
                mounter.bind(f"/dev/{name}", f"{self._root}/dev/{name}", readonly=False)

    def _unmount(self) -> None:
        if self._mounted:
            assert self._f._mounter is not None
            self._f._mounter.detach(self._root)
            self._mounted = False

    async def close(self) -> None:
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            self._f._live.discard(self)
            try:
                with contextlib.suppress(OSError):  # already gone with the factory's run dir
                    self._unmount()
            finally:
                if self._cgroup is not None:
                    self._cgroup.remove()
                if self._netns is not None and self._f._mounter is not None:
                    self._f._mounter.close_netns(self._netns)
                dead = self._f._layers.release(self._stack)
                self._stack = ()
                await _remove([self._dir, *dead])

    # -- tools -------------------------------------------------------------------------------------------

    async def _run(self, command: str) -> Any:
        assert self._f._mounter is not None
        if not self._f.network and self._netns is None:
            # Made on first use (about a millisecond): a fork that only serves file tools never needs one.
            self._netns = self._f._mounter.new_netns()
        return await run_bash(
            self._f._mounter.exec_prefix(self._netns),
            self._root,
            command,
            self._state,
            env=self._f.env,
            drop_caps=self._f.drop_caps,
            timeout=self._f.timeout,
            max_output=self._f.max_output,
            cgroup_procs=self._cgroup.procs if self._cgroup else None,
        )

    async def execute(self, call: ToolCall) -> Outcome:
        tool, args = call.tool, call.args
        if tool not in TOOLS:
            raise ValueError(f"workspace sandboxes have the tools {', '.join(TOOLS)}; got {tool!r}")
        if not isinstance(args, dict):
            raise ValueError(f"{tool} takes a JSON object of arguments, got the text {args[:200]!r}")
        wanted = {"bash": ("command",), "read_file": ("path",), "write_file": ("path", "content")}
        for key in wanted.get(tool, ("path",)):
            if not isinstance(args.get(key), str):
                raise ValueError(f"{tool} needs a string argument {key!r}, got args {call.key[:200]}")
        async with self._lock:
            if self._closed:
                raise SandboxError("this sandbox is closed")
            state = self._state
            root = self.root
            if tool == "bash":
                try:
                    result = await self._run(args["command"])
                except OSError as exc:  # the machinery failed (e.g. a missing binary): not the command
                    return Outcome({"error": f"could not start the command: {exc}"}, None, True)
                if result.timed_out:
                    error = f"timed out after {self._f.timeout:g} s"
                    return Outcome({"output": result.output, "exit_code": None, "error": error}, None, True)
                output: dict[str, Any] = {"output": result.output, "exit_code": result.exit_code}
                state = result.state
            elif tool == "read_file":
                output = fast.read_file(root, state.cwd, args["path"], self._f.max_output)
            elif tool == "write_file":
                output = fast.write_file(root, state.cwd, args["path"], args["content"])
            else:
                output = fast.list_dir(root, state.cwd, args["path"])
            changed = await self._observe() or state != self._state
            self._state = state
            return Outcome(output, changed)

    async def _observe(self) -> bool:
        """Did the filesystem change since the last look? Empty upper dirs answer in microseconds."""
        if self._f.mode == "copy":
            dirs = [str(self._dir / "data")]
        else:
            dirs = [self._upper(k) for k in range(len(self._listings))]
        changed = False
        for k, d in enumerate(dirs):
            if self._listings[k] is None and self._f.mode != "copy" and is_empty(d):
                continue
            now = await asyncio.to_thread(listing, d)
            changed = changed or now != self._listings[k]
            self._listings[k] = now
        return changed

    # -- snapshots ---------------------------------------------------------------------------------------

    async def snapshot(self) -> str:
        async with self._lock:
            if self._closed:
                raise SandboxError("this sandbox is closed")
            if self._f.mode == "copy":
                return await self._snapshot_copy()
            dirty = [k for k in range(len(self._listings)) if not is_empty(self._upper(k))]
            if dirty:
                await self._freeze(dirty)
            return self._f._register(self._state, self._stack)

    async def _freeze(self, dirty: list[int]) -> None:
        """Unmount, move the changed upper dirs into a new layer, remount on fresh ones."""
        layers = self._f._layers
        # No command is running (we hold the lock) and each one's PID namespace died with it, so nothing
        # can write into the upper dirs while they become a layer.
        self._unmount()
        old_gen = self._gen
        try:
            layer_id, path = layers.new()
            for k in dirty:
                os.rename(self._upper(k), path / str(k))
            layers.acquire([layer_id])
            self._stack = (*self._stack, layer_id)
            if len(self._stack) > self._f.max_layers:
                await self._merge()
        finally:
            self._gen += 1
            self._mount()
            # What is left of the old generation is empty upper dirs and work dirs: quick to remove in line.
            for k in range(len(self._listings)):
                for prefix in ("u", "w"):
                    shutil.rmtree(self._dir / f"{prefix}{k}.{old_gen}", ignore_errors=True)

    async def _merge(self) -> None:
        """Flatten this sandbox's whole stack into one layer (the old layers live on for their snapshots)."""
        layers = self._f._layers
        layer_id, path = layers.new()
        xattr = self._f._mounter.opaque_xattr if self._f._mounter else "trusted.overlay.opaque"

        def merge_all() -> None:
            for k, mnt in enumerate(self._f.layout.overlays):
                parts = [str(layers.dir(lid, k)) for lid in reversed(self._stack)]
                parts = [p for p in parts if os.path.isdir(p)]
                if parts:
                    merge_layers(parts, list(mnt.lowers), str(path / str(k)), xattr)

        await asyncio.to_thread(merge_all)
        layers.acquire([layer_id])
        dead = layers.release(self._stack)
        self._stack = (layer_id,)
        await _remove(dead)

    async def _snapshot_copy(self) -> str:
        dest = self._f._run.path / "copies" / secrets.token_hex(6)
        dest.parent.mkdir(exist_ok=True)
        await _copy_tree(str(self._dir / "data"), str(dest))
        return self._f._register(self._state, copy=dest)


async def _remove(paths: Sequence[Path]) -> None:
    def remove() -> None:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)

    if paths:
        await asyncio.to_thread(remove)


def _cleanup(run: RunDir, mounter: Mounter | None) -> None:
    """Remove a factory's run dir (unmounting what is left) and stop its mount helper."""
    try:
        run.remove()
    finally:
        if mounter is not None:
            mounter.close()
