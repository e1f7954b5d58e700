// The dashboard at /dashboard: /metrics (and GET /v1/engines where the server has it) read
// every second, shown as numbers, plots and tables.

import { api, ensureKey, errorText } from "./api.js";
import { drawPlot } from "./charts.js";
import { mergeListed, metricRows, requestsInFlight } from "./engines.js";
import { parseMetrics, quantile, rate, total } from "./prom.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const KEEP = 120;  // scrapes kept: two minutes of plots
const RATE_WINDOW_MS = 5000;  // rates over the last five seconds
const QUANTILE_WINDOW_MS = 60000;  // latency percentiles over the last minute
const history = [];
const plots = { tokens: [], running: [], waiting: [], kv: [] };
let listing = "unknown";  // GET /v1/engines: "yes", "no" (404), "unknown"

function scrapeBefore(now, ms) {
  return history.find((s) => now.time - s.time <= ms && s !== now) ?? null;
}

const DASH = "\u2013";  // no value (yet)
const known = (v) => v !== null && v !== undefined && Number.isFinite(v);
const fixed = (digits) => (v) => (known(v) ? v.toFixed(digits) : DASH);
const whole = fixed(0);
const percent = (v) => (known(v) ? `${(v * 100).toFixed(0)}%` : DASH);
const seconds = (v) => {
  if (!known(v)) return DASH;
  return v < 1 ? `${(v * 1000).toFixed(0)} ms` : `${v.toFixed(2)} s`;
};
const TTFT = "sluice:time_to_first_token_seconds";
const E2E = "sluice:e2e_request_latency_seconds";
const GENERATED = "sluice:generation_tokens_total";

function frontendNumbers(now) {
  const recent = scrapeBefore(now, RATE_WINDOW_MS);
  const minute = scrapeBefore(now, QUANTILE_WINDOW_MS);
  const s = now.series;
  const done = (scrape) => (total(scrape.series, "sluice:request_success_total") ?? 0)
    + (total(scrape.series, "sluice:request_errors_total") ?? 0);
  const requestRate = recent
    ? (done(now) - done(recent)) / ((now.time - recent.time) / 1000) : null;
  // Over the last minute; since the start while the minute saw no request.
  const q = (name, ...ps) => ps.map((p) => seconds(
    quantile(now, minute, name, p) ?? quantile(now, null, name, p))).join(" / ");
  return [
    ["requests-per-second", "Requests/s", fixed(2)(requestRate)],
    ["tokens-per-second", "Generated tokens/s", fixed(1)(rate(now, recent, GENERATED))],
    ["generated-tokens", "Generated tokens", whole(total(s, GENERATED))],
    ["in-flight", "In flight", whole(total(s, "sluice:frontend_requests_in_flight"))],
    ["queued", "Queued", whole(total(s, "sluice:frontend_queued_requests"))],
    ["errors", "Errors", whole(total(s, "sluice:request_errors_total") ?? 0)],
    ["aborted", "Aborted in engines", whole(total(s, "sluice:requests_aborted_total"))],
    ["ttft", "First token p50 / p90 / p99", q(TTFT, 0.5, 0.9, 0.99)],
    ["e2e", "Whole request p50 / p99", q(E2E, 0.5, 0.99)],
  ];
}

function renderFrontend(now) {
  const items = frontendNumbers(now).flatMap(([key, label, value]) => {
    const dt = document.createElement("dt");
    dt.textContent = label;
    const dd = document.createElement("dd");
    dd.dataset.stat = key;
    dd.textContent = value;
    return [dt, dd];
  });
  $("frontend-stats").replaceChildren(...items);
}

function cell(text, field) {
  const td = document.createElement("td");
  td.textContent = text;
  if (field) td.dataset.field = field;
  return td;
}

function renderEngines(rows) {
  const body = $("engines").tBodies[0];
  body.replaceChildren(...[...rows.values()].map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.engine = r.id;
    const state = cell(r.state, "state");
    state.className = `state ${r.state}`;
    const kv = known(r.kvUsed) ? `${whole(r.kvUsed)} / ${whole(r.kvTotal)}` : DASH;
    tr.append(cell(r.id, "id"), cell(r.role ?? "n/a", "role"), state,
      cell(whole(r.running), "running"), cell(whole(r.waiting), "waiting"), cell(kv, "kv"),
      cell(percent(r.hitRate), "prefix-hits"), cell(fixed(1)(r.tokensPerSecond), "tokens"),
      cell(whole(r.postproc), "postproc"));
    tr.title = r.address;
    return tr;
  }));
}

function renderRequests(listed) {
  const body = $("requests").tBodies[0];
  const note = (text) => {
    const td = cell(text, "note");
    td.colSpan = 4;
    const tr = document.createElement("tr");
    tr.append(td);
    body.replaceChildren(tr);
  };
  if (listing === "no") {
    return note("n/a: this server does not list its engines' requests (GET /v1/engines)");
  }
  if (!listed) return note(DASH);
  const requests = requestsInFlight(listed);
  if (!requests.length) return note("none");
  body.replaceChildren(...requests.map((r) => {
    const tr = document.createElement("tr");
    tr.append(cell(r.engine), cell(r.id), cell(`${r.age.toFixed(1)} s`), cell(whole(r.tokens)));
    return tr;
  }));
}

function renderPlots(now, rows) {
  const previous = history[history.length - 2] ?? null;
  const list = [...rows.values()].filter((r) => r.state !== "down");
  const sum = (field) => list.reduce((acc, r) => acc + (r[field] ?? 0), 0);
  const push = (key, value) => {
    plots[key].push(value);
    if (plots[key].length > KEEP) plots[key].shift();
  };
  push("tokens", rate(now, previous, GENERATED));
  push("running", sum("running"));
  push("waiting", sum("waiting"));
  push("kv", sum("kvTotal") ? (100 * sum("kvUsed")) / sum("kvTotal") : null);
  drawPlot($("plot-tokens"), [{ values: plots.tokens }], KEEP);
  const queue = [{ values: plots.running }, { values: plots.waiting, dashed: true }];
  drawPlot($("plot-queue"), queue, KEEP);
  drawPlot($("plot-kv"), [{ values: plots.kv }], KEEP);
}

async function listEngines() {
  if (listing === "no") return null;
  const response = await api("v1/engines");
  if (response.status === 404) listing = "no";  // a server without the listing: /metrics only
  if (!response.ok) return null;
  listing = "yes";
  return response.json();
}

async function poll() {
  const response = await api("metrics");
  if (!response.ok) throw new Error(`/metrics: ${await errorText(response)}`);
  const now = { time: Date.now(), series: parseMetrics(await response.text()) };
  history.push(now);
  if (history.length > KEEP) history.shift();
  const listed = await listEngines();
  const rows = mergeListed(metricRows(now, scrapeBefore(now, RATE_WINDOW_MS)), listed);
  renderFrontend(now);
  renderEngines(rows);
  renderRequests(listed);
  renderPlots(now, rows);
  $("status").textContent = `updated ${new Date(now.time).toLocaleTimeString()}`;
  document.body.dataset.polls = String(Number(document.body.dataset.polls ?? 0) + 1);
}

async function loop() {
  try {
    await poll();
  } catch (error) {
    $("status").textContent = `not updated: ${error?.message ?? error}`;
  }
  setTimeout(loop, POLL_MS);
}

ensureKey().then(loop);
