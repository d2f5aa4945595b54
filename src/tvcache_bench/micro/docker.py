"""`tvcache bench docker`: Docker containers next to the same image's layers under workspace sandboxes.

On one image of a 300 MB+ root filesystem (the Debian base plus 6,000 files of 30 KB, built once and cached by
the daemon), in one run:

- per backend, `DockerSandboxes` and `WorkspaceSandboxes.from_image`, the median of repeated
  create (a fresh sandbox), snapshot (of a 1 MB diff: a sandbox writes a new 1 MB file before each of
  `SNAPSHOTS` snapshots), restore (a sandbox from the first snapshot, 1 MB written since the image, and from the
  last, `SNAPSHOTS` MB written: both backends' restores copy what the sandbox wrote) and one `true`;
- container creations per second against concurrency 1 to 64 (each of c workers creates containers one
  after the other; 2c creations, at least 32, per point), through the pipeline with its concurrency cap and
  retries, and with neither (the daemon on its own), with the failures of each: the published system's Figure 13.

Targets: from_image snapshot and restore of a 1 MB diff each under 5 ms, and a fork (that snapshot and restore) at
least 50 times faster than a DockerSandboxes one (a copy of the container's upper dir, a new container with it)
measured in the same run; the
rate-limited pipeline keeps at least 85% of its peak throughput at 64 concurrent creations, with zero failures.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tvcache.calls import ToolCall
from tvcache.sandboxes.docker import CREATE_CONCURRENCY, DockerSandboxes, build_image
from tvcache.sandboxes.docker._pipeline import Pipeline
from tvcache.sandboxes.images import workspace_from_image
from tvcache.sandboxes.reclaim import scratch_dir

from ..docker_setup import DockerUnavailable, debian_base

__all__ = ["bench_image", "main", "print_tables", "run", "write_chart"]

FILES, FILE_SIZE = 6000, 30_000
#: Snapshots taken of a sandbox writing 1 MB before each, the same number for both backends: the last one's restore
#: copies SNAPSHOTS MB.
SNAPSHOTS = 10
SNAPSHOT_1MB = "snapshot (1 MB diff)"
RESTORE_1MB, RESTORE_ALL = "restore (1 MB written)", f"restore ({SNAPSHOTS} MB written)"
_TARGETED = (SNAPSHOT_1MB, RESTORE_1MB)
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
TARGET_MS, TARGET_RATIO, TARGET_HOLD = 5.0, 50.0, 0.85
DOCKERFILE = f"""\
FROM {{base}}
RUN mkdir -p /opt/bulk && for i in $(seq 0 {FILES - 1}); do \\
      head -c {FILE_SIZE} /dev/urandom > /opt/bulk/f$((i % 60))_$i; done
