// Keel's page: reads the API with the token of this tab (from #token=... once, then sessionStorage), and shows a
// job's ETTR (the cumulative and sliding-window curves, lost time by phase), its incidents with each one's
// timeline, and its nodes. Every value is set as text, never as markup. When everything is drawn,
// <body data-state="ready">; on a failure, data-state="error" and the reason in #error.
"use strict";

const TOKEN_KEY = "keel-api-token";
const $ = (selector) => document.querySelector(selector);

function takeTokenFromFragment() {
  const match = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);  // out of the address bar and history
  }
}

class ApiError extends Error {
  constructor(status, detail) {
    super(`${status}: ${detail}`);
    this.status = status;
  }
}

async function api(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) throw new ApiError(401, "no token yet");
  const response = await fetch(path, { headers: { Authorization: `Bearer ${token}` }, cache: "no-store" });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail ?? response.statusText);
    throw new ApiError(response.status, detail);
  }
  return body;
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text ?? "";
  if (className) td.className = className;
  return td;
}

function clear(tbody) {
  while (tbody.firstChild) tbody.removeChild(tbody.firstChild);
}

function when(iso) {
  return iso ? new Date(iso).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z") : "";
}

function seconds(s) {
  if (s === null || s === undefined) return "";
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(2)} h`;
}

function percent(x) {
  return x === null || x === undefined ? "–" : `${(100 * x).toFixed(2)} %`;
}

function showLogin(reason) {
  $("#main").hidden = true;
  $("#login").hidden = false;
  if (reason) $("#login-reason").textContent = reason;
  document.body.dataset.state = "login";
}

function showError(error) {
  $("#error").hidden = false;
  $("#error").textContent = String(error.message || error);
  document.body.dataset.state = "error";
}

function figure(dl, name, value) {
  const dt = document.createElement("dt");
  dt.textContent = name;
  const dd = document.createElement("dd");
  dd.textContent = value;
  const box = document.createElement("div");
  box.append(dt, dd);
  dl.append(box);
}

function svg(name, attributes, text) {
  const element = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (text !== undefined) element.textContent = text;
  return element;
}

function drawChart(chart, points) {
  while (chart.firstChild) chart.removeChild(chart.firstChild);
  if (points.length < 2) {
    chart.append(svg("text", { x: 20, y: 130 }, "no steps yet"));
    return;
  }
  const left = 56, right = 810, top = 12, bottom = 228;
  const t0 = Date.parse(points[0].at), t1 = Date.parse(points[points.length - 1].at);
  const lowest = Math.min(...points.flatMap((p) => [p.cumulative, p.window]));
  const floor = Math.max(0, Math.min(0.9, Math.floor((lowest - 0.005) * 50) / 50));
  const x = (at) => left + ((Date.parse(at) - t0) / Math.max(1, t1 - t0)) * (right - left);
  const y = (v) => bottom - ((v - floor) / (1 - floor)) * (bottom - top);
  for (let k = 0; k <= 4; k++) {
    const v = floor + ((1 - floor) * k) / 4;
    chart.append(svg("line", { x1: left, x2: right, y1: y(v), y2: y(v), class: "grid" }));
    chart.append(svg("text", { x: 4, y: y(v) + 4 }, percent(v)));
  }
  chart.append(svg("text", { x: left, y: 250 }, when(points[0].at)));
  chart.append(svg("text", { x: right, y: 250, "text-anchor": "end" }, when(points[points.length - 1].at)));
  for (const series of ["cumulative", "window"]) {
    const line = points.map((p) => `${x(p.at).toFixed(1)},${y(p[series]).toFixed(1)}`).join(" ");
    chart.append(svg("polyline", { points: line, class: series, "data-series": series }));
  }
}

function drawLost(tbody, cumulative) {
  clear(tbody);
  const rows = [
    ...Object.entries(cumulative.lost_by_phase_s).map(([phase, s]) => [`incidents: ${phase}`, s]),
    ...Object.entries(cumulative.overhead_s).map(([kind, s]) => [`while running: ${kind.replace("_", "-")}`, s]),
  ];
  const most = Math.max(1e-9, ...rows.map(([, s]) => s));
  for (const [where, s] of rows) {
    const row = tbody.insertRow();
    cell(row, where);
    cell(row, seconds(s));
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.width = `${(100 * s) / most}%`;
    cell(row, "").append(bar);
  }
}

async function showTimeline(incident, row) {
  document.querySelectorAll("#incidents tr.selected").forEach((r) => r.classList.remove("selected"));
  if (row) row.classList.add("selected");
  const timeline = await api(`/v1/incidents/${encodeURIComponent(incident.id)}/timeline`);
  $("#timeline").hidden = false;
  $("#timeline-title").textContent = `${incident.kind} ${incident.id.slice(0, 8)}`;
  const tbody = $("#timeline tbody");
  clear(tbody);
  for (const event of timeline.events) {
    const line = tbody.insertRow();
    line.dataset.type = event.type;
    cell(line, event.offset_s.toFixed(1));
    cell(line, event.type);
    cell(line, event.what);
  }
}

const PAGE = 100;  // incidents a page of the list holds (the API's default)

// Rows for one page of incidents (newest first), then an "older" button while the API has more.
function addIncidents(job, page) {
  const tbody = $("#incidents tbody");
  for (const incident of page.incidents) {
    const row = tbody.insertRow();
    row.className = "incident";
    row.dataset.id = incident.id;
    cell(row, when(incident.opened_at));
    cell(row, incident.kind);
    cell(row, incident.node_id);
    cell(row, incident.rung === null ? "" : String(incident.rung));
    cell(row, incident.outcome || "open");
    cell(row, seconds(incident.time_to_resolution_s));
    cell(row, incident.reason);
    row.addEventListener("click", () => showTimeline(incident, row).catch(showError));
  }
  const older = $("#older");
  older.hidden = page.next_before === null;
  older.onclick = page.next_before === null ? null : () => {
    older.disabled = true;
    api(`/v1/incidents?job=${encodeURIComponent(job)}&limit=${PAGE}&before=${page.next_before}`)
      .then((next) => addIncidents(job, next), showError)
      .finally(() => { older.disabled = false; });
  };
}

async function showJob(job) {
  const [ettr, series, incidents, nodes] = await Promise.all([
    api(`/v1/jobs/${encodeURIComponent(job)}/ettr?window=1h`),
    api(`/v1/jobs/${encodeURIComponent(job)}/ettr/series?window=1h&points=240`),
    api(`/v1/incidents?job=${encodeURIComponent(job)}&limit=${PAGE}`),
    api(`/v1/nodes?job=${encodeURIComponent(job)}`),
  ]);
  const dl = $("#ettr-figures");
  while (dl.firstChild) dl.removeChild(dl.firstChild);
  const cumulative = ettr.cumulative;
  figure(dl, "cumulative", percent(cumulative && cumulative.ettr));
  figure(dl, "last hour", percent(ettr.window && ettr.window.ettr));
  figure(dl, "lost", seconds(cumulative ? cumulative.lost_s : 0));
  figure(dl, "incidents", String(incidents.total));
  drawChart($("#ettr-chart"), series.points);
  if (cumulative) drawLost($("#lost tbody"), cumulative);

  clear($("#incidents tbody"));
  addIncidents(job, incidents);
  const nodeRows = $("#nodes tbody");
  clear(nodeRows);
  for (const node of nodes.nodes) {
    const row = nodeRows.insertRow();
    row.dataset.node = node.node_id;
    cell(row, node.node_id);
    cell(row, node.health, node.health);
    cell(row, node.evicted ? "evicted" : "", node.evicted ? "evicted" : "");
    cell(row, node.detail);
    cell(row, when(node.updated_at));
  }
  $("#timeline").hidden = true;
  $("#updated").textContent = `as of ${when(new Date().toISOString())}`;
}

async function start() {
  try {
    const jobs = (await api("/v1/jobs")).jobs.filter((j) => !j.job_id.startsWith("_"));  // _keel: the control plane's
    jobs.sort((a, b) => b.last_event_at.localeCompare(a.last_event_at));
    $("#login").hidden = true;
    $("#main").hidden = false;
    const select = $("#job");
    while (select.firstChild) select.removeChild(select.firstChild);
    for (const job of jobs) select.append(new Option(job.job_id, job.job_id));
    const wanted = new URLSearchParams(location.search).get("job");
    if (wanted && jobs.some((j) => j.job_id === wanted)) select.value = wanted;
    if (jobs.length) await showJob(select.value);
    // ?incident=<id>: a link straight to one incident's timeline (what a page to the on-call person carries).
    const linked = new URLSearchParams(location.search).get("incident");
    const row = linked && document.querySelector(`#incidents tr[data-id="${CSS.escape(linked)}"]`);
    // An incident older than the first page has no row: its timeline opens all the same.
    if (linked) await showTimeline({ id: linked, kind: row ? row.cells[1].textContent : "incident" }, row || null);
    document.body.dataset.state = "ready";
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin(`The API refused the token: ${error.message}`);
    } else {
      showError(error);
    }
  }
}

document.addEventListener("DOMContentLoaded", () => {
  takeTokenFromFragment();
  $("#login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
    $("#token").value = "";
    start();
  });
  $("#forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin("Token forgotten.");
  });
  $("#job").addEventListener("change", () => {
    const job = $("#job").value;
    const url = new URL(location.href);
    url.searchParams.set("job", job);
    history.replaceState(null, "", url);
    document.body.dataset.state = "loading";
    showJob(job).then(() => { document.body.dataset.state = "ready"; }, showError);
  });
  start();
});
