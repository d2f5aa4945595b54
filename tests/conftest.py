"""What every test shares: the `serial` and `slow` marks, for the default run's two pytest-xdist workers, and a heap
frozen at each test file's start (`pytest_runtest_setup`).

The default run (`python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder`, docs/development.md) runs
two test files at once, one per worker, the files with a `slow` test first. Nearly every test owns what it touches
(its own tmp, ports from the kernel, labels with its pid), but a few assert on what a killed process left in the
machine's usual places (/dev/shm, cgroups), which any factory made meanwhile by the other worker reclaims. Those
are marked `serial`: such a test runs while the other worker runs none (a readers-writer lock on two files the
workers share; a test waiting to run alone goes before the tests that arrive after it).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Each worker's share of the cores for torch's threads (the trainers' tests, and the examples they start), set
    # before anything imports torch. Two workers' torch at two threads each on two cores took 308 s for test_grpo.py
    # and test_trainer_trl.py side by side, at one thread each 81 s (OpenMP threads spin waiting for each other).
    cores = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a test marked `slow` first (in their order), then the rest: each worker takes the next file as it
    finishes one, so the longest start early and the short ones fill the end, instead of one long file starting
    last while the other worker idles."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within each group stays


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """At each test file's first test: collect what the files before it left, then move every object still alive
    (the modules imported so far, torch's among them) to the permanent generation, which no collection examines.
    The replay engine collects garbage before each step (`tvcache_bench.replay._PeakMemory`); once a worker had
    imported torch (test_grpo.py, test_trainer_trl.py run first), each of those collections walked its ~400,000
    objects: 143 collections took 52 s of test_replay.py's and test_strategies.py's 80 s. Objects made after the
    freeze are collected as before; only what was alive at a file's start and becomes garbage later is kept."""
    global _frozen_for
    if item.path != _frozen_for:
        _frozen_for = item.path
        gc.collect()
        gc.freeze()


#: The test file whose first test froze the heap (`pytest_runtest_setup`).
_frozen_for: Path | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Around setup, call and teardown: a fixture's setup (a factory made) counts as much as the test's body.
    with _turn(item, nextitem):
        yield


#: The lock, still held exclusively after a serial test whose next test is serial too.
_kept: IO[str] | None = None


def _serial(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("serial") is not None


@contextlib.contextmanager
def _turn(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _kept
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield  # one process: tests run one at a time anyway
        return
    lock, _kept = _kept, None
    if lock is None:
        # The run's temp root, shared by its workers (each has its own basetemp under it); private API, no public one.
        shared = Path(item.config._tmp_path_factory.getbasetemp()).parent  # type: ignore[attr-defined]
        lock = open(shared / "serial.lock", "a")  # noqa: SIM115 (it may outlive this call: `_kept`)
        with open(shared / "serial.gate", "a") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX)  # the gate keeps newcomers out while a serial test waits for the lock
            try:
                fcntl.flock(lock, fcntl.LOCK_EX if _serial(item) else fcntl.LOCK_SH)
            finally:
                fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        if _serial(item) and _serial(nextitem):
            # Kept for the next serial test: released between them, the lock let the other worker run a test of
            # its own each time, during which this worker waited, so the two took turns for the whole serial file
            # (tests/test_reclaim.py's 43 tests) instead of this one going on to other files afterwards.
            _kept = lock
        else:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
