"""What a command runs inside: bubblewrap's view of a sandbox root, with what a default Docker container holds.

Every command is started as

    [nsenter ... --] bwrap --unshare-pid --unshare-ipc --unshare-uts --as-pid-1 --die-with-parent --new-session
        --bind ROOT / --proc /proc  (read-only and masked /proc paths)  (/dev/null & co. from the host)
        --cap-drop ALL --cap-add ...  --seccomp FD  --chdir /  -- bash ...

bubblewrap (Debian's `bubblewrap`, one small C program) makes the namespaces, mounts the sandbox's root as the
new `/` (recursively, and every mount `nosuid,nodev`: a device node in a layer cannot be opened), binds the
host's /dev/null, zero, full, random, urandom and tty over the root's, mounts a fresh procfs, pivots into the
root (the host's tree is unmounted from the namespace, so no chroot trick leads back
out), drops capabilities, loads the seccomp filter and starts bash as PID 1 of its namespace: when bash exits
the kernel kills everything it left. A timeout kills that PID 1 directly (see _shell.end_namespace):
`--die-with-parent` alone would leave a PID 1 that cleared its parent-death signal running. `--new-session`
detaches the command from any terminal (no TIOCSTI keystrokes into the host's).

/proc, as in Docker: `/proc/sys`, `/proc/sysrq-trigger`, `/proc/irq`, `/proc/bus` and `/proc/fs` read-only
(`/proc/sys/kernel/core_pattern` would otherwise make the host's kernel run any program as root; `/proc/fs`
only when something in it is writable, as /proc/fs/nfsd is); Docker's masked files (`/proc/kcore`,
`/proc/keys`, `/proc/timer_list`, `/proc/sched_debug`, ...) read as empty and its masked directories
(`/proc/acpi`, `/proc/scsi`, `/proc/asound`) as empty (a fresh tmpfs per command). The read-only
views are bind mounts of the host's procfs entries, which show the same thing: a sysctl answers for the
namespaces of the process that reads it. There is no /sys at all (Docker mounts it read-only).

Capabilities: Docker's default set less CAP_MKNOD and CAP_SYS_CHROOT (which nothing here needs), in every
isolation mode: no CAP_SYS_ADMIN, CAP_DAC_READ_SEARCH (`open_by_handle_at`, the "shocker" escape),
CAP_SYS_MODULE, CAP_SYS_PTRACE, CAP_SYS_RAWIO, CAP_NET_ADMIN, ...
"""

from __future__ import annotations

import os
import shutil

from ..base import SandboxError

__all__ = ["CAPABILITIES", "Jail", "find_bwrap"]

#: Docker's default capabilities, less CAP_MKNOD and CAP_SYS_CHROOT.
CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
)
#: Bound read-only; bubblewrap itself covers /proc/irq and /proc/bus (and would /proc/sys, but its check that
#: a directory is writable says no for /proc/sys).
_READ_ONLY = ("sys", "sysrq-trigger", "fs")
_MASKED_FILES = ("kcore", "keys", "key-users", "latency_stats", "timer_list", "timer_stats", "sched_debug")
_MASKED_DIRS = ("acpi", "scsi", "asound")
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def _proc_options(empty: str) -> list[str]:
    """The bubblewrap options for /proc, for the entries this kernel has. `empty` is an empty file: masked
    files are bound to it (not to /dev/null, which a `nodev` bind would make unreadable instead of empty)."""
    options = ["--proc", "/proc"]
    for name in _READ_ONLY:
        if _writable(f"/proc/{name}"):
            options += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
    for name in _MASKED_FILES:
        if os.path.isfile(f"/proc/{name}"):
            options += ["--ro-bind", empty, f"/proc/{name}"]
    for name in _MASKED_DIRS:
        if os.path.isdir(f"/proc/{name}"):
            options += ["--tmpfs", f"/proc/{name}"]  # empty; what a command writes there dies with it
    return options


def _writable(path: str) -> bool:
    """Does `path` exist and hold a file root may write? (Each bind costs every command a little, so entries
    with nothing writable in them, such as /proc/fs without nfsd, are left alone.)"""
    if not os.path.isdir(path):
        return os.path.exists(path)
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                if os.stat(os.path.join(dirpath, name)).st_mode & 0o222:
                    return True
            except OSError:
                continue
    return False


def find_bwrap() -> str:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError("workspace sandboxes need bubblewrap: apt-get install bubblewrap (or dnf, apk, ...)")
    _check_proc()
    return bwrap


def _check_proc() -> None:
    """bwrap and the mounts name processes by their pid in /proc, which must be this PID namespace's."""
    try:
        seen = os.readlink("/proc/self")
    except OSError as exc:
        raise SandboxError(f"workspace sandboxes need /proc mounted: {exc}") from None
    if seen != str(os.getpid()):
        raise SandboxError(
            f"this process is pid {os.getpid()} in its PID namespace but /proc names it {seen}: /proc belongs to "
            "another PID namespace, and bubblewrap would open other processes' files; mount a /proc for this one "
            "(unshare --pid --fork --mount-proc, or a container's own /proc)"
        )


class Jail:
    """The argv that starts a command in a sandbox root (see the module docstring). `empty` is the path of an
    empty, read-only file."""

    def __init__(self, empty: str) -> None:
        bwrap = find_bwrap()
        self._head = [
            bwrap,
            *("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--as-pid-1", "--die-with-parent"),
            "--new-session",
        ]
        self._tail = [
            *_proc_options(empty),
            # Per command, not per sandbox: each bind costs every later one a read of the mount table.
            *(arg for name in _DEVICES for arg in ("--dev-bind", f"/dev/{name}", f"/dev/{name}")),
            *("--cap-drop", "ALL"),
            *(arg for cap in CAPABILITIES for arg in ("--cap-add", cap)),
            *("--chdir", "/"),
        ]

    def argv(self, root: str, seccomp_fd: int | None) -> list[str]:
        """bubblewrap over `root` (a path in the sandbox's mount namespace), up to the command's `--`."""
        seccomp = [] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]
        return [*self._head, "--bind", root, "/", *self._tail, *seccomp, "--"]
