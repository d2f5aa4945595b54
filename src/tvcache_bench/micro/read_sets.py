"""`tvcache bench sandbox`, read sets (issue 24): what tracing a command's reads costs, per swe-like command.

The same commands run in one sandbox of an untraced factory and one of each traced factory (`read_sets=True`,
traced with strace and with eBPF), interleaved, `REPEATS` times each, each call right after a `:` in its own
sandbox; the table gives each command's median wall time each way and the ratios, and how many state keys its read
set holds. The traced time is the call's until it answers: the command, traced; what it read is digested after the
answer (`Outcome.reads_later`), and the table gives that on its own, the time from the answer until the read set
is whole (content digests are cached per factory, as in a long run).

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
from tvcache.sandboxes.base import settled
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
        factories = [WorkspaceSandboxes(plain), *(WorkspaceSandboxes(plain, read_sets=True) for _ in TRACERS)]
        commands, workspace = PLAIN_COMMANDS, "a small Python project (no swe base built)"
    else:
        traced = [_swe_factory(read_sets=True) for _ in TRACERS]
        factories, commands = [made[0], *(t[0] for t in traced if t is not None)], made[1]
        workspace = "the swe marshmallow 3.0.0 base"
    for tracer, factory in zip(TRACERS, factories[1:], strict=True):
        factory._use_ebpf = tracer == "eBPF"
    try:
        boxes = [await f.create() for f in factories]
        used = [_tracer_of(f) for f in factories[1:]]
        times: dict[str, list[list[float]]] = {c: [[] for _ in boxes] for c in commands}
        keys: dict[str, list[int | None]] = {c: [None for _ in TRACERS] for c in commands}
        after: dict[str, list[list[float]]] = {c: [[] for _ in TRACERS] for c in commands}
        for command in commands:
            call = ToolCall("bash", {"command": command})
            for box in boxes:  # warm: the files in the page cache, the base's digests computed once
                await box.execute(call)
            for _ in range(repeats):
                for k, box in enumerate(boxes):
                    # Each measured call follows a call of its own sandbox: a call right after another sandbox's
                    # took up to twice as long, whatever its tracer (eBPF's, right after strace's, carried that).
                    await box.execute(_SETTLE)
                    start = time.perf_counter()
                    outcome = await box.execute(call)
                    answered = time.perf_counter()
                    times[command][k].append((answered - start) * 1000)
                    if k:
                        outcome = await settled(outcome)
                        after[command][k - 1].append((time.perf_counter() - answered) * 1000)
                        keys[command][k - 1] = None if outcome.reads is None else len(outcome.reads)
        figures = {
            command: {"untraced_ms": statistics.median(ts[0]), "traced_ms": [statistics.median(t) for t in ts[1:]]}
            for command, ts in times.items()
        }
        for command, fig in figures.items():
            fig["keys"] = keys[command]
            fig["digest_ms"] = [statistics.median(a) for a in after[command]]
        untraced = sum(statistics.median(ts[0]) for ts in times.values())
        totals = [sum(statistics.median(ts[k]) for ts in times.values()) / untraced for k in range(1, len(boxes))]
        degraded = [f.degraded.get("read_sets") for f in factories[1:]]
    finally:
        for f in factories:
            await f.close()
        if plain is not None:
            import shutil

            shutil.rmtree(plain, ignore_errors=True)
    return {
        "workspace": workspace,
        "repeats": repeats,
        "tracers": used,
        "figures": figures,
        "total_ratios": totals,
        "degraded": degraded,
    }


_SETTLE = ToolCall("bash", {"command": ":"})
#: The tracers compared: strace (ptrace stops) and eBPF (no stops); eBPF falls back to strace where it
#: cannot run, which the table says.
TRACERS = ["strace", "eBPF"]


def _tracer_of(factory: WorkspaceSandboxes) -> str:
    if factory._ebpf is not None:
        return "eBPF"
    return "strace" if factory._tracer is not None else "untraced"


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"Read sets: each command untraced and traced ({result['workspace']}), medians")
    table.add_column("command")
    table.add_column("untraced", justify="right")
    for tracer in result["tracers"]:
        table.add_column(tracer, justify="right")
        table.add_column("ratio", justify="right")
        table.add_column("then digests", justify="right")
    table.add_column("keys read", justify="right")
    for command, fig in result["figures"].items():
        cells = [command[:60], f"{fig['untraced_ms']:.1f} ms"]
        for traced, digest in zip(fig["traced_ms"], fig["digest_ms"], strict=True):
            cells += [f"{traced:.1f} ms", f"{traced / fig['untraced_ms']:.2f}x", f"{digest:.1f} ms"]
        cells.append(" / ".join("none (hazard)" if k is None else str(k) for k in fig["keys"]))
        table.add_row(*cells)
    console.print(table)
    for tracer, ratio in zip(result["tracers"], result["total_ratios"], strict=True):
        console.print(f"All commands together, until the answer: {tracer}/untraced = {ratio:.2f}x")
    for tracer, why in zip(result["tracers"], result["degraded"], strict=True):
        if why:
            console.print(f"[red]Tracing ({tracer}) did not work here: {why}[/red]")
