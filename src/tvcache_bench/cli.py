"""The `tvcache bench` and `tvcache replay` commands.

`tvcache.cli` hands these two commands to this module (`add_commands`, then `run_command`), so `tvcache serve`
and `import tvcache` never load the benchmarks.

    tvcache bench sql [--tasks N] [--epochs E] [--rollouts R] [--seed S] [--no-tpch] [common]
    tvcache bench swe [--tasks N] [--epochs E] [--timeout S] [common]
    tvcache bench terminal [--tasks N] [--epochs E] [--timeout S] [common]
    tvcache bench airline [--tasks N] [--epochs E] [--latency S] [common]
    tvcache bench video [--tasks N] [--epochs E] [--rollouts R] [--seed S] [common]
    tvcache bench grpo [--steps N] [--seed S] [--json OUT] [--charts DIR]
        common: [--batch B] [--concurrency C] [--strategies LIST] [--store URL] [--no-progress]
                [--json OUT] [--charts DIR]

    tvcache replay TRACES --sandbox workspace|docker|sqlite|python:module:factory --base DIR | --image IMAGE
        [--setup CMD] [--read-sets]
        [--tasks N] [--epochs E] [--timeout S] [--concurrency C] [--store URL]
        [--strategies none,naive,paper,tvcache] [--json OUT] [--charts DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from tvcache.extras import MissingExtra, install_command, require
from tvcache.sandboxes.base import SandboxError

from .data import MissingData, workloads_dir
from .strategies import STRATEGIES
from .turns import REALISTIC, TurnTime

if TYPE_CHECKING:
    from .replay import ReplayOptions, ReplayResult
    from .workload import Workload

__all__ = ["BENCHES", "add_commands", "run_command"]

BENCHES = {
    "quick": "the main job: one minute of SQL rollouts, tvcache against no cache, a naive cache and the published one",
    "sql": "SQL rollouts on the real databases (Spider-de, Geography) plus seconds-long TPC-H queries",
    "swe": "SWE-agent bash rollouts (traces/swe-dev.jsonl) in workspace sandboxes holding each project",
    "terminal": "terminal-agent bash rollouts on six Terminal-Bench-style tasks in workspace sandboxes, 2 epochs",
    "airline": "tau-bench airline rollouts (traces/tau-airline.jsonl) on the 14 airline tools",
    "video": "video question answering on real clips: load, preprocess (OpenCV features), then read-only analyses",
    "synthetic": "a parametric GRPO workload for scale: thousands of rollouts, 10^5+ graph nodes",
    "overhead": "the cache's own cost per call, hit and miss, for the memory and SQLite stores",
    "sandbox": "workspace sandbox create / snapshot / restore / exec next to cp -a of the same base",
    "server": "the shared server's lookups/s and latency at 1, 8 and 32 clients and at 256 requests/s",
    "redis": "lookups/s through the Redis store at 1 and 32 clients",
    "remote": "a sandbox through tvcache sandbox-server (loopback and veth) next to in-process: latency, calls/s",
    "docker": "Docker containers next to the same image's layers in workspace sandboxes; creations/s by concurrency",
    "grpo": "a real GRPO run (TRL, SmolLM2-135M on the CPU, text-to-SQL tool calls) twice, without and with tvcache",
}


def add_commands(subparsers: Any) -> None:
    """Add `bench` and `replay` to the `tvcache` command's subparsers."""
    bench = subparsers.add_parser("bench", help="run a benchmark workload and print its figures")
    bench.add_argument("workload", choices=list(BENCHES), help="; ".join(f"{k}: {v}" for k, v in BENCHES.items()))
    bench.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT")
    bench.add_argument("--base", help="(sandbox) the base directory to measure; default: a generated 300 MB tree")
    bench.add_argument(
        "--published",
        metavar="DIR",
        help="(server) a checkout of the published system (github.com/TVCache/TVCache) whose server to measure "
        "side by side; default: $TVCACHE_PUBLISHED_SERVER, else tvcache's alone",
    )
    add_bench_options(bench)
    p = subparsers.add_parser(
        "replay",
        help="replay recorded rollouts (JSONL traces) under several caching strategies and compare them",
        description="Replay a trace file the way GRPO steps run it (per step a batch of tasks, all rollouts of "
        "a task concurrent, each rollout's calls in order), under each strategy in turn on the same schedule, "
        "checking every answer against the uncached one.",
    )
    p.add_argument("traces", metavar="TRACES", help="JSONL trace file (format: tvcache_bench/data/README.md)")
    p.add_argument(
        "--sandbox",
        required=True,
        metavar="KIND",
        help="workspace (--base DIR or --image IMAGE, tool bash), docker (--image IMAGE, tool bash), "
        "sqlite (--base FILE, tool sql), or python:module:factory (factory() returns a Sandboxes; factory(base) "
        "with --base)",
    )
    p.add_argument("--base", help="the directory or database every rollout starts from")
    p.add_argument(
        "--image",
        help="(docker, workspace) the Docker image every rollout starts from: containers of it (docker), or its "
        "layers as the sandbox's root (workspace); an OCI layout or `docker save` archive path also works there",
    )
    p.add_argument("--setup", metavar="CMD", help="run once before any rollout: a shell command (workspace) or SQL")
    p.add_argument(
        "--read-sets",
        action="store_true",
        help="(workspace) trace the commands' reads in the sandboxes of the strategies that reuse results by what a "
        "call read (tvcache); the other strategies run untraced. SQLite sandboxes tell their reads without it",
    )
    p.add_argument("--tasks", type=_positive_int, metavar="N", help="replay only the first N tasks of the file")
    p.add_argument("--epochs", type=_positive_int, default=1, metavar="E", help="replay the traces E times (default 1)")
    p.add_argument("--batch", type=_positive_int, default=4, metavar="B", help="tasks per training step (default 4)")
    p.add_argument(
        "--timeout", type=_positive_float, metavar="S", help="seconds per call; a call over it ends its rollout"
    )
    p.add_argument(
        "--concurrency", type=_positive_int, default=8, metavar="C", help="rollouts in flight at once (default 8)"
    )
    p.add_argument("--store", metavar="URL", help="tvcache's store (default: in memory), e.g. sqlite:///cache.db")
    p.add_argument("--namespace", help="tvcache namespace in the store (default: a fresh one per run)")
    p.add_argument(
        "--strategies",
        type=_strategies,
        default=list(STRATEGIES),
        metavar="LIST",
        help=f"comma-separated, from {','.join(STRATEGIES)} (default: all); 'none' is the correctness oracle",
    )
    p.add_argument(
        "--read-only",
        type=_names,
        default=frozenset(),
        metavar="TOOLS",
        help="comma-separated tools that never change state",
    )
    p.add_argument(
        "--turns",
        choices=("step", "strategy"),
        default="step",
        help="how strategies take turns: step (all run step 1, then all run step 2, ...: load drift falls on all "
        "alike; the default) or strategy (each runs the whole schedule and is closed before the next: one "
        "strategy's snapshots at a time, for big ones such as SQLite copies of large databases)",
    )
    p.add_argument(
        "--turn-time",
        type=_turn_time,
        default="realistic",
        metavar="SPEC",
        help="the model's turn before each call but a rollout's first, from the traces' started/ended timestamps "
        f"where they have them, else: none, fixed:SECONDS, lognormal:MEDIAN[:SIGMA] or realistic ({REALISTIC}, the "
        "default); background work (a snapshot) is free only in it",
    )
    p.add_argument("--turn-seed", type=int, default=0, metavar="S", help="seed of the turn times drawn (default 0)")
    p.add_argument("--no-prefetch", action="store_true", help="do not prefetch sandboxes for the next step")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON to OUT")
    p.add_argument("--charts", metavar="DIR", help="write PNG charts into DIR")


