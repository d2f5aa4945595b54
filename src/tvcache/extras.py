"""Optional extras: a feature whose extra is not installed says so in one line, with the command that adds it.

`require("server", "the server", "uvicorn")` where uvicorn is missing raises `MissingExtra("the server needs the
'server' extra (No module named 'uvicorn'): pip install 'tvcache[server]'")`.
"""

from __future__ import annotations

import importlib

__all__ = ["MissingExtra", "install_command", "require"]


class MissingExtra(ImportError):
    """A feature needs an optional extra that is not installed; the message names the `pip install` to run."""


def require(extra: str, feature: str, *modules: str) -> None:
    """Import `modules`, or raise `MissingExtra` naming `feature` and the command that installs `extra`.

    Importing (rather than looking the modules up) also catches a module that is there but cannot load."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise MissingExtra(
                f"{feature} needs the '{extra}' extra ({exc}): {install_command(extra)}", name=name
            ) from exc


def install_command(extra: str) -> str:
    """`pip install 'tvcache[extra]'`, or for a checkout installed with `pip install -e DIR`, the same for DIR
    (the package index may not have this version, or any)."""
    # Imported here: `tvcache.stores` imports this module, and `import tvcache` must stay light.
    import importlib.metadata
    import json
    from urllib.parse import unquote, urlsplit

    try:
        origin = json.loads(importlib.metadata.distribution("tvcache").read_text("direct_url.json") or "{}")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        origin = {}
    url = urlsplit(str(origin.get("url", "")))
    if origin.get("dir_info", {}).get("editable") and url.scheme == "file":
        return f"pip install -e '{unquote(url.path)}[{extra}]'"
    return f"pip install 'tvcache[{extra}]'"
