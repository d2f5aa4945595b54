"""Helpers for microbenchmarks that run a server and its load in separate processes."""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "pin"]


def pin(pid: int, cpu: int) -> None:
    """Keep a process on one core (where there are two or more), so the server and its load do not compete."""
    if (os.cpu_count() or 1) >= 2 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, {cpu})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
