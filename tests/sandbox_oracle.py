"""The sandbox-level oracle shared by the backends' tests: a sandbox that is snapshotted, restored and rewound
at random points must answer exactly as a fresh sandbox executing the same history does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tvcache import Outcome, Sandboxes, ToolCall

# A step: ("call", ToolCall) executes it; ("restore", _) continues on a restored copy of a snapshot of the
# current sandbox; ("rewind", i) goes back to the i-th snapshot taken so far (its state and its history).
Step = tuple[str, Any]


async def check_snapshots_against_fresh_replay(factory: Sandboxes, steps: Sequence[Step]) -> None:
    box = await factory.create()
    history: list[tuple[ToolCall, Outcome]] = []
    snapshots: list[tuple[str, list[tuple[ToolCall, Outcome]]]] = []  # each with the history it holds
    for kind, arg in steps:
        if kind == "call":
            history.append((arg, await box.execute(arg)))
            continue
        if kind == "rewind" and snapshots:
            snap, saved = snapshots[arg % len(snapshots)]
            history = list(saved)
        else:
            snap = await box.snapshot()
            snapshots.append((snap, list(history)))
        await box.close()
        box = await factory.restore(snap)
    await box.close()
    fresh = await factory.create()
    try:
        for call, outcome in history:
            assert await fresh.execute(call) == outcome, call
    finally:
        await fresh.close()
