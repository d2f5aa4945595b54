"""`tvcache bench quick`: the README's main job. Well under a minute on 2 cores.

A mix of SQL rollouts on real databases (the data that ships with tvcache, `tvcache_bench/data/sql/`), replayed
under no cache, the naive (tool, args) cache, the published strategy and tvcache, on the same GRPO schedule, with
every answer checked against the uncached one:

- text-to-SQL tasks of the `sql` workload (`tvcache_bench.workloads.sql.build_workload`: Spider-de, Geography,
  Chinook questions; TPC-H left out, its queries take seconds each), when that module is installed;
- `chinook-writes` (`chinook_workload`, below): questions over the Chinook database whose exploring agents
  also change data now and then (an UPDATE of prices, an INSERT, a DELETE of playlist entries) before
  querying it again, as agents with write access do. These make the difference between caches visible
  without depending on timing: a rollout that changed a table must not be served another rollout's answer.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import random
from typing import Any

from tvcache.calls import Tools

from ..data import workload_path
from ..replay import ReplayOptions, ReplayResult, replay_strategies
from ..report import print_table, wide_console, write_charts
from ..strategies import STRATEGIES
from ..traces import Trace, TraceCall, task_order
from ..turns import TurnTime
from ..workload import Workload, combine

__all__ = ["SIZES", "STRATEGIES", "build", "chinook_workload", "quick", "run", "sql_workload"]


# Full: well under a minute for all four strategies on 2 cores. Small: a few seconds, for tests; its rollouts
# run one at a time, so which answers a naive cache gets wrong does not depend on timing.
SIZES: dict[str, dict[str, int]] = {
    "full": {"sql_tasks": 56, "chinook_tasks": 8, "rollouts": 8, "epochs": 3, "concurrency": 8},
    "small": {"sql_tasks": 2, "chinook_tasks": 3, "rollouts": 6, "epochs": 2, "concurrency": 1},
}


async def sql_workload(tasks: int, rollouts: int, seed: int) -> Workload | None:
    """The `sql` workload's first `tasks` tasks without TPC-H, or None where that module is not installed."""
    try:
        sql = importlib.import_module("tvcache_bench.workloads.sql")
    except ModuleNotFoundError as exc:
        if exc.name != "tvcache_bench.workloads.sql":
            raise  # the module is there but something it needs is not: say so, do not hide it
        return None
    options: dict[str, Any] = {"tasks": tasks, "rollouts": rollouts, "seed": seed}
    if "tpch" in inspect.signature(sql.build_workload).parameters:
        options["tpch"] = False  # its seconds-long joins (and building its data) do not fit in a minute
    made = sql.build_workload(**options)
    workload: Workload = await made if inspect.isawaitable(made) else made
    return workload


