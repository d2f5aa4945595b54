"""The shared cache server: the store interface over HTTP, a live dashboard, Prometheus metrics.

    from tvcache.server import serve
    serve("sqlite:///runs/cache.db", host="127.0.0.1", port=8470, token="s3cret")

Nothing here is imported by the core: `import tvcache` stays light, and `ToolCache("http://...")` loads
only the client (`tvcache.stores.http`) and the wire format it shares with the server (`wire.py`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "print_stats", "serve"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: the wire format alone must not pull in uvicorn or prometheus-client.
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "serve":
        from .run import serve

        return serve
    if name == "print_stats":
        from .report import print_stats

        return print_stats
    raise AttributeError(f"module 'tvcache.server' has no attribute {name!r}")
