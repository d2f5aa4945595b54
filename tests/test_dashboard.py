"""The dashboard, rendered by a real browser: headless Chromium (Debian's `chromium`) loads `/` from a server
whose graph was filled by real rollouts, and the test checks the DOM the page built and saves a screenshot."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kv
import tvcache
from server_helpers import Server

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)"
)

TOKEN = "dashboard-token"
SCREENSHOT_COPY = Path("/tmp/tvcache-dashboard.png")


def slow(args: dict[str, Any], delay: float = 0.05) -> dict[str, Any]:
    return dict(args, delay=delay)


# Rollouts that share a prefix and then branch; slow writes get snapshots, reads become memos, repeats hit.
PLANS = [
    [("write", slow({"key": "a", "value": "x"})), ("read", {"key": "a"}), ("append", slow({"key": "a", "value": "1"}))],
    [("write", slow({"key": "a", "value": "x"})), ("read", {"key": "b"}), ("append", slow({"key": "a", "value": "2"}))],
    [("write", slow({"key": "a", "value": "x"})), ("write", {"key": "b", "value": "y"}), ("list", {})],
    [("write", {"key": "c", "value": "z"}), ("read", {"key": "c"}), ("delete", {"key": "c"})],
]


async def populate(url: str) -> dict[str, Any]:
    async with tvcache.ToolCache(url, snapshot_budget=4) as cache:
        boxes = kv.sandboxes()

        async def rollout(plan: list[tuple[str, dict[str, Any]]]) -> None:
            async with cache.rollout("build-project", boxes, kv.TOOLS) as r:
                for tool, args in plan:
                    await r.call(tool, args)

        # Concurrent rounds a second apart, as training steps: the first executes (and its rollouts wait
        # for each other's identical calls), the later ones hit; a budget of 4 snapshots forces evictions.
        for _ in range(3):
            await asyncio.gather(*(rollout(plan) for plan in PLANS for _ in range(2)))
            await asyncio.sleep(1.1)
        async with cache.rollout("small-task", boxes, kv.TOOLS) as r:
            await r.call("read", {"key": "a"})
        key = cache.scope("build-project", boxes).key
        graph = await cache.store.export(key)
    return {"key": key, "graph": graph}


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any]]]:
    with Server(tmp_path_factory.mktemp("dashboard"), "memory://", TOKEN) as server:
        data = asyncio.run(populate(server.token_url))
        yield server, data


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1440,1200",
        "--hide-scrollbars",
        "--virtual-time-budget=6000",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def page_url(server: Server, key: str) -> str:
    return f"{server.url}/#token={TOKEN}&task={key}"


def test_dashboard_renders_the_graph_and_charts(populated: tuple[Server, dict[str, Any]], tmp_path: Path) -> None:
    server, data = populated
    graph = data["graph"]
    dom = chromium(tmp_path, "--dump-dom", page_url(server, data["key"])).stdout
    assert 'id="graph"' in dom, dom[-2000:]

    # The task list names both tasks; the selected one is the one asked for in the URL.
    assert "build-project" in dom and "small-task" in dom
    assert re.search(rf'<li data-task="{data["key"]}" class="selected">', dom)

    # One drawn node per state: the root plus one per edge (node ids are chained hashes: a tree).
    nodes = re.findall(r'<g class="node([^"]*)" data-node="([0-9a-f]{32})" data-hits="(\d+)" data-memos="(\d+)"', dom)
    edges = [e for e in graph.entries if e.kind == "edge"]
    memos = [e for e in graph.entries if e.kind == "memo"]
    assert len(nodes) == 1 + len(edges)
    assert {n[1] for n in nodes} == {data["key"]} | {e.child.hex() for e in edges}
    assert sum(int(n[3]) for n in nodes) == len(memos)
    assert sum(int(n[2]) for n in nodes) == sum(e.hits for e in graph.entries) > 0
    assert dom.count('class="edge"') == len(edges)
    snapshot_nodes = {s.node.hex() for s in graph.snapshots}
    assert snapshot_nodes and {n[1] for n in nodes if "snapshot" in n[0]} == snapshot_nodes
    assert any("root" in n[0] and n[1] == data["key"] for n in nodes)

    # Totals and live charts: a line per chart, drawn from the server's time series.
    assert re.search(r'data-total="hit rate"><b>\d+\.\d%</b>', dom)
    for chart in ("hit-rate", "saved", "executions", "waits", "evictions"):
        section = dom.split(f'id="chart-{chart}"', 1)[1].split("</figure>", 1)[0]
        assert "<polyline" in section, chart
    assert 'class="status ok"' in dom


def test_dashboard_without_the_token_says_so(populated: tuple[Server, dict[str, Any]], tmp_path: Path) -> None:
    server, _ = populated
    dom = chromium(tmp_path, "--dump-dom", server.url + "/").stdout
    assert 'class="status bad"' in dom and "needs a token" in dom


def test_dashboard_screenshot(populated: tuple[Server, dict[str, Any]], tmp_path: Path) -> None:
    server, data = populated
    shot = tmp_path / "dashboard.png"
    result = chromium(tmp_path, f"--screenshot={shot}", page_url(server, data["key"]))
    assert shot.exists(), result.stderr[-2000:]
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000  # a blank page compresses far smaller
    shutil.copyfile(shot, SCREENSHOT_COPY)
    print(f"dashboard screenshot: {shot} (copy: {SCREENSHOT_COPY})")
