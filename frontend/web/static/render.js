// One message as DOM: Markdown (safely, markdown.js), reasoning folded apart, tool calls as
// calls, attached images, and an answer's numbers.

import { renderMarkdown } from "./markdown.js";

function el(tag, className, children = []) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  node.append(...children);
  return node;
}

export function messageNode(message) {
  const node = el("article", `message ${message.role}`);
  node.setAttribute("aria-label", message.role === "user" ? "You" : "Assistant");
  fillMessage(node, message);
  return node;
}

// Redraws a message in place (called as its answer streams in).
export function fillMessage(node, message) {
  const parts = [];
  if (message.reasoning) parts.push(reasoningNode(message));
  if (message.content) parts.push(el("div", "md", [renderMarkdown(message.content)]));
  for (const call of message.tool_calls ?? []) parts.push(toolCallNode(call));
  for (const url of message.images ?? []) {
    // Only images the user attached (data: URLs); anything else from storage is dropped.
    if (typeof url === "string" && url.startsWith("data:image/")) parts.push(imageNode(url));
  }
  if (message.error) parts.push(el("p", "error", [message.error]));
  if (message.stopped) parts.push(el("p", "note", ["Stopped."]));
  if (message.stats) parts.push(statsNode(message.stats, message.trace));
  node.replaceChildren(...parts);
  node.dataset.chunks = String(message.chunks ?? 0);
}

function reasoningNode(message) {
  const details = el("details", "reasoning");
  details.open = Boolean(message.reasoningOpen);
  details.addEventListener("toggle", () => { message.reasoningOpen = details.open; });
  const label = message.content || message.stats ? "Reasoning" : "Thinking\u2026";
  details.append(el("summary", "", [label]), el("div", "md", [renderMarkdown(message.reasoning)]));
  return details;
}

function toolCallNode(call) {
  const args = el("code", "", [`${call.name || "?"}(${call.arguments})`]);
  return el("div", "tool-call", [el("span", "tag", ["Tool call"]), args]);
}

function imageNode(url) {
  const img = document.createElement("img");
  img.alt = "attached image";
  img.src = url;
  return img;
}

function statsNode(stats, trace) {
  // Numbers or nothing: a stored conversation may hold anything.
  const known = (v) => v !== null && v !== undefined && Number.isFinite(Number(v));
  const bits = [`${known(stats.tokens) ? Number(stats.tokens) : "?"} tokens`];
  if (known(stats.ttft)) bits.push(`first token ${Number(stats.ttft).toFixed(2)} s`);
  if (known(stats.tokensPerSecond)) {
    bits.push(`${Number(stats.tokensPerSecond).toFixed(1)} tokens/s`);
  }
  const node = el("p", "stats", [bits.join(" \u00b7 ")]);
  const traceId = /^[\da-f]{2}-([\da-f]{32})-/.exec(String(trace ?? ""))?.[1];
  if (traceId) node.append(" \u00b7 trace ", el("code", "trace", [traceId]));
  return node;
}
