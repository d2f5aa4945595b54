"""The `tvcache replay` command, and the `tvcache bench quick|synthetic` handlers.

Wiring (in `tvcache.cli`): `replay_cli.add_commands(subparsers)` adds `replay`; `replay_cli.run_command(args)`
runs it and returns the exit code. `replay_cli.add_bench_options(bench_parser)` adds `--charts DIR` to
`tvcache bench`, and `replay_cli.run_bench(args)` runs `quick` or `synthetic` and returns their JSON summary.

    tvcache replay TRACES --sandbox workspace|sqlite|python:module:factory --base DIR [--setup CMD]
        [--tasks N] [--epochs E] [--timeout S] [--concurrency C] [--store URL]
        [--policies none,naive,paper,tvcache] [--json OUT] [--charts DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from .policies import POLICIES

__all__ = ["add_bench_options", "add_commands", "run_bench", "run_command"]


def add_commands(subparsers: Any) -> None:
    """Add `replay` to the `tvcache` command's subparsers."""
    p = subparsers.add_parser(
        "replay",
        help="replay recorded rollouts (JSONL traces) under several caching policies and compare them",
        description="Replay a trace file the way GRPO steps run it (per step a batch of tasks, all rollouts of "
        "a task concurrent, each rollout's calls in order), under each policy in turn on the same schedule, "
        "checking every answer against the uncached one.",
    )
    p.add_argument("traces", metavar="TRACES", help="JSONL trace file (format: ../shared/workloads/README.md)")
    p.add_argument(
        "--sandbox",
        required=True,
        metavar="KIND",
        help="workspace (--base DIR, tool bash), sqlite (--base FILE, tool sql), "
        "or python:module:factory (factory() returns a Sandboxes; factory(base) with --base)",
    )
    p.add_argument("--base", help="the directory or database every rollout starts from")
    p.add_argument("--setup", metavar="CMD", help="run once before any rollout: a shell command (workspace) or SQL")
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
        "--policies",
        type=_policies,
        default=list(POLICIES),
        metavar="LIST",
        help=f"comma-separated, from {','.join(POLICIES)} (default: all); 'none' is the correctness oracle",
    )
    p.add_argument(
        "--read-only",
        type=_names,
        default=frozenset(),
        metavar="TOOLS",
        help="comma-separated tools that never change state",
    )
    p.add_argument("--no-prefetch", action="store_true", help="do not prefetch sandboxes for the next step")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON to OUT")
    p.add_argument("--charts", metavar="DIR", help="write PNG charts into DIR")


def run_command(args: argparse.Namespace) -> int:
    """Run `tvcache replay`; returns the exit code (2 with a message on bad input)."""
    from .traces import TraceError

    try:
        return asyncio.run(_replay(args))
    except (TraceError, ValueError, TypeError, FileNotFoundError, NotADirectoryError) as exc:
        print(f"tvcache replay: error: {exc}", file=sys.stderr)
        return 2


async def _replay(args: argparse.Namespace) -> int:
    from .replay import ReplayOptions, replay_policies
    from .report import print_table, wide_console, write_charts, write_json
    from .workload import load_workload

    options = ReplayOptions(
        batch=args.batch,
        epochs=args.epochs,
        concurrency=args.concurrency,
        timeout=args.timeout,
        prefetch=not args.no_prefetch,
        progress=not args.no_progress,
    )
    workload = await load_workload(
        args.traces,
        args.sandbox,
        base=args.base,
        setup=args.setup,
        tasks=args.tasks,
        read_only=args.read_only,
        timeout=args.timeout,
    )
    try:
        result = await replay_policies(workload, args.policies, options, store=args.store, namespace=args.namespace)
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
    return 0


def add_bench_options(parser: argparse.ArgumentParser) -> None:
    """Options `tvcache bench quick|synthetic` take besides `--json`."""
    parser.add_argument("--charts", metavar="DIR", help="(quick, synthetic) write PNG charts into DIR")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run `tvcache bench quick` or `tvcache bench synthetic`; returns the figures for `--json`."""
    charts = getattr(args, "charts", None)
    if args.workload == "quick":
        from . import quick

        return quick.run(charts=charts)
    if args.workload == "synthetic":
        from . import synthetic

        return synthetic.run(charts=charts)
    raise ValueError(f"run_bench handles quick and synthetic, not {args.workload!r}")


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


def _policies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        named = ", ".join(unknown) or repr(text)
        raise argparse.ArgumentTypeError(f"unknown policy {named}; choose from {','.join(POLICIES)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a policy is named twice in {text!r}")
    return names


def _names(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())
