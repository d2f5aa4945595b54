// The tvcache dashboard: live charts from /v1/stats and the selected task's tool-call graph from /v1/export.
// Plain DOM and SVG, no libraries. Text from the server (task names, calls) is only ever set as textContent.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const STATS_EVERY_MS = 1000;
const GRAPH_EVERY_MS = 3000;
const CHART_SECONDS = 300; // charts show the last five minutes
const HIT_RATE_SAMPLES = 5; // the hit rate chart: each point covers the last five samples (seconds)
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
    ["hit rate since start", t.lookups ? ((100 * answered) / t.lookups).toFixed(1) + "%" : "–"],
    ["tool time saved", fmtSeconds(t.seconds_saved)],
    ["read-set hits", fmtCount(t.read_set_hits || 0)],
    ["executions", fmtCount(t.records - (t.read_set_hits || 0))],
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

// Rates between consecutive samples (the server samples once a second), over the last CHART_SECONDS; the hit
// rate over HIT_RATE_SAMPLES samples at a time to steady it.
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
    const j = Math.max(0, i - HIT_RATE_SAMPLES);
    const lookups = series.lookups[i] - series.lookups[j];
    if (lookups > 0) hitRate.push([t[i], Math.min(100, (100 * (series.hits[i] - series.hits[j])) / lookups)]);
  }
  const saved = [];
  for (let i = Math.max(first, 0); i < t.length; i++) saved.push([t[i], series.seconds_saved[i]]);
  const now = t.length ? t[t.length - 1] : 0;
  return {
    "chart-hit-rate": [hitRate, (v) => v.toFixed(0) + "%", 100, now],
    "chart-saved": [saved, fmtSeconds, 0, now],
    "chart-executions": [rate(series.records), fmtCount, 0, now],
    "chart-waits": [rate(series.waits), fmtCount, 0, now],
    "chart-evictions": [rate(series.evictions), fmtCount, 0, now],
  };
}

function fmtSpan(s) {
  if (s >= 120) return Math.round(s / 60) + " min";
  return Math.max(1, Math.round(s)) + " s";
}

