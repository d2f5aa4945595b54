"""Where a container's cgroup2 group is, to read the CPU time its processes used and freeze them while a snapshot
copies their files, as files (no daemon round trip; see sandboxes/_cgroup2).

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

import os
from pathlib import Path
from typing import Any

from .._cgroup2 import mounts, under

__all__ = ["can_freeze", "group_of"]


def group_of(info: dict[str, Any]) -> Path | None:
    """The cgroup2 directory of the running container the daemon's inspect `info` describes; None if not here."""
    pid, cid = (info.get("State") or {}).get("Pid"), info.get("Id")
    if not (isinstance(pid, int) and pid > 0 and isinstance(cid, str) and cid):
        return None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            group = next((line.rstrip("\n")[3:] for line in f if line.startswith("0::")), None)
        _, mount = mounts()
    except (OSError, ValueError):
        return None
    if group is None or mount is None or cid not in os.path.basename(group):
        return None
    root = mount[1]
    if root != "/" and not group.startswith(root + "/"):  # a mount of part of the hierarchy, without the group
        return None
    path = under(mount, group)
    return path if path.is_dir() else None


def can_freeze(group: Path | None) -> bool:
    """Whether this process may freeze `group` (a rootless daemon's may not be ours to write)."""
    return group is not None and os.access(group / "cgroup.freeze", os.W_OK)
