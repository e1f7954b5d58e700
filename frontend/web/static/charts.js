// Line plots on a canvas: a series per line, scaled to its largest value, colours from
// the page's CSS (so light and dark both read).

function cssColor(name, fallback) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;
}

// lines: [{values: [number|null], dashed?: bool}]; points are the last `span` values.
export function drawPlot(canvas, lines, span) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const values = lines.flatMap((l) => l.values).filter((v) => Number.isFinite(v));
  const top = Math.max(1, ...values) * 1.1;
  g.fillStyle = cssColor("--muted", "#666");
  g.font = "11px system-ui, sans-serif";
  g.fillText(formatTop(top), 4, 12);
  g.strokeStyle = cssColor("--line", "#ddd");
  g.beginPath();
  g.moveTo(0, height - 0.5);
  g.lineTo(width, height - 0.5);
  g.stroke();
  g.strokeStyle = cssColor("--accent", "#2563eb");
  g.lineWidth = 2;
  for (const line of lines) strokeLine(g, line, span, width, height, top);
}

function strokeLine(g, line, span, width, height, top) {
  g.setLineDash(line.dashed ? [5, 4] : []);
  g.beginPath();
  let drawing = false;
  line.values.slice(-span).forEach((value, i, shown) => {
    if (!Number.isFinite(value)) { drawing = false; return; }
    const x = width - (shown.length - 1 - i) * (width / Math.max(span - 1, 1));
    const y = height - 2 - (value / top) * (height - 16);
    if (drawing) g.lineTo(x, y); else g.moveTo(x, y);
    drawing = true;
  });
  g.stroke();
}

function formatTop(value) {
  return value >= 100 ? value.toFixed(0) : value.toFixed(1);
}
