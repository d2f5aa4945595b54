"""The `tvcache` command: `serve`, `stats` and `gc` (the library), `bench` and `replay` (the benchmarks).

Each group of commands lives with what it runs; this module only dispatches, and loads the benchmarks only
for their own commands, so `tvcache serve` starts without them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .version import __version__

__all__ = ["main"]

_BENCH_COMMANDS = {
    "bench": "run a benchmark workload and print its figures (tvcache_bench)",
    "replay": "replay recorded rollouts (JSONL traces) under several caches and compare them (tvcache_bench)",
}


def main(argv: Sequence[str] | None = None) -> int:
    from .server import cli as server_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tvcache", description="A stateful tool-value cache for agent RL.")
    parser.add_argument("--version", action="version", version=f"tvcache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    server_cli.add_commands(commands)
    _add_gc(commands)
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
    if args.command == "gc":
        return _gc(args)
    return bench_cli.run_command(args)


def _add_gc(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gc = commands.add_parser(
        "gc",
        help="reclaim what killed tvcache processes left on this machine (scratch, mounts, cgroups, containers)",
        description="List and remove everything tvcache processes that are gone left on this machine: scratch "
        "directories in /dev/shm, the temp dir, /var/tmp and ~/.cache/tvcache (and each --tmp), workspace run "
        "dirs with their mounts and cgroups, Docker containers, images and networks. What a running process "
        "owns is never touched.",
    )
    gc.add_argument("--dry-run", action="store_true", help="only list what would be reclaimed, with sizes")
    gc.add_argument(
        "--tmp", action="append", default=[], metavar="DIR", help="also look here (a factory's tmp); repeatable"
    )
    gc.add_argument("--docker-url", help="the Docker daemon (default: $DOCKER_HOST or the local socket)")
    gc.add_argument("--no-docker", action="store_true", help="do not ask a Docker daemon")


def _gc(args: argparse.Namespace) -> int:
    from .sandboxes import reclaim

    found = reclaim.leftovers(reclaim.scratch_parents(args.tmp))
    if not args.no_docker:
        try:
            found += reclaim.docker_leftovers(args.docker_url)
        except Exception as exc:  # no client library, no daemon: the files are reclaimed all the same
            print(f"Docker not checked: {type(exc).__name__}: {exc}".strip(), file=sys.stderr)
    for item in found:
        if not args.dry_run:
            item.reclaim()
        print(f"{_size(item.size):>10}  {item.kind:<14} pid {item.owner:<8} {item.where}")
    verb = "would reclaim" if args.dry_run else "reclaimed"
    print(f"{verb} {len(found)} item{'s' * (len(found) != 1)} of dead processes, {_size(sum(i.size for i in found))}")
    return 0


def _size(n: float) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    while n >= 1024 and len(units) > 1:
        n /= 1024
        units.pop(0)
    return f"{n:.0f} B" if units[0] == "B" else f"{n:.1f} {units[0]}"


if __name__ == "__main__":
    sys.exit(main())
