"""A workload: recorded rollouts plus the sandboxes to replay them in. The interface every workload
module (`sql`, `swe`, `airline`, `synthetic`, ...) implements, and builders for `tvcache replay TRACES`.

A workload module returns a `Workload`; the replay engine (`replay.py`) runs it under every strategy. The
builders here make one from any trace file and a sandbox kind:

- `sqlite`: `base` is a SQLite file; tool `sql` with args `{"query": str}`. `setup` is an SQL script run once
  on a private copy of the file before any rollout starts.
- `workspace`: `base` is a directory, or `image` a Docker or OCI image whose layers become the sandbox's root
  (`WorkspaceSandboxes.from_image`); tool `bash` with args `{"command": str}`. `setup` is a shell command run
  once in a sandbox of the base; its result is the state every rollout starts from.
- `docker`: `image` is a Docker image; each sandbox a container of it (`DockerSandboxes`); tool `bash`, and
  `setup` as for workspace.
- `python:module:factory`: `module.factory()` returns a `Sandboxes`, or `module.factory(base)` when a base
  is given. Setup is the factory's business.

`read_sets` (`--read-sets`) traces what each command reads in workspace sandboxes, for the strategies that reuse
results by it; the others get an untraced factory of the same base (`Workload.untraced`). SQLite sandboxes always
tell what a query read (the authorizer), and the other kinds cannot be told to: for them it is an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import os
import shutil
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvcache.calls import ToolCall, Tools
from tvcache.sandboxes.base import Sandbox, SandboxError, Sandboxes
from tvcache.sandboxes.reclaim import scratch_dir

from .traces import Trace, read_traces, task_order

__all__ = ["SetupSandboxes", "Workload", "combine", "first_tasks", "load_workload", "sandboxes_from_spec"]


async def _nothing() -> None:
    return None


@dataclass
class Workload:
    name: str
    traces: list[Trace]
    sandboxes: Callable[[str], Sandboxes]  # task -> its sandbox factory (may be shared among tasks)
    tools: Tools  # annotations (read_only etc.)
    close: Callable[[], Awaitable[None]] = field(default=_nothing)  # releases factories / temp files
    notes: str = ""  # where the data comes from, for the report
    # The same sandboxes without tracing what calls read, for the strategies that do not reuse by it and for the
    # oracle's re-executions (None: `sandboxes` serves every strategy).
    untraced: Callable[[str], Sandboxes] | None = None


def first_tasks(traces: list[Trace], n: int | None) -> list[Trace]:
    """The rollouts of the first `n` tasks of the file (all when `n` is None), in file order."""
    if n is None:
        return list(traces)
    if n < 1:
        raise ValueError(f"--tasks must be at least 1, got {n}")
    keep = set(task_order(traces)[:n])
    return [t for t in traces if t.task in keep]


def combine(name: str, parts: Sequence[Workload], order: Sequence[str] | None = None) -> Workload:
    """One workload made of several, for mixes: each task keeps its own part's sandboxes. `order` lists
    every task in the order to run them (default: the parts' tasks one part after the other). The parts
    must annotate tools alike, since a workload has one `Tools`."""
    if not parts:
        raise ValueError("combine needs at least one workload")
    owner: dict[str, Workload] = {}
    for part in parts:
        if part.tools != parts[0].tools:
            raise ValueError(f"workloads {parts[0].name!r} and {part.name!r} annotate tools differently")
        for task in task_order(part.traces):
            if task in owner:
                raise ValueError(f"task {task!r} is in both {owner[task].name!r} and {part.name!r}")
            owner[task] = part
    tasks = list(order) if order is not None else list(owner)
    if sorted(tasks) != sorted(owner):
        raise ValueError("order must list every task of the parts exactly once")
    by_task: dict[str, list[Trace]] = {}
    for part in parts:
        for trace in part.traces:
            by_task.setdefault(trace.task, []).append(trace)

    async def close() -> None:
        for part in parts:
            await part.close()

    return Workload(
        name=name,
        traces=[trace for task in tasks for trace in by_task[task]],
        sandboxes=lambda task: owner[task].sandboxes(task),
        tools=parts[0].tools,
        close=close,
        notes="; ".join(f"{part.name}: {part.notes.rstrip('.')}" for part in parts if part.notes),
    )


async def load_workload(
    traces_path: str | Path,
    sandbox: str,
    *,
    base: str | Path | None = None,
    setup: str | None = None,
    tasks: int | None = None,
    read_only: frozenset[str] = frozenset(),
    timeout: float | None = None,
    image: str | None = None,
    read_sets: bool = False,
) -> Workload:
    """A workload replaying `traces_path` in one sandbox factory shared by all its tasks (each task still
    has its own scope in the cache, and every rollout starts from the factory's base state). `read_sets`: see
    the module docstring."""
    if read_sets:
        _check_read_sets(sandbox, setup)  # before the traces are read, as sandboxes_from_spec would after
    traces = first_tasks(read_traces(traces_path), tasks)
    if not traces:
        raise ValueError(f"{traces_path} holds no rollouts")
    options: dict[str, Any] = {"base": base, "setup": setup, "timeout": timeout, "image": image}
    factory, release = await sandboxes_from_spec(sandbox, **options, read_sets=read_sets)
    untraced: Sandboxes | None = None
    if read_sets:  # the strategies that do not reuse by what a call read, and the oracle, run untraced
        try:
            untraced, release_untraced = await sandboxes_from_spec(sandbox, **options)
        except BaseException:
            await release()
            raise
        release = _both(release_untraced, release)
    where = f"{sandbox} sandboxes" + (f" from {base}" if base else "") + (f" of image {image}" if image else "")
    where += f" after setup {setup!r}" if setup else ""
    where += ", traced for their reads for the strategies that reuse by them" if read_sets else ""
    return Workload(
        name=Path(traces_path).stem,
        traces=traces,
        sandboxes=lambda task: factory,
        tools=Tools(read_only=read_only),
        close=release,
        notes=f"{len(traces)} rollouts of {len(task_order(traces))} tasks from {traces_path}, replayed in {where}",
        untraced=None if untraced is None else (lambda task: untraced),
    )


def _both(first: Callable[[], Awaitable[None]], then: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def release() -> None:
        try:
            await first()
        finally:
            await then()

    return release


def _check_read_sets(sandbox: str, setup: str | None) -> None:
    """ValueError unless `--read-sets` means something for this sandbox kind."""
    from tvcache.server.factories import read_sets_refused  # the sandbox server refuses the same kinds

    refused = read_sets_refused(sandbox)
    if refused is not None:
        raise ValueError(refused)
    if sandbox == "workspace" and setup:
        # SetupSandboxes starts from a snapshot whose digests no factory can tell (`BaseDigests`): the option
        # would silently reuse nothing by what a call read.
        raise ValueError("--read-sets does not work with --setup yet: bake the setup into --base or --image instead")
    if sandbox != "workspace":
        raise ValueError(f"--read-sets applies to --sandbox workspace, not {sandbox!r}")


async def sandboxes_from_spec(
    spec: str,
    *,
    base: str | Path | None,
    setup: str | None,
    timeout: float | None,
    image: str | None = None,
    read_sets: bool = False,
) -> tuple[Sandboxes, Callable[[], Awaitable[None]]]:
    """The factory a `--sandbox` value names, and a function releasing it; `read_sets` (workspace only) traces
    what its commands read."""
    if image is not None and spec not in ("workspace", "docker"):
        raise ValueError(f"--image applies to --sandbox workspace or docker, not {spec!r}")
    if read_sets:
        _check_read_sets(spec, setup)
    if spec == "docker":
        return await _docker(base, image, setup, timeout)
    if spec == "sqlite":
        return _sqlite(base, setup, timeout)
    if spec == "workspace":
        return await _workspace(base, setup, timeout, image, read_sets)
    if spec.startswith("python:"):
        if setup:
            raise ValueError("--setup is not supported with python: sandboxes; do the setup in the factory")
        factory = _python(spec, base)
        return factory, lambda: _close(factory)
    raise ValueError(f"unknown sandbox {spec!r}: use sqlite, workspace or python:module:factory")


def _sqlite(
    base: str | Path | None, setup: str | None, timeout: float | None
) -> tuple[Sandboxes, Callable[[], Awaitable[None]]]:
    from tvcache.sandboxes.sqlite import SQLiteSandboxes

    if base is None:
        raise ValueError("--sandbox sqlite needs --base FILE.sqlite")
    source = Path(base)
    if not source.is_file():
        raise FileNotFoundError(f"--base {source} is not a SQLite file")
    options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if not setup:
        factory = SQLiteSandboxes(source, **options)
        return factory, factory.close
    # The setup runs on a private copy: the user's file is never written.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    scratch = scratch_dir("setup", shm)
    try:
        copy = scratch / "base.sqlite"
        shutil.copyfile(source, copy)
        conn = sqlite3.connect(copy, isolation_level=None)
        try:
            conn.executescript(setup)
        except sqlite3.Error as exc:
            raise ValueError(f"--setup failed on {source}: {exc}") from exc
        finally:
            conn.close()
        factory = SQLiteSandboxes(copy, **options)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return factory, factory.close


async def _workspace(
    base: str | Path | None,
    setup: str | None,
    timeout: float | None,
    image: str | None = None,
    read_sets: bool = False,
) -> tuple[Sandboxes, Callable[[], Awaitable[None]]]:
    from tvcache.sandboxes.images import workspace_from_image
    from tvcache.sandboxes.workspace import WorkspaceSandboxes

    if (base is None) == (image is None):
        raise ValueError("--sandbox workspace needs --base DIR or --image IMAGE (one of them)")
    options: dict[str, Any] = {"read_sets": True} if read_sets else {}
    if timeout is not None and "timeout" in inspect.signature(WorkspaceSandboxes).parameters:
        options["timeout"] = timeout
    if image is not None:
        inner: Sandboxes = await workspace_from_image(image, **options)
    else:
        assert base is not None
        _check_dir(base)
        inner = WorkspaceSandboxes(base, **options)
    return await _with_setup(inner, setup)


async def _docker(
    base: str | Path | None, image: str | None, setup: str | None, timeout: float | None
) -> tuple[Sandboxes, Callable[[], Awaitable[None]]]:
    from tvcache.sandboxes.docker import DockerSandboxes

    if image is None or base is not None:
        raise ValueError("--sandbox docker needs --image IMAGE (and no --base)")
    options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    return await _with_setup(await asyncio.to_thread(DockerSandboxes, image, **options), setup)


async def _with_setup(inner: Sandboxes, setup: str | None) -> tuple[Sandboxes, Callable[[], Awaitable[None]]]:
    """`inner`, or `inner` after a bash `setup`, with the function releasing it."""
    if not setup:
        return inner, lambda: _close(inner)
    try:
        wrapped = await SetupSandboxes.build(inner, ToolCall("bash", {"command": setup}))
    except BaseException:
        await _close(inner)
        raise
    return wrapped, wrapped.close


def _check_dir(base: str | Path) -> None:
    if not Path(base).is_dir():
        raise FileNotFoundError(f"--base {base} is not a directory")


def _python(spec: str, base: str | Path | None) -> Sandboxes:
    parts = spec.split(":")
    if len(parts) != 3 or not all(parts[1:]):
        raise ValueError(f"--sandbox {spec!r}: expected python:module:factory, e.g. python:mypkg.world:sandboxes")
    _, module_name, attribute = parts
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--sandbox {spec!r}: cannot import {module_name!r} ({exc})") from exc
    make = getattr(module, attribute, None)
    if not callable(make):
        raise ValueError(f"--sandbox {spec!r}: {module_name} has no callable {attribute!r}")
    factory = make(str(base)) if base is not None else make()
    if not isinstance(factory, Sandboxes):
        raise TypeError(
            f"--sandbox {spec!r}: {attribute}() returned {type(factory).__name__}, which is not a Sandboxes "
            "(fingerprint, create, restore, delete)"
        )
    return factory


async def _close(factory: object) -> None:
    close = getattr(factory, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result


class SetupSandboxes:
    """A factory whose sandboxes start after a setup call: the setup runs once in a sandbox of `inner`,
    which is snapshotted; every `create` restores that snapshot. The fingerprint covers the setup, so a
    changed setup is a new scope."""

    def __init__(self, inner: Sandboxes, start: str, fingerprint: str):
        self._inner = inner
        self._start = start
        self._fingerprint = fingerprint

    @classmethod
    async def build(cls, inner: Sandboxes, setup: ToolCall) -> SetupSandboxes:
        box = await inner.create()
        try:
            outcome = await box.execute(setup)
            output = outcome.output
            # A workspace's bash answers {"output", "exit_code"}: a non-zero exit is a failed setup too.
            failed = isinstance(output, dict) and output.get("exit_code", 0) != 0
            if outcome.error or failed:
                raise SandboxError(f"setup {setup.key[:200]} failed: {str(output)[:1000]}")
            start = await box.snapshot()
        finally:
            await box.close()
        digest = hashlib.blake2b(f"{inner.fingerprint}\0{setup.key}".encode(), digest_size=16).hexdigest()
        return cls(inner, start, f"setup-{digest}")

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    async def create(self) -> Sandbox:
        return await self._inner.restore(self._start)

    async def restore(self, snapshot_id: str) -> Sandbox:
        return await self._inner.restore(snapshot_id)

    async def delete(self, snapshot_id: str) -> None:
        if snapshot_id != self._start:  # the starting state outlives every cache eviction
            await self._inner.delete(snapshot_id)

    async def close(self) -> None:
        await self._inner.delete(self._start)
        await _close(self._inner)
