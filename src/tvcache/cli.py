"""The `tvcache` command: `tvcache bench WORKLOAD`, and more as the project grows."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]

BENCHES = {
    "quick": "a one-minute SQL rollout workload comparing tvcache with no cache and a naive cache",
    "overhead": "the cache's own cost per call, hit and miss, for the memory and SQLite stores",
    "sandbox": "workspace sandbox create / snapshot / restore / exec next to cp -a of the same base",
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tvcache", description="A stateful tool-value cache for agent RL.")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark workload and print its figures")
    bench.add_argument("workload", choices=sorted(BENCHES), help="; ".join(f"{k}: {v}" for k, v in BENCHES.items()))
    bench.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT")
    bench.add_argument("--base", help="(sandbox) the base directory to measure; default: a generated 300 MB tree")
    args = parser.parse_args(argv)

    if args.command == "bench":
        results = _bench(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    return 0


def _bench(args: argparse.Namespace) -> object:
    if args.workload == "overhead":
        from .bench import overhead

        return overhead.run()
    if args.workload == "quick":
        from .bench import quick

        return quick.run()
    if args.workload == "sandbox":
        import asyncio

        from .bench import sandbox

        return asyncio.run(sandbox.main(args.base))
    raise AssertionError(args.workload)


if __name__ == "__main__":
    sys.exit(main())
