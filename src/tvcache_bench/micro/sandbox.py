"""`tvcache bench sandbox`: what a workspace sandbox fork costs, next to copying the workspace.

For a base of at least 300 MB in many files (generated once under /var/tmp and reused, unless `base` is
given), it measures in one run, each as a median over repetitions:

- create: a fresh sandbox (overlay mounts and a network namespace),
- snapshot: freezing a sandbox whose upper dir holds a 1 MB diff into a layer (the sandbox keeps running),
- restore: a new sandbox on top of that snapshot,
- restore + `true`: the same, plus its first bash command (what a fork costs before it does anything),
- one `true` command: a fresh bash in fresh namespaces, chrooted into the sandbox,
- `cp -a` of the base into the same tmp directory, the copy-based fork it replaces.

Targets: snapshot and restore each under 5 ms and at least 100 times faster than `cp -a`.

Then, what a sandbox's size costs the host (issue 19): the same calls in a sandbox holding `MANY_FILES` files it
wrote itself (200,000) and in one holding a single file, each after one file changed, as the ratio of the two:
a trivial command (which includes change detection), change detection alone (fanotify, see workspace._changes),
a snapshot (a delta on the last one, see workspace._deltas), a restore (which replays the chain: O(files)); next to
them the paths that walk or copy the whole sandbox, which they replace (and which remain where fanotify is
missing); this process's RSS before and after; and the JSON size of `list_dir` on the big directory against
`max_output`.

Last, what tracing read sets costs per swe-like command (see `read_sets`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tvcache.calls import ToolCall
from tvcache.sandboxes._fdtree import remove_tree
from tvcache.sandboxes._layers import copy_layer
from tvcache.sandboxes.reclaim import scratch, scratch_dir
from tvcache.sandboxes.workspace import WorkspaceSandboxes

__all__ = ["DEFAULT_BASE", "main", "make_base", "print_many", "print_table", "run", "run_many"]

DEFAULT_BASE = Path("/var/tmp/tvcache-bench-base-300m")
FILES, DIRS, FILE_SIZE = 6000, 60, 50_000  # 300 MB
TARGET_MS, TARGET_RATIO = 5.0, 100.0
REPEATS = 25
COPY_REPEATS = 3


def make_base(path: Path = DEFAULT_BASE) -> Path:
    """A 300 MB tree of 6,000 files in 60 directories, made once and reused (a marker records it is done)."""
    marker = path / ".complete"
    if marker.exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    chunk = os.urandom(FILE_SIZE)
    for i in range(FILES):
        d = path / f"pkg{i % DIRS:02d}"
        d.mkdir(exist_ok=True)
        # Distinct contents (a counter up front), one random block behind: fast to write, never deduplicated.
        (d / f"module{i:05d}.dat").write_bytes(i.to_bytes(8, "little") + chunk[8:])
    marker.write_text(f"{FILES} files of {FILE_SIZE} bytes\n")
    return path


def _tree_size(path: Path) -> tuple[int, int]:
    size = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            size += os.lstat(os.path.join(root, name)).st_size
            files += 1
    return size, files


async def _timed(repeats: int, setup: Callable[[], Awaitable[Any]], op: Callable[[Any], Awaitable[Any]]) -> list[float]:
    """Milliseconds of `op(setup())`, untimed set-up and clean-up (`op`'s result is closed if it can be)."""
    times = []
    for _ in range(repeats):
        arg = await setup()
        start = time.perf_counter()
        result = await op(arg)
        times.append((time.perf_counter() - start) * 1000)
        if hasattr(result, "close"):
            await result.close()
    return times


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))],
        "n": len(ordered),
    }


