"""This process's Python, run inside a workspace sandbox: what to mount and the command line.

A workspace sandbox shows the host's root filesystem, read-only beneath it, but not /tmp, /run, /dev, /proc,
/sys, /mnt, /media or other filesystems: those it makes its own. An interpreter (or a venv) living there, say a
venv under /tmp, is missing inside, and every command that runs it fails. So each of this interpreter's prefixes
(`sys.prefix`, the venv's, with its site-packages; `sys.base_prefix`, the Python it was made from, with the
standard library) that a sandbox cannot see is mounted into it at a path of its own, as a lower layer: what the
sandbox writes there lands in its own upper directory, never on the host.

The command then runs the base interpreter from where the sandbox sees it, with no `site` processing (`-S`) and
this process's `sys.path` (its prefixes moved to where the sandbox sees them) as PYTHONPATH: so it imports what
this process imports, .pth additions included, wherever the venv is and whether or not it uses the system's
packages. `-B`: compiling modules must not write `__pycache__` files into the sandbox's state.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass

__all__ = ["SandboxedPython", "sandboxed_python"]

#: Top-level directories a workspace sandbox replaces with its own (see tvcache.sandboxes.workspace._layout).
_HIDDEN_TOPS = frozenset({"tmp", "run", "dev", "proc", "sys", "mnt", "media"})


@dataclass(frozen=True)
class SandboxedPython:
    mounts: dict[str, str]
    """Sandbox mount point -> host directory, for the prefixes a sandbox does not see (add them to its base)."""
    command: str
    """A shell command line that starts the interpreter in the sandbox, to be followed by a script and its
    arguments."""


def sandboxed_python(at: str = "/opt/tvcache-python") -> SandboxedPython:
    """How to run this process's interpreter in a workspace sandbox; hidden prefixes are mounted at `at`/N."""
    moved: dict[str, str] = {}  # host prefix -> where the sandbox sees it
    for prefix in dict.fromkeys(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)):
        if not _visible(prefix):
            moved[prefix] = f"{at}/{len(moved)}"

    def inside(path: str) -> str:
        real = os.path.realpath(path)
        for prefix, point in moved.items():
            if real == prefix or real.startswith(prefix + os.sep):
                return point + real[len(prefix) :]
        return real

    executable = inside(getattr(sys, "_base_executable", sys.executable))
    # The current directory ('') and entries with a ':' (which PYTHONPATH cannot hold) are left out.
    path = [inside(p) for p in sys.path if p and os.pathsep not in p and os.path.exists(p)]
    env = f"PYTHONPATH={shlex.quote(os.pathsep.join(dict.fromkeys(path)))}"
    base = os.path.realpath(sys.base_prefix)
    if base in moved:  # a Python built with --enable-shared finds libpython by an absolute path (RUNPATH)
        env += f" LD_LIBRARY_PATH={shlex.quote(moved[base] + '/lib')}"
    return SandboxedPython(
        mounts={point: prefix for prefix, point in moved.items()},
        command=f"{env} {shlex.quote(executable)} -S -B",
    )


def _visible(path: str) -> bool:
    """Does a workspace sandbox over the host's `/` see `path` where the host does: on the root filesystem,
    outside the directories the sandbox makes its own?"""
    top = path.strip("/").split("/", 1)[0]
    try:
        return top not in _HIDDEN_TOPS and os.stat(path).st_dev == os.stat("/").st_dev
    except OSError:
        return False