async def build(size: str = "full", seed: int = 0) -> Workload:
    """The quick mix: the chinook-writes tasks spread evenly among the sql workload's tasks."""
    s = SIZES[size]
    writes = chinook_workload(s["chinook_tasks"], s["rollouts"], seed)
    sql = await sql_workload(s["sql_tasks"], s["rollouts"], seed)
    if sql is None:
        return writes
    first, second = task_order(sql.traces), task_order(writes.traces)
    every = max(1, len(first) // max(1, len(second)))
    order: list[str] = []
    for i, task in enumerate(first):
        if i % every == every - 1 and second:
            order.append(second.pop(0))
        order.append(task)
    return combine("quick", [sql, writes], order + second)


async def quick(
    size: str = "full", seed: int = 0, progress: bool = True, turn_time: TurnTime | None = None
) -> ReplayResult:
    s = SIZES[size]
    workload = await build(size, seed)
    try:
        options = ReplayOptions(
            batch=4,
            epochs=s["epochs"],
            concurrency=s["concurrency"],
            progress=progress,
            turn_time=turn_time or TurnTime(),
        )
        return await replay_strategies(workload, STRATEGIES, options)
    finally:
        await workload.close()


def run(
    charts: str | None = None,
    *,
    small: bool = False,
    seed: int = 0,
    progress: bool = True,
    turn_time: TurnTime | None = None,
) -> dict[str, Any]:
    """Run the quick job, print its table (and write charts into `charts`); returns the JSON summary. No model
    turns between calls unless `turn_time` says (they would take it past a minute)."""
    console = wide_console()
    result = asyncio.run(
        quick("small" if small else "full", seed, progress=progress and not small, turn_time=turn_time)
    )
    print_table(result, console)
    if charts:
        for path in write_charts(result, charts):
            console.print(f"chart: {path}")
    return result.summary()


# -- the built-in generator ----------------------------------------------------------------------------

# (question, tables it needs, gold query)
CHINOOK_TASKS = [
    (
        "How many tracks does each genre have?",
        ["Track", "Genre"],
        "SELECT g.Name, COUNT(*) AS n FROM Track t JOIN Genre g ON g.GenreId = t.GenreId "
        "GROUP BY g.Name ORDER BY n DESC",
    ),
    (
        "Which five customers spent the most?",
        ["Customer", "Invoice"],
        "SELECT c.FirstName, c.LastName, ROUND(SUM(i.Total), 2) AS spent FROM Customer c "
        "JOIN Invoice i ON i.CustomerId = c.CustomerId GROUP BY c.CustomerId ORDER BY spent DESC LIMIT 5",
    ),
    (
        "What is the average track length per media type?",
        ["Track", "MediaType"],
        "SELECT m.Name, ROUND(AVG(t.Milliseconds)) AS ms FROM Track t JOIN MediaType m "
        "ON m.MediaTypeId = t.MediaTypeId GROUP BY m.Name ORDER BY ms DESC",
    ),
    (
        "Which artists have the most albums?",
        ["Artist", "Album"],
        "SELECT ar.Name, COUNT(*) AS albums FROM Album al JOIN Artist ar ON ar.ArtistId = al.ArtistId "
        "GROUP BY ar.ArtistId ORDER BY albums DESC, ar.Name LIMIT 10",
    ),
    (
        "What are the total sales per billing country?",
        ["Invoice"],
        "SELECT BillingCountry, ROUND(SUM(Total), 2) AS sales FROM Invoice GROUP BY BillingCountry ORDER BY sales DESC",
    ),
    (
        "How many customers does each support rep have?",
        ["Employee", "Customer"],
        "SELECT e.FirstName, e.LastName, COUNT(c.CustomerId) AS customers FROM Employee e "
        "LEFT JOIN Customer c ON c.SupportRepId = e.EmployeeId GROUP BY e.EmployeeId ORDER BY customers DESC",
    ),
    (
        "Which tracks are the most expensive?",
        ["Track"],
        "SELECT Name, UnitPrice FROM Track ORDER BY UnitPrice DESC, Name LIMIT 10",
    ),
    (
        "Which playlists have the most tracks?",
        ["Playlist", "PlaylistTrack"],
        "SELECT p.Name, COUNT(*) AS n FROM Playlist p JOIN PlaylistTrack pt ON pt.PlaylistId = p.PlaylistId "
        "GROUP BY p.PlaylistId ORDER BY n DESC",
    ),
]

# Writes an exploring agent makes to a table it studies (scratch rows, "fixing" data): state changes that
# later queries of the same rollout see.
CHINOOK_WRITES = {
    "Track": "UPDATE Track SET UnitPrice = 1.99 WHERE GenreId = 1",
    "Genre": "INSERT INTO Genre (Name) VALUES ('Experimental')",
    "Customer": "UPDATE Customer SET SupportRepId = 3 WHERE Country = 'USA'",
    "Invoice": "UPDATE Invoice SET Total = Total * 1.1 WHERE BillingCountry = 'Canada'",
    "Album": "INSERT INTO Album (Title, ArtistId) VALUES ('Demo', 1)",
    "Artist": "DELETE FROM Artist WHERE ArtistId NOT IN (SELECT ArtistId FROM Album)",
    "MediaType": "DELETE FROM Track WHERE MediaTypeId = 3",
    "Employee": "UPDATE Employee SET ReportsTo = 1 WHERE EmployeeId = 3",
    "Playlist": "DELETE FROM PlaylistTrack WHERE PlaylistId = 1 AND TrackId % 2 = 0",
    "PlaylistTrack": "DELETE FROM PlaylistTrack WHERE PlaylistId = 1 AND TrackId % 2 = 0",
}


def _variants(gold: str, rng: random.Random) -> str:
    """A candidate query near the gold one, as a model's earlier attempts are."""
    choice = rng.randrange(4)
    if choice == 0 and "DESC" in gold:
        return gold.replace("DESC", "ASC", 1)
    if choice == 1:
        return gold.split(" LIMIT ")[0] + " LIMIT 3"
    if choice == 2 and " ORDER BY " in gold:
        return gold.split(" ORDER BY ")[0]
    return gold


def chinook_rollout(task: int, rng: random.Random) -> list[TraceCall]:
    """One rollout of an agent working on question `task`: it may list the tables, looks up the schema of
    (and may sample) each table the question needs, tries one or two candidate queries near the gold one,
    after each of which it may change data in one of those tables, may keep an answer as a temp view and
    read it back, and ends with the gold query. Rollouts of a question share most calls, in other orders and
    after other writes, as GRPO samples of one prompt do."""
    _, tables, gold = CHINOOK_TASKS[task % len(CHINOOK_TASKS)]

    def sql(query: str) -> TraceCall:
        return TraceCall("sql", {"query": query})

    calls = []
    if rng.random() < 0.8:
        calls.append(sql("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"))
    for table in rng.sample(tables, len(tables)):
        if rng.random() < 0.8:
            calls.append(sql(f"SELECT sql FROM sqlite_master WHERE name = '{table}'"))
        if rng.random() < 0.5:
            calls.append(sql(f"SELECT * FROM {table} LIMIT 3"))
    for _ in range(rng.randrange(1, 3)):
        calls.append(sql(_variants(gold, rng)))
        if rng.random() < 0.3:
            calls.append(sql(CHINOOK_WRITES[rng.choice(tables)]))
    if rng.random() < 0.2:
        calls.append(sql(f"CREATE TEMP VIEW answer AS {gold}"))
        calls.append(sql("SELECT * FROM answer LIMIT 5"))
    calls.append(sql(gold))
    return calls


def chinook_workload(tasks: int, rollouts: int, seed: int = 0) -> Workload:
    from tvcache.sandboxes.sqlite import SQLiteSandboxes

    rng = random.Random(seed)
    traces = [
        Trace(f"chinook-writes/{t}", f"r{r}", "tvcache_bench.workloads.quick (generated)", chinook_rollout(t, rng))
        for t in range(tasks)
        for r in range(rollouts)
    ]
    factory = SQLiteSandboxes(workload_path("sql", "chinook", "chinook.sqlite"))
    return Workload(
        name="chinook-writes",
        traces=traces,
        sandboxes=lambda task: factory,
        tools=Tools(),
        close=factory.close,
        notes=f"{tasks} questions over sql/chinook/chinook.sqlite (lerocha/chinook-database, MIT), {rollouts} "
        f"rollouts each from a seeded exploration policy that also writes (seed {seed}), "
        f"{sum(len(t.calls) for t in traces)} sql calls",
    )
