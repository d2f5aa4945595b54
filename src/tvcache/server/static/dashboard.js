// The tvcache dashboard: live charts from /v1/stats and the selected task's tool-call graph from /v1/export.
// Plain DOM and SVG, no libraries. Text from the server (task names, calls) is only ever set as textContent.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const STATS_EVERY_MS = 1000;
const GRAPH_EVERY_MS = 3000;
const CHART_SECONDS = 300; // charts show the last five minutes
const GRAPH_LIMIT = 2000; // entries drawn at most

// A token comes once in the URL fragment (#token=...), which browsers never send to the server.
const params = new URLSearchParams(location.hash.slice(1));
if (params.get("token")) sessionStorage.setItem("tvcache-token", params.get("token"));
const token = sessionStorage.getItem("tvcache-token");
let selected = params.get("task");
let tasks = [];
let lastGraphKey = "";

async function api(path, body) {
  const headers = { "Content-Type": "application/json" };
  if (token) headers.Authorization = "Bearer " + token;
  const response = await fetch(path, body === undefined ? { headers } : { method: "POST", headers, body: JSON.stringify(body) });
  if (response.status === 401) throw new Error("this server needs a token: open /#token=YOUR_TOKEN");
  if (!response.ok) throw new Error(path + " answered " + response.status);
  return response.json();
}

function el(tag, attrs, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function setStatus(text, ok) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = "status " + (ok ? "ok" : "bad");
}

const b64ToHex = (b64) => Array.from(atob(b64), (c) => c.charCodeAt(0).toString(16).padStart(2, "0")).join("");
const hexToB64 = (hex) => btoa(hex.match(/../g).map((h) => String.fromCharCode(parseInt(h, 16))).join(""));

function fmtSeconds(s) {
  if (s >= 3600) return (s / 3600).toFixed(1) + " h";
  if (s >= 60) return (s / 60).toFixed(1) + " min";
  if (s >= 1) return s.toFixed(1) + " s";
  return (s * 1000).toFixed(0) + " ms";
}
const fmtCount = (n) => (n >= 1e6 ? (n / 1e6).toFixed(1) + "M" : n >= 1e4 ? (n / 1e3).toFixed(1) + "k" : String(Math.round(n * 10) / 10));

// -- totals and charts ----------------------------------------------------------------------------------

function renderTotals(stats) {
  const t = stats.totals;
  const answered = t.hits + t.waited_hits;
  const items = [
    ["lookups", fmtCount(t.lookups)],
    ["hit rate", t.lookups ? ((100 * answered) / t.lookups).toFixed(1) + "%" : "–"],
    ["tool time saved", fmtSeconds(t.seconds_saved)],
    ["executions", fmtCount(t.records)],
    ["waits (single flight)", fmtCount(t.waits)],
    ["evictions", fmtCount(t.evictions)],
    ["tasks", String(tasks.length)],
  ];
  const box = document.getElementById("totals");
  box.replaceChildren(
    ...items.map(([label, value]) => {
      const div = el("div", { class: "total", "data-total": label });
      div.append(el("b", {}, value), el("span", {}, label));
      return div;
    }),
  );
  document.getElementById("store").textContent = stats.store + " · up " + fmtSeconds(stats.uptime);
}

