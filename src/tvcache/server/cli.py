"""`tvcache serve`, `stats` and `sandbox-server`: argparse wiring for the main CLI (and `python -m tvcache.server`).

Importing this module is cheap: the server (uvicorn, prometheus-client) loads only when a command runs.

commands = parser.add_subparsers(dest="command", required=True)
server_cli.add_commands(commands)
...
if args.command in server_cli.COMMANDS:
    return server_cli.run_command(args)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import sandbox_cli

__all__ = ["COMMANDS", "add_commands", "run_command"]

COMMANDS = ("serve", "stats", "sandbox-server")


def add_commands(subparsers: Any) -> None:
    """Add `serve`, `stats` and `sandbox-server` to an `ArgumentParser.add_subparsers()` object."""
    serve = subparsers.add_parser("serve", help="run the shared cache server (HTTP API, dashboard, /metrics)")
    serve.add_argument(
        "--store",
        default="memory://",
        help="memory:// (default), sqlite:///relative.db, sqlite:////absolute.db or redis://host:port/db",
    )
    add_server_options(serve, 8470)
    serve.add_argument(
        "--max-wait",
        type=float,
        help="longest a wait request is held before the server answers 'ask again' (default 30 s)",
    )
    sandbox_cli.add_command(subparsers)

    stats = subparsers.add_parser("stats", help="print a running server's stats as a table")
    stats.add_argument("url", help="the server, e.g. http://127.0.0.1:8470 (or http://:TOKEN@host:port)")
    add_token_options(
        stats,
        "send `Authorization: Bearer TOKEN`, TOKEN being what FILE holds (default: from the URL or TVCACHE_TOKEN)",
    )
    stats.add_argument("--json", action="store_true", help="print the raw stats as JSON instead")


def add_server_options(parser: argparse.ArgumentParser, port: int) -> None:
    """The options every server takes: where it listens, who may use it, how much it reads and logs."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=port, help=f"port to bind (default {port})")
    add_token_options(
        parser,
        "require `Authorization: Bearer TOKEN` on the API, TOKEN being what FILE holds (default: the TVCACHE_TOKEN "
        "variable)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        help="connections held at once (default 4096, fewer if `ulimit -n` is low); past it, the connection "
        "waiting longest for its request is closed",
    )
    parser.add_argument("--max-body-mb", type=float, help="request body limit in MiB (default 32)")
    parser.add_argument(
        "--read-timeout",
        type=float,
        help="seconds a client may take to send a request's headers, and again its body (default 15)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")


def add_token_options(parser: argparse.ArgumentParser, help: str) -> None:
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--token-file", metavar="FILE", help=help)
    who.add_argument("--token", help="as --token-file, but every user of this machine can read it (ps): avoid")


def server_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The options of `add_server_options` that were given, as keyword arguments of `serve`/`serve_sandboxes`."""
    if not 0 < args.port < 65536:
        raise SystemExit(f"--port must be 1..65535, got {args.port}")
    limits: dict[str, Any] = {"token": given_token(args)}
    if args.max_connections is not None:
        if args.max_connections < 1:
            raise SystemExit(f"tvcache {args.command}: --max-connections must be at least 1")
        limits["max_connections"] = args.max_connections
    if args.max_body_mb is not None:
        limits["max_body"] = int(args.max_body_mb * 2**20)
    if args.read_timeout is not None:
        limits["read_timeout"] = args.read_timeout
    return limits


def given_token(args: argparse.Namespace) -> str | None:
    """The token given by --token-file or --token (None: TVCACHE_TOKEN, or the URL's, is used). A token on the
    command line is in every user's `ps`: it still works, for the scripts that pass one, with a warning."""
    command = f"tvcache {args.command}"
    if args.token is not None:
        print(
            f"{command}: warning: --token is visible to every user of this machine (ps, /proc/PID/cmdline); "
            "pass --token-file FILE or set TVCACHE_TOKEN instead",
            file=sys.stderr,
        )
        return str(args.token)
    if args.token_file is None:
        return None
    try:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{command}: --token-file: cannot read {args.token_file}: {exc}") from None
    if not token or any(c.isspace() for c in token):
        raise SystemExit(f"{command}: --token-file: {args.token_file} must hold the token alone, on one line")
    return token


def run_command(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from ..extras import MissingExtra, require
        from ..stores.base import StoreError

        try:
            require("server", "the server", "uvicorn", "uvloop", "httptools", "prometheus_client")
        except MissingExtra as exc:
            raise SystemExit(f"tvcache serve: {exc}") from None
        from .run import serve

        limits = server_limits(args)
        if args.max_wait is not None:
            limits["wait_cap"] = args.max_wait
        try:
            serve(
                None if args.store == "memory://" else args.store,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                access_log=args.access_log,
                **limits,
            )
        except (ValueError, OSError, StoreError, MissingExtra) as exc:  # a bad store URL, path or limit: no traceback
            raise SystemExit(f"tvcache serve: {exc}") from None
        return 0
    if args.command == "stats":
        import msgspec

        from .report import fetch_stats, print_stats

        token = given_token(args)
        try:  # an unreachable server or a refused token: one line, no traceback
            if args.json:
                stats, _ = fetch_stats(args.url, token)
                print(msgspec.json.format(msgspec.json.encode(stats), indent=2).decode())
            else:
                print_stats(args.url, token)
        except RuntimeError as exc:
            raise SystemExit(f"tvcache stats: {exc}") from None
        return 0
    if args.command == "sandbox-server":
        return sandbox_cli.run(args)
    raise ValueError(f"not a server command: {args.command!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvcache.server", description="The tvcache cache server.")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(argv))
