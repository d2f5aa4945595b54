"""The GRPO run's table (one line per step, both runs side by side) and its charts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...report import style_axes

if TYPE_CHECKING:
    from rich.console import Console

    from .bench import Run

__all__ = ["print_steps", "write_charts"]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _counts(rewards: list[float]) -> str:
    return "/".join(str(sum(r == v for r in rewards)) for v in (-1.0, 0.0, 1.0))


def print_steps(runs: dict[str, Run], console: Console) -> None:
    from rich.table import Table

    none, cached = runs["none"], runs["tvcache"]
    table = Table(title="GRPO run: the same seed without and with tvcache", title_justify="left")
    for header in (
        "step",
        "rewards none",
        "rewards tvcache",
        "-1/0/1",
        "model calls",
        "tool calls",
        "hit rate",
        "tool s none",
        "tool s tvcache",
        "step s none",
        "step s tvcache",
    ):
        table.add_column(header, justify="left" if header.startswith("rewards") else "right")
    for i, (a, b) in enumerate(zip(none.steps, cached.steps, strict=False)):
        table.add_row(
            str(i + 1),
            _rewards(a.rewards),
            _rewards(b.rewards) + ("" if a.rewards == b.rewards else "  [red]differs[/red]"),
            _counts(b.rewards),
            str(b.model_calls),
            str(b.tool_calls),
            f"{b.hits / b.tool_calls:.0%}" if b.tool_calls else "-",
            f"{a.tool_seconds:.3f}",
            f"{b.tool_seconds:.3f}",
            f"{none.step_seconds[i]:.1f}" if i < len(none.step_seconds) else "-",
            f"{cached.step_seconds[i]:.1f}" if i < len(cached.step_seconds) else "-",
        )
    console.print(table)
    tool_none, tool_cached = (sum(s.tool_seconds for s in r.steps) for r in (none, cached))
    step_none, step_cached = sum(none.step_seconds), sum(cached.step_seconds)
    calls = sum(s.tool_calls for s in cached.steps)
    hits = sum(s.hits for s in cached.steps)
    same = all(a.rewards == b.rewards for a, b in zip(none.steps, cached.steps, strict=True))
    console.print(
        f"rewards identical: {'yes' if same else '[red]NO[/red]'}; mean reward none {_mean(_flat(none))} "
        f"tvcache {_mean(_flat(cached))}; model tool calls {sum(s.model_calls for s in cached.steps)}; "
        f"hit rate {hits}/{calls} = {hits / calls if calls else 0:.0%}; "
        f"tool seconds {tool_none:.3f} -> {tool_cached:.3f} ({_ratio(tool_none, tool_cached)}); "
        f"step seconds {step_none:.1f} -> {step_cached:.1f} ({_ratio(step_none, step_cached)})"
    )


def _rewards(values: list[float]) -> str:
    return " ".join(f"{v:+.0f}" if v else "0" for v in values)


def _flat(run: Run) -> list[float]:
    return [r for s in run.steps for r in s.rewards]


def _ratio(before: float, after: float) -> str:
    if before <= 0 or after <= 0:
        return "-"
    return f"{before / after:.2f}x less" if after <= before else f"{after / before:.2f}x more"


def write_charts(runs: dict[str, Run], directory: str | Path) -> list[Path]:
    """`grpo-rewards.png` (mean reward per step, both runs) and `grpo-tool-seconds.png` (tool seconds per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "grpo-rewards.png", out / "grpo-tool-seconds.png"]

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    styles: dict[str, dict[str, Any]] = {
        "none": {"color": "#888888", "linewidth": 4, "alpha": 0.6},
        "tvcache": {"color": "#1f77b4", "linewidth": 1.5, "marker": "o", "markersize": 4},
    }
    for name, run in runs.items():
        ax.plot(range(1, len(run.steps) + 1), [_mean(s.rewards) for s in run.steps], label=name, **styles.get(name, {}))
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_title("GRPO rewards, same seed, without and with tvcache")
    style_axes(ax)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.4
    for k, (name, run) in enumerate(runs.items()):
        steps = [i + 1 + (k - 0.5) * width for i in range(len(run.steps))]
        ax.bar(steps, [s.tool_seconds for s in run.steps], width, label=name, color=styles[name]["color"])
    ax.set_xlabel("training step")
    ax.set_ylabel("seconds in tool calls")
    ax.set_title("Tool time per GRPO step")
    style_axes(ax)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
