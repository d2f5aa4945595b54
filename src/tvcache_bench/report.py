"""Reports of a replay: a rich table, a JSON file and PNG charts.

The charts follow the paper's figures: hit rate per epoch per strategy (grouped bars) and the distribution of
per-call tool time with and without the cache (CDF on a log time axis), plus total tool time per strategy and
where that time went (stacked bars: executing, waiting, creating, restoring, replaying, snapshotting, store round
trips, the cache's own overhead).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .replay import PARTS, ReplayResult, StrategyRun, percentile

__all__ = [
    "PAPER",
    "format_bytes",
    "format_seconds",
    "print_table",
    "print_tool_table",
    "style_axes",
    "wide_console",
    "write_charts",
    "write_json",
    "write_tool_chart",
]

# One colour per strategy, the same in every chart.
COLORS = {"none": "#7f7f7f", "naive": "#d62728", "paper": "#1f77b4", "tvcache": "#2ca02c"}
LABELS = {"none": "no cache", "naive": "naive (tool, args)", "paper": "TVCache paper's policy", "tvcache": "tvcache"}


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def format_bytes(size: float | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def wide_console() -> Console:
    """A console for tables: the terminal's width, or 160 columns when writing to a file or pipe (logs,
    CI), where rich would otherwise fold the table into 80."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


# The published system the `paper` strategy reimplements, as the reports cite it.
PAPER = (
    'Kumar, Kataria, Oh, Manzoor and Singh, "TVCache: A Stateful Tool-Value Cache for Post-Training LLM Agents", '
    "arXiv:2602.10986, 2026"
)

# Reports fit a 100-column terminal: the table holds what a reader compares at a glance, the detail table below it
# the rest, and the notes and legend wrap at the same width.
WIDTH = 100


def print_table(result: ReplayResult, console: Console | None = None) -> None:
    console = console or wide_console()
    width = min(console.width, WIDTH)
    summary = result.summary()
    strategies = summary["strategies"]
    compared = "none" in strategies
    o = result.options
    main = Table(
        title=f"{result.workload}: {result.tasks} tasks, {result.rollouts} rollouts, "
        f"{result.calls_per_epoch} calls x {o.epochs} epoch{'s' if o.epochs > 1 else ''} "
        f"(batch {o.batch} tasks/step, {o.concurrency} concurrent rollouts)",
        title_justify="left",
    )
    detail = Table(title="detail", title_justify="left")
    for table, columns in (
        (
            main,
            [
                "hit rate",
                "executions",
                "median call",
                "tool time",
                *_compared(compared, "speedup", "incorrect\nhits"),
                "snapshots",
            ],
        ),
        (detail, ["replayed", "p90 call", *_compared(compared, "median speedup"), "rollout time", "peak memory"]),
    ):
        table.add_column("strategy")
        for column in columns:
            table.add_column(column, justify="right")
    for name, row in strategies.items():
        incorrect = row["incorrect_hits"]
        shown = "-" if incorrect is None else f"[bold red]{incorrect}[/]" if incorrect else "[green]0[/]"
        baseline = name == "none"
        main.add_row(
            name,
            f"{row['hit_rate']:.1%}",
            str(row["executions"]),
            format_seconds(row["median_call_seconds"]),
            format_seconds(row["total_tool_seconds"]),
            *_compared(compared, "-" if baseline else _ratio(row["speedup_total"]), shown),
            str(row["snapshots"]),
        )
        detail.add_row(
            name,
            str(row["replays"]),
            format_seconds(row["p90_call_seconds"]),
            *_compared(compared, "-" if baseline else _ratio(row["speedup_median"])),
            format_seconds(row["rollout_seconds"]),
            format_bytes(row["peak_memory_bytes"]),
        )
    console.print(main, width=width)
    console.print(detail, width=width)
    console.print(_breakdown_table(summary), width=width)
    if compared:
        console.print(_paired_table(summary), width=width)
    else:
        console.print("paired cost of commands: no baseline (no 'none' strategy in this run)", width=width)
    for line in _footnotes(result, summary):
        console.print(line, highlight=False, width=width)
    legend = Table.grid(padding=(0, 1))  # a grid, so that long meanings wrap under themselves
    legend.add_column(no_wrap=True)
    legend.add_column()
    for term, meaning in _legend(strategies):
        legend.add_row(f"  {term} =", meaning)
    console.print("reading the tables:", width=width)
    console.print(legend, highlight=False, width=width)


