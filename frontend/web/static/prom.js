// Prometheus text exposition, read into samples, and the sums, rates and histogram
// quantiles the dashboard shows.

const SAMPLE = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"/g;

function number(text) {
  if (text === "+Inf") return Infinity;
  if (text === "-Inf") return -Infinity;
  return Number(text);
}

function labels(text) {
  const out = {};
  for (const [, name, value] of (text ?? "").matchAll(LABEL)) {
    out[name] = value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
  }
  return out;
}

// name -> [{labels, value}]
export function parseMetrics(text) {
  const series = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = SAMPLE.exec(line);
    if (!match) continue;
    if (!series.has(match[1])) series.set(match[1], []);
    series.get(match[1]).push({ labels: labels(match[2]), value: number(match[3]) });
  }
  return series;
}

function matches(sampleLabels, want) {
  return Object.entries(want).every(([k, v]) => sampleLabels[k] === v);
}

export function has(series, name) {
  return series.has(name);
}

// The sum of a series' samples whose labels include `want`; null when there is none.
export function total(series, name, want = {}) {
  const samples = (series.get(name) ?? []).filter((s) => matches(s.labels, want));
  return samples.length ? samples.reduce((sum, s) => sum + s.value, 0) : null;
}

// label value -> the sum of the samples with it.
export function byLabel(series, name, label) {
  const out = new Map();
  for (const s of series.get(name) ?? []) {
    const key = s.labels[label];
    if (key !== undefined) out.set(key, (out.get(key) ?? 0) + s.value);
  }
  return out;
}

// Per-second increase of a counter between two scrapes (null if either lacks it or it reset).
export function rate(now, then, name, want = {}) {
  if (!then) return null;
  const a = total(now.series, name, want);
  const b = total(then.series, name, want);
  const seconds = (now.time - then.time) / 1000;
  if (a === null || b === null || seconds <= 0 || a < b) return null;
  return (a - b) / seconds;
}

// A histogram's cumulative buckets, all label sets summed: [[le, count], ...] by le.
function buckets(series, name) {
  const byBound = new Map();
  for (const s of series.get(`${name}_bucket`) ?? []) {
    const le = number(s.labels.le);
    byBound.set(le, (byBound.get(le) ?? 0) + s.value);
  }
  return [...byBound.entries()].sort((a, b) => a[0] - b[0]);
}

// The q-quantile of what a histogram observed between two scrapes (since start when `then`
// is null), interpolated inside its bucket as Prometheus' histogram_quantile; null: nothing.
export function quantile(now, then, name, q) {
  const current = buckets(now.series, name);
  const before = new Map(then ? buckets(then.series, name) : []);
  const counts = current.map(([le, n]) => [le, n - (before.get(le) ?? 0)]);
  const count = counts.length ? counts[counts.length - 1][1] : 0;
  if (count <= 0) return null;
  const rank = q * count;
  let lower = 0;
  let below = 0;
  for (const [le, n] of counts) {
    if (n >= rank) {
      if (le === Infinity) return lower;  // beyond the last bound: its lower edge
      return lower + (le - lower) * ((rank - below) / Math.max(n - below, 1e-9));
    }
    lower = le;
    below = n;
  }
  return lower;
}
