"""Per-process run directories, and the reaping of those a crashed process left behind.

Every `WorkspaceSandboxes` keeps all it creates under `<tmp>/tvcache-workspace/run-<owner>-<token>/`, whose name
records the creating process (pid, start time, PID namespace: see `reclaim`) and whose `cgroups` file lists its
cgroup directories (named as the run dir). Each new factory first reaps the run dirs whose owner is gone (through
`reclaim.reclaim_dead`, with the rest of dead processes' scratch): it detaches every mount below them, removes them
and their cgroups. Mounts made through a user-namespace helper vanish with the helper, so only files remain there.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

from .._fdtree import remove_tree
from ..reclaim import detach_all, mounts_below, owner_alive, owner_name, reclaim_dead, run_owner
from ._cgroups import remove_tree as remove_cgroup_tree

__all__ = ["RunDir", "mounts_below", "reap", "stale_run_dirs"]

ROOT_NAME = "tvcache-workspace"


def _owner_alive(run_dir: Path) -> bool:
    owner = run_owner(run_dir.name)
    if owner is not None:
        return owner_alive(*owner)
    try:  # named by an earlier version, whose `owner` file names the owner
        pid_text, start = (run_dir / "owner").read_text().split()
    except (OSError, ValueError):
        # Named in a way this version cannot attribute (by another version of tvcache on this machine): whether
        # its owner lives cannot be told, so it stays, however long it has been idle. A run dir of this version
        # has its owner in its name from the moment it exists.
        return True
    return owner_alive(int(pid_text), start)


def stale_run_dirs(tmp: Path) -> list[Path]:
    """The run dirs under `tmp` whose owner process is gone."""
    root = tmp / ROOT_NAME
    if not root.is_dir():
        return []
    return [d for d in root.iterdir() if d.name.startswith("run-") and not _owner_alive(d)]


def reap(run_dir: Path) -> None:
    """Detach every mount below a run dir, remove its cgroups and the dir, whatever shape a dead sandbox left
    its files in (any depth, any path length: see _fdtree.remove_tree)."""
    try:
        detach_all(run_dir)
    finally:
        try:
            _remove_cgroups(run_dir)
        finally:
            remove_tree(run_dir)


class RunDir:
    def __init__(self, tmp: Path):
        reclaim_dead(tmp)  # dead processes' run dirs, and any other scratch of theirs here
        root = tmp / ROOT_NAME
        root.mkdir(mode=0o700, exist_ok=True)
        self.name = f"run-{owner_name()}-{secrets.token_hex(4)}"  # the owner, named from the first moment
        self.path = root / self.name
        self.path.mkdir(mode=0o700)

    def record_cgroups(self, dirs: list[Path]) -> None:
        """Where this run's cgroups are, for whoever removes the run dir (this process or a reaper)."""
        (self.path / "cgroups").write_text("".join(f"{d}\n" for d in dirs))

    def remove(self) -> None:
        reap(self.path)


def _remove_cgroups(run_dir: Path) -> None:
    try:
        dirs = (run_dir / "cgroups").read_text().split("\n")
    except OSError:
        return
    for d in dirs:
        if d and Path(d).name == run_dir.name:  # only a run's own groups, whatever the file says
            with contextlib.suppress(OSError):
                remove_cgroup_tree(Path(d))
