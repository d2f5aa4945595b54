"""The CPU time a cgroup2 group's processes used: `usage_usec` of its `cpu.stat`, which the kernel keeps whether or
not the cpu controller is enabled there. Workspace sandboxes read their own group's, Docker ones their container's.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["usage_seconds"]


def usage_seconds(path: Path | None) -> float | None:
    """`usage_usec` of the `cpu.stat` at `path` in seconds; None without one or when it cannot be read."""
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
