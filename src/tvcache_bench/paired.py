"""The paired cost of a command: each strategy's executions against the baseline's executions of the same calls.

Totals of tool time compare strategies that ran in different windows of a shared machine, so the load of each
window decides them as much as the strategy does. Pairing asks a narrower question: when a strategy executes a
call (a miss), does the command itself take longer than when no cache executes it? A pair is the same call of
the same rollout in the same epoch (the key `(epoch, rollout, call)`: the same task, the same command, after the
same history of calls), executed without error by both the strategy and the baseline (`none`), with the same
answer (durations the command printed masked, as the oracle compares them). A different answer means the call
may have run in another state (a naive hit skipped a write) or the tool is not deterministic there, so it is not
the same work. The strategy's hits are no work at all and are not pairs.

Each side of a pair is the execution alone, as the strategy's rollout counts it (`RolloutStats`): its wall time
(no lookup, sandbox creation, restore, replay or snapshot) and, where the sandbox measures it, the CPU time the
command's processes used (a workspace or Docker command: its sandbox's or container's cgroup). CPU time moves less
with the machine's load than wall time does. The figures: the sums over the pairs, and the median of the
per-command ratios (strategy / baseline), above 1 when the strategy's commands cost more.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Execution", "Key", "paired"]

Key = tuple[int, int, int]  # (epoch, rollout, call)


@dataclass(frozen=True, slots=True)
class Execution:
    """One executed call: its wall seconds, its CPU seconds (None: not measured) and the digest of its answer."""

    seconds: float
    cpu_seconds: float | None
    answer: bytes


def paired(executed: Mapping[Key, Execution], baseline: Mapping[Key, Execution], name: str) -> dict[str, Any]:
    """The paired cost of `executed` against the `baseline` strategy's executions, named `name` (see the module
    docstring): `commands` pairs, the executions left out (`unpaired`: the baseline did not execute the call
    without error; `different_answers`), wall and CPU sums over the pairs, and the medians of per-command ratios
    (None without a pair; the CPU figures are over the pairs measured on both sides)."""
    pairs = []
    unpaired = different = 0
    for key, mine in executed.items():
        theirs = baseline.get(key)
        if theirs is None:
            unpaired += 1
        elif theirs.answer != mine.answer:
            different += 1
        else:
            pairs.append((mine, theirs))
    cpu = [(m.cpu_seconds, t.cpu_seconds) for m, t in pairs]
    timed = [(m, t) for m, t in cpu if m is not None and t is not None]
    return {
        "baseline": name,
        "commands": len(pairs),
        "unpaired": unpaired,
        "different_answers": different,
        "seconds": sum(m.seconds for m, _ in pairs),
        "baseline_seconds": sum(t.seconds for _, t in pairs),
        "median_ratio": _median_ratio([(m.seconds, t.seconds) for m, t in pairs]),
        "cpu_commands": len(timed),
        "cpu_seconds": sum(m for m, _ in timed),
        "baseline_cpu_seconds": sum(t for _, t in timed),
        "median_cpu_ratio": _median_ratio(timed),
    }


def _median_ratio(pairs: list[tuple[float, float]]) -> float | None:
    """The median of mine / theirs over the pairs whose baseline side is above zero (a ratio to nothing is none)."""
    ratios = [mine / theirs for mine, theirs in pairs if theirs > 0]
    return statistics.median(ratios) if ratios else None