# The breakdown's columns and chart segments: each part of `PARTS`, then the overhead, in one colour each.
BREAKDOWN = (*PARTS, "overhead")
PART_COLORS = dict(
    zip(
        BREAKDOWN, ("#2ca02c", "#17becf", "#ff7f0e", "#9467bd", "#d62728", "#8c564b", "#1f77b4", "#7f7f7f"), strict=True
    )
)
PART_LABELS = {"store": "store round trips", "waiting": "waiting (single flight)", "overhead": "cache overhead"}
PART_COLUMNS = dict(
    zip(BREAKDOWN, ("execute", "wait", "create", "restore", "replay", "snapshot", "store", "overhead"), strict=True)
)


def _breakdown_table(summary: dict[str, Any]) -> Table:
    table = Table(title="where the tool time goes", title_justify="left")
    table.add_column("strategy")
    for part in BREAKDOWN:
        table.add_column(PART_COLUMNS[part], justify="right")
    for name, row in summary["strategies"].items():
        table.add_row(name, *(_part_seconds(row["time_breakdown"][part]) for part in BREAKDOWN))
    return table


def _paired_table(summary: dict[str, Any]) -> Table:
    """Per strategy, its executed commands against no cache's executions of the same calls (see `paired.py`)."""
    table = Table(title="paired commands: the same calls executed by the strategy and by none", title_justify="left")
    columns = ("pairs", "left out", "wall", "none wall", "ratio", "cpu", "none cpu", "cpu ratio")
    table.add_column("strategy")
    for column in columns:
        table.add_column(column, justify="right")
    for name, row in summary["strategies"].items():
        p = row["paired"]
        if p is None:
            continue
        cpu = p["cpu_commands"] > 0
        table.add_row(
            name,
            str(p["commands"]),
            str(p["unpaired"] + p["different_answers"]),
            format_seconds(p["seconds"]),
            format_seconds(p["baseline_seconds"]),
            _plain_ratio(p["median_ratio"]),
            format_seconds(p["cpu_seconds"]) if cpu else "-",
            format_seconds(p["baseline_cpu_seconds"]) if cpu else "-",
            _plain_ratio(p["median_cpu_ratio"]),
        )
    return table


def _plain_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _part_seconds(seconds: float) -> str:
    """A part's seconds; "-" for work the strategy never did."""
    return "-" if seconds == 0 else format_seconds(seconds)


def _compared(compared: bool, *cells: str) -> list[str]:
    """The cells that compare with the `none` strategy: none of them in a run without it."""
    return list(cells) if compared else []


# What each strategy is, in the legend.
MEANINGS = {
    "none": "no cache: every call executes in the rollout's own sandbox; its answers are the oracle",
    "naive": "a cache keyed on (tool, args) alone, blind to the sandbox's state: after a state-changing call it can "
    "return an answer recorded in another state",
    "paper": f"the policy of the published TVCache system ({PAPER}): a key per exact history of calls, read-only "
    "tools memoized only where annotated, a snapshot after every state-changing call, no single flight",
    "tvcache": "tvcache.ToolCache with its defaults (in memory unless --store)",
    "exact": "tvcache.ToolCache(read_sets=False): exact history only, no reuse by what a call read",
}


