"""A model's bad calls, and what every sandbox must do with them: answer a refusal (`error=True`, unchanged), the
same every time, and carry on with its state as it was; through the cache, the rollout carries on in the same
sandbox (nothing is rebuilt or replayed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tvcache import Sandbox, Sandboxes, ToolCache, ToolCall

#: Bad calls of the shell sandboxes' tools (workspace, Docker): unknown tools, malformed JSON (kept as text),
#: missing arguments, wrong types, NUL bytes where a command line or a path cannot hold one, half a surrogate pair.
SHELL = [
    ("python", {"code": "1"}),
    ("bash", "ls -la {"),
    ("bash", '["ls"]'),
    ("bash", {"cmd": "ls"}),
    ("bash", {"command": ["ls"]}),
    ("bash", {"command": None}),
    ("read_file", {"path": 5}),
    ("write_file", {"path": "x"}),
    ("list_dir", {}),
    ("bash", {"command": "echo a\0b"}),
    ("read_file", {"path": "a\0b"}),
    ("list_dir", {"path": "\0"}),
    ("bash", '{"command": "echo \\ud800"}'),  # half a surrogate pair, escaped in the model's JSON
    ("read_file", {"path": "a\ud800"}),
    ("write_file", {"path": "x", "content": "\udfff"}),
]
#: A call that changes a shell sandbox's state, and one that reads it.
SHELL_STATE = (
    ToolCall("write_file", {"path": "/tmp/kept.txt", "content": "still here"}),
    ToolCall("bash", {"command": "cat /tmp/kept.txt; ls /tmp"}),
)
#: Bad calls of SQLite sandboxes' one tool.
SQL = [
    ("bash", {"command": "ls"}),
    ("sql", "SELECT 1"),
    ("sql", {"sql": "SELECT 1"}),
    ("sql", {"query": 1}),
    ("sql", {"query": "SELECT 1", "limit": 2}),
    ("sql", {"query": None}),
]


async def check(boxes: Sandboxes, bad: Sequence[tuple[str, Any]], write: ToolCall, read: ToolCall) -> None:
    """Both checks below, on a sandbox of `boxes` and through the cache."""
    box = await boxes.create()
    try:
        await check_refused(box, bad, write, read)
    finally:
        await box.close()
    await check_rollout_goes_on(boxes, bad, write, read)


async def check_refused(box: Sandbox, bad: Sequence[tuple[str, Any]], write: ToolCall, read: ToolCall) -> None:
    """`write` changes the sandbox's state and `read` reads it: after each bad call, twice, `read` answers as before."""
    await box.execute(write)
    before = (await box.execute(read)).output
    answers = []
    for _ in range(2):
        for tool, args in bad:
            outcome = await box.execute(ToolCall(tool, args))
            assert outcome.error and outcome.changed is False, (tool, args, outcome)
            answers.append(outcome.output)
    assert answers[: len(bad)] == answers[len(bad) :]  # the same message each time
    assert len({repr(a) for a in answers}) > 1  # each says what is wrong with its own call
    assert (await box.execute(read)).output == before


async def check_rollout_goes_on(
    boxes: Sandboxes, bad: Sequence[tuple[str, Any]], write: ToolCall, read: ToolCall
) -> None:
    """Through the cache: the bad calls are error results, and the rollout's next call runs in the same sandbox."""
    cache = ToolCache()
    try:
        async with cache.rollout("bad-calls", boxes) as rollout:
            await rollout.call(write.tool, write.args)
            results = [await rollout.call(tool, args) for tool, args in bad]
            assert all(r.error and not r.hit for r in results)
            after = await rollout.call(read.tool, read.args)
        stats = cache.stats()
        assert stats["creates"] == 1 and stats["replays"] == 0 and stats["restores"] == 0, stats
        assert stats["detached"] == 0 and stats["failures"] == len(bad)
        box = await boxes.create()  # the oracle: the same good calls in a fresh sandbox, no cache
        try:
            await box.execute(write)
            assert after.output == (await box.execute(read)).output
        finally:
            await box.close()
    finally:
        await cache.close()
