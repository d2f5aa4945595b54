"""What the shell backends' tests share (workspace sandboxes, Docker sandboxes, images as layers): helpers to run a
command, a listener on the host's loopback, and the oracle invariant on random shell workloads: concurrent rollouts
through a ToolCache must get exactly what the same histories give executed uncached in fresh sandboxes."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from typing import Any

import tvcache
from tvcache import ToolCall

FILES = ["a", "b", "data/a.txt", "data/b.txt", "d/e", "README"]
DIRS = ["/testbed", "/testbed/data", "/testbed/d", "/tmp/w"]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def bash(box: Any, command: str) -> dict[str, Any]:
    outcome = await box.execute(ToolCall("bash", {"command": command}))
    assert not outcome.error, outcome
    assert isinstance(outcome.output, dict)
    return outcome.output


async def out(box: Any, command: str) -> str:
    return str((await bash(box, command))["output"])


class Listener:
    """A TCP server on the host's loopback that greets whoever connects: what a sandbox without network must not
    reach."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.sendall(b"hello from the host\n")
            conn.close()


def random_command(rng: random.Random) -> str:
    """A shell step: file writes, appends, deletes, renames, cd, export, or a read."""
    f, g = rng.choice(FILES), rng.choice(FILES)
    word = rng.choice(["x", "y", "zz", "a b"])
    n = rng.randrange(4)
    return rng.choice(
        [
            f"mkdir -p $(dirname {f}) && echo '{word}' > {f}",
            f"echo '{word}' >> {f} 2>&1",
            f"rm -f {f}",
            f"rm -rf {rng.choice(['data', 'd', 'src', 'replaced'])}",
            f"mv {f} {g} 2>&1; echo $?",
            f"mkdir -p {rng.choice(DIRS)} && cd {rng.choice(DIRS)}",
            f"export V{n}='{word}'",
            f"unset V{n}",
            f"cat {f} 2>&1",
            "pwd; env | grep ^V | sort",
            "find /testbed /tmp/w 2>/dev/null | sort",
            f"wc -c {f} 2>&1; ls -1A",
        ]
    )


def rollout_plan(seed: int, rollouts: int, length: int) -> list[list[str]]:
    """Rollouts sharing a prefix, then diverging (as GRPO samples of one task do)."""
    rng = random.Random(seed)
    shared = [random_command(rng) for _ in range(length)]
    plan = []
    for _ in range(rollouts):
        cut = rng.randrange(length + 1)
        plan.append(shared[:cut] + [random_command(rng) for _ in range(length - cut)])
    return plan


async def uncached(oracle: Any, commands: list[str]) -> list[dict[str, Any]]:
    """The oracle: a history executed in one fresh sandbox, no cache involved."""
    box = await oracle.create()
    try:
        return [await bash(box, c) for c in commands]
    finally:
        await box.close()


async def cached_rollouts_wrong(boxes: Any, oracle: Any, plan: list[list[str]], rounds: int) -> int:
    """Run `plan` through a ToolCache `rounds` times (concurrent rollouts, random pauses), then two rollouts that
    rebuild a state; count the answers that differ from the oracle's fresh uncached sandboxes."""
    rng = random.Random(len(plan))
    expected = [await uncached(oracle, commands) for commands in plan]
    wrong = 0
    async with tvcache.ToolCache(snapshot_budget=4) as cache:

        async def rollout(commands: list[str]) -> list[Any]:
            got = []
            async with cache.rollout("task", boxes) as r:
                for command in commands:
                    await asyncio.sleep(rng.choice([0, 0.002, 0.01]))
                    got.append((await r.call("bash", {"command": command})).output)
            return got

        for _ in range(rounds):  # later rounds mostly hit
            results = await asyncio.gather(*(rollout(c) for c in plan))
            for want, got in zip(expected, results, strict=True):
                wrong += sum(a != b for a, b in zip(got, want, strict=True))
        # However the timing fell above, a state to rebuild: one rollout makes a change, and the next, which hits
        # it, misses right after and needs a sandbox in that state (restored from a snapshot, or replayed).
        change = [*plan[0], "echo rebuilt >> rebuilt.log"]
        for commands in (change, [*change, "cat rebuilt.log; ls -A"]):
            want = await uncached(oracle, commands)
            wrong += sum(a != b for a, b in zip(await rollout(commands), want, strict=True))
        stats = cache.stats()
        assert stats["hits"] > 0 and stats["snapshots"] + stats["replays"] > 0, stats
    return wrong
