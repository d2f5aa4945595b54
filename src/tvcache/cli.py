"""The `tvcache` command: `bench`, `replay`, `serve`, `stats`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

BENCHES = {
    "quick": "the main job: one minute of SQL rollouts, tvcache against no cache, a naive cache and the paper's policy",
    "sql": "SQL rollouts on the real databases (Spider-de, Geography) plus seconds-long TPC-H queries",
    "swe": "SWE-agent bash rollouts (traces/swe-dev.jsonl) in workspace sandboxes holding each project",
    "airline": "tau-bench airline rollouts (traces/tau-airline.jsonl) on the 14 airline tools",
    "synthetic": "a parametric GRPO workload for scale: thousands of rollouts, 10^5+ graph nodes",
    "overhead": "the cache's own cost per call, hit and miss, for the memory and SQLite stores",
    "sandbox": "workspace sandbox create / snapshot / restore / exec next to cp -a of the same base",
    "server": "the shared server's lookups/s and latency at 1, 8 and 32 clients and at 256 requests/s",
    "redis": "lookups/s through the Redis store at 1 and 32 clients",
}


def main(argv: Sequence[str] | None = None) -> int:
    from .bench import replay_cli
    from .server import cli as server_cli

    parser = argparse.ArgumentParser(prog="tvcache", description="A stateful tool-value cache for agent RL.")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark workload and print its figures")
    bench.add_argument("workload", choices=list(BENCHES), help="; ".join(f"{k}: {v}" for k, v in BENCHES.items()))
    bench.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT")
    bench.add_argument("--base", help="(sandbox) the base directory to measure; default: a generated 300 MB tree")
    replay_cli.add_bench_options(bench)
    replay_cli.add_commands(commands)
    server_cli.add_commands(commands)
    args = parser.parse_args(argv)

    if args.command == "replay":
        return replay_cli.run_command(args)
    if args.command in server_cli.COMMANDS:
        return server_cli.run_command(args)
    results = _bench(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


def _bench(args: argparse.Namespace) -> Any:
    workload = args.workload
    if workload in ("quick", "synthetic", "sql", "swe", "airline"):
        from .bench import replay_cli

        return replay_cli.run_bench(args)
    if workload == "overhead":
        from .bench import overhead

        return overhead.run()
    if workload == "sandbox":
        from .bench import sandbox

        return asyncio.run(sandbox.main(args.base))
    if workload == "server":
        from .bench import server

        return server.run()
    if workload == "redis":
        from .bench import redis_store

        return redis_store.run()
    raise AssertionError(workload)


if __name__ == "__main__":
    sys.exit(main())
