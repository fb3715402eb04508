"""The one page of ``status --serve`` (:mod:`p2p_diloco.cli.serve`): HTML, CSS and a small hand-written SVG chart
script, all inline, so that the page fetches nothing but the server's own ``/api/status`` and ``/api/history``
(no CDN, no font, no chart library: a page opened on a machine without internet access works the same).

Every text that comes from the DHT (peer names, states, profiles) is set with ``textContent``, never parsed as
HTML: a peer cannot put markup or script on the page.
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>p2p-diloco swarm</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em 2em; color: #1d2430; background: #fbfbfd; }
  h1 { font-size: 1.3em; margin: 0 0 .2em; }
  .muted { color: #68707c; }
  #run span.fig { display: inline-block; margin-right: 1.6em; }
  #run b { font-size: 1.15em; }
  table { border-collapse: collapse; margin: .8em 0 1.2em; }
  th, td { padding: .25em .8em; border-bottom: 1px solid #e2e5ea; text-align: left; white-space: nowrap; }
  th { background: #eef1f5; font-weight: 600; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .charts { display: flex; flex-wrap: wrap; gap: 1.2em; }
  .chart { background: #fff; border: 1px solid #e2e5ea; border-radius: 6px; padding: .5em .8em; }
  .chart h2 { font-size: 1em; margin: 0 0 .3em; }
  .legend span { margin-right: 1em; }
  .legend i { display: inline-block; width: 12px; height: 3px; vertical-align: middle; margin-right: .3em; }
  #error { color: #b3261e; }
</style>
</head>
<body>
<h1>p2p-diloco swarm <span id="run-id" class="muted"></span></h1>
<div id="run"></div>
<div id="consensus" class="muted"></div>
<div id="error"></div>
<table id="peers">
  <thead><tr><th>name</th><th>state</th><th>device</th><th>reachable</th><th>step</th><th>tokens</th><th>tok/s</th>
  <th>fragment versions</th><th>last sync</th><th>MB out/in</th><th>loss</th><th>seen</th></tr></thead>
  <tbody></tbody>
</table>
<div id="left" class="muted"></div>
<div class="charts">
  <div class="chart"><h2>training loss per peer</h2><svg id="loss-chart" width="520" height="240"></svg>
    <div class="legend" id="loss-legend"></div></div>
  <div class="chart"><h2>rounds committed (all fragments)</h2><svg id="rounds-chart" width="520" height="240"></svg></div>
  <div class="chart"><h2>tokens/s (live peers)</h2><svg id="rate-chart" width="520" height="240"></svg></div>
</div>
<p class="muted">Read from the DHT every <span id="refresh"></span> s, as <code>p2p-diloco status</code> reads it;
JSON: <a href="/api/status">/api/status</a> (= <code>status --json</code>), <a href="/api/history">/api/history</a>;
Prometheus: <a href="/metrics">/metrics</a>. <span id="updated"></span></p>
<script>
"use strict";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const SVG = "http://www.w3.org/2000/svg";
let refreshS = 2;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function age(now, t) {
  if (!t || t <= 0) return "never";
  const s = Math.max(0, now - t);
  return s < 120 ? s.toFixed(0) + "s ago" : s < 7200 ? (s / 60).toFixed(0) + "m ago" : (s / 3600).toFixed(1) + "h ago";
}
function span(s) {  // an axis tick: seconds up to 10 minutes, then minutes to a tenth (no two ticks alike)
  return s < 600 ? Math.round(s) + "s" : (s / 60).toFixed(1).replace(/\\.0$/, "") + "m";
}
function fmt(n, digits) { return Number(n).toLocaleString("en-US", {maximumFractionDigits: digits || 0}); }

function renderStatus(d, view) {
  document.getElementById("run-id").textContent = d.run_id ? "run " + d.run_id : "(no run in this DHT)";
  const s = d.summary, run = document.getElementById("run");
  run.replaceChildren();
  const ours = (d.runs_detail || []).find(r => r.run_id === d.run_id);
  for (const [label, value] of [["config hash", d.config_hash || (ours && ours.config_hash) || "-"], ["live peers", s.live],
                                ["tokens", fmt(s.tokens)], ["tokens/s", fmt(s.tokens_per_s)]]) {
    const f = el("span", "", "fig");
    f.append(el("span", label + " ", "muted"), el("b", value));
    run.append(f);
  }
  document.getElementById("consensus").textContent = "consensus: " + view.consensus;
  document.getElementById("consensus").title = view.definition;
  const body = document.querySelector("#peers tbody");
  body.replaceChildren();
  for (const p of d.peers) {
    if (p.status !== "live" && p.status !== "foreign") continue;
    const full = p.kind === "PeerRecord";
    const tr = el("tr");
    tr.dataset.peer = p.name;
    const cells = [
      [p.name], [p.status === "live" ? p.state : p.status], [p.profile || "-"],
      [full ? (p.addresses && p.addresses.length ? "yes (" + p.addresses.length + (p.addresses.length > 1 ? " addresses)" : " address)") : "client only") : ""],
      [full ? p.inner_step : "", "num"], [full ? fmt(p.tokens) : "", "num"], [full ? fmt(p.tokens_per_s) : "", "num"],
      [full && p.fragment_versions.length ? p.fragment_versions.join(",") : "-", "versions"],
      [full ? age(d.dht_time, p.last_sync_time) : ""],
      [full ? (p.bytes_sent / 1e6).toFixed(1) + "/" + (p.bytes_received / 1e6).toFixed(1) : "", "num"],
      [typeof p.loss === "number" ? p.loss.toFixed(3) : "-", "num"], [age(d.dht_time, p.time)],
    ];
    for (const [text, cls] of cells) tr.append(el("td", text, cls));
    if (p.status === "foreign") tr.style.color = "#b3261e";
    body.append(tr);
  }
  const left = document.getElementById("left");
  left.replaceChildren();
  for (const [name, pid, t] of s.left) left.append(el("div", "left: " + name + " (" + pid.slice(-8) + ") " + age(d.dht_time, t)));
}

// One line chart: series = [{name, color, points: [[t, y], ...]}]; x is DHT time (seconds), shown relative to now.
function drawChart(svg, series, yLabel) {
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), L = 52, R = 10, T = 10, B = 28;
  svg.replaceChildren();
  const all = series.flatMap(s => s.points);
  svg.dataset.points = String(Math.max(0, ...series.map(s => s.points.length)));
  if (all.length === 0) {
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", W / 2); t.setAttribute("y", H / 2); t.setAttribute("text-anchor", "middle");
    t.setAttribute("fill", "#68707c"); t.textContent = "no data yet";
    svg.append(t); return;
  }
  let x0 = Math.min(...all.map(p => p[0])), x1 = Math.max(...all.map(p => p[0]));
  let y0 = Math.min(...all.map(p => p[1])), y1 = Math.max(...all.map(p => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.05; y0 = y0 >= 0 ? Math.max(0, y0 - pad) : y0 - pad; y1 += pad;  // counts stay >= 0
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const line = (x1_, y1_, x2_, y2_, color) => {
    const l = document.createElementNS(SVG, "line");
    l.setAttribute("x1", x1_); l.setAttribute("y1", y1_); l.setAttribute("x2", x2_); l.setAttribute("y2", y2_);
    l.setAttribute("stroke", color); svg.append(l);
  };
  const label = (x, y, text, anchor) => {
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("font-size", "11"); t.setAttribute("fill", "#68707c");
    t.setAttribute("text-anchor", anchor); t.textContent = text; svg.append(t);
  };
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    line(L, sy(y), W - R, sy(y), "#eef1f5");
    label(L - 4, sy(y) + 4, Math.abs(y) >= 1000 ? fmt(y) : y.toPrecision(3), "end");
  }
  for (let i = 0; i <= 4; i++) {
    const x = x0 + (x1 - x0) * i / 4;
    label(sx(x), H - 10, x1 - x < 0.5 ? "now" : "-" + span(x1 - x), "middle");
  }
  label(L, H - 1, yLabel, "start");
  for (const s of series) {
    if (s.points.length === 0) continue;
    const pl = document.createElementNS(SVG, "polyline");
    pl.setAttribute("fill", "none"); pl.setAttribute("stroke", s.color); pl.setAttribute("stroke-width", "2");
    pl.setAttribute("points", s.points.map(p => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "));
    pl.dataset.series = s.name;
    svg.append(pl);
    if (s.points.length === 1) {
      const c = document.createElementNS(SVG, "circle");
      c.setAttribute("cx", sx(s.points[0][0])); c.setAttribute("cy", sy(s.points[0][1])); c.setAttribute("r", "3");
      c.setAttribute("fill", s.color); svg.append(c);
    }
  }
}

function renderHistory(h) {
  const pts = h.points;
  const names = [...new Set(pts.flatMap(p => Object.keys(p.loss)))].sort();
  const loss = names.map((name, i) => ({name, color: COLORS[i % COLORS.length],
    points: pts.filter(p => name in p.loss).map(p => [p.t, p.loss[name]])}));
  drawChart(document.getElementById("loss-chart"), loss, "loss");
  const legend = document.getElementById("loss-legend");
  legend.replaceChildren();
  for (const s of loss) {
    const item = el("span"), swatch = el("i");
    swatch.style.background = s.color;
    item.append(swatch, document.createTextNode(s.name));
    legend.append(item);
  }
  drawChart(document.getElementById("rounds-chart"), [{name: "rounds", color: "#2ca02c",
    points: pts.map(p => [p.t, p.rounds])}], "rounds");
  drawChart(document.getElementById("rate-chart"), [{name: "tokens/s", color: "#1f77b4",
    points: pts.map(p => [p.t, p.tokens_per_s])}], "tokens/s");
}

async function refresh() {
  try {
    const [status, history] = await Promise.all([fetch("/api/status"), fetch("/api/history")]);
    const h = await history.json();
    refreshS = h.refresh_s || refreshS;
    document.getElementById("refresh").textContent = refreshS;
    if (status.ok) renderStatus(await status.json(), h);
    renderHistory(h);
    document.getElementById("error").textContent = status.ok ? "" : "waiting for the first read of the DHT";
    document.getElementById("updated").textContent = "Updated " + new Date().toLocaleTimeString() + ".";
    document.body.dataset.ready = "1";
  } catch (e) {
    document.getElementById("error").textContent = "cannot reach the status server: " + e;
  }
  setTimeout(refresh, refreshS * 1000);
}
refresh();
</script>
</body>
</html>
"""