def _legend(strategies: dict[str, Any]) -> list[tuple[str, str]]:
    """How to read the tables: the strategies in them and every column."""
    compared = "none" in strategies
    lines = [(name, MEANINGS[name]) for name in strategies if name in MEANINGS]
    lines += [
        ("hit rate", "calls answered from the cache (also after waiting for a concurrent identical call) / all calls"),
        ("executions", "tool calls run for rollouts (the misses)"),
        (
            "median call",
            "the median time of a call as its rollout saw it: lookup, waits, sandbox creation or restore, replays, "
            "execution, snapshot",
        ),
        ("tool time", "the sum of every call's time: all the time rollouts waited for tools"),
    ]
    if compared:
        lines += [
            ("speedup", "none's tool time / the strategy's: what a training step feels"),
            (
                "incorrect hits",
                "hits whose answer differs from the uncached answer of the same call of the same rollout; wrong "
                "answers (noted above where there are more) also count executed calls whose answer differs because "
                "an earlier incorrect hit skipped a state change",
            ),
        ]
    lines += [
        ("snapshots", "sandbox states saved to restore later (a file copy, a layer, a container commit each)"),
        ("replayed", "calls run again to rebuild a sandbox state (not in executions)"),
        ("p90 call", "the 90th percentile of a call's time"),
        ("where the tool time goes", "the tool time split by what the calls waited for, each column a sum:"),
        ("execute", "executing the calls (the misses)"),
        ("wait", "waiting for another rollout's identical call (single flight)"),
        ("create", "making fresh sandboxes"),
        ("restore", "restoring snapshots"),
        ("replay", "replaying calls to rebuild a state"),
        ("snapshot", "saving sandbox states"),
        ("store", "round trips to the cache's store (lookups, records, claims, leases, snapshot records)"),
        (
            "overhead",
            "the rest: the cache's own work, closing sandboxes, deleting evicted snapshots, waiting for the CPU",
        ),
    ]
    if compared:
        lines.append(
            ("median speedup", "none's median call / the strategy's: a typical call (a hit takes microseconds)")
        )
        lines += [
            (
                "paired commands",
                "each call the strategy executed (a miss) paired with none's execution of the same call of the same "
                "rollout and epoch, when both ran it without error and answered alike: the same command after the "
                "same history, so the same work; the execution alone, without lookup, creation, restore, replay "
                "or snapshot",
            ),
            ("pairs", "how many calls were paired"),
            ("left out", "executions not paired: none did not execute that call without error, or answered otherwise"),
            ("wall", "the pairs' wall time under the strategy"),
            ("none wall", "the same pairs' wall time under none"),
            ("ratio", "the median over the pairs of the strategy's wall time / none's: above 1, they cost more"),
            (
                "cpu",
                "the CPU time the pairs' processes used under the strategy (the sandbox's cgroup; '-' where the "
                "sandbox does not measure it): it moves less with the machine's load than wall time does",
            ),
            ("none cpu", "the same pairs' CPU time under none"),
            ("cpu ratio", "the median over the pairs of the strategy's CPU time / none's"),
        ]
    lines.append(
        (
            "rollout time",
            "every rollout's time from its start to its end, summed: the model's turns between its calls (see "
            "the note on turns) and its tool time",
        )
    )
    lines.append(
        (
            "peak memory",
            "how far the strategy's steps raised this process's peak resident memory, summed over its steps (its "
            "graph, its in-process sandboxes and snapshots)",
        )
    )
    return lines


def _footnotes(result: ReplayResult, summary: dict[str, Any]) -> list[str]:
    lines = []
    if result.notes:
        lines.append(f"data: {result.notes}")
    strategies = summary["strategies"]
    turns = summary["options"]["turn_time"]
    if turns == "none":
        lines.append("model turns: none (calls back to back): the rollout time is about the tool time")
    else:
        shares = ", ".join(
            f"{name} {row['total_tool_seconds'] / row['rollout_seconds']:.0%}"
            for name, row in strategies.items()
            if row["rollout_seconds"] > 0
        )
        spent = max((row["turn_seconds"] for row in strategies.values()), default=0.0)
        lines.append(
            f"model turns: {turns}, {format_seconds(spent)} in all between calls, the same for every strategy "
            f"(trace timestamps where the traces have them); share of the rollout time spent in tools: {shares}"
        )
    load = summary.get("load_average")
    if load:
        lines.append(
            f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} at the start and {load[1]:.1f} at the end "
            "(other work slows every strategy alike: compare ratios within a run)"
        )
    if "tvcache" in strategies:
        row = strategies["tvcache"]
        misses = row["calls"] - row["hits"]
        lines.append(
            f"tvcache: {row['warm']} of {misses} misses started from a prefetched (warm) sandbox; "
            f"{int(row['stats'].get('waits', 0))} of its hits waited for a concurrent identical call (single "
            f"flight) and took about as long as executing it; {int(row['stats'].get('mismatches', 0))} replay "
            "mismatches"
        )
    for name, row in strategies.items():
        if row.get("read_set_hits"):
            checked = row.get("incorrect_read_set_hits")
            edges = int(row.get("stats", {}).get("read_set_edges", 0))
            lines.append(
                f"{name}: {row['read_set_hits']} of its hits were by what the call read (read sets; {edges} of them "
                "state-changing calls, whose recorded writes moved the rollout)"
                + ("" if checked is None else f", {checked} of them incorrect")
            )
        wrong, hits = row["wrong_answers"], row["incorrect_hits"]
        if wrong and wrong != hits:
            lines.append(f"{name}: {wrong} wrong answers in all, {wrong - hits} of them executed in a wrong state")
        if row["nondeterministic_answers"]:
            lines.append(
                f"{name}: {row['nondeterministic_answers']} answers differed from the uncached ones, but so did "
                "a re-execution of the rollout: the tool is not deterministic there (not counted as incorrect)"
            )
        if row["errors"] or row["failed_rollouts"]:
            lines.append(
                f"{name}: {row['errors']} failed calls ({row['timeouts']} timeouts), "
                f"{row['failed_rollouts']} rollouts ended by an exception, {row['skipped_calls']} calls skipped"
                + (f"; first: {row['first_error']}" if row["first_error"] else "")
            )
    if result.oracle_nondeterministic:
        lines.append(
            f"warning: {result.oracle_nondeterministic} uncached answers differed between epochs: some tool is "
            "not deterministic, so some 'incorrect' answers may be noise"
        )
    if "none" not in strategies:
        lines.append("no 'none' strategy in this run: correctness and speedups were not measured")
    return lines