// Rates between consecutive samples, over the chart window; hit rate over a 5-sample window to steady it.
function chartData(series) {
  const t = series.t;
  const first = t.findIndex((x) => x >= t[t.length - 1] - CHART_SECONDS);
  const rate = (column) => {
    const out = [];
    for (let i = Math.max(first, 1); i < t.length; i++) out.push([t[i], (column[i] - column[i - 1]) / Math.max(t[i] - t[i - 1], 1e-3)]);
    return out;
  };
  const hitRate = []; // undefined while nothing is looked up: those seconds are left out, not drawn as 0%
  for (let i = Math.max(first, 1); i < t.length; i++) {
    const j = Math.max(0, i - 5);
    const lookups = series.lookups[i] - series.lookups[j];
    if (lookups > 0) hitRate.push([t[i], Math.min(100, (100 * (series.hits[i] - series.hits[j])) / lookups)]);
  }
  const saved = [];
  for (let i = Math.max(first, 0); i < t.length; i++) saved.push([t[i], series.seconds_saved[i]]);
  return {
    "chart-hit-rate": [hitRate, (v) => v.toFixed(0) + "%", 100],
    "chart-saved": [saved, fmtSeconds, 0],
    "chart-executions": [rate(series.records), fmtCount, 0],
    "chart-waits": [rate(series.waits), fmtCount, 0],
    "chart-evictions": [rate(series.evictions), fmtCount, 0],
  };
}

function renderChart(id, points, fmt, fixedMax) {
  const figure = document.getElementById(id);
  const W = 300, H = 90, PAD = 2;
  const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", "data-points": points.length });
  const max = fixedMax || Math.max(1e-9, ...points.map((p) => p[1]));
  const t0 = points.length ? points[0][0] : 0;
  const span = points.length > 1 ? points[points.length - 1][0] - t0 : 1;
  const xy = points.map(([t, v]) => [PAD + ((W - 2 * PAD) * (t - t0)) / span, H - PAD - ((H - 2 * PAD) * v) / max]);
  svg.append(el("svg:line", { class: "axis", x1: 0, y1: H - PAD, x2: W, y2: H - PAD }));
  if (xy.length > 1) {
    const line = xy.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join(" ");
    svg.append(el("svg:polygon", { class: "area", points: `${xy[0][0]},${H - PAD} ${line} ${xy[xy.length - 1][0]},${H - PAD}` }));
    svg.append(el("svg:polyline", { points: line }));
  }
  const caption = figure.querySelector("figcaption");
  let now = caption.querySelector(".now");
  if (!now) {
    now = el("span", { class: "now" });
    caption.append(now);
  }
  now.textContent = points.length ? fmt(points[points.length - 1][1]) + " (max " + fmt(max) + ")" : "–";
  if (points.length > 1) svg.append(el("svg:text", { x: 3, y: H - 5 }, "−" + Math.round(span) + " s"));
  const old = figure.querySelector("svg");
  if (old) old.replaceWith(svg);
  else figure.append(svg);
}

// -- tasks ----------------------------------------------------------------------------------------------

function renderTasks(stats) {
  const list = document.getElementById("task-list");
  document.getElementById("no-tasks").hidden = tasks.length > 0;
  const counts = stats.tasks || {};
  const ordered = [...tasks].sort((a, b) => (counts[b.scope_key]?.lookups || 0) - (counts[a.scope_key]?.lookups || 0) || a.task.localeCompare(b.task));
  if (!selected && ordered.length) selected = ordered[0].scope_key;
  list.replaceChildren(
    ...ordered.map((info) => {
      const c = counts[info.scope_key] || { lookups: 0, hits: 0, records: 0, seconds_saved: 0 };
      const li = el("li", { "data-task": info.scope_key, class: info.scope_key === selected ? "selected" : "" });
      li.append(el("div", { class: "name" }, info.task));
      li.append(
        el(
          "div",
          { class: "meta" },
          `${info.namespace} · ${fmtCount(c.lookups)} lookups · ${c.lookups ? Math.round((100 * c.hits) / c.lookups) : 0}% hits · ${fmtCount(c.records)} executions · ${fmtSeconds(c.seconds_saved)} saved`,
        ),
      );
      li.addEventListener("click", () => {
        selected = info.scope_key;
        selectedNode = null;
        lastGraphKey = "";
        refreshGraph();
        renderTasks(stats);
      });
      return li;
    }),
  );
}

// -- the graph ------------------------------------------------------------------------------------------

