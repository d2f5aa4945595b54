"""Control groups read and written as files: where the hierarchies are mounted and this process's groups in them,
the CPU time a cgroup2 group's processes used, and freezing them. Workspace sandboxes use their own groups
(workspace/_cgroups), Docker ones their container's (docker/_cgroup), `reclaim` what a dead process left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from ..errors import SandboxError

__all__ = ["FREEZE_TIMEOUT", "Mount", "frozen", "is_frozen", "mounts", "own_groups", "under", "usage_seconds"]

Mount = tuple[Path, str]
"""A cgroup hierarchy's mount: (mount point, the part of the hierarchy mounted there)."""

FREEZE_TIMEOUT = 30.0
"""Seconds a group may take to freeze (a process in uninterruptible sleep holds it up) before the freeze is undone
and the snapshot fails."""


def mounts(controllers: Iterable[str] = ()) -> tuple[dict[str, Mount], Mount | None]:
    """This process's cgroup v1 mounts of `controllers` (by controller) and its cgroup2 mount."""
    wanted = set(controllers)
    v1: dict[str, Mount] = {}
    v2 = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype = fields[sep + 1]
            where = (Path(fields[4].encode().decode("unicode_escape")), fields[3])
            if fstype == "cgroup":
                for controller in wanted.intersection(fields[sep + 3].split(",")):
                    v1.setdefault(controller, where)
            elif fstype == "cgroup2" and v2 is None:
                v2 = where
    return v1, v2


def own_groups() -> tuple[dict[str, str], str | None]:
    """This process's group per v1 controller, and its v2 group."""
    v1: dict[str, str] = {}
    v2 = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "":
                v2 = path
            for controller in controllers.split(","):
                v1[controller] = path
    return v1, v2


def under(mount: Mount, path: str) -> Path:
    """The directory of the group `path` (as /proc/<pid>/cgroup names it) below `mount`."""
    point, root = mount
    relative = path[len(root) :] if root != "/" and path.startswith(root) else path
    return point / relative.lstrip("/")


def usage_seconds(path: Path | None) -> float | None:
    """`usage_usec` of the `cpu.stat` at `path` in seconds (the kernel keeps it whether or not the cpu controller is
    enabled in the group); None without one or when it cannot be read."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"usage_usec "):
                    return int(line[11:]) / 1e6
    except (OSError, ValueError):
        pass
    return None


def is_frozen(group: Path) -> bool:
    with open(group / "cgroup.events", "rb") as f:
        return b"frozen 1\n" in f.read()


@contextlib.asynccontextmanager
async def frozen(group: Path, what: str, timeout: float = FREEZE_TIMEOUT) -> AsyncIterator[None]:
    """Every process of `group` stopped, and kept from running, until the block ends; `what` names the group's
    owner in the errors. A group that does not freeze in `timeout` seconds is a `SandboxError`, thawed.

    The writes are synchronous (a cgroup file answers at once), so a cancellation cannot come between freezing and
    the thaw's write; a group gone meanwhile (its sandbox removed) has nothing left to thaw."""
    loop = asyncio.get_running_loop()
    freeze = group / "cgroup.freeze"
    try:
        try:
            freeze.write_bytes(b"1")
            deadline = loop.time() + timeout
            while not is_frozen(group):
                if loop.time() >= deadline:
                    raise SandboxError(f"{what}: its processes did not freeze in {timeout:g} s")
                await asyncio.sleep(0.005)
        except OSError as exc:
            raise SandboxError(f"{what}: freezing its processes failed: {exc}") from exc
        yield
    finally:
        # Another failure to thaw is raised as it is, not as a SandboxError (which says the sandbox is as it was):
        # the cache then closes the sandbox rather than keep a frozen one.
        with contextlib.suppress(FileNotFoundError):
            freeze.write_bytes(b"0")
