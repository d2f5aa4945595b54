"""`tvcache bench sandbox`, read sets (issue 24): what tracing a command's reads costs, per swe-like command.

The same commands run in one sandbox of an untraced factory and one of a traced factory (`read_sets=True`),
interleaved, `REPEATS` times each; the table gives each command's median wall time both ways and their ratio, and
how many state keys its read set holds. The traced time is the whole call: strace in the jail, parsing its output
and digesting what the command read (content digests are cached per factory, as in a long run).

The workspace is the `swe` benchmark's marshmallow base when it has been built (`tvcache bench swe`), with its
virtual environment at /opt/venv; otherwise a small Python project next to the host's Python.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tvcache.calls import ToolCall
from tvcache.sandboxes.workspace import WorkspaceSandboxes

__all__ = ["print_table", "run"]

REPEATS = 7
#: Commands as SWE-agent rollouts issue them (traces/swe-dev.jsonl): reading, searching, running code and tests.
SWE_COMMANDS = [
    "cat /testbed/src/marshmallow/__init__.py",
    "grep -rn 'def _deserialize' /testbed/src/marshmallow/ | head -20",
    "ls -la /testbed/src/marshmallow",
    "find /testbed/src -name '*.py' | head -50",
    "cd /testbed && git status",
    "cd /testbed && python -c 'import marshmallow; print(marshmallow.__version__)'",
    "cd /testbed && python -m pytest tests/test_registry.py -q 2>&1 | tail -3",
]
PLAIN_COMMANDS = [
    "cat /testbed/pkg/core.py",
    "grep -rn 'def ' /testbed/pkg | head -20",
    "ls -la /testbed/pkg",
    "find /testbed -name '*.py'",
    "cd /testbed && python3 -c 'import pkg.core, json, email.mime.text, unittest; print(pkg.core.VALUE)'",
    "cd /testbed && python3 -m unittest -q pkg.test_core 2>&1 | tail -1",
]


def _swe_factory(**options: Any) -> tuple[WorkspaceSandboxes, list[str]] | None:
    from ..workloads.swe import ENV_MOUNT, Base, cache_root, sandbox_env

    root = cache_root() / "marshmallow-3.0.0"
    if not (root / "complete.json").is_file():
        return None
    base = Base("marshmallow", "3.0.0", root)
    spec = {"/testbed": str(base.testbed), ENV_MOUNT: str(base.env)}
    return WorkspaceSandboxes(spec, env=sandbox_env(base), cwd="/testbed", **options), SWE_COMMANDS


def _plain_project() -> Path:
    root = Path(tempfile.mkdtemp(prefix="tvcache-bench-reads-"))
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "core.py").write_text("VALUE = 42\n\n\ndef double(x):\n    return 2 * x\n")
    (root / "pkg" / "test_core.py").write_text(
        "import unittest\nfrom pkg.core import double\n\n\nclass T(unittest.TestCase):\n"
        "    def test_double(self):\n        self.assertEqual(double(2), 4)\n"
    )
    return root


async def run(repeats: int = REPEATS) -> dict[str, Any]:
    """Measure and return the figures (milliseconds) as a JSON-able dict."""
    made = _swe_factory()
    plain = None
    if made is None:
        plain = _plain_project()
        factories = [WorkspaceSandboxes(plain), WorkspaceSandboxes(plain, read_sets=True)]
        commands, workspace = PLAIN_COMMANDS, "a small Python project (no swe base built)"
    else:
        traced = _swe_factory(read_sets=True)
        assert traced is not None
        factories, commands = [made[0], traced[0]], made[1]
        workspace = "the swe marshmallow 3.0.0 base"
    try:
        boxes = [await f.create() for f in factories]
        times: dict[str, list[list[float]]] = {c: [[], []] for c in commands}
        keys: dict[str, int | None] = {}
        for command in commands:
            call = ToolCall("bash", {"command": command})
            for box in boxes:  # warm: the files in the page cache, the base's digests computed once
                await box.execute(call)
            for _ in range(repeats):
                for k, box in enumerate(boxes):
                    start = time.perf_counter()
                    outcome = await box.execute(call)
                    times[command][k].append((time.perf_counter() - start) * 1000)
                    if k == 1:
                        keys[command] = None if outcome.reads is None else len(outcome.reads)
        figures: dict[str, dict[str, float | None]] = {}
        for command, (untraced, traced_times) in times.items():
            a, b = statistics.median(untraced), statistics.median(traced_times)
            figures[command] = {"untraced_ms": a, "traced_ms": b, "ratio": b / a, "keys": keys[command]}
        total = sum(float(f["traced_ms"] or 0) for f in figures.values()) / sum(
            float(f["untraced_ms"] or 0) for f in figures.values()
        )
        degraded = factories[1].degraded.get("read_sets")
    finally:
        for f in factories:
            await f.close()
        if plain is not None:
            import shutil

            shutil.rmtree(plain, ignore_errors=True)
    return {"workspace": workspace, "repeats": repeats, "figures": figures, "total_ratio": total, "degraded": degraded}


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"Read sets: each command untraced and traced ({result['workspace']}), medians")
    for column in ("command", "untraced", "traced", "ratio", "keys read"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for command, fig in result["figures"].items():
        keys = "none (hazard)" if fig["keys"] is None else str(fig["keys"])
        table.add_row(
            command[:70], f"{fig['untraced_ms']:.1f} ms", f"{fig['traced_ms']:.1f} ms", f"{fig['ratio']:.2f}x", keys
        )
    console.print(table)
    console.print(f"All commands together: traced/untraced = {result['total_ratio']:.2f}x")
    if result["degraded"]:
        console.print(f"[red]Tracing did not work here: {result['degraded']}[/red]")