def write_json(result: ReplayResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.summary(), indent=2) + "\n")


def write_charts(result: ReplayResult, directory: str | Path) -> list[Path]:
    """Write the charts as PNG files into `directory` (created if needed); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = result.workload.replace("/", "_")
    paths = [
        _hit_rate_chart(result, out / f"{stem}-hit-rate.png"),
        _call_time_chart(result, out / f"{stem}-call-times.png"),
        _tool_time_chart(result, out / f"{stem}-tool-time.png"),
        _breakdown_chart(result, out / f"{stem}-time-breakdown.png"),
    ]
    return [p for p in paths if p is not None]


def style_axes(ax: Any) -> None:
    """The charts' one look: no top or right frame, light horizontal grid lines behind the data."""
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _hit_rate_chart(result: ReplayResult, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    runs = [r for r in result.strategies.values() if r.name != "none"]
    if not runs:
        return None
    epochs = result.options.epochs
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 + 1.4 * epochs), 3.6), dpi=150)
    for i, run in enumerate(runs):
        rates = [100 * r for r in run.epoch_hit_rates()]
        xs = [e + (i - (len(runs) - 1) / 2) * width for e in range(epochs)]
        bars = ax.bar(xs, rates, width, label=LABELS.get(run.name, run.name), color=COLORS.get(run.name))
        ax.bar_label(bars, fmt="%.0f%%", fontsize=7, padding=1)
    ax.set_xticks(range(epochs), [f"epoch {e + 1}" for e in range(epochs)])
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{result.workload}: hit rate per epoch", fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    style_axes(ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _call_time_chart(result: ReplayResult, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    runs = [r for r in result.strategies.values() if r.samples]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6.0, 3.6), dpi=150)
    for run in runs:
        ordered = sorted(max(s, 1e-7) for s in run.samples)
        n = len(ordered)
        ys = [(i + 1) / n for i in range(n)]
        median = percentile(ordered, 0.5)
        label = f"{LABELS.get(run.name, run.name)} (median {_short_seconds(median)})"
        ax.step(ordered, ys, where="post", color=COLORS.get(run.name), label=label, linewidth=1.6)
        ax.plot([median], [0.5], "o", color=COLORS.get(run.name), markersize=3)
    ax.set_xscale("log")
    ax.set_xlabel("tool-call time as the rollout sees it (s, log scale)")
    ax.set_ylabel("fraction of calls")
    ax.set_ylim(0, 1.02)
    ax.axhline(0.5, color="black", linewidth=0.5, alpha=0.3)
    ax.set_title(f"{result.workload}: distribution of per-call time", fontsize=10)
    ax.legend(fontsize=7, frameon=False, loc="lower right")
    style_axes(ax)
    ax.grid(axis="x", alpha=0.2, which="major")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _tool_time_chart(result: ReplayResult, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    runs: list[StrategyRun] = list(result.strategies.values())
    if not runs:
        return None
    base = result.baseline
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=150)
    names = [LABELS.get(r.name, r.name) for r in runs]
    totals = [r.total_tool_seconds for r in runs]
    bars = ax.bar(names, totals, color=[COLORS.get(r.name, "#9467bd") for r in runs])
    labels = []
    for run, total in zip(runs, totals, strict=True):
        text = _short_seconds(total)
        if base is not None and run is not base and total > 0:
            text += f"\n{base.total_tool_seconds / total:.1f}x"
        if run.incorrect_hits:
            text += f"\n{run.incorrect_hits} incorrect hits"
        labels.append(text)
    ax.bar_label(bars, labels, fontsize=7, padding=2)
    ax.set_ylabel("total tool time (s)")
    ax.set_ylim(0, max(totals) * 1.35 if max(totals) > 0 else 1)
    ax.set_title(f"{result.workload}: total tool-call time", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    style_axes(ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _breakdown_chart(result: ReplayResult, path: Path) -> Path | None:
    """A stacked bar per strategy: its total tool time split by where it went."""
    import matplotlib.pyplot as plt

    runs = [r for r in result.strategies.values() if r.samples]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=150)
    names = [LABELS.get(r.name, r.name) for r in runs]
    parts = [r.breakdown() for r in runs]
    bottoms = [0.0] * len(runs)
    for part in BREAKDOWN:
        heights = [max(0.0, p[part]) for p in parts]  # a negative overhead (timer noise) has no bar
        if not any(heights):
            continue
        ax.bar(names, heights, bottom=bottoms, color=PART_COLORS[part], label=PART_LABELS.get(part, part))
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, (run, top) in enumerate(zip(runs, bottoms, strict=True)):
        ax.annotate(_short_seconds(run.total_tool_seconds), (x, top), ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("total tool time (s)")
    ax.set_title(f"{result.workload}: where the tool time goes", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    style_axes(ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _short_seconds(seconds: float) -> str:
    return format_seconds(seconds).replace(" ", "")


# -- per-tool hit rates (opt-in: a workload whose tools differ in kind prints them) ----------------------------


def _tools(result: ReplayResult) -> list[str]:
    """Every tool called, in order of first call."""
    return list(dict.fromkeys(tool for run in result.strategies.values() for tool in run.tool_calls))


def print_tool_table(result: ReplayResult, console: Console | None = None) -> None:
    """Hit rate per tool and strategy (hits / calls), the published paper's Figure 12."""
    console = console or wide_console()
    runs = [r for r in result.strategies.values() if r.name != "none"]
    if not runs:
        return
    table = Table(title=f"{result.workload}: hit rate per tool", title_justify="left")
    table.add_column("tool")
    table.add_column("calls", justify="right")
    for run in runs:
        table.add_column(run.name, justify="right")
    per_run = [run.tool_hit_rates() for run in runs]
    for tool in _tools(result):
        rates = [f"{rates[tool]['hit_rate']:.1%}" if tool in rates else "-" for rates in per_run]
        table.add_row(tool, str(max(r.tool_calls.get(tool, 0) for r in runs)), *rates)
    console.print(table)


def write_tool_chart(result: ReplayResult, directory: str | Path) -> list[Path]:
    """`<workload>-tool-hit-rate.png`: grouped bars of hit rate per tool and strategy; [] without data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result.strategies.values() if r.name != "none" and r.tool_calls]
    tools = _tools(result)
    if not runs or not tools:
        return []
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result.workload.replace('/', '_')}-tool-hit-rate.png"
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(5.5, 1.3 * len(tools) + 1.5), 3.8), dpi=150)
    for i, run in enumerate(runs):
        hit_rates = run.tool_hit_rates()
        rates = [100 * hit_rates[t]["hit_rate"] if t in hit_rates else 0.0 for t in tools]
        xs = [k + (i - (len(runs) - 1) / 2) * width for k in range(len(tools))]
        bars = ax.bar(xs, rates, width, label=LABELS.get(run.name, run.name), color=COLORS.get(run.name))
        ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1)
    ax.set_xticks(range(len(tools)), [t.replace("_", "_\n", 1) for t in tools], fontsize=7)
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{result.workload}: hit rate per tool, all epochs", fontsize=10)
    ax.legend(fontsize=7, frameon=False, loc="upper left", ncols=len(runs))
    style_axes(ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return [path]