// Node ids are chained hashes, so the graph of one task is a tree: every node but the root has exactly one
// incoming edge. Leaves get consecutive columns, a parent sits above the middle of its children.
function layout(graph, rootB64) {
  const nodes = new Map(); // base64 id -> {id, depth, children: [edge], memos: [entry], in: edge, snapshot}
  const node = (id) => {
    if (!nodes.has(id)) nodes.set(id, { id, children: [], memos: [], in: null, snapshots: [] });
    return nodes.get(id);
  };
  node(rootB64);
  for (const e of graph.entries) {
    const parent = node(e.node);
    if (e.kind === "edge") {
      parent.children.push(e);
      node(e.child).in = e;
    } else parent.memos.push(e);
  }
  for (const s of graph.snapshots) node(s.node).snapshots.push(s);
  const roots = [...nodes.values()].filter((n) => n.id === rootB64 || !n.in);
  let column = 0;
  const place = (n, depth) => {
    n.depth = depth;
    const kids = n.children.map((e) => nodes.get(e.child));
    kids.forEach((k) => place(k, depth + 1));
    n.x = kids.length ? (kids[0].x + kids[kids.length - 1].x) / 2 : column++;
  };
  // An explicit stack would be needed for trees thousands of levels deep; rollouts are far shallower.
  roots.forEach((r) => place(r, 0));
  return { nodes, columns: column };
}

function renderGraph(graph) {
  const svg = document.getElementById("graph");
  const rootB64 = hexToB64(selected);
  const { nodes, columns } = layout(graph, rootB64);
  const depth = Math.max(0, ...[...nodes.values()].map((n) => n.depth));
  // Spread a small tree over the panel (room for edge labels); a large one scrolls at 46 px a column.
  const M = 30, DY = 78;
  const room = document.getElementById("graph-box").clientWidth - 2 * M - 4;
  const DX = Math.max(46, Math.min(220, room / Math.max(columns, 1)));
  const width = Math.max(400, columns * DX + 2 * M), height = (depth + 1) * DY + 2 * M;
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const pos = (n) => [M + n.x * DX + DX / 2, M + n.depth * DY];
  const labels = DX >= 110; // only where they fit
  const edges = el("svg:g", { class: "edges" });
  const dots = el("svg:g", { class: "nodes" });
  for (const n of nodes.values()) {
    const [x, y] = pos(n);
    if (n.in) {
      const parent = nodes.get(n.in.node);
      const [px, py] = pos(parent);
      const path = el("svg:path", {
        class: "edge",
        d: `M${px},${py} C${px},${(py + y) / 2} ${x},${(py + y) / 2} ${x},${y}`,
        "stroke-width": (1 + Math.log2(1 + n.in.hits)).toFixed(1),
        "data-hits": n.in.hits,
      });
      path.append(el("svg:title", {}, `${n.in.call}\n${n.in.hits} hits · ${fmtSeconds(n.in.seconds)} per execution`));
      edges.append(path);
      if (labels) {
        const text = n.in.call.length > 30 ? n.in.call.slice(0, 29) + "…" : n.in.call;
        edges.append(el("svg:text", { class: "edge-label", x: x + 8, y: y - 24 }, text));
      }
    }
    const hits = (n.in ? n.in.hits : 0) + n.memos.reduce((sum, m) => sum + m.hits, 0);
    const classes = ["node"];
    if (n.id === rootB64) classes.push("root");
    if (n.snapshots.length) classes.push("snapshot");
    if (n.id === selectedNode) classes.push("selected");
    const g = el("svg:g", {
      class: classes.join(" "),
      "data-node": b64ToHex(n.id),
      "data-hits": hits,
      "data-memos": n.memos.length,
      "data-snapshots": n.snapshots.length,
      transform: `translate(${x},${y})`,
    });
    g.append(el("svg:circle", { r: (5 + 2 * Math.log2(1 + hits)).toFixed(1) }));
    g.append(el("svg:title", {}, `node ${b64ToHex(n.id).slice(0, 12)}…\n${hits} hits · ${n.memos.length} memos · ${n.snapshots.length} snapshots`));
    if (hits) g.append(el("svg:text", { x: -4, y: 22 }, String(hits)));
    if (n.memos.length) {
      const memo = el("svg:g", { class: "memo", transform: "translate(9,-16)" });
      memo.append(el("svg:rect", { width: 8 + 5 * String(n.memos.length).length, height: 11, rx: 4 }));
      memo.append(el("svg:text", { x: 3, y: 8.5 }, String(n.memos.length)));
      g.append(memo);
    }
    g.addEventListener("mouseenter", () => showDetails(n));
    g.addEventListener("click", () => {
      selectedNode = n.id;
      showDetails(n);
      renderGraph(graph);
    });
    dots.append(g);
  }
  svg.replaceChildren(edges, dots);
  showDetails(nodes.get(selectedNode) || nodes.get(rootB64));
  const info = graph.task;
  document.getElementById("graph-title").textContent = info ? `${info.task} (${info.namespace})` : "tool-call graph";
  const edgesCount = graph.entries.filter((e) => e.kind === "edge").length;
  document.getElementById("graph-summary").textContent =
    `${nodes.size} states · ${edgesCount} edges · ${graph.entries.length - edgesCount} memos · ` +
    `${graph.snapshots.length} snapshots` + (graph.truncated ? ` · showing the first ${GRAPH_LIMIT} entries` : "");
}

