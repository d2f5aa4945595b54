"""Everything tvcache leaves on a machine names its owner, and what a dead owner left is reclaimed.

A training job dies by `kill -9`, OOM or preemption without closing anything, so nothing it made may depend on
a clean exit to go away. An owner is a process, named by its pid, its start time (field 22 of /proc/<pid>/stat,
clock ticks since boot: a pid the kernel has since given to another process does not pass for the owner) and its
PID namespace (an owner in another one, such as a container sharing /dev/shm, is never judged from here). What
names it:

- scratch, a directory made by `scratch_dir(kind, parent)`, is called
  `tvcache-<kind>-<pid>-<start>-<pid namespace>-<token>` from the moment it exists (no window where a crash leaves
  it unnamed). Mounts below it are detached when it is reclaimed (a debootstrap root mounts /proc);
- a `WorkspaceSandboxes` run dir, `<tmp>/tvcache-workspace/run-<pid>-<start>-<pid namespace>-<token>/`, holds
  its mounts and the list of its cgroups, which are named as it is (see `workspace._rundir`);
- Docker containers, images and networks carry the labels `tvcache.run` and `tvcache.owner` (see `docker._run`).

Whatever makes scratch or a run dir first reclaims everything of dead owners in its parent and in the usual
places (/dev/shm, the temp dir, /var/tmp, tvcache's cache: `reclaim_dead`, which `scratch_dir` and `RunDir` call),
so the next factory leaves nothing of a killed one; `tvcache gc` lists and reclaims the same, with sizes
(`leftovers(scratch_parents())`) and Docker's (`docker_leftovers`), and a sandbox server reclaims when it starts.
Nothing of a live owner is ever touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import secrets
import signal
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import _syscalls as sc
from ._fdtree import OPEN_DIR, Skip, Walk, remove_tree

log = logging.getLogger(__name__)

__all__ = [
    "Leftover",
    "die_with_parent",
    "docker_leftovers",
    "leftovers",
    "mounts_below",
    "owner_alive",
    "process_start_time",
    "reclaim_dead",
    "run_owner",
    "scratch",
    "scratch_dir",
    "scratch_parents",
]

#: `tvcache-<kind>-<pid>-<start>-<pid namespace>-<token>`; a kind is words of letters joined by hyphens, so it
#: never swallows the numbers after it.
_NAME = re.compile(
    r"^tvcache-(?P<kind>[a-z]+(?:-[a-z]+)*)-(?P<pid>\d+)-(?P<start>\d+)-(?P<namespace>\d+)-(?P<token>[0-9a-f]{8})$"
)
#: A workspace run dir and its cgroups: `run-<pid>-<start>-<pid namespace>-<token>`.
_RUN = re.compile(r"^run-(?P<pid>\d+)-(?P<start>\d+)-(?P<namespace>\d+)-[0-9a-f]{8}$")
#: SQLite scratch from before owners were named by start time (`mkdtemp(prefix="tvcache-sqlite-<pid>-")`): its
#: owner is gone only when no process has that pid at all.
_OLD_SQLITE = re.compile(r"^tvcache-sqlite-(?:build-)?(?P<pid>\d+)-[a-z0-9_]{8}$")


def process_start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot), or None if there is no such process. Raises OSError
    when /proc cannot be read (a full descriptor table, no memory): that says nothing about the process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 22 (starttime) counts from after the ")" closing the command name, which may contain spaces.
    return data[data.rindex(b")") + 2 :].split()[19].decode()


def pid_namespace() -> str:
    """This process's PID namespace (the inode of /proc/self/ns/pid)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def owner_alive(pid: int, start: str, namespace: str | None = None) -> bool:
    """Whether the process that started at `start` with pid `pid` still runs (not a later one with its pid). An
    owner in another PID namespace (a container sharing this /dev/shm, as `--ipc=host` does) has pids this process
    cannot look up: it counts as alive, as does one this process cannot look up now (a full descriptor table):
    only a definite answer removes anything."""
    if namespace is not None and namespace != pid_namespace():
        return True
    try:
        return process_start_time(pid) == start
    except OSError:
        return True


def owner_name() -> str:
    """`<pid>-<start>-<pid namespace>` of this process."""
    start = process_start_time(os.getpid())
    if start is None:  # a name without the start time would name no owner, and be reclaimed as nobody's
        raise OSError(f"cannot read this process's start time from /proc/{os.getpid()}/stat: is /proc mounted?")
    return f"{os.getpid()}-{start}-{pid_namespace()}"


