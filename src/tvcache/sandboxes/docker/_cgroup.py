"""A container's cgroup2 group, read and written as files (no daemon round trip): the CPU time its processes used,
and freezing them while a snapshot copies their files.

The group is found once per container, from its first process (`State.Pid` in the daemon's inspect):
/proc/<pid>/cgroup names its cgroup2 group (`0::<path>`), below this process's cgroup2 mount (/proc/self/mountinfo).
runc puts a container there with either cgroup driver (cgroupfs: /docker/<id>; systemd:
/system.slice/docker-<id>.scope), on a cgroup v2 host and on a hybrid one alike. The group counts only when its
name holds the container's id: a pid of another pid namespace (a remote daemon, a rootless one, one in another
container) names some other process, and a group the container shares holds others' processes too. Whatever
cannot be found gives None: calls go on unmeasured, and snapshots pause the container through the daemon
(as they do where the group may not be written).

**CPU**: `usage_usec` in the group's `cpu.stat`, which the kernel keeps whether or not the cpu controller is
enabled there, and which counts every process of the container, the commands `docker exec` starts included.

**Freezing** writes the group's `cgroup.freeze` rather than asking the daemon to pause: the daemon's record of
whether a container is paused also follows the runtime's pause and resume events, which arrive late under load,
and a late "paused" after the unpause returned makes the daemon refuse the next exec ("is paused, unpause the
container before exec"; with 16 containers at once on Docker 20.10, 450 of 960 execs right after a pause and
unpause, and 6 containers refusing every exec from then on: docs/sandboxes.md).
The daemon never hears of this freeze: an exec that comes meanwhile waits, frozen, until the thaw.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ...errors import SandboxError

__all__ = ["FREEZE_TIMEOUT", "can_freeze", "frozen", "group_of"]

FREEZE_TIMEOUT = 30.0
"""Seconds a group may take to freeze (a process in uninterruptible sleep holds it up) before the freeze is undone
and the snapshot fails."""


def _cgroup2_mount() -> tuple[str, str] | None:
    """This process's cgroup2 mount: (mount point, its root within the hierarchy)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[fields.index("-") + 1] == "cgroup2":
                return fields[4].encode().decode("unicode_escape"), fields[3]
    return None


def group_of(info: dict[str, Any]) -> Path | None:
    """The cgroup2 directory of the running container the daemon's inspect `info` describes; None if not here."""
    pid, cid = (info.get("State") or {}).get("Pid"), info.get("Id")
    if not (isinstance(pid, int) and pid > 0 and isinstance(cid, str) and cid):
        return None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            group = next((line.rstrip("\n")[3:] for line in f if line.startswith("0::")), None)
        mount = _cgroup2_mount()
    except (OSError, ValueError):
        return None
    if group is None or mount is None or cid not in os.path.basename(group):
        return None
    point, root = mount
    if root != "/":  # a mount of part of the hierarchy: the group must be inside it
        if not group.startswith(root + "/"):
            return None
        group = group[len(root) :]
    path = Path(point, group.lstrip("/"))
    return path if path.is_dir() else None


def can_freeze(group: Path | None) -> bool:
    """Whether this process may freeze `group` (a rootless daemon's may not be ours to write)."""
    return group is not None and os.access(group / "cgroup.freeze", os.W_OK)


def _is_frozen(group: Path) -> bool:
    with open(group / "cgroup.events", "rb") as f:
        return b"frozen 1\n" in f.read()


@contextlib.asynccontextmanager
async def frozen(group: Path, timeout: float = FREEZE_TIMEOUT) -> AsyncIterator[None]:
    """Every process of `group` stopped, and kept from running, until the block ends.

    The writes are synchronous (a cgroup file answers at once), so a cancellation cannot come between freezing and
    the thaw's write; a group gone meanwhile (the container removed) has nothing left to thaw."""
    loop = asyncio.get_running_loop()
    freeze = group / "cgroup.freeze"
    try:
        try:
            freeze.write_bytes(b"1")
            deadline = loop.time() + timeout
            while not _is_frozen(group):
                if loop.time() >= deadline:
                    raise SandboxError(f"docker: the container's processes did not freeze in {timeout:g} s")
                await asyncio.sleep(0.005)
        except OSError as exc:
            raise SandboxError(f"docker: freezing the container failed: {exc}") from exc
        yield
    finally:
        # Another failure to thaw is raised as it is, not as a SandboxError (which says the sandbox is as it was):
        # the cache then closes the sandbox rather than keep a frozen one.
        with contextlib.suppress(FileNotFoundError):
            freeze.write_bytes(b"0")