async def run(base: str | None = None, *, repeats: int = REPEATS, copy_repeats: int = COPY_REPEATS) -> dict[str, Any]:
    """Measure and return the figures (milliseconds) as a JSON-able dict."""
    base_path = Path(base) if base is not None else await asyncio.to_thread(make_base)
    size, files = await asyncio.to_thread(_tree_size, base_path)
    true = ToolCall("bash", {"command": "true"})
    diff = ToolCall("bash", {"command": "head -c 1048576 /dev/urandom > /tmp/diff.bin"})
    async with WorkspaceSandboxes(base_path) as boxes:
        tmp = boxes._run.path.parent.parent  # the tmp directory uppers live in: copies go there too
        warm = await boxes.create()  # the factory's first sandbox also learns the initial shell state
        await warm.execute(true)
        ops: dict[str, list[float]] = {}

        async def nothing() -> None:
            return None

        ops["create"] = await _timed(repeats, nothing, lambda _: boxes.create())

        async def dirty_box() -> Any:
            await warm.execute(diff)
            return warm

        snapshots: list[str] = []

        async def snapshot(box: Any) -> None:
            snapshots.append(await box.snapshot())

        ops["snapshot (1 MB diff)"] = await _timed(repeats, dirty_box, snapshot)
        snap = snapshots[-1]

        async def restore(_: Any) -> Any:
            return await boxes.restore(snap)

        ops["restore"] = await _timed(repeats, nothing, restore)

        async def restore_and_run(_: Any) -> Any:
            box = await boxes.restore(snap)
            await box.execute(true)
            return box

        ops["restore + `true`"] = await _timed(repeats, nothing, restore_and_run)

        async def run_true(box: Any) -> None:
            await box.execute(true)

        async def the_warm_box() -> Any:
            return warm

        ops["one `true` command"] = await _timed(repeats * 2, the_warm_box, run_true)
        mode = boxes.mode

        def copy_once() -> float:
            dest = scratch_dir("bench-cp", tmp)
            try:
                start = time.perf_counter()
                subprocess.run(["cp", "-a", "--", f"{base_path}/.", str(dest)], check=True)
                return (time.perf_counter() - start) * 1000
            finally:
                shutil.rmtree(dest, ignore_errors=True)

        ops["cp -a of the base"] = [await asyncio.to_thread(copy_once) for _ in range(copy_repeats)]

    figures = {name: _summary(times) for name, times in ops.items()}
    copy_ms = figures["cp -a of the base"]["median_ms"]
    for fig in figures.values():
        fig["times_faster_than_cp_a"] = copy_ms / fig["median_ms"] if fig["median_ms"] > 0 else float("inf")
    met = all(
        figures[name]["median_ms"] < TARGET_MS and figures[name]["times_faster_than_cp_a"] >= TARGET_RATIO
        for name in ("snapshot (1 MB diff)", "restore")
    )
    return {
        "base": str(base_path),
        "base_bytes": size,
        "base_files": files,
        "mode": mode,
        "tmp": str(tmp),
        "figures": figures,
        "targets": {"max_ms": TARGET_MS, "min_times_faster": TARGET_RATIO, "met": met},
    }


