"""Which process an object belongs to: the one that made it, never a child forked from it.

A forked child (a worker pool, a daemonising library) holds a copy of every object of its parent: a sandbox
factory whose cleanup would remove the parent's live sandboxes, a database connection and the thread that served
it, a tracer's buffer. Such an object remembers how many forks its process had seen when it was made, and is
inherited wherever that count differs:

    self._owner = forks()            # when made
    if inherited(self._owner): ...   # a forked child's copy: leave the parent's things alone

Not the pid: a container's first process (pid 1) may fork a child into a PID namespace of its own (unshare then
fork, as a nested container or sandbox tool does), whose first process is pid 1 too.
"""

from __future__ import annotations

import os

__all__ = ["forks", "inherited"]

_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def forks() -> int:
    """How many forks lie between the first process that imported tvcache and this one. An object reaches only
    processes forked from its maker (or from those), each counting more forks than the one it was forked from: so
    the count tells the maker from every process holding a copy."""
    return _forks


def inherited(token: int) -> bool:
    """Was `token` (a `forks()`) taken by a process this one was forked from?"""
    return token != _forks
