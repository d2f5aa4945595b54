"""The CPU time a container's processes used, read as a file (no daemon round trip per call): `usage_usec` in
the `cpu.stat` of the container's cgroup2 group, which the kernel keeps whether or not the cpu controller is
enabled there, and which counts every process of the container, the commands `docker exec` starts included.

The group is found once per container, from its first process (`State.Pid` in the daemon's inspect):
/proc/<pid>/cgroup names its cgroup2 group (`0::<path>`), below this process's cgroup2 mount (/proc/self/mountinfo).
runc puts a container there with either cgroup driver (cgroupfs: /docker/<id>; systemd:
/system.slice/docker-<id>.scope), on a cgroup v2 host and on a hybrid one alike. The group counts only when its
name holds the container's id: a pid of another pid namespace (a remote daemon, a rootless one, one in another
container) names some other process, and a group the container shares counts others' CPU too. Whatever cannot be
found or read gives None: the call goes on, unmeasured.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._cpustat import usage_seconds

__all__ = ["cpu_stat"]


def _cgroup2_mount() -> tuple[str, str] | None:
    """This process's cgroup2 mount: (mount point, its root within the hierarchy)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[fields.index("-") + 1] == "cgroup2":
                return fields[4].encode().decode("unicode_escape"), fields[3]
    return None


def cpu_stat(info: dict[str, Any]) -> Path | None:
    """The `cpu.stat` of the running container the daemon's inspect `info` describes; None if not found here."""
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
    path = Path(point, group.lstrip("/"), "cpu.stat")
    return path if usage_seconds(path) is not None else None