def run_command(args: argparse.Namespace) -> int:
    """Run `tvcache bench` or `tvcache replay`. A mistake that can be seen before any work (an option that does
    not apply, a bad store URL or --base, a missing extra or benchmark data) is one line on stderr and exit
    status 2; a run whose figures mean nothing (see `_failed_strategies`) exits with status 1, naming the first
    error."""
    command = f"tvcache {args.command}" + (f" {args.workload}" if args.command == "bench" else "")
    try:
        _check(args, command)
        if args.command == "replay":
            return _replay_command(args)
        results = _bench(args)
    except (MissingExtra, MissingData) as exc:
        _fail(command, str(exc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return _failed_strategies(command, results)


def _check(args: argparse.Namespace, command: str) -> None:
    """Everything about the command line that can be checked before any work."""
    require("bench", "this command", "rich")
    if args.charts:
        require("bench", "--charts", "matplotlib")
    if args.command == "bench":
        workload = args.workload
        if workload in BENCH_DEFAULTS:
            _bench_options(args, workload)
        if args.base is not None and workload != "sandbox":
            _fail(command, "--base applies to the sandbox workload only")
        if args.published is not None and workload != "server":
            _fail(command, "--published applies to the server workload only")
        if workload == "server" and _published(args) is not None:
            from .micro.server import published_script

            try:
                published_script(_published(args) or "")
            except ValueError as exc:
                _fail(command, f"--published: {exc}")
        if workload == "sandbox" and args.base is not None and not Path(args.base).is_dir():
            _fail(command, f"--base {args.base} is not a directory: name the tree to measure, or leave --base out")
        if workload in ("quick", "sql", "swe", "airline"):
            workloads_dir()
        if workload in ("server", "remote"):
            require("server", "this command", "uvicorn", "uvloop", "httptools", "prometheus_client")
            require("client", "this command", "aiohttp")
        if workload == "redis":
            require("redis", "this command", "redis")
            if args.store is not None and not args.store.startswith("redis"):
                _fail(command, f"--store {args.store}: the redis workload measures a Redis server (redis://...)")
        if workload == "docker":
            require("docker", "this command", "aiodocker")
        if workload == "video":
            require("bench", "this command", "cv2")
        if workload == "grpo":
            try:
                require("grpo", "this command", "torch")
            except MissingExtra:  # pip would answer the extra alone with a CUDA build of torch
                _fail(
                    command,
                    "this command needs torch: install a CPU build first (pip install torch==2.13.0 on these "
                    f"machines, elsewhere from PyTorch's CPU index), then {install_command('grpo')}",
                )
            require("grpo", "this command", "trl", "datasets", "gguf", "jmespath")
            workloads_dir()
            from .workloads.grpo.model import gguf_file

            gguf_file()  # MissingModel (a MissingExtra) names the package to install
    if _workspace_sandboxes(args):
        from tvcache.sandboxes.workspace._jail import find_bwrap

        try:
            find_bwrap()
        except SandboxError as exc:
            _fail(command, str(exc))
    store = getattr(args, "store", None)
    if store is not None:
        from tvcache.stores import open_store

        try:
            opened = open_store(store)  # raises MissingExtra where the store's extra is not installed
        except ValueError as exc:
            _fail(command, f"--store: {exc}")
        asyncio.run(opened.close())


def _published(args: argparse.Namespace) -> str | None:
    """The checkout of the published system whose server `bench server` measures too: --published, else the
    environment's TVCACHE_PUBLISHED_SERVER."""
    from .micro.server import PUBLISHED_ENV

    return args.published or os.environ.get(PUBLISHED_ENV) or None


def _workspace_sandboxes(args: argparse.Namespace) -> bool:
    """Does the command run workspace sandboxes (which need bubblewrap)?"""
    if args.command == "replay":
        return bool(args.sandbox == "workspace")
    return bool(
        args.workload in ("swe", "terminal", "video", "sandbox", "docker")
    )  # docker: from_image beside containers


def _fail(command: str, message: str) -> NoReturn:
    print(f"{command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _failed_strategies(command: str, summary: Any) -> int:
    """1, saying so on stderr, if some strategy's run has problems (`StrategyRun.problems`: every call failed, a
    tool failed on every call, calls failed that the uncached run answered): its figures mean nothing. Else 0."""
    rows = summary.get("strategies", {}) if isinstance(summary, dict) else {}
    failed = [problem for row in rows.values() for problem in row.get("problems", ())]
    for problem in failed:
        print(f"{command}: error: {problem}", file=sys.stderr)
    if isinstance(summary, dict) and summary.get("identical") is False:  # tvcache bench grpo
        print(f"{command}: error: the rewards with tvcache differ from those without it", file=sys.stderr)
        return 1
    return 1 if failed else 0


def _bench(args: argparse.Namespace) -> Any:
    workload = args.workload
    if workload in BENCH_DEFAULTS:
        return run_bench(args)
    if workload == "overhead":
        from .micro import overhead

        return overhead.run()
    if workload == "sandbox":
        from .micro import sandbox

        return asyncio.run(sandbox.main(args.base))
    if workload == "server":
        from .micro import server

        return server.run(published=_published(args))
    if workload == "redis":
        from .micro import redis

        return redis.run(args.store)
    if workload == "remote":
        from .micro import remote

        return remote.run()
    if workload == "docker":
        from .micro import docker

        return asyncio.run(docker.main(getattr(args, "charts", None)))
    raise AssertionError(workload)


def _replay_command(args: argparse.Namespace) -> int:
    """Run `tvcache replay`; returns the exit code (2 with a message on bad input)."""
    from .traces import TraceError

    try:
        summary = asyncio.run(_replay(args))
    except (TraceError, ValueError, TypeError, FileNotFoundError, NotADirectoryError) as exc:
        print(f"tvcache replay: error: {exc}", file=sys.stderr)
        return 2
    return _failed_strategies("tvcache replay", summary)


async def _replay(args: argparse.Namespace) -> dict[str, Any]:
    from .replay import ReplayOptions, replay_strategies
    from .report import print_table, wide_console, write_charts, write_json
    from .workload import load_workload

    options = ReplayOptions(
        batch=args.batch,
        epochs=args.epochs,
        concurrency=args.concurrency,
        timeout=args.timeout,
        prefetch=not args.no_prefetch,
        progress=not args.no_progress,
        turns=args.turns,
        turn_time=TurnTime.parse(args.turn_time, args.turn_seed),
    )
    workload = await load_workload(
        args.traces,
        args.sandbox,
        base=args.base,
        setup=args.setup,
        tasks=args.tasks,
        read_only=args.read_only,
        timeout=args.timeout,
        image=args.image,
        read_sets=args.read_sets,
    )
    try:
        result = await replay_strategies(workload, args.strategies, options, store=args.store, namespace=args.namespace)
    finally:
        await workload.close()
    console = wide_console()
    print_table(result, console)
    if args.json:
        write_json(result, args.json)
        console.print(f"figures: {args.json}")
    if args.charts:
        for path in write_charts(result, args.charts):
            console.print(f"chart: {path}")
    return result.summary()


# Per workload: the `tvcache bench` options it takes (besides --json and --charts) and their defaults.
BENCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "quick": {"no_progress": False, "turn_time": "none", "turn_seed": 0},
    "synthetic": {"no_progress": False},
    # sql's strategies take turns by strategy: its SQLite snapshots copy whole databases (373 MB for TPC-H), too
    # many to hold every strategy's at once in tmpfs.
    "sql": {"tasks": 40, "epochs": 1, "rollouts": 8, "seed": 0, "no_tpch": False, "turns": "strategy"},
    "swe": {"tasks": None, "epochs": 1, "timeout": 60.0, "no_warmup": False, "turns": "step", "read_sets": False},
    "terminal": {"tasks": None, "epochs": 2, "timeout": 60.0, "no_warmup": False, "turns": "step", "read_sets": False},
    "airline": {"tasks": None, "epochs": 1, "latency": 0.05, "turns": "step"},
    "video": {"tasks": None, "epochs": 1, "rollouts": 8, "seed": 0, "turns": "step"},
    "grpo": {"steps": 10, "seed": 0},
}
_REPLAY_OPTIONS = {
    "batch": 4,
    "concurrency": 8,
    "strategies": list(STRATEGIES),
    "store": None,
    "no_progress": False,
    "turn_time": "realistic",
    "turn_seed": 0,
}
for _options in ("sql", "swe", "terminal", "airline", "video"):
    BENCH_DEFAULTS[_options].update(_REPLAY_OPTIONS)


def add_bench_options(parser: argparse.ArgumentParser) -> None:
    """Options `tvcache bench` takes besides `--json`; each workload says which apply (`BENCH_DEFAULTS`)."""
    parser.add_argument("--charts", metavar="DIR", help="write PNG charts into DIR")
    parser.add_argument(
        "--tasks",
        type=_positive_int,
        metavar="N",
        help="(sql, swe, terminal, airline, video) the first N tasks (sql default 40)",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        metavar="E",
        help="(sql, swe, terminal, airline, video) replay the rollouts E times (default 1; terminal 2)",
    )
    parser.add_argument(
        "--rollouts", type=_positive_int, metavar="R", help="(sql, video) rollouts per task (default 8)"
    )
    parser.add_argument(
        "--seed", type=int, metavar="S", help="(sql, video, grpo) seed of the rollout policy or training (default 0)"
    )
    parser.add_argument("--steps", type=_positive_int, metavar="N", help="(grpo) training steps (default 10)")
    parser.add_argument("--no-tpch", action="store_true", default=None, help="(sql) leave out the TPC-H tasks")
    parser.add_argument(
        "--latency",
        type=_non_negative_float,
        metavar="S",
        help="(airline) simulated service latency per tool execution, seconds (default 0.05; 0: none)",
    )
    parser.add_argument(
        "--timeout", type=_positive_float, metavar="S", help="(swe, terminal) seconds a command may run (default 60)"
    )
    parser.add_argument(
        "--read-sets",
        action="store_true",
        default=None,
        help="(swe, terminal) trace the commands' reads in the workspace sandboxes of tvcache (read_sets=True); the "
        "other strategies run untraced",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        default=None,
        help="(swe, terminal) skip the untimed uncached pass that runs before the measured ones",
    )
    parser.add_argument(
        "--turns",
        choices=("step", "strategy"),
        help="(sql, swe, terminal, airline, video) how strategies take turns: step by step, or each strategy's whole "
        "schedule (default: strategy for sql, step for the others; see `tvcache replay --help`)",
    )
    parser.add_argument(
        "--batch",
        type=_positive_int,
        metavar="B",
        help="(sql, swe, terminal, airline, video) tasks per training step (default 4)",
    )
    parser.add_argument(
        "--concurrency",
        type=_positive_int,
        metavar="C",
        help="(sql, swe, terminal, airline, video) rollouts in flight (default 8)",
    )
    parser.add_argument(
        "--strategies",
        type=_strategies,
        metavar="LIST",
        help=f"(sql, swe, terminal, airline, video) comma-separated, from {','.join(STRATEGIES)} (default: all)",
    )
    parser.add_argument(
        "--store",
        metavar="URL",
        help="(sql, swe, terminal, airline, video) tvcache's store (default: in memory); (redis) the Redis server to "
        "measure",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        default=None,
        help="(quick, synthetic, sql, swe, terminal, airline, video) no progress bars",
    )
    parser.add_argument(
        "--turn-time",
        type=_turn_time,
        metavar="SPEC",
        help="(quick, sql, swe, terminal, airline, video) the model's turn between a rollout's calls: none, "
        f"fixed:SECONDS, lognormal:MEDIAN[:SIGMA] or realistic ({REALISTIC}); default realistic, none for quick",
    )
    parser.add_argument(
        "--turn-seed", type=int, metavar="S", help="(quick, sql, swe, terminal, airline, video) its seed"
    )


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run `tvcache bench quick|synthetic|sql|swe|airline|video`; prints the report, returns the figures for
    `--json`. An option that does not apply to the workload is an error (exit status 2)."""
    workload = args.workload
    if workload not in BENCH_DEFAULTS:
        raise ValueError(f"run_bench handles {', '.join(BENCH_DEFAULTS)}, not {workload!r}")
    o = _bench_options(args, workload)
    charts = getattr(args, "charts", None)
    turn_time = TurnTime.parse(o["turn_time"], o["turn_seed"]) if "turn_time" in o else TurnTime()
    if workload == "quick":
        from .workloads import quick

        return quick.run(charts=charts, progress=not o["no_progress"], turn_time=turn_time)
    if workload == "grpo":
        from .workloads.grpo import bench as grpo

        return grpo.run(o["steps"], seed=o["seed"], charts=charts)
    if workload == "synthetic":
        from .workloads import synthetic

        return synthetic.run(charts=charts, progress=not o["no_progress"])
    from .replay import ReplayOptions

    options = ReplayOptions(
        batch=o["batch"],
        epochs=o["epochs"],
        concurrency=o["concurrency"],
        progress=not o["no_progress"],
        turns=o["turns"],
        turn_time=turn_time,
    )
    common: dict[str, Any] = {"options": options, "strategies": o["strategies"], "store": o["store"], "charts": charts}
    if workload == "airline":
        from .workloads.airline import bench as airline_bench

        return airline_bench.run(tasks=o["tasks"], latency=o["latency"], **common)
    if workload == "video":
        from .workloads.video import bench as video_bench

        return video_bench.run(tasks=o["tasks"], rollouts=o["rollouts"], seed=o["seed"], **common)
    if workload == "sql":
        from .workloads import sql

        def build_sql() -> Workload:
            return sql.build_workload(tasks=o["tasks"], rollouts=o["rollouts"], seed=o["seed"], tpch=not o["no_tpch"])

        return _replay_bench(build_sql, options, o, charts, describe=sql.describe)
    # A call's own time limit is the sandbox's (`--timeout`, the same for every strategy); the replay's limit
    # only guards against a hang, since it also counts the restores and replays a cached strategy does for it.
    options = replace(options, timeout=max(600.0, 10 * o["timeout"]))
    if workload == "terminal":
        from .workloads import terminal

        def build_terminal() -> Workload:
            return terminal.build_workload(o["tasks"], timeout=o["timeout"], read_sets=o["read_sets"])

        return _replay_bench(build_terminal, options, o, charts, describe=terminal.describe, warmup=not o["no_warmup"])
    from .workloads import swe

    def build_swe() -> Workload:
        return swe.build_workload(o["tasks"], timeout=o["timeout"], log=_say, read_sets=o["read_sets"])

    # The first pass of workspace sandboxes in a process ran 12-14% slower than identical later ones here
    # (measured with three uncached passes in a row), which would count as speedup for every cached strategy:
    # an untimed uncached pass first puts the baseline on the same footing.
    return _replay_bench(build_swe, options, o, charts, describe=swe.describe, warmup=not o["no_warmup"])


def _bench_options(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    """The workload's options: those given, else its defaults; any other option given is an error."""
    defaults = BENCH_DEFAULTS[workload]
    every = {name for table in BENCH_DEFAULTS.values() for name in table}
    given = {name for name in every if getattr(args, name, None) is not None}
    stray = sorted(given - set(defaults))
    if stray:
        flags = ", ".join("--" + name.replace("_", "-") for name in stray)
        verb = "does" if len(stray) == 1 else "do"
        _fail(f"tvcache bench {workload}", f"{flags} {verb} not apply to {workload}")
    return {name: getattr(args, name) if name in given else default for name, default in defaults.items()}


def _replay_bench(
    build: Callable[[], Workload],
    options: ReplayOptions,
    o: dict[str, Any],
    charts: str | None,
    describe: Callable[[], str],
    warmup: bool = False,
) -> dict[str, Any]:
    from .replay import replay, replay_strategies
    from .report import print_table, wide_console, write_charts
    from .strategies import NoCacheStrategy

    class WarmUp(NoCacheStrategy):
        name = "warm-up"

    async def go() -> ReplayResult:
        workload = build()
        try:
            if warmup:
                _say("warm-up: one untimed uncached pass (--no-warmup skips it)")
                await replay(workload, [WarmUp()], replace(options, epochs=1, verify=False))
            return await replay_strategies(workload, o["strategies"], options, store=o["store"])
        finally:
            await workload.close()

    console = wide_console()
    result = asyncio.run(go())
    print_table(result, console)
    if charts:
        for path in write_charts(result, charts):
            console.print(f"chart: {path}")
    summary = result.summary()
    summary["about"] = describe()
    return summary


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def _turn_time(text: str) -> str:
    """A `--turn-time` value, checked here so that a bad one is a usage error before anything runs."""
    try:
        TurnTime.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _strategies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        named = ", ".join(unknown) or repr(text)
        raise argparse.ArgumentTypeError(f"unknown strategy {named}; choose from {','.join(STRATEGIES)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a strategy is named twice in {text!r}")
    return names


def _names(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())
