"""Work in threads: a function in a short-lived thread of its own (`in_own_thread`), and a copy in a worker thread
that a cancellation waits for (`to_thread_to_the_end`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["in_own_thread", "to_thread_to_the_end"]

T = TypeVar("T")


async def to_thread_to_the_end(work: Callable[..., T], *args: Any) -> T:
    """`asyncio.to_thread(work, *args)`, except that a cancellation is raised only once the thread has ended: a
    thread cannot be stopped, and a caller that removes what a cancelled copy made must not race the copy."""
    running = asyncio.ensure_future(asyncio.to_thread(work, *args))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        if not running.cancelled():
            running.exception()  # retrieved: the cancellation is what the caller hears of
        raise


def in_own_thread(work: Callable[[], T], name: str) -> T:
    """For work that must not happen on the caller's thread: switching a thread's network namespace (the rest of
    the process stays where it was), or running an event loop from code that may already be inside one."""
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(work())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