"""


def _context() -> Path:
    context = scratch_dir("bench-docker")
    (context / "Dockerfile").write_text(DOCKERFILE.format(base=debian_base()))
    return context


async def bench_image() -> str:
    """The benchmark image (built once; the daemon keeps it between runs)."""
    context = await asyncio.to_thread(_context)
    try:
        return await build_image(context)
    finally:
        await asyncio.to_thread(shutil.rmtree, context, True)


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))] * 1000,
        "n": len(ordered),
    }


async def _timed(repeats: int, op: Callable[[], Awaitable[Any]]) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = await op()
        times.append(time.perf_counter() - start)
        if hasattr(result, "close"):
            await result.close()
    return times


async def _operations(boxes: Any, repeats: int) -> dict[str, dict[str, float]]:
    """create, snapshot of a 1 MB diff, restore of 1 and of SNAPSHOTS MB written, each `repeats` times (the
    snapshot SNAPSHOTS times), and `true` twice as often."""
    true = ToolCall("bash", {"command": "true"})
    warm = await boxes.create()
    await warm.execute(true)
    ops = {"create": await _timed(repeats, boxes.create)}
    snaps, snap_times = [], []
    for i in range(SNAPSHOTS):
        await warm.execute(ToolCall("bash", {"command": f"head -c 1048576 /dev/urandom > /tmp/diff{i}.bin"}))
        start = time.perf_counter()
        snaps.append(await warm.snapshot())
        snap_times.append(time.perf_counter() - start)
    ops[SNAPSHOT_1MB] = snap_times
    ops[RESTORE_1MB] = await _timed(repeats, lambda: boxes.restore(snaps[0]))
    ops[RESTORE_ALL] = await _timed(repeats, lambda: boxes.restore(snaps[-1]))
    ops["one `true`"] = await _timed(repeats * 2, lambda: warm.execute(true))
    for snap in snaps:
        await boxes.delete(snap)
    await warm.close()
    return {name: _summary(times) for name, times in ops.items()}


async def _throughput(image: str, concurrency: int, limited: bool) -> dict[str, Any]:
    """Creations per second with `concurrency` workers, through the pipeline (`limited`) or straight."""
    boxes = DockerSandboxes(image)
    if not limited:
        boxes._pipeline = Pipeline(None, retries=0)  # the daemon on its own
    made: list[Any] = []
    failures = 0
    total = max(32, 2 * concurrency)
    await boxes.create()  # set-up (reaping, the initial shell state) outside the timing
    queue = iter(range(total))

    async def worker() -> None:
        nonlocal failures
        for _ in queue:
            try:
                made.append(await boxes.create())
            except Exception:
                failures += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    retries = boxes.retries
    await boxes.close()
    return {
        "concurrency": concurrency,
        "created": len(made),
        "failures": failures,
        "retries": retries,
        "seconds": seconds,
        "per_second": len(made) / seconds,
    }


async def run(*, repeats: int = 10, concurrency: tuple[int, ...] = CONCURRENCY) -> dict[str, Any]:
    image = await bench_image()
    async with DockerSandboxes(image) as docker_boxes:
        docker_ops = await _operations(docker_boxes, repeats)
    async with await workspace_from_image(image) as layered:
        mode = layered.mode
        layered_ops = await _operations(layered, repeats * 3)
    curves: dict[str, list[dict[str, Any]]] = {"rate-limited": [], "unlimited": []}
    for c in concurrency:
        for name, capped in (("rate-limited", True), ("unlimited", False)):
            curves[name].append(await _throughput(image, c, capped))
    size = await asyncio.to_thread(_image_bytes, image)

    # A fork is a snapshot then a restore of it (1 MB written): a copy of the upper dir + a container with it,
    # against a copy into a layer + a sandbox with a copy of the layer.
    def fork(ops: dict[str, dict[str, float]]) -> float:
        return ops[SNAPSHOT_1MB]["median_ms"] + ops[RESTORE_1MB]["median_ms"]

    ratios = {
        "snapshot": docker_ops[SNAPSHOT_1MB]["median_ms"] / layered_ops[SNAPSHOT_1MB]["median_ms"],
        "restore": docker_ops[RESTORE_1MB]["median_ms"] / layered_ops[RESTORE_1MB]["median_ms"],
        "fork": fork(docker_ops) / fork(layered_ops),
    }
    limited = curves["rate-limited"]
    peak = max(point["per_second"] for point in limited)
    at_max = limited[-1]
    return {
        "image": image,
        "rootfs_bytes": size,
        "workspace_mode": mode,
        "create_concurrency": CREATE_CONCURRENCY,
        "load_average": os.getloadavg(),
        "docker": docker_ops,
        "from_image": layered_ops,
        "times_faster": ratios,
        "throughput": curves,
        "targets": {
            "from_image_ms": all(layered_ops[k]["median_ms"] < TARGET_MS for k in _TARGETED),
            "times_faster": ratios["fork"] >= TARGET_RATIO,
            "pipeline_holds_peak": at_max["per_second"] >= TARGET_HOLD * peak and at_max["failures"] == 0,
        },
    }


def _image_bytes(image: str) -> int:
    import subprocess

    out = subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", image], capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def print_tables(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(
        title=f"One image ({result['rootfs_bytes'] / 1e6:.0f} MB rootfs): DockerSandboxes next to "
        f"WorkspaceSandboxes.from_image ({result['workspace_mode']} mode); load average "
        + " ".join(f"{x:.1f}" for x in result["load_average"])
    )
    for column in ("operation", "docker median", "docker p90", "from_image median", "from_image p90", "ratio"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    for name, fig in result["docker"].items():
        other = result["from_image"][name]
        table.add_row(
            name,
            f"{fig['median_ms']:.1f} ms",
            f"{fig['p90_ms']:.1f} ms",
            f"{other['median_ms']:.2f} ms",
            f"{other['p90_ms']:.2f} ms",
            f"{fig['median_ms'] / other['median_ms']:,.0f}x",
        )
    console.print(table)
    curve = Table(title="Container creations per second against concurrency (failures, retries)")
    curve.add_column("concurrency", justify="right")
    for name in result["throughput"]:
        curve.add_column(name, justify="right")
    rows = zip(*result["throughput"].values(), strict=True)
    for points in rows:
        cells = [f"{p['per_second']:.1f}/s ({p['failures']} failed, {p['retries']} retried)" for p in points]
        curve.add_row(str(points[0]["concurrency"]), *cells)
    console.print(curve)
    t = result["targets"]

    def verdict(ok: bool) -> str:
        return "[green]met[/green]" if ok else "[red]NOT met[/red]"

    console.print(
        f"from_image snapshot and restore of a 1 MB diff under {TARGET_MS:g} ms: {verdict(t['from_image_ms'])}"
    )
    ratios = result["times_faster"]
    console.print(
        f"... and a fork (that snapshot + restore) >= {TARGET_RATIO:g}x faster than Docker's: "
        f"{ratios['fork']:,.0f}x (snapshot {ratios['snapshot']:,.0f}x, restore {ratios['restore']:,.0f}x): "
        f"{verdict(t['times_faster'])}"
    )
    console.print(
        f"rate-limited pipeline (cap {result['create_concurrency']}) keeps {TARGET_HOLD:.0%} of its peak at "
        f"concurrency {result['throughput']['rate-limited'][-1]['concurrency']} with no failure: "
        f"{verdict(t['pipeline_holds_peak'])}"
    )


def write_chart(result: dict[str, Any], directory: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(directory) / "docker-create-throughput.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    styles = {"rate-limited": ("#2ca02c", "o"), "unlimited": ("#d62728", "s")}
    for name, points in result["throughput"].items():
        color, marker = styles[name]
        label = f"pipeline (cap {result['create_concurrency']}, retries)" if name == "rate-limited" else name
        xs = [p["concurrency"] for p in points]
        ax.plot(xs, [p["per_second"] for p in points], marker=marker, color=color, label=label)
        for p in points:
            if p["failures"]:
                ax.annotate(f"{p['failures']} failed", (p["concurrency"], p["per_second"]), fontsize=8, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks([p["concurrency"] for p in result["throughput"]["rate-limited"]])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent container creations")
    ax.set_ylabel("containers created per second")
    ax.set_ylim(bottom=0)
    ax.set_title("Docker container creation throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


async def main(charts: str | None = None) -> dict[str, Any]:
    try:
        result = await run()
    except DockerUnavailable as exc:
        raise SystemExit(f"tvcache bench docker: error: {exc}") from None
    print_tables(result)
    if charts:
        print(f"chart: {write_chart(result, charts)}")
    return result
