// The engine table's rows: from /metrics (every engine the frontend hears, its queues, KV
// pages, prefix-cache hits and tokens/s), overlaid with GET /v1/engines where the server has
// it (role, draining, the requests each engine holds).

import { byLabel, rate, total } from "./prom.js";

const PER_ENGINE = {
  running: "sluice:num_requests_running",
  waiting: "sluice:num_requests_waiting",
  kvTotal: "sluice:kv_cache_total_pages",
  kvFree: "sluice:kv_cache_free_pages",
  postproc: "sluice:postproc_workers",
};

// One row per engine id, from a scrape (and the one a few seconds before it, for rates).
export function metricRows(now, then) {
  const rows = new Map();
  for (const s of now.series.get("sluice:engine_live") ?? []) {
    const id = s.labels.engine || s.labels.address || "engine";
    rows.set(id, { id, address: s.labels.address ?? "", role: null,
      state: s.value > 0 ? "up" : "down" });
  }
  if (!rows.size && now.series.has("sluice:engine_up")) {  // a frontend older than issue 18
    rows.set("engine", { id: "engine", address: "", role: null,
      state: total(now.series, "sluice:engine_up") > 0 ? "up" : "down" });
  }
  for (const row of rows.values()) addEngineSeries(row, now, then);
  return rows;
}

function addEngineSeries(row, now, then) {
  for (const [field, name] of Object.entries(PER_ENGINE)) {
    row[field] = byLabel(now.series, name, "engine").get(row.id) ?? null;
  }
  row.kvUsed = row.kvTotal !== null && row.kvFree !== null ? row.kvTotal - row.kvFree : null;
  const want = { engine: row.id };
  row.tokensPerSecond = rate(now, then, "sluice:computed_tokens_total", want);
  const hits = rate(now, then, "sluice:prefix_cache_hits_total", want);
  const queries = rate(now, then, "sluice:prefix_cache_queries_total", want);
  if (queries) {
    row.hitRate = hits / queries;
  } else {  // nothing asked lately: the rate since the engine started
    const allQueries = total(now.series, "sluice:prefix_cache_queries_total", want);
    const allHits = total(now.series, "sluice:prefix_cache_hits_total", want);
    row.hitRate = allQueries ? allHits / allQueries : null;
  }
}

// /v1/engines' {"object": "list", "data": [...]} laid over the metric rows.
export function mergeListed(rows, listed) {
  for (const e of listed?.data ?? []) {
    const id = String(e.id);
    const row = rows.get(id) ?? { id, tokensPerSecond: null };
    rows.set(id, {
      ...row,
      address: e.address ?? row.address ?? "",
      role: e.role ?? null,
      state: e.state ?? row.state,
      running: e.running ?? row.running ?? null,
      waiting: e.waiting ?? row.waiting ?? null,
      kvTotal: e.kv_pages_total ?? row.kvTotal ?? null,
      kvUsed: e.kv_pages_used ?? row.kvUsed ?? null,
      hitRate: e.prefix_cache_hit_rate ?? row.hitRate ?? null,
      postproc: e.postproc_workers ?? row.postproc ?? null,
    });
  }
  return rows;
}

// Every listed engine's requests in flight, oldest first.
export function requestsInFlight(listed) {
  const out = [];
  for (const e of listed?.data ?? []) {
    for (const r of e.requests ?? []) {
      out.push({ engine: String(e.id), id: String(r.id), age: Number(r.age_s),
        tokens: Number(r.output_tokens) });
    }
  }
  return out.sort((a, b) => b.age - a.age);
}
