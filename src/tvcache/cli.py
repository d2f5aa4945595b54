"""The `tvcache` command: `serve` and `stats` (the library), `bench` and `replay` (the benchmarks).

Each group of commands lives with what it runs; this module only dispatches, and loads the benchmarks only
for their own commands, so `tvcache serve` starts without them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

_BENCH_COMMANDS = {
    "bench": "run a benchmark workload and print its figures (tvcache_bench)",
    "replay": "replay recorded rollouts (JSONL traces) under several caches and compare them (tvcache_bench)",
}


def main(argv: Sequence[str] | None = None) -> int:
    from .server import cli as server_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tvcache", description="A stateful tool-value cache for agent RL.")
    commands = parser.add_subparsers(dest="command", required=True)
    server_cli.add_commands(commands)
    wants_bench = next((a for a in argv if not a.startswith("-")), None) in _BENCH_COMMANDS
    if wants_bench:
        try:
            from tvcache_bench import cli as bench_cli
        except ImportError as exc:
            from .extras import install_command

            raise SystemExit(f"tvcache: the benchmarks are not installed ({exc}): {install_command('bench')}") from None
        bench_cli.add_commands(commands)
    else:
        for name, help in _BENCH_COMMANDS.items():  # listed in --help; loaded only when chosen
            commands.add_parser(name, help=help, add_help=False)
    args = parser.parse_args(argv)
    if args.command in server_cli.COMMANDS:
        return server_cli.run_command(args)
    return bench_cli.run_command(args)


if __name__ == "__main__":
    sys.exit(main())
