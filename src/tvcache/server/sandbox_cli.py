"""`tvcache sandbox-server`: serve one sandbox factory over HTTP for `tvcache.RemoteSandboxes` clients.

tvcache sandbox-server --sandbox workspace --base /srv/tasks/repo --host 10.0.0.5 --token-file /etc/tvcache/token
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .factories import KINDS

__all__ = ["add_command", "run"]


def add_command(subparsers: Any) -> None:
    from .cli import add_server_options

    p = subparsers.add_parser(
        "sandbox-server",
        help="serve a sandbox factory over HTTP for RemoteSandboxes clients on other machines",
        description="Serve one sandbox factory over HTTP. It runs whatever its clients send, so it binds "
        "127.0.0.1 unless told otherwise, and refuses another address without a token.",
    )
    p.add_argument("--sandbox", required=True, metavar="KIND", help=KINDS)
    p.add_argument("--base", help="the directory (workspace) or database file (sqlite) every sandbox starts from")
    p.add_argument("--image", help="the image every sandbox starts from (docker)")
    p.add_argument("--timeout", type=float, help="seconds a tool call may take (default: the backend's own)")
    p.add_argument(
        "--read-sets",
        action="store_true",
        help="(workspace) trace what each command reads, so that clients reuse results by it (SQLite sandboxes tell "
        "what a query read without it)",
    )
    p.add_argument(
        "--lease",
        type=float,
        help="seconds an unused sandbox lives before it is closed (default 300); "
        "clients renew the leases of the sandboxes they hold",
    )
    p.add_argument("--max-sandboxes", type=int, help="live sandboxes at most (default 256); more are refused")
    p.add_argument(
        "--max-snapshots", type=int, help="snapshots kept at most (default 1024); the least recently used go first"
    )
    add_server_options(p, 8471)


def run(args: argparse.Namespace) -> int:
    from ..extras import MissingExtra, require

    try:
        require("server", "the sandbox server", "uvicorn", "uvloop", "httptools", "prometheus_client")
    except MissingExtra as exc:
        raise SystemExit(f"tvcache sandbox-server: {exc}") from None
    from ..sandboxes.base import SandboxError
    from .cli import server_limits
    from .factories import open_sandboxes
    from .run import serve_sandboxes

    limits = server_limits(args)
    for option in ("timeout", "lease", "max_sandboxes", "max_snapshots"):
        if getattr(args, option) is not None:
            limits[option] = getattr(args, option)
    _reclaim_predecessors(docker=args.sandbox == "docker")
    try:
        factory = open_sandboxes(
            args.sandbox, base=args.base, image=args.image, timeout=args.timeout, read_sets=args.read_sets
        )
        serve_sandboxes(factory, args.host, args.port, log_level=args.log_level, access_log=args.access_log, **limits)
    except (ValueError, TypeError, OSError, SandboxError) as exc:  # a bad kind, path, image or limit: no traceback
        raise SystemExit(f"tvcache sandbox-server: {exc}") from None
    return 0


def _reclaim_predecessors(*, docker: bool) -> None:
    """Before serving, remove what dead tvcache processes left here, a killed predecessor's sandboxes and
    snapshots among them (its scratch and run dirs on disk; its containers and snapshot images on Docker)."""
    from ..sandboxes import reclaim

    found = reclaim.leftovers(reclaim.scratch_parents())
    if docker:
        try:
            found += reclaim.docker_leftovers()
        except Exception as exc:  # the factory will say what is wrong with Docker; serving may not start at all
            print(f"tvcache sandbox-server: could not look for dead runs on Docker: {exc}", file=sys.stderr)
    for item in found:
        item.reclaim()
    if found:
        print(
            f"tvcache sandbox-server: reclaimed {len(found)} thing(s) dead processes left "
            f"({sum(i.size for i in found) >> 20} MiB): {', '.join(i.where for i in found)}",
            file=sys.stderr,
        )
