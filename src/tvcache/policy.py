"""Decisions made from what the cache measures online: when to snapshot, and by which route a miss reaches its state.

Pure functions over measured costs, and what a task's rollouts showed of coming back to the same states, so they
can be tested and replaced on their own. (What to evict is the stores' decision: `stores.eviction`.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Costs", "Reuse", "Route", "cheapest_route", "should_snapshot", "worth_leasing"]


class _Mean:
    """An exponentially weighted mean of measured seconds (`None` until the first measurement)."""

    __slots__ = ("n", "value")

    def __init__(self) -> None:
        self.value: float | None = None
        self.n = 0

    def add(self, seconds: float) -> None:
        self.n += 1
        weight = max(0.2, 1.0 / self.n)  # plain mean for the first samples, then exponential
        self.value = seconds if self.value is None else self.value + weight * (seconds - self.value)


@dataclass
class Costs:
    """What one sandbox backend's operations cost, in seconds, as measured so far.

    Until an operation has been measured, it is estimated from one that has: a backend whose sandboxes are
    cheap to create is assumed cheap to snapshot and restore, so fast backends get snapshots (and so get
    measured) instead of being ruled out by a pessimistic constant.
    """

    measured_create: _Mean = field(default_factory=_Mean)
    measured_restore: _Mean = field(default_factory=_Mean)
    measured_snapshot: _Mean = field(default_factory=_Mean)
    prior: float = 0.01

    @property
    def create(self) -> float:
        return _first(self.measured_create.value, self.measured_restore.value, self.prior)

    @property
    def restore(self) -> float:
        return _first(self.measured_restore.value, self.measured_create.value, self.prior)

    @property
    def snapshot(self) -> float:
        return _first(self.measured_snapshot.value, self.measured_restore.value, self.measured_create.value, self.prior)


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)


class Reuse:
    """What one task's rollouts have shown so far of coming back to the same states: how many restores a
    snapshot taken at a given depth (edges from the root) can expect.

    Two counts say it, each an estimate of restores per snapshot, and the smaller one is believed:

    - *Revisits*: per depth, the states rollouts made there (they executed the edge: first to arrive) and the
      arrivals of later rollouts at a state already made (they hit the edge). Later arrivals per state made is
      how many rollouts came back to each state at that depth: about the group size above the depth where the
      group's rollouts diverge, about zero below it. Smoothed towards the depth above (capped at one revisit:
      one more rollout per state is what the cost-only rule assumed), so a depth nothing has reached yet
      borrows from its parent, and a few observations do not decide alone.
    - *Use*: snapshots restored (or forked ahead of need) per snapshot taken in the task, plus one of each: a
      state that rollouts come back to but replay through as hits (a second epoch of the same rollouts) needs
      no snapshot either.
    """

    __slots__ = ("made", "restored", "revisited", "taken")

    def __init__(self) -> None:
        self.made: list[int] = [0]  # per depth (index 0: the root, made once): states made there
        self.revisited: list[int] = [0]  # per depth: arrivals at a state made before
        self.taken = 0
        self.restored = 0

    def reached(self, depth: int, made: bool) -> None:
        """A rollout reached a state at `depth`, by executing the edge (`made`) or by hitting it."""
        while len(self.made) <= depth:
            self.made.append(0)
            self.revisited.append(0)
        if made:
            self.made[depth] += 1
        else:
            self.revisited[depth] += 1

    def expected(self, depth: int) -> float:
        """Restores a snapshot of a state at `depth` can expect."""
        revisits = 1.0
        for d in range(1, depth + 1):
            made, revisited = (self.made[d], self.revisited[d]) if d < len(self.made) else (0, 0)
            revisits = (revisited + min(revisits, 1.0)) / (made + 1)
        return min(revisits, (self.restored + 1) / (self.taken + 1))


def should_snapshot(rebuild_seconds: float, costs: Costs, reuses: float = 1.0) -> bool:
    """Snapshot a state when the rebuilds it is expected to save pay for it: each of the `reuses` expected restores
    saves rebuilding the state (restore the nearest snapshot or create, then replay the calls since) at the price of
    a restore, and saving it costs a snapshot now."""
    return reuses * (rebuild_seconds - costs.restore) > costs.snapshot


class Route(enum.IntEnum):
    """Ways to bring a live sandbox to a rollout's state; on equal cost the lower value wins (less work)."""

    CATCH_UP = 0  # replay, in the rollout's own sandbox, the edges it skipped as hits
    FRESH = 1  # a new sandbox from the base, then replay every edge
    RESTORE = 2  # restore the deepest snapshot on the path, then replay the edges below it


def worth_leasing(catch_up: float, fresh: float, restore: float) -> bool:
    """Whether asking the store for a snapshot to restore is worth a round trip: only when restoring, before any
    replay, already costs less than the cheaper of the other two routes."""
    return min(catch_up, fresh) > restore


def cheapest_route(catch_up: float, fresh: float, restore: float | None) -> Route:
    """The cheapest route, given each one's estimated seconds (restore: None when no snapshot is leased).

    Costs include the replays each route needs; `inf` rules a route out (no sandbox to catch up)."""
    options = [(catch_up, Route.CATCH_UP), (fresh, Route.FRESH)]
    if restore is not None:
        options.append((restore, Route.RESTORE))
    return min(options)[1]
