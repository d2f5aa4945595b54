"""A hostile command against the sandbox machinery itself (issue 19): a PID 1 that outlives its timeout, a racer
that swaps files and symlinks while a snapshot copies them, trees deeper and paths longer than the host's own
walks and PATH_MAX allow. Each reproduces what an attacker did to the landed code, in every isolation mode that
works here; each failed before its fix.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shell_oracle import out, run
from test_workspace import MODES, small_base, usable
from tvcache import ToolCall
from tvcache.sandboxes.workspace import WorkspaceSandboxes


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return usable(str(request.param))


@pytest.fixture
def base() -> Iterator[Path]:
    with small_base() as path:
        yield path


def _running(token: str) -> list[int]:
    """Live processes whose command line holds `token` (a zombie's reads as empty)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _gone(token: str) -> bool:
    # The kernel tears a PID namespace down asynchronously; give it a moment, not a deadline to meet.
    for _ in range(200):
        if not _running(token):
            return True
        time.sleep(0.01)
    return False


# Clears its parent-death signal, ignores every signal it can, and runs until killed.
SURVIVOR = """import ctypes, signal, time
ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(s, signal.SIG_IGN)
while True:
    time.sleep(0.05)
"""


async def _timed_out(box: object, command: str) -> None:
    await box.execute(ToolCall("write_file", {"path": "/tmp/survivor.py", "content": SURVIVOR}))  # type: ignore[attr-defined]
    outcome = await box.execute(ToolCall("bash", {"command": command}))  # type: ignore[attr-defined]
    assert outcome.error and "timed out" in outcome.output["error"], outcome


def test_a_timeout_ends_a_pid_1_that_cleared_its_parent_death_signal(base: Path, mode: str) -> None:
    token = "survivor-" + secrets.token_hex(6)

    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation=mode, timeout=2) as boxes:  # type: ignore[arg-type]
            box = await boxes.create()
            await _timed_out(box, f"exec python3 /tmp/survivor.py {token}")
            assert _gone(token), f"the command's PID 1 outlived its timeout: {_running(token)}"
            # The sandbox goes on, and a snapshot of it copies a sandbox where nothing runs.
            assert await out(box, "echo after") == "after\n"
            other = await boxes.restore(await box.snapshot())
            assert await out(other, "echo restored") == "restored\n"

    run(main())


def test_a_timeout_ends_every_process_the_command_started(base: Path, mode: str) -> None:
    token = "orphan-" + secrets.token_hex(6)
    # Children in new sessions, double-forked, each clearing its parent-death signal.
    command = f"for i in 1 2 3; do setsid sh -c 'python3 /tmp/survivor.py {token} &'; done; sleep 100"

    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation=mode, timeout=2) as boxes:  # type: ignore[arg-type]
            box = await boxes.create()
            await _timed_out(box, command)
            assert _gone(token), f"processes the command started outlived its timeout: {_running(token)}"

    run(main())
