"""Run a function in a short-lived thread of its own and hand back its result or its exception.

For work that must not happen on the caller's thread: switching a thread's network namespace (the rest of the
process stays where it was), or running an event loop from code that may already be inside one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["in_own_thread"]

T = TypeVar("T")


def in_own_thread(work: Callable[[], T], name: str) -> T:
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