MANY_FILES = 200_000
MANY_REPEATS = 5
_MAKE_MANY = """python3 -c '
import os
os.makedirs("/testbed/many", exist_ok=True)
for i in range({n}):
    open(f"/testbed/many/f{{i}}", "w").close()
'"""


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def run_many(files: int = MANY_FILES, *, repeats: int = MANY_REPEATS) -> dict[str, Any]:
    """What a sandbox of `files` files costs next to one of a single file, after one file changed (ms), and what the
    paths that walked or copied the whole sandbox cost (the fallbacks where fanotify is missing)."""
    touch = ToolCall("bash", {"command": "echo x >> /testbed/many/f0"})
    true = ToolCall("bash", {"command": "true"})
    figures: dict[str, dict[str, float]] = {}
    rss: dict[str, float] = {}
    with scratch("bench-many") as base:
        async with WorkspaceSandboxes(base) as boxes:
            small, big = await boxes.create(), await boxes.create()
            await small.execute(ToolCall("bash", {"command": _MAKE_MANY.format(n=1)}))
            rss["before"] = _rss_mib()
            await big.execute(ToolCall("bash", {"command": _MAKE_MANY.format(n=files)}))
            for box in (small, big):
                await box.snapshot()  # the first snapshot of the files themselves is not the point
            rss["after"] = _rss_mib()
            for name, box in (("small", small), ("big", big)):
                slow = max(2, repeats // 2) if name == "big" else repeats  # the O(files) paths take seconds there

                async def the_box(b: Any = box) -> Any:
                    return b

                async def written(b: Any = box) -> Any:
                    # Through the sandbox's root, from here: the change is not looked at yet (a call would).
                    await asyncio.to_thread(_append, os.path.join(b.root, "testbed/many/f0"))
                    return b

                async def touched(b: Any = box) -> Any:
                    await b.execute(touch)
                    return b

                async def detect(b: Any) -> None:
                    assert await b._fs.changed()

                async def walk(b: Any) -> None:
                    await b._fs._relisted()  # what every call did before fanotify (and still does without)

                async def snapshot(b: Any) -> None:
                    await b.snapshot()

                async def full_copy(b: Any) -> None:
                    # What every snapshot did before deltas (and still does when the account cannot tell them).
                    dest = Path(tempfile.mkdtemp(dir=boxes._run.path))
                    try:
                        for k in range(len(b._fs._listings)):
                            await asyncio.to_thread(copy_layer, b._fs._upper(k), str(dest / str(k)))
                    finally:
                        await asyncio.to_thread(remove_tree, dest)

                async def restore(b: Any) -> Any:
                    return await boxes.restore(await b.snapshot())

                async def trivial(b: Any) -> None:
                    await b.execute(true)

                figures[f"a trivial command ({name})"] = _summary(await _timed(repeats, the_box, trivial))
                figures[f"change detection ({name})"] = _summary(await _timed(repeats, written, detect))
                figures[f"change detection by a full walk ({name})"] = _summary(await _timed(slow, written, walk))
                figures[f"snapshot, one file changed ({name})"] = _summary(await _timed(repeats, touched, snapshot))
                figures[f"snapshot by a full copy ({name})"] = _summary(await _timed(slow, touched, full_copy))
                figures[f"restore ({name})"] = _summary(await _timed(slow, touched, restore))
            listed = await big.execute(ToolCall("list_dir", {"path": "/testbed/many"}))
            list_bytes = len(json.dumps(listed.output))
    ratios = {
        what: figures[f"{what} (big)"]["median_ms"] / max(figures[f"{what} (small)"]["median_ms"], 1e-6)
        for what in _MANY_ROWS
    }
    old_over_new = {
        new: figures[f"{old} (big)"]["median_ms"] / max(figures[f"{new} (big)"]["median_ms"], 1e-6)
        for new, old in _OLD_PATHS.items()
    }
    return {
        "files": files,
        "figures": figures,
        "big_over_small": ratios,
        "old_over_new": old_over_new,
        "rss_mib": rss,
        "list_dir_bytes": list_bytes,
        "max_output": boxes.max_output,
    }


_MANY_ROWS = (
    "a trivial command",
    "change detection",
    "change detection by a full walk",
    "snapshot, one file changed",
    "snapshot by a full copy",
    "restore",
)
#: Each operation, and the path it took before (and still takes where fanotify is missing).
_OLD_PATHS = {
    "change detection": "change detection by a full walk",
    "snapshot, one file changed": "snapshot by a full copy",
}


def _append(path: str) -> None:
    with open(path, "a") as f:
        f.write("x\n")


def print_many(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"A sandbox of {result['files']:,} files next to one of 1 file, one file changed each time")
    for column in ("operation", f"{result['files']:,} files", "1 file", "ratio"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    figures = result["figures"]
    for what, ratio in result["big_over_small"].items():
        big, small = figures[f"{what} (big)"], figures[f"{what} (small)"]
        table.add_row(what, f"{big['median_ms']:.2f} ms", f"{small['median_ms']:.2f} ms", f"{ratio:.1f}x")
    console.print(table)
    for new, ratio in result["old_over_new"].items():
        console.print(f"{new}, {result['files']:,} files: {ratio:,.0f}x faster than {_OLD_PATHS[new]}")
    rss = result["rss_mib"]
    console.print(
        f"This process's RSS: {rss['before']:.0f} MiB before the {result['files']:,} files, {rss['after']:.0f} MiB "
        f"after (+{rss['after'] - rss['before']:.1f} MiB). list_dir of them: {result['list_dir_bytes']:,} bytes "
        f"of JSON with max_output {result['max_output']:,}."
    )


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(
        title=(
            f"Workspace sandboxes ({result['mode']} mode): base {result['base_bytes'] / 1e6:.0f} MB in "
            f"{result['base_files']:,} files at {result['base']}, uppers and copies in {result['tmp']}"
        )
    )
    for column in ("operation", "median", "p90", "runs", "vs cp -a"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    for name, fig in result["figures"].items():
        ratio = "1x" if name.startswith("cp -a") else f"{fig['times_faster_than_cp_a']:,.0f}x faster"
        table.add_row(name, f"{fig['median_ms']:.2f} ms", f"{fig['p90_ms']:.2f} ms", str(fig["n"]), ratio)
    console.print(table)
    targets = result["targets"]
    verdict = "[green]met[/green]" if targets["met"] else "[red]NOT met[/red]"
    console.print(
        f"Target: snapshot and restore each under {targets['max_ms']:g} ms and at least "
        f"{targets['min_times_faster']:g}x faster than cp -a: {verdict}"
    )


async def main(base: str | None = None) -> dict[str, Any]:
    """Run the benchmark, print its table, and return the figures."""
    result = await run(base)
    print_table(result)
    result["many_files"] = await run_many()
    print_many(result["many_files"])
    from . import read_sets

    result["read_sets"] = await read_sets.run()
    read_sets.print_table(result["read_sets"])
    return result