// The window a chart covers is written under it ("last 3 min ... now"), in HTML: text inside the stretched
// SVG would be stretched with it.
function renderChart(id, points, fmt, fixedMax, now) {
  const figure = document.getElementById(id);
  const W = 300, H = 90, PAD = 2;
  const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", "data-points": points.length });
  const max = fixedMax || Math.max(1e-9, ...points.map((p) => p[1]));
  const t0 = points.length ? points[0][0] : now;
  const span = Math.max(now - t0, 1);
  const xy = points.map(([t, v]) => [PAD + ((W - 2 * PAD) * (t - t0)) / span, H - PAD - ((H - 2 * PAD) * v) / max]);
  svg.append(el("svg:line", { class: "axis", x1: 0, y1: H - PAD, x2: W, y2: H - PAD }));
  if (xy.length > 1) {
    const line = xy.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join(" ");
    svg.append(el("svg:polygon", { class: "area", points: `${xy[0][0]},${H - PAD} ${line} ${xy[xy.length - 1][0]},${H - PAD}` }));
    svg.append(el("svg:polyline", { points: line }));
  }
  const caption = figure.querySelector("figcaption");
  let value = caption.querySelector(".now");
  if (!value) {
    value = el("span", { class: "now" });
    caption.append(value);
  }
  value.textContent = points.length ? fmt(points[points.length - 1][1]) + " (max " + fmt(max) + ")" : "–";
  const axis = el("div", { class: "window" });
  axis.append(el("span", {}, points.length > 1 ? "last " + fmtSpan(span) : "no data yet"), el("span", {}, "now"));
  const old = figure.querySelector("svg");
  if (old) old.replaceWith(svg);
  else figure.append(svg);
  const oldAxis = figure.querySelector(".window");
  if (oldAxis) oldAxis.replaceWith(axis);
  else figure.append(axis);
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

// -- call labels ----------------------------------------------------------------------------------------

// A stored call is its key: the tool name, a space and the canonical JSON of its arguments, cut at 200
// characters, so the JSON may stop mid-way. Labels show the tool and a short form of the arguments: the main
// one (a command, a query, a path) as plain text, then other short ones as key=value.
const MAIN_ARGS = ["command", "cmd", "query", "sql", "path", "file", "filename", "url", "code", "pattern", "key", "name"];

function splitCall(call) {
  const space = call.indexOf(" ");
  if (space < 0) return [call, []];
  const text = call.slice(space + 1);
  try {
    const value = JSON.parse(text);
    if (value && typeof value === "object" && !Array.isArray(value)) return [call.slice(0, space), Object.entries(value)];
    return [call.slice(0, space), [["", value]]];
  } catch {
    return [call.slice(0, space), scanPairs(text)];
  }
}

// The key/value pairs at the start of a JSON object cut short; a value cut off ends with "…".
function scanPairs(text) {
  const pairs = [];
  let i = 1;
  if (text[0] !== "{") return [["", text + "…"]];
  while (i < text.length && text[i] === '"') {
    const key = readString(text, i);
    if (!key.closed || text[key.end] !== ":") break;
    i = key.end + 1;
    if (text[i] === '"') {
      const value = readString(text, i);
      pairs.push([key.value, value.closed ? value.value : value.value + "…"]);
      i = value.end;
    } else {
      const end = skipValue(text, i);
      pairs.push([key.value, end < text.length ? text.slice(i, end) : text.slice(i) + "…"]);
      i = end;
    }
    if (text[i] !== ",") break;
    i += 1;
  }
  return pairs;
}

function readString(text, start) {
  let j = start + 1;
  while (j < text.length && text[j] !== '"') j += text[j] === "\\" ? 2 : 1;
  const closed = j < text.length;
  const raw = closed ? text.slice(start, j + 1) : text.slice(start).replace(/\\(u[0-9a-fA-F]{0,3})?$/, "") + '"';
  let value;
  try {
    value = JSON.parse(raw);
  } catch {
    value = raw.slice(1, -1);
  }
  return { value, closed, end: closed ? j + 1 : text.length };
}

function skipValue(text, i) {
  let depth = 0;
  for (; i < text.length; i++) {
    const c = text[i];
    if (c === '"') i = readString(text, i).end - 1;
    else if (c === "{" || c === "[") depth++;
    else if (c === "}" || c === "]") {
      if (depth === 0) return i;
      depth--;
    } else if (c === "," && depth === 0) return i;
  }
  return i;
}

const oneLine = (value) => (typeof value === "string" ? value : JSON.stringify(value)).replace(/\s+/g, " ").trim();

function shortCall(call) {
  const [tool, pairs] = splitCall(call);
  if (!pairs.length) return tool;
  let main = -1;
  for (const name of MAIN_ARGS) if (main < 0) main = pairs.findIndex(([key]) => key === name);
  if (main < 0) main = 0;
  const rest = pairs
    .filter((_, i) => i !== main)
    .map(([key, value]) => [key, oneLine(value)])
    .filter(([, value]) => value.length <= 24)
    .map(([key, value]) => `${key}=${value}`);
  return `${tool}: ${[oneLine(pairs[main][1]), ...rest].join(" ")}`;
}

// Text widths by the canvas with the labels' own font: measuring SVG text would lay the page out per label.
let measurer = null;
function fitText(text, width, font) {
  if (!measurer) measurer = document.createElement("canvas").getContext("2d");
  measurer.font = font;
  if (measurer.measureText(text).width <= width) return text;
  let lo = 0, hi = text.length; // the longest prefix that fits with an ellipsis
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (measurer.measureText(text.slice(0, mid) + "…").width <= width) lo = mid;
    else hi = mid - 1;
  }
  return lo ? text.slice(0, lo).trimEnd() + "…" : "";
}

// -- the graph ------------------------------------------------------------------------------------------

