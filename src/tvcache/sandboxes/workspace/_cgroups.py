"""Control groups: a memory and a process limit per sandbox, and one group all sandboxes share.

Every sandbox gets its own group (made on its first command: a sandbox that only serves file tools never
needs one) with `memory` bytes and `processes` tasks at most; each command's shell joins it before anything
runs (see _shell). The kernel counts what the group hits: an OOM kill (`oom_kill` in memory.events, or
memory.oom_control on cgroup v1) or a refused fork (`max` in pids.events). A command during which a count moved
is reported as a failure, never as an answer.

All sandboxes of all tvcache processes under one parent share a group, `tvcache-workspace`, capped at 3/4 of
the machine's memory and half its process ids, and scheduled as one group against the rest of the machine's
processes, so that many sandboxes at their limits at once still leave the host room to work.

Where the groups live:

- cgroup v1 (one hierarchy per controller): below this process's own group in the memory, pids and cpu
  hierarchies (for cpu only the shared group, which is what gives the host its share);
- cgroup v2: beside this process's own group (a group that holds processes cannot delegate controllers),
  or below the root if this process is in the root group, with the memory, pids and cpu controllers enabled
  where the parent offers them.

Only root may do this; where a controller is missing, `Cgroups.missing` says which and why, and the factory
reports it (`WorkspaceSandboxes.degraded`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from .._cgroup2 import mounts, own_groups, under, usage_seconds

__all__ = ["CONTROLLERS", "GROUP", "Cgroups", "SandboxCgroup", "remove_tree"]

GROUP = "tvcache-workspace"
CONTROLLERS = ("memory", "pids", "cpu")
#: The shared group's share of the machine.
_MEMORY_SHARE = 3 / 4
_PIDS_SHARE = 1 / 2


@dataclass(frozen=True, slots=True)
class _Hierarchy:
    """Where one controller lives: the shared group's directory, and whether it is the unified hierarchy."""

    group: Path
    unified: bool


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _machine_limits() -> tuple[int, int]:
    """(bytes of memory, process ids) the shared group may use."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    pids = min(int(Path(f"/proc/sys/kernel/{name}").read_text()) for name in ("pid_max", "threads-max"))
    return int(memory * _MEMORY_SHARE), int(pids * _PIDS_SHARE)


def _find() -> tuple[dict[str, _Hierarchy], dict[str, str]]:
    """The shared group per controller (made and capped here), and why each missing controller is missing."""
    mounts_v1, mount_v2 = mounts(CONTROLLERS)
    own_v1, own_v2 = own_groups()
    memory_cap, pids_cap = _machine_limits()
    found: dict[str, _Hierarchy] = {}
    missing: dict[str, str] = {}
    for controller in CONTROLLERS:
        if controller in mounts_v1 and controller in own_v1:
            group = under(mounts_v1[controller], own_v1[controller]) / GROUP
            unified = False
        elif mount_v2 is not None and own_v2 is not None:
            parent = under(mount_v2, own_v2 if own_v2 == "/" else os.path.dirname(own_v2))
            try:
                offered = (parent / "cgroup.subtree_control").read_text().split()
            except OSError:
                offered = []
            if controller not in offered:
                missing[controller] = f"the cgroup2 group {parent} does not delegate the {controller} controller"
                continue
            group = parent / GROUP
            unified = True
        else:
            missing[controller] = f"no cgroup hierarchy has the {controller} controller"
            continue
        try:
            group.mkdir(exist_ok=True)
            if unified:
                (group / "cgroup.subtree_control").write_text(f"+{controller}")
        except OSError as exc:
            missing[controller] = f"cannot make {group}: {exc.strerror}"
            continue
        if controller == "memory":
            _write(group / ("memory.max" if unified else "memory.limit_in_bytes"), str(memory_cap))
        elif controller == "pids":
            _write(group / "pids.max", str(pids_cap))
        found[controller] = _Hierarchy(group, unified)
    return found, missing


def _core() -> Path | None:
    """The shared group in the cgroup2 hierarchy, made here, whatever controllers it has: each sandbox's group
    there is what kills (`cgroup.kill`) and freezes (`cgroup.freeze`) it. None without a usable cgroup2 mount."""
    _, mount_v2 = mounts()
    _, own_v2 = own_groups()
    if mount_v2 is None or own_v2 is None:
        return None
    group = under(mount_v2, own_v2 if own_v2 == "/" else os.path.dirname(own_v2)) / GROUP
    try:
        group.mkdir(exist_ok=True)
    except OSError:
        return None
    return group if (group / "cgroup.freeze").exists() or (group / "cgroup.kill").exists() else None


@dataclass(slots=True)
class SandboxCgroup:
    """One sandbox's groups: the cgroup.procs files its commands join, and the counts of limits hit."""

    dirs: list[Path]
    procs: list[str]
    oom_events: Path | None
    pids_events: Path | None
    core: Path | None = None
    """Its cgroup2 group (also on a host whose controllers are all cgroup v1): `cgroup.kill`, `cgroup.freeze`
    (sandboxes/_cgroup2.frozen)."""
    _removed: bool = field(default=False)

    def kill(self) -> None:
        """SIGKILL everything in the sandbox's groups (the kernel's cgroup.kill where there is one)."""
        if self.core is not None and _write(self.core / "cgroup.kill", "1"):
            return
        for path in self.dirs:
            _kill_members(path)

    def hits(self) -> tuple[int, int]:
        """(OOM kills, refused forks) so far."""
        return _count(self.oom_events, "oom_kill"), _count(self.pids_events, "max")

    def id(self) -> int | None:
        """The group's cgroup id, as the kernel names it to eBPF programs (`cgroup`, bpf_get_current_cgroup_id): the
        inode number of its cgroup2 directory; None without a cgroup2 group."""
        return None if self.core is None else os.stat(self.core).st_ino

    def cpu_seconds(self) -> float | None:
        """The CPU time the sandbox's processes used so far (`usage_usec` of its cgroup2 group's `cpu.stat`, which
        the kernel keeps whether or not the cpu controller is enabled there); None without a cgroup2 group."""
        return None if self.core is None else (usage_seconds(self.core / "cpu.stat") or 0.0)

    def remove(self) -> None:
        if not self._removed:
            self._removed = True
            for path in self.dirs:
                _kill_and_rmdir(path)