def die_with_parent() -> None:
    """A `preexec_fn` for a helper that works in scratch (debootstrap, tar): the kernel kills it when the thread
    that started it dies, so a killed owner leaves no helper writing into what the next factory reclaims."""
    PR_SET_PDEATHSIG = 1
    if sc._libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


# -- scratch ----------------------------------------------------------------------------------------------


def scratch_dir(kind: str, parent: str | os.PathLike[str] | None = None) -> Path:
    """A new private directory `<parent>/tvcache-<kind>-<owner>-<token>` (parent: the system's temp dir),
    after reclaiming what dead owners left in `parent`. Removing it is the caller's job."""
    if not re.fullmatch(r"[a-z]+(?:-[a-z]+)*", kind):
        raise ValueError(f"a scratch kind is words of lowercase letters joined by '-', got {kind!r}")
    where = Path(parent if parent is not None else tempfile.gettempdir())
    reclaim_dead(where)
    path = where / f"tvcache-{kind}-{owner_name()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


@contextlib.contextmanager
def scratch(kind: str, parent: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """`scratch_dir` for the length of a `with` block (like `tempfile.TemporaryDirectory`)."""
    path = scratch_dir(kind, parent)
    try:
        yield path
    finally:
        remove(path)


def reclaim_dead(parent: str | os.PathLike[str]) -> list[Leftover]:
    """Remove everything in `parent` and in the usual places (`scratch_parents`) whose owner is gone: scratch of
    every kind, workspace run dirs with their mounts and cgroups, and workspace cgroups whose run dir went without
    them. So whichever factory comes next, and wherever the killed process worked by default, nothing of it stays.
    When nothing is dead this costs some directory listings (about 1 ms here)."""
    found = leftovers(scratch_parents([parent]), sized=False)
    for item in found:
        try:
            item.reclaim()
        except Exception as exc:  # whatever a dead owner left, the next factory must start
            log.warning("cannot reclaim %s: %r", item.where, exc)
    return found


@dataclass(frozen=True)
class Leftover:
    """One thing a dead owner left: where it is, what made it, how many bytes it holds, how to remove it."""

    where: str
    kind: str
    owner: str
    size: int
    _remove: Callable[[], object] = field(repr=False, compare=False)

    def reclaim(self) -> None:
        self._remove()


def scratch_parents(extra: Iterable[str | os.PathLike[str]] = ()) -> list[Path]:
    """Where tvcache makes scratch by default: /dev/shm, the system's temp dir, /var/tmp and tvcache's cache
    (`~/.cache/tvcache`, whose builders unpack and download beside what they build), plus `extra`."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvcache"
    roots = [Path("/dev/shm"), Path(tempfile.gettempdir()), Path("/var/tmp"), *map(Path, extra), cache]
    found: list[Path] = []
    for path in [*roots, *_subdirs(cache)]:  # the cache's builders work beside what they build (layers/, video/)
        with contextlib.suppress(OSError):
            path = path.resolve()
            if path.is_dir() and path not in found:
                found.append(path)
    return found


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink() and not _NAME.match(p.name)]
    except OSError:
        return []


def leftovers(parents: Iterable[Path], *, sized: bool = True) -> list[Leftover]:
    """What dead owners left in `parents`: scratch, and workspace run dirs (`<parent>/tvcache-workspace/run-*`)
    with the mounts and cgroups they hold; and workspace cgroups whose run dir is gone, wherever it was. `sized`:
    measure each (a walk of the tree)."""
    from .workspace._rundir import reap, stale_run_dirs

    found = []
    for parent in parents:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            owner = _dead_owner(name)
            if owner is not None:
                path = parent / name
                found.append(Leftover(str(path), *owner, du(path) if sized else 0, functools.partial(remove, path)))
        for run_dir in stale_run_dirs(parent):
            pid = run_dir.name.split("-")[1]
            size = du(run_dir) if sized else 0
            found.append(Leftover(str(run_dir), "workspace", pid, size, functools.partial(reap, run_dir)))
    return found + cgroup_leftovers()


def cgroup_leftovers() -> list[Leftover]:
    """Workspace runs' cgroups (`<hierarchy>/.../tvcache-workspace/run-<owner>-<token>`) whose owner is gone: a
    run dir reclaimed normally takes its cgroups along, so these are the ones whose run dir was deleted unreaped."""
    from .workspace._cgroups import remove_tree

    found = []
    for group in _shared_groups():
        with contextlib.suppress(OSError):
            for name in os.listdir(group):
                owner = run_owner(name)
                if owner is not None and not owner_alive(*owner):
                    path = group / name
                    found.append(Leftover(str(path), "cgroup", str(owner[0]), 0, functools.partial(remove_tree, path)))
    return found


def _shared_groups() -> set[Path]:
    """The `tvcache-workspace` groups: beside or below this process's own group in each hierarchy (where its
    factories and those of processes started with it put theirs), and any within a few levels of a hierarchy's
    root (those of processes started elsewhere)."""
    from ._cgroup2 import mounts, own_groups, under
    from .workspace._cgroups import CONTROLLERS, GROUP

    v1, v2 = mounts(CONTROLLERS)
    own_v1, own_v2 = own_groups()
    groups = {under(v1[c], own_v1[c]) / GROUP for c in v1 if c in own_v1}
    if v2 is not None and own_v2 is not None:
        groups.add(under(v2, own_v2 if own_v2 == "/" else os.path.dirname(own_v2)) / GROUP)
    for point in {where for where, _ in [*v1.values(), *([v2] if v2 else [])]}:
        for folder, dirs, _ in os.walk(point):
            if GROUP in dirs:
                groups.add(Path(folder, GROUP))
            if folder.count("/") - str(point).count("/") >= 3:
                dirs[:] = []
            dirs[:] = [d for d in dirs if d != GROUP]
    return groups


def run_owner(name: str) -> tuple[int, str, str] | None:
    """(pid, start, PID namespace) of a workspace run named `run-<pid>-<start>-<namespace>-<token>`."""
    m = _RUN.match(name)
    return (int(m["pid"]), m["start"], m["namespace"]) if m else None


def _dead_owner(name: str) -> tuple[str, str] | None:
    """(kind, owner pid) if `name` is scratch whose owner is gone, else None."""
    m = _NAME.match(name)
    if m is not None:
        return None if owner_alive(int(m["pid"]), m["start"], m["namespace"]) else (m["kind"], m["pid"])
    m = _OLD_SQLITE.match(name)
    if m is not None and not os.path.exists(f"/proc/{m['pid']}"):
        return "sqlite", m["pid"]
    return None


def docker_leftovers(url: str | None = None) -> list[Leftover]:
    """The runs of `DockerSandboxes` on the daemon at `url` (default: $DOCKER_HOST or the local socket) whose
    owner on this host is gone. Raises what the client raises when no daemon answers."""
    from .docker import _blocking
    from .docker._run import dead_runs, remove_run

    def reclaimer(run: str) -> Callable[[], object]:
        return lambda: _blocking(lambda docker: remove_run(docker, run), url)

    return [
        Leftover(f"docker run {run} (containers, images, networks)", "docker", pid, size, reclaimer(run))
        for run, pid, size in _blocking(dead_runs, url)
    ]


def remove(path: Path) -> None:
    """Detach the mounts at or below `path`, then remove it (a file or a tree); what is already gone is fine."""
    detach_all(path)
    remove_tree(path)


def detach_all(path: Path) -> None:
    """Detach every mount at or below `path` (lazily: one still in use goes once it is not)."""
    with contextlib.suppress(OSError):
        for target in mounts_below(path):
            with contextlib.suppress(OSError):
                sc.umount(target, sc.MNT_DETACH)


def mounts_below(path: Path) -> list[str]:
    """The mount points at or below `path`, deepest first."""
    prefix = str(path).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4].encode().decode("unicode_escape")
            if target == str(path) or target.startswith(prefix):
                found.append(target)
    return sorted(found, key=len, reverse=True)


class _Du(Walk):
    def __init__(self, root: int):
        super().__init__([root])
        self.dev = os.fstat(root).st_dev
        self.total = 0

    def on_other(self, fds: list[int], name: str, st: os.stat_result) -> None:
        if st.st_dev == self.dev:
            self.total += st.st_blocks * 512

    def on_dir(self, fds: list[int], name: str, st: os.stat_result) -> None:
        if st.st_dev != self.dev:  # a mount point: neither it nor what is below counts
            raise Skip
        self.total += st.st_blocks * 512


def du(path: Path) -> int:
    """Bytes `path` occupies (allocated blocks; one file system; what vanishes meanwhile counts 0)."""
    try:
        top = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(top.st_mode):
        return top.st_blocks * 512
    try:
        fd = os.open(path, OPEN_DIR)
    except OSError:
        return 0
    try:
        walk = _Du(fd)
        with contextlib.suppress(OSError):
            walk.run()
    finally:
        os.close(fd)
    return top.st_blocks * 512 + walk.total
