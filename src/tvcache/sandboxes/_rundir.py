"""Per-process run directories (and pids cgroups), and the reaping of those a crashed process left behind.

Every `WorkspaceSandboxes` keeps all it creates under `<tmp>/tvcache-workspace/run-<pid>-<token>/`, whose
`owner` file records the creating process's pid and start time. Each new factory first reaps the run dirs
whose owner is gone (pid dead or reused): it detaches every mount below them, removes them and their
cgroups. Mounts made through a user-namespace helper vanish with the helper, so only files remain there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import time
from pathlib import Path

from . import _syscalls as sc

__all__ = ["PidsCgroup", "RunDir", "reap_stale"]

ROOT_NAME = "tvcache-workspace"
CGROUP_NAME = "tvcache-workspace"


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # Field 22 (starttime) counts from after the ")" closing the command name, which may contain spaces.
    return data[data.rindex(b")") + 2 :].split()[19].decode()


def _owner_alive(run_dir: Path) -> bool:
    try:
        pid_text, start = (run_dir / "owner").read_text().split()
    except (OSError, ValueError):
        # No owner file yet: a run dir being created right now, or a crash before writing it. Only an old
        # one is stale.
        try:
            return time.time() - run_dir.stat().st_mtime < 60
        except OSError:
            return False
    return _start_time(int(pid_text)) == start


def _mounts_below(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4].encode().decode("unicode_escape")
            if target == str(path) or target.startswith(prefix):
                found.append(target)
    return sorted(found, key=len, reverse=True)


def _detach_all(path: Path) -> None:
    for target in _mounts_below(path):
        with contextlib.suppress(OSError):
            sc.umount(target, sc.MNT_DETACH)


def reap_stale(tmp: Path) -> int:
    """Remove the run dirs under `tmp` whose owner process is gone; returns how many were reaped."""
    root = tmp / ROOT_NAME
    reaped = 0
    if not root.is_dir():
        return 0
    for run_dir in root.iterdir():
        if not run_dir.name.startswith("run-") or _owner_alive(run_dir):
            continue
        with contextlib.suppress(OSError):
            _detach_all(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        PidsCgroup.remove_run(run_dir.name)
        reaped += 1
    return reaped


class RunDir:
    def __init__(self, tmp: Path):
        reap_stale(tmp)
        root = tmp / ROOT_NAME
        root.mkdir(mode=0o700, exist_ok=True)
        self.name = f"run-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = root / self.name
        self.path.mkdir(mode=0o700)
        start = _start_time(os.getpid())
        (self.path / "owner").write_text(f"{os.getpid()} {start}\n")

    def remove(self) -> None:
        _detach_all(self.path)
        shutil.rmtree(self.path, ignore_errors=True)
        PidsCgroup.remove_run(self.name)


def _pids_hierarchy() -> Path | None:
    """Where the pids controller is mounted (cgroup v1), or a cgroup2 root delegating it; None if neither."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v2 = None
    for line in lines:
        fields = line.split()
        sep = fields.index("-")
        fstype, super_opts = fields[sep + 1], fields[sep + 3]
        if fstype == "cgroup" and "pids" in super_opts.split(","):
            return Path(fields[4])
        if fstype == "cgroup2" and v2 is None:
            v2 = Path(fields[4])
    if v2 is not None:
        with contextlib.suppress(OSError):
            if "pids" in (v2 / "cgroup.subtree_control").read_text().split():
                return v2
    return None


class PidsCgroup:
    """A pids cgroup per sandbox, capping how many processes its commands may run at once (fork bombs)."""

    def __init__(self, path: Path):
        self.path = path
        self.procs = str(path / "cgroup.procs")

    @staticmethod
    def for_sandbox(run_name: str, box: str, max_pids: int) -> PidsCgroup | None:
        if os.geteuid() != 0:
            return None
        hierarchy = _pids_hierarchy()
        if hierarchy is None:
            return None
        path = hierarchy / CGROUP_NAME / run_name / box
        try:
            path.mkdir(parents=True)
            (path / "pids.max").write_text(str(max_pids))
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return PidsCgroup(path)

    def remove(self) -> None:
        _kill_and_rmdir(self.path)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # the run's group, once its last sandbox is gone

    @staticmethod
    def remove_run(run_name: str) -> None:
        hierarchy = _pids_hierarchy()
        if hierarchy is None:
            return
        run = hierarchy / CGROUP_NAME / run_name
        if not run.is_dir():
            return
        for box in run.iterdir():
            if box.is_dir():
                _kill_and_rmdir(box)
        with contextlib.suppress(OSError):
            run.rmdir()


def _kill_and_rmdir(path: Path) -> None:
    # Normally empty: every command's PID namespace dies with it. Kill stragglers rather than leak the group.
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.01)
