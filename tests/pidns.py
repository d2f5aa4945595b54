"""A process that is the first of a PID namespace of its own (pid 1), as a container's first process is, and a child
it forks into a namespace of its own, whose pid is 1 too: for tests of what tells a forked child from its parent.

    found = run_python(SCRIPT, "arg", namespace=True)   # what SCRIPT printed as JSON; skips without unshare
    # in SCRIPT:
    child = fork(new_namespace=True, alarm=30)          # 0 in the child, whose os.getpid() is 1
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest

__all__ = ["IN_A_PID_NAMESPACE", "fork", "run_python"]

#: A new PID namespace (and /proc for it), as a container gives its processes.
IN_A_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", "--"]
CLONE_NEWPID = 0x20000000


def run_python(script: str, *args: str, namespace: bool, own_proc: bool = True) -> Any:
    """What the Python program `script` printed as JSON, run with `args` in a process of its own, in a PID namespace
    of its own if `namespace` (then it is that namespace's first process: its pid is 1), with a /proc of that
    namespace unless not `own_proc` (then /proc is the machine's, where pid 1 is another process). `script` can
    import the tests' modules."""
    if namespace and (shutil.which("unshare") is None or subprocess.run([*IN_A_PID_NAMESPACE, "true"]).returncode):
        pytest.skip("unshare cannot make a PID namespace here")
    unshare = IN_A_PID_NAMESPACE if own_proc else [w for w in IN_A_PID_NAMESPACE if w != "--mount-proc"]
    argv = [*(unshare if namespace else []), sys.executable, "-c", script, *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def fork(*, new_namespace: bool, alarm: int) -> int:
    """`os.fork()`, the child in a PID namespace of its own if `new_namespace` (it is that namespace's first
    process: pid 1), the parent's later children in the parent's namespace as before. The child ends with status 3
    if it still runs after `alarm` seconds (a namespace's first process ignores signals it has no handler for)."""
    if not new_namespace:
        child = os.fork()
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.unshare(CLONE_NEWPID) != 0:  # for the children made from now on
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWPID)")
            child = os.fork()
            # Back to the parent's own namespace for its later children: none could be made in the new one once
            # its first process ends.
            if child != 0 and libc.setns(own, CLONE_NEWPID) != 0:
                raise OSError(ctypes.get_errno(), "setns(CLONE_NEWPID)")
        finally:
            os.close(own)
    if child == 0:
        signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
        signal.alarm(alarm)
    return child
