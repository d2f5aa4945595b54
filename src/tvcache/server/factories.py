"""The sandbox factory a `tvcache sandbox-server --sandbox KIND` serves.

- `workspace --base DIR`: `WorkspaceSandboxes(DIR)`, tools bash, read_file, write_file, list_dir;
- `sqlite --base FILE`: `SQLiteSandboxes(FILE)`, tool sql;
- `docker --image IMAGE`: `DockerSandboxes(IMAGE)`;
- `python:module:factory`: `module.factory()`, or `module.factory(base)` with `--base`, returning any Sandboxes.

`timeout` (seconds per call) goes to the backends that take one. `read_sets` (`--read-sets`) traces what each
workspace command reads, so that clients reuse results by it; SQLite sandboxes tell what a query read without it,
and the other kinds cannot be told to: for them it is an error.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from ..sandboxes.base import Sandboxes

__all__ = ["KINDS", "open_sandboxes", "read_sets_refused"]

KINDS = "workspace (--base DIR), sqlite (--base FILE), docker (--image IMAGE) or python:module:factory"


def open_sandboxes(
    kind: str,
    *,
    base: str | None = None,
    image: str | None = None,
    timeout: float | None = None,
    read_sets: bool = False,
) -> Sandboxes:
    """The factory `kind` names; ValueError with a message for the command line when it cannot be made."""
    refused = read_sets_refused(kind) if read_sets else None
    if refused is not None:
        raise ValueError(refused)
    if kind.startswith("python:"):
        return _python(kind, base)
    backends = {
        "workspace": ("tvcache.sandboxes.workspace", "WorkspaceSandboxes", base, "--base DIR"),
        "sqlite": ("tvcache.sandboxes.sqlite", "SQLiteSandboxes", base, "--base FILE"),
        "docker": ("tvcache.sandboxes.docker", "DockerSandboxes", image, "--image IMAGE"),
    }
    if kind not in backends:
        raise ValueError(f"unknown --sandbox {kind!r}: use {KINDS}")
    module_name, name, source, needs = backends[kind]
    if source is None:
        raise ValueError(f"--sandbox {kind} needs {needs}")
    if kind == "workspace" and not Path(source).is_dir():
        raise ValueError(f"--base {source} is not a directory")
    if kind == "sqlite" and not Path(source).is_file():
        raise ValueError(f"--base {source} is not a SQLite file")
    try:
        backend = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--sandbox {kind} is not available here ({exc})") from None
    options: dict[str, Any] = {"read_sets": True} if read_sets else {}
    if timeout is not None:
        if "timeout" not in inspect.signature(backend).parameters:
            raise ValueError(f"--timeout is not an option of {name}")
        options["timeout"] = timeout
    factory: Sandboxes = backend(source, **options)
    return factory


_NO_READ_SETS = {
    "sqlite": "SQLite sandboxes always tell what a query read (through the authorizer), without the option",
    "docker": "Docker containers cannot tell what a call read",
    "python": "a python: factory decides itself whether its sandboxes tell what a call read "
    "(e.g. WorkspaceSandboxes(..., read_sets=True))",
}


def read_sets_refused(kind: str) -> str | None:
    """Why `--read-sets` means nothing for sandbox `kind` (a message for the command line), or None."""
    why = _NO_READ_SETS.get(kind.split(":")[0])
    return None if why is None else f"--read-sets applies to --sandbox workspace, not {kind}: {why}"


def _python(spec: str, base: str | None) -> Sandboxes:
    _, module_name, attribute = [*spec.split(":"), "", ""][:3]
    if not module_name or not attribute or spec.count(":") != 2:
        raise ValueError(f"--sandbox {spec!r}: expected python:module:factory, e.g. python:mypkg.world:sandboxes")
    try:
        make = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--sandbox {spec!r}: {exc}") from None
    factory = make(base) if base is not None else make()
    if not isinstance(factory, Sandboxes):
        raise ValueError(f"--sandbox {spec!r}: {attribute}() returned a {type(factory).__name__}, not a Sandboxes")
    return factory