def _count(path: Path | None, key: str) -> int:
    if path is None:
        return 0
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except OSError:
        pass
    return 0


class Cgroups:
    """The cgroups of one factory's sandboxes: `<shared group>/<run>/<sandbox>` in each hierarchy."""

    def __init__(self, run_name: str):
        self.missing: dict[str, str] = {}
        self._hierarchies: dict[str, _Hierarchy] = {}
        self._core: Path | None = None
        if os.geteuid() != 0:
            self.missing = {c: "needs root" for c in CONTROLLERS}
            return
        try:
            self._hierarchies, self.missing = _find()
            self._core = _core()
        except OSError as exc:
            self.missing = {c: f"cannot read the cgroup layout: {exc}" for c in CONTROLLERS}
        self._run_name = run_name

    @property
    def run_dirs(self) -> list[Path]:
        """The run's directories (to be reaped by a later process if this one dies)."""
        seen: dict[Path, None] = {}
        for controller, h in self._hierarchies.items():
            if controller != "cpu" or h.unified:
                seen[h.group / self._run_name] = None
        if self._core is not None:
            seen[self._core / self._run_name] = None
        return list(seen)

    def sandbox(self, name: str, *, memory: int | None, processes: int | None) -> SandboxCgroup | None:
        """Make a sandbox's groups, with its limits; None when no group can be made here."""
        if not self._hierarchies and self._core is None:
            return None
        dirs: list[Path] = []
        procs: list[str] = []
        oom_events = pids_events = None
        made: set[Path] = set()
        core = None
        try:
            for controller, h in self._hierarchies.items():
                if controller == "cpu" and not h.unified:
                    procs.append(str(h.group / "cgroup.procs"))  # the shared group is the point
                    continue
                path = h.group / self._run_name / name
                if path not in made:
                    if not path.parent.exists():
                        path.parent.mkdir(exist_ok=True)
                        for c, other in self._hierarchies.items():
                            if other.unified:
                                _write(path.parent / "cgroup.subtree_control", f"+{c}")
                    path.mkdir()
                    made.add(path)
                    dirs.append(path)
                    procs.append(str(path / "cgroup.procs"))
                if controller == "memory":
                    if memory is not None:
                        limit = "memory.max" if h.unified else "memory.limit_in_bytes"
                        if not _write(path / limit, str(memory)):
                            raise OSError(f"cannot set {path / limit}")
                    oom_events = path / ("memory.events" if h.unified else "memory.oom_control")
                elif controller == "pids":
                    if processes is not None and not _write(path / "pids.max", str(processes)):
                        raise OSError(f"cannot set {path / 'pids.max'}")
                    pids_events = path / "pids.events"
            if self._core is not None:
                core = self._core / self._run_name / name  # on cgroup v2 alone, the group made above
                if core not in made:
                    core.parent.mkdir(exist_ok=True)
                    core.mkdir()
                    dirs.append(core)
                    procs.append(str(core / "cgroup.procs"))
        except BaseException:
            for path in dirs:
                _kill_and_rmdir(path)
            raise
        return SandboxCgroup(dirs, procs, oom_events, pids_events, core)

    def remove(self) -> None:
        for run in self.run_dirs:
            remove_tree(run)


def remove_tree(path: Path) -> None:
    """Remove a run's group and its sandboxes' groups, killing what is left in them."""
    if not path.is_dir():
        return
    for child in path.iterdir():
        if child.is_dir():
            _kill_and_rmdir(child)
    _kill_and_rmdir(path)


def _kill_members(path: Path) -> None:
    if _write(path / "cgroup.kill", "1"):
        return
    with contextlib.suppress(OSError):
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def _kill_and_rmdir(path: Path) -> None:
    # Normally empty: every command's PID namespace dies with it. Kill stragglers rather than leak the group.
    for _ in range(100):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            _kill_members(path)
            time.sleep(0.01)