// Node ids are chained hashes, so the graph of one task is a tree: every node but the root has exactly one
// incoming edge. It is drawn left to right, a column per depth: leaves get consecutive rows and a parent sits
// at the middle of its children's rows, so two nodes of one column are at least a row apart. Each edge's
// label sits on the edge's last horizontal stretch, in its child's row and between the two columns: labels
// of one column are a row apart, and labels of different columns never share an x, so none overlap.
function layout(graph, rootB64) {
  const nodes = new Map(); // base64 id -> {id, depth, row, children: [edge], memos: [entry], in: edge, snapshots}
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
  // Besides the root, a state whose incoming edge is past a truncated export's limit is drawn as a root.
  const roots = [...nodes.values()].filter((n) => n.id === rootB64 || !n.in);
  let rows = 0;
  let depth = 0;
  const place = (n, d) => {
    n.depth = d;
    depth = Math.max(depth, d);
    const kids = n.children.map((e) => nodes.get(e.child));
    kids.forEach((k) => place(k, d + 1));
    n.row = kids.length ? (kids[0].row + kids[kids.length - 1].row) / 2 : rows++;
  };
  // An explicit stack would be needed for trees thousands of levels deep; rollouts are far shallower.
  roots.forEach((r) => place(r, 0));
  return { nodes, rows, depth };
}

const ROW = 34; // px between rows: room for a label above each edge line
const R_MAX = 10; // largest node radius: a circle and its memo badge stay inside its row
const M = 16; // margin around the drawing
const LABEL_FONT_PX = 11;

function renderGraph(graph) {
  const svg = document.getElementById("graph");
  const rootB64 = hexToB64(selected);
  const { nodes, rows, depth } = layout(graph, rootB64);
  // Columns share the panel's width, 170 to 340 px each: deeper trees get shorter labels, then scroll.
  const room = document.getElementById("graph-box").clientWidth - 2 * M - 2 * R_MAX - 4;
  const DX = depth ? Math.max(170, Math.min(340, room / depth)) : 0;
  const width = Math.max(300, 2 * M + 2 * R_MAX + depth * DX);
  const height = 2 * M + Math.max(1, rows) * ROW;
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const pos = (n) => [M + R_MAX + n.depth * DX, M + ROW / 2 + n.row * ROW];
  const font = `${LABEL_FONT_PX}px ${getComputedStyle(svg).fontFamily}`;
  const elbow = R_MAX + 8; // where a parent's edges turn towards their children's rows
  const edges = el("svg:g", { class: "edges" });
  const dots = el("svg:g", { class: "nodes" });
  for (const n of nodes.values()) {
    const [x, y] = pos(n);
    if (n.in) {
      const [px, py] = pos(nodes.get(n.in.node));
      const group = el("svg:g", { class: "edge-group" });
      group.append(el("svg:title", {}, `${n.in.call}\n${n.in.hits} hits · ${fmtSeconds(n.in.seconds)} per execution`));
      group.append(
        el("svg:path", {
          class: "edge",
          d: `M${px},${py} H${px + elbow} V${y} H${x}`,
          "stroke-width": Math.min(4, 1 + Math.log2(1 + n.in.hits) / 2).toFixed(1),
          "data-hits": n.in.hits,
        }),
      );
      const left = px + elbow + 6;
      const text = fitText(shortCall(n.in.call), x - R_MAX - 6 - left, font);
      if (text) group.append(el("svg:text", { class: "edge-label", x: left, y: y - 7 }, text));
      edges.append(group);
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
    const r = Math.min(R_MAX - (n.snapshots.length ? 2 : 0), 4 + 1.5 * Math.log2(1 + hits));
    g.append(el("svg:circle", { r: r.toFixed(1) }));
    g.append(el("svg:title", {}, `node ${b64ToHex(n.id).slice(0, 12)}…\n${hits} hits · ${n.memos.length} memos · ${n.snapshots.length} snapshots`));
    if (n.memos.length) {
      // Above the circle, so it stays clear of the edges that leave the node to the right.
      const w = 7 + 5 * String(n.memos.length).length;
      const memo = el("svg:g", { class: "memo", transform: `translate(${-w / 2},${-R_MAX - 12})` });
      memo.append(el("svg:rect", { width: w, height: 11, rx: 4 }));
      memo.append(el("svg:text", { x: w / 2, y: 8.5, "text-anchor": "middle" }, String(n.memos.length)));
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
    `${graph.snapshots.length} snapshots · ${depth} levels deep` +
    (graph.truncated ? ` · showing the first ${GRAPH_LIMIT} entries` : "");
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
    for (const [id, [points, fmt, max, now]] of Object.entries(chartData(stats.series))) renderChart(id, points, fmt, max, now);
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