let selectedNode = null;

function showDetails(n) {
  const box = document.getElementById("details");
  const table = el("table");
  const head = el("tr");
  ["kind", "call", "hits", "seconds", "bytes"].forEach((h) => head.append(el("th", {}, h)));
  table.append(head);
  const rows = [...(n.in ? [n.in] : []), ...n.memos, ...n.children];
  for (const e of rows) {
    const tr = el("tr");
    const kind = e === n.in ? "edge in" : e.kind === "memo" ? "memo" : "edge out";
    tr.append(el("td", {}, kind));
    const call = el("td");
    call.append(el("code", {}, e.call));
    tr.append(call, el("td", {}, String(e.hits)), el("td", {}, fmtSeconds(e.seconds)), el("td", {}, String(e.size)));
    table.append(tr);
  }
  const title = el("p", {}, `node ${b64ToHex(n.id)} · ${n.snapshots.length} snapshot(s)` +
    (n.snapshots.length ? " held by " + n.snapshots.map((s) => s.origin).join(", ") : ""));
  box.classList.remove("muted");
  box.replaceChildren(title, table);
}

// -- polling --------------------------------------------------------------------------------------------

async function refreshStats() {
  try {
    const [stats, taskList] = await Promise.all([api("/v1/stats"), api("/v1/tasks")]);
    tasks = taskList;
    renderTotals(stats);
    for (const [id, [points, fmt, max]] of Object.entries(chartData(stats.series))) renderChart(id, points, fmt, max);
    renderTasks(stats);
    setStatus("live · " + new Date().toLocaleTimeString(), true);
    if (selected && !lastGraphKey) refreshGraph();
  } catch (err) {
    setStatus(String(err.message || err), false);
  }
}

async function refreshGraph() {
  if (!selected) return;
  try {
    const graph = await api("/v1/export", { scope_key: selected, limit: GRAPH_LIMIT });
    // Redraw only when something changed, so hovering and scrolling are not disturbed every few seconds.
    const key = selected + JSON.stringify(graph.entries.map((e) => e.hits)) + graph.entries.length + graph.snapshots.length;
    if (key !== lastGraphKey) {
      lastGraphKey = key;
      renderGraph(graph);
    }
  } catch (err) {
    setStatus(String(err.message || err), false);
  }
}

refreshStats();
setInterval(refreshStats, STATS_EVERY_MS);
setInterval(refreshGraph, GRAPH_EVERY_MS);
