"""Snapshots by expected reuse (`policy.Reuse`): a state is saved only where the restores the task's rollouts so far
let one expect, times what each saves, pay for the snapshot. Rollouts that diverge early take few snapshots;
rollouts that share a prefix get snapshots where they share it, and restore them."""

from __future__ import annotations

import asyncio
from typing import Any

import kv
import tvcache
from faults import FaultySandboxes
from tvcache.policy import Costs, Reuse, should_snapshot

GROUP = 6  # rollouts per task per step
STEPS = 3


def costs(snapshot: float, restore: float) -> Costs:
    made = Costs()
    made.measured_snapshot.add(snapshot)
    made.measured_restore.add(restore)
    made.measured_create.add(restore)
    return made


def test_with_nothing_known_it_is_the_cost_rule() -> None:
    reuse, c = Reuse(), costs(0.01, 0.005)
    assert reuse.expected(1) == 1.0
    assert should_snapshot(0.02, c, reuse.expected(1)) and not should_snapshot(0.014, c, reuse.expected(1))


def test_rollouts_that_diverge_at_their_first_call_expect_no_reuse() -> None:
    reuse = Reuse()
    for _ in range(STEPS * GROUP):  # every rollout makes its own states
        for depth in (1, 2, 3):
            reuse.reached(depth, made=True)
    reuse.taken = GROUP  # the first step's first states were saved, on the prior; none was restored
    assert all(reuse.expected(depth) < 0.1 for depth in (1, 2, 3, 4))
    # A state ten times dearer to rebuild than to save is not saved: nobody comes back to it.
    assert not should_snapshot(0.1, costs(0.01, 0.001), reuse.expected(2))


def test_a_shared_prefix_expects_the_group_back_and_the_depths_below_it_do_not() -> None:
    reuse = Reuse()
    for _ in range(STEPS):
        for rollout in range(GROUP):  # the group shares two calls, then each goes its own way
            for depth in (1, 2):
                reuse.reached(depth, made=rollout == 0)
            reuse.reached(3, made=True)
    reuse.taken, reuse.restored = STEPS * 2, STEPS * (GROUP - 1)  # the shared state's snapshot served the group
    assert reuse.expected(2) > 1.5
    assert reuse.expected(3) < 0.2 and reuse.expected(4) < reuse.expected(3) + 1e-9
    c = costs(0.01, 0.001)
    assert should_snapshot(0.02, c, reuse.expected(2)) and not should_snapshot(0.02, c, reuse.expected(3))


def test_states_revisited_only_by_hits_are_not_worth_saving() -> None:
    """A second epoch of the same rollouts comes back to every state but replays through them as hits: the
    snapshots taken are never restored, and the task stops taking them."""
    reuse = Reuse()
    for rollout in range(GROUP):
        reuse.reached(1, made=rollout == 0)
    reuse.taken = 20
    assert reuse.expected(1) < 0.1


async def run_steps(plan: Any, delay: float = 0.02) -> list[dict[str, float]]:
    """`STEPS` training steps of one task, `GROUP` concurrent rollouts each (`plan(step, rollout)`: their calls);
    the cache's stats after each step."""
    boxes = FaultySandboxes(kv.sandboxes())
    boxes.snapshot_delay = delay
    async with tvcache.ToolCache() as cache:

        async def rollout(step: int, i: int) -> None:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                for tool, args in plan(step, i):
                    assert not (await r.call(tool, args)).error

        after = []
        for step in range(STEPS):
            await asyncio.gather(*(rollout(step, i) for i in range(GROUP)))
            await cache.flush()
            after.append(cache.stats())
        return after


def write(key: str, delay: float = 0.05) -> tuple[str, dict[str, Any]]:
    return ("write", {"key": key, "value": "v", "delay": delay})


def test_rollouts_that_diverge_early_take_few_snapshots() -> None:
    first, *_, stats = asyncio.run(run_steps(lambda step, i: [write(f"s{step}r{i}c{c}") for c in range(3)]))
    states = STEPS * GROUP * 3  # each dearer to rebuild (50 ms a call) than to save (20 ms): the cost rule saves all
    assert stats["snapshots"] + stats["snapshots_skipped"] >= states - GROUP
    # The first step saved some states before anything was known; once it showed that nobody comes back, the
    # next steps save few of their 2 x 18 (measured costs vary with the machine's load: not none for sure).
    assert stats["snapshots"] - first["snapshots"] <= GROUP
    assert stats["restores"] == 0


def test_rollouts_that_share_a_prefix_snapshot_it_and_restore_it() -> None:
    def plan(step: int, i: int) -> list[tuple[str, dict[str, Any]]]:
        return [write("a"), write("b"), write(f"s{step}r{i}"), ("read", {"key": f"s{step}r{i}"})]

    *_, stats = asyncio.run(run_steps(plan))
    # The shared state is saved and every rollout but its maker restores it for its own write, step after step.
    assert stats["restores"] + stats["warm"] >= (STEPS * GROUP - 1) * 0.8
    assert 1 <= stats["snapshots"] <= 2 + GROUP
    assert stats["snapshots_skipped"] >= GROUP  # the rollouts' own states: nobody comes back to them
