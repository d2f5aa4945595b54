"""Decisions made from measured costs: when to snapshot, and by which route a miss reaches its state.

Pure functions over numbers the cache measures online, so they can be tested and replaced on their own.
(What to evict is the stores' decision: `stores.eviction`.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Costs", "Route", "cheapest_route", "should_snapshot", "worth_leasing"]


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


def should_snapshot(rebuild_seconds: float, costs: Costs) -> bool:
    """Snapshot a state when rebuilding it (restore the nearest snapshot or create, then replay the calls
    since) costs more than saving it now and restoring it later."""
    return rebuild_seconds > costs.snapshot + costs.restore


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
