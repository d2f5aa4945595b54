"""The dashboard, rendered by a real browser: headless Chromium (Debian's `chromium`) loads `/` from a real
`tvcache serve` whose graphs were filled by real rollouts (key-value tools, and SQL on the real Chinook database
in SQLite sandboxes), and the tests read back what the page built and where it drew it.

Chromium is driven over the DevTools protocol (its websocket, through aiohttp), so a test can run a script in
the page: the edge labels' boxes are measured by the browser's own layout (`getBoundingClientRect`)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import kv
import tvcache
from server_helpers import Server
from tvcache_bench.data import workload_path

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)"
)

TOKEN = "dashboard-token"
SCREENSHOT_COPY = Path("/tmp/tvcache-dashboard.png")
WIDTH, HEIGHT = 1440, 1000


def slow(args: dict[str, Any], delay: float = 0.05) -> dict[str, Any]:
    return dict(args, delay=delay)


# Rollouts that share a prefix and then branch; slow writes get snapshots, reads become memos, repeats hit.
PLANS = [
    [("write", slow({"key": "a", "value": "x"})), ("read", {"key": "a"}), ("append", slow({"key": "a", "value": "1"}))],
    [("write", slow({"key": "a", "value": "x"})), ("read", {"key": "b"}), ("append", slow({"key": "a", "value": "2"}))],
    [("write", slow({"key": "a", "value": "x"})), ("write", {"key": "b", "value": "y"}), ("list", {})],
    [("write", {"key": "c", "value": "z"}), ("read", {"key": "c"}), ("delete", {"key": "c"})],
]

# An SQL agent on Chinook: reads (memos, observed) between writes (edges) whose statements run far longer than
# a label has room for. Three writes deep, branching at every level, as GRPO rollouts of one prompt do.
TABLES = "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
PRICES = "SELECT g.Name, ROUND(AVG(t.UnitPrice), 3) FROM Track t JOIN Genre g ON g.GenreId = t.GenreId GROUP BY g.Name"
ROCK = (
    "UPDATE Track SET UnitPrice = ROUND(UnitPrice * 1.10, 2) WHERE GenreId IN "
    "(SELECT GenreId FROM Genre WHERE Name IN ('Rock', 'Metal', 'Alternative & Punk', 'Heavy Metal'))"
)
JAZZ = (
    "UPDATE Track SET UnitPrice = ROUND(UnitPrice * 1.25, 2) WHERE GenreId IN "
    "(SELECT GenreId FROM Genre WHERE Name IN ('Jazz', 'Blues', 'Classical'))"
)
PLAYLIST = "INSERT INTO Playlist (PlaylistId, Name) VALUES (19, 'Nineties rock and grunge, picked by the agent')"
SHORT = (
    "DELETE FROM PlaylistTrack WHERE PlaylistId = 1 AND TrackId IN "
    "(SELECT TrackId FROM Track WHERE Milliseconds < 120000 AND MediaTypeId <> 1)"
)
FILL = (
    "INSERT INTO PlaylistTrack (PlaylistId, TrackId) SELECT 19, TrackId FROM Track WHERE AlbumId IN "
    "(SELECT AlbumId FROM Album WHERE ArtistId = 1) ORDER BY TrackId LIMIT 20"
)
VIEW = (
    "CREATE TEMP VIEW expensive_tracks AS SELECT t.Name, t.UnitPrice, g.Name AS Genre FROM Track t "
    "JOIN Genre g ON g.GenreId = t.GenreId WHERE t.UnitPrice > 1.0"
)
TOTALS = (
    "UPDATE Invoice SET Total = (SELECT ROUND(SUM(il.UnitPrice * il.Quantity), 2) FROM InvoiceLine il "
    "WHERE il.InvoiceId = Invoice.InvoiceId)"
)
OPERA = (
    "DELETE FROM InvoiceLine WHERE TrackId IN (SELECT TrackId FROM Track WHERE GenreId = "
    "(SELECT GenreId FROM Genre WHERE Name = 'Opera'))"
)
SQL_PATHS = [
    [ROCK, SHORT, TOTALS],
    [ROCK, SHORT, OPERA],
    [ROCK, VIEW, TOTALS],
    [JAZZ, SHORT, OPERA],
    [JAZZ, FILL],
    [PLAYLIST, FILL, TOTALS],
    [PLAYLIST, FILL, OPERA],
    [PLAYLIST, VIEW],
]
# A longer history: one rollout twelve writes deep, and others leaving it at several depths.
DEEP = [
    f"INSERT INTO Genre (GenreId, Name) VALUES ({100 + i}, 'Genre number {i} added by a long rollout')"
    for i in range(12)
]
DEEP_PATHS = [DEEP, [*DEEP[:4], ROCK, SHORT], [*DEEP[:8], JAZZ], [*DEEP[:11], OPERA]]


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

        async with tvcache.SQLiteSandboxes(workload_path("sql", "chinook", "chinook.sqlite")) as chinook:

            async def sql_rollout(task: str, writes: list[str]) -> None:
                async with cache.rollout(task, chinook) as r:
                    await r.call("sql", {"query": TABLES})
                    for write in writes:
                        await r.call("sql", {"query": write})
                        await r.call("sql", {"query": PRICES})

            for _ in range(2):  # the second round hits
                await asyncio.gather(*(sql_rollout("chinook-prices", w) for w in SQL_PATHS))
                await asyncio.gather(*(sql_rollout("chinook-deep", w) for w in DEEP_PATHS))
            keys = {
                "kv": cache.scope("build-project", boxes).key,
                "sql": cache.scope("chinook-prices", chinook).key,
                "deep": cache.scope("chinook-deep", chinook).key,
            }
        graphs = {name: await cache.store.export(key) for name, key in keys.items()}
    return {"keys": keys, "graphs": graphs}


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any]]]:
    with Server(tmp_path_factory.mktemp("dashboard"), "memory://", TOKEN) as server:
        data = asyncio.run(populate(server.token_url))
        yield server, data


# -- Chromium over the DevTools protocol ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def devtools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A headless Chromium for the module; yields its DevTools port."""
    assert CHROMIUM is not None
    tmp = tmp_path_factory.mktemp("chromium")
    profile = tmp / "profile"
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
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--remote-debugging-port=0",
        "about:blank",
    ]
    with open(tmp / "chromium.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        active = profile / "DevToolsActivePort"  # Chromium writes the port it chose here
        deadline = time.monotonic() + 60
        while not (active.exists() and active.read_text().count("\n") >= 1):
            assert proc.poll() is None, (tmp / "chromium.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "chromium did not open its DevTools port in 60 s"
            time.sleep(0.05)
        yield int(active.read_text().split()[0])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Page:
    """One browser tab: DevTools commands over its websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.ids = iter(range(1, 10**9))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        sent = next(self.ids)
        await self.ws.send_json({"id": sent, "method": method, "params": params})
        while True:  # events come in between; the answer carries our id
            message = json.loads(await self.ws.receive_str(timeout=60))
            if message.get("id") == sent:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message["result"])

    async def evaluate(self, expression: str) -> Any:
        reply = await self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"in the page: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def wait_for(self, condition: str, timeout: float = 30.0) -> Any:
        """Evaluate `condition` until it is truthy (the page polls the server every second or three)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = await self.evaluate(condition)
            except RuntimeError:  # the page is still navigating: its old document went away
                value = None
            if value:
                return value
            assert time.monotonic() < deadline, f"the page never satisfied {condition}"
            await asyncio.sleep(0.1)


@asynccontextmanager
async def open_page(port: int, url: str) -> AsyncIterator[Page]:
    """A new tab (fresh sessionStorage) of WIDTH x HEIGHT showing `url`."""
    async with aiohttp.ClientSession() as http:
        async with http.put(f"http://127.0.0.1:{port}/json/new?about:blank") as response:
            target = await response.json(content_type=None)
        try:
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.send(
                    "Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False
                )
                await page.send("Page.navigate", url=url)
                yield page
        finally:
            async with http.get(f"http://127.0.0.1:{port}/json/close/{target['id']}"):
                pass


def page_url(server: Server, key: str) -> str:
    return f"{server.url}/#token={TOKEN}&task={key}"


def graph_drawn(edges: int, charts: bool = True) -> str:
    """True in the page once the graph has `edges` edges (and, with `charts`, every chart has its line)."""
    drawn = f"document.querySelectorAll('#graph .edge').length === {edges}"
    return drawn + (" && document.querySelectorAll('.chart polyline').length === 5" if charts else "")


# Every edge label's box and its whole call (the tooltip), the nodes' boxes, the panel's and the drawing's.
MEASURE = """(() => {
  const box = (r) => ({left: r.left, right: r.right, top: r.top, bottom: r.bottom});
  return {
    panel: box(document.getElementById('graph-box').getBoundingClientRect()),
    svg: box(document.getElementById('graph').getBoundingClientRect()),
    labels: [...document.querySelectorAll('#graph .edge-label')].map((t) => ({
      text: t.textContent,
      title: t.parentNode.querySelector('title').textContent,
      ...box(t.getBoundingClientRect()),
    })),
    nodes: [...document.querySelectorAll('#graph .node circle')].map((c) => box(c.getBoundingClientRect())),
  };
})()"""


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]


def inside(inner: dict[str, float], outer: dict[str, float]) -> bool:
    return (
        outer["left"] <= inner["left"]
        and inner["right"] <= outer["right"]
        and outer["top"] <= inner["top"]
        and inner["bottom"] <= outer["bottom"]
    )


def check_labels(drawn: dict[str, Any], graph: Any) -> list[dict[str, Any]]:
    """Every edge has a label that says its tool and the start of its query, and none overlaps another label
    or a node. Returns the labels."""
    labels = drawn["labels"]
    edges = [e for e in graph.entries if e.kind == "edge"]
    assert len(labels) == len(edges) > 0
    calls = {e.call for e in edges}
    for label in labels:
        call = label["title"].split("\n", 1)[0]
        assert call in calls  # the tooltip holds the whole call
        # The stored call is cut at 200 characters; these queries hold no quotes or escapes to decode.
        query = call.removeprefix('sql {"query":"').removesuffix('"}')
        text = label["text"]
        assert text.startswith("sql: ") and "{" not in text, text  # the tool and the query, not cut JSON
        shown = text.removesuffix("…")
        assert len(shown) > len("sql: ") + 8 and f"sql: {query}".startswith(shown), (text, query)
        assert label["right"] > label["left"] and label["bottom"] > label["top"]
        assert inside(label, drawn["svg"]), (label, drawn["svg"])
    assert any(label["text"].endswith("…") for label in labels)  # long queries are elided, not run over
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            assert not overlap(a, b), (a, b)
        for node in drawn["nodes"]:
            assert not overlap(a, node), (a, node)
    return list(labels)


# -- the tests ------------------------------------------------------------------------------------------------


def test_dashboard_renders_the_graph_and_charts(populated: tuple[Server, dict[str, Any]], devtools: int) -> None:
    server, data = populated
    key, graph = data["keys"]["kv"], data["graphs"]["kv"]
    edges = [e for e in graph.entries if e.kind == "edge"]
    memos = [e for e in graph.entries if e.kind == "memo"]

    async def go() -> str:
        async with open_page(devtools, page_url(server, key)) as page:
            await page.wait_for(graph_drawn(len(edges)))
            return str(await page.evaluate("document.documentElement.outerHTML"))

    dom = asyncio.run(go())
    # The task list names every task; the selected one is the one asked for in the URL.
    for task in ("build-project", "small-task", "chinook-prices", "chinook-deep"):
        assert task in dom
    assert re.search(rf'<li data-task="{key}" class="selected">', dom)

    # One drawn node per state: the root plus one per edge (node ids are chained hashes: a tree).
    nodes = re.findall(r'<g class="node([^"]*)" data-node="([0-9a-f]{32})" data-hits="(\d+)" data-memos="(\d+)"', dom)
    assert len(nodes) == 1 + len(edges)
    assert {n[1] for n in nodes} == {key} | {e.child.hex() for e in edges}
    assert sum(int(n[3]) for n in nodes) == len(memos)
    assert sum(int(n[2]) for n in nodes) == sum(e.hits for e in graph.entries) > 0
    assert dom.count('class="edge"') == len(edges)
    snapshot_nodes = {s.node.hex() for s in graph.snapshots}
    assert snapshot_nodes and {n[1] for n in nodes if "snapshot" in n[0]} == snapshot_nodes
    assert any("root" in n[0] and n[1] == key for n in nodes)
    # Labels name the tool and its arguments in short: `write: a value=x` (`delay` is not in the key), not cut JSON.
    labels = re.findall(r'<text class="edge-label"[^>]*>([^<]*)</text>', dom)
    assert len(labels) == len(edges) and "write: a value=x" in labels, labels

    # Totals and live charts: a line per chart, drawn from the server's time series, and what each covers.
    assert re.search(r'data-total="hit rate since start"><b>\d+\.\d%</b>', dom)
    for chart in ("hit-rate", "saved", "executions", "waits", "evictions"):
        section = dom.split(f'id="chart-{chart}"', 1)[1].split("</figure>", 1)[0]
        assert "<polyline" in section, chart
        assert re.search(r'<div class="window"><span>last \d+ (s|min)</span><span>now</span></div>', section), section
    hit_rate = dom.split('id="chart-hit-rate"', 1)[1].split("</figure>", 1)[0]
    assert "<figcaption>hit rate, 5 s windows" in hit_rate
    assert 'class="status ok"' in dom


def test_dashboard_without_the_token_says_so(populated: tuple[Server, dict[str, Any]], devtools: int) -> None:
    server, _ = populated

    async def go() -> str:
        async with open_page(devtools, server.url + "/") as page:
            status = "document.getElementById('status')"
            return str(await page.wait_for(f"{status}.className === 'status bad' && {status}.textContent"))

    assert "needs a token" in asyncio.run(go())


def test_edge_labels_of_a_three_level_sql_graph_fit(
    populated: tuple[Server, dict[str, Any]], devtools: int, tmp_path: Path
) -> None:
    """Long SQL on every edge, three writes deep: each label says `sql: <the query's start>…`, no two overlap,
    and all lie inside the panel without scrolling. The screenshot is the README's picture."""
    server, data = populated
    key, graph = data["keys"]["sql"], data["graphs"]["sql"]
    edges = [e for e in graph.entries if e.kind == "edge"]
    shot = tmp_path / "dashboard.png"

    async def go() -> dict[str, Any]:
        async with open_page(devtools, page_url(server, key)) as page:
            await page.wait_for(graph_drawn(len(edges)))
            drawn = await page.evaluate(MEASURE)
            png = await page.send("Page.captureScreenshot", format="png")
            shot.write_bytes(base64.b64decode(png["data"]))
            return dict(drawn)

    drawn = asyncio.run(go())
    assert max(len(p) for p in SQL_PATHS) == 3
    labels = check_labels(drawn, graph)
    for label in labels:
        assert inside(label, drawn["panel"]), (label, drawn["panel"])
    assert all(len(label["text"]) >= 40 for label in labels)  # three levels leave room for a good part of each query

    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000  # a blank page compresses far smaller
    shutil.copyfile(shot, SCREENSHOT_COPY)
    print(f"dashboard screenshot: {shot} (copy: {SCREENSHOT_COPY})")


def test_edge_labels_of_a_deep_graph_fit(populated: tuple[Server, dict[str, Any]], devtools: int) -> None:
    """Twelve levels: columns narrow to share the panel, then the drawing scrolls; labels shorten, and still
    none overlaps another or leaves the drawing."""
    server, data = populated
    key, graph = data["keys"]["deep"], data["graphs"]["deep"]
    edges = [e for e in graph.entries if e.kind == "edge"]

    async def go() -> dict[str, Any]:
        async with open_page(devtools, page_url(server, key)) as page:
            await page.wait_for(graph_drawn(len(edges), charts=False))
            return dict(await page.evaluate(MEASURE))

    drawn = asyncio.run(go())
    check_labels(drawn, graph)


def test_call_labels_say_the_tool_and_its_main_argument(
    populated: tuple[Server, dict[str, Any]], devtools: int
) -> None:
    """The page's own `shortCall` on stored call texts, cut at 200 characters as the core stores them."""
    server, data = populated
    long_command = "cd /testbed && python -m pytest tests/test_fields.py -k " + '\\"nested and not slow\\" ' * 20
    cases = {
        'sql {"query":"SELECT count(*) FROM Track"}': "sql: SELECT count(*) FROM Track",
        'write_file {"content":"print(1)\\n","path":"/testbed/a.py"}': "write_file: /testbed/a.py content=print(1)",
        'get_reservation_details {"reservation_id":"ZFA04Y"}': "get_reservation_details: ZFA04Y",
        'search_direct_flight {"date":"2024-05-16","destination":"SEA","origin":"JFK"}': (
            "search_direct_flight: 2024-05-16 destination=SEA origin=JFK"
        ),
        "now {}": "now",
        'tmux "ls -la\\n"': "tmux: ls -la",
        f'bash {{"command":"{long_command}"}}'[:200]: None,  # cut mid-string: checked below
    }

    async def go() -> dict[str, str]:
        async with open_page(devtools, page_url(server, data["keys"]["kv"])) as page:
            await page.wait_for("typeof shortCall === 'function'")
            return dict(
                await page.evaluate(f"Object.fromEntries({json.dumps(list(cases))}.map(c => [c, shortCall(c)]))")
            )

    labels = asyncio.run(go())
    for call, expected in cases.items():
        if expected is not None:
            assert labels[call] == expected, (call, labels[call])
    cut = labels[next(call for call, expected in cases.items() if expected is None)]
    assert cut.startswith('bash: cd /testbed && python -m pytest tests/test_fields.py -k "nested and not slow"'), cut
    assert cut.endswith("…") and "\\" not in cut and "{" not in cut, cut
