// One streamed chat completion: the request the playground sends, and the answer as it
// arrives (content, reasoning, tool calls, usage), with its time to first token.

import { api, errorText } from "./api.js";
import { sseData } from "./stream.js";

// The messages as the API takes them: a user's images as image_url parts.
export function apiMessages(system, messages) {
  const out = system.trim() ? [{ role: "system", content: system }] : [];
  for (const m of messages) {
    if (m.role === "user" && m.images?.length) {
      const parts = [{ type: "text", text: m.content }];
      for (const url of m.images) parts.push({ type: "image_url", image_url: { url } });
      out.push({ role: "user", content: parts });
    } else if (m.role === "user" || m.role === "assistant" || m.role === "system") {
      out.push({ role: m.role, content: m.content ?? "" });
    }
  }
  return out;
}

export function requestBody(settings, messages) {
  const body = {
    model: settings.model,
    messages: apiMessages(settings.system ?? "", messages),
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const [field, value] of [["temperature", settings.temperature],
    ["top_p", settings.topP], ["max_tokens", settings.maxTokens]]) {
    if (value !== "" && value !== undefined && Number.isFinite(Number(value))) {
      body[field] = Number(value);
    }
  }
  return { ...body, ...settings.extra };  // the user's own fields win
}

// Streams one answer into `answer` (its fields grow in place), calling onUpdate after each
// chunk. Resolves with the answer; a Stop (signal) resolves it with stopped: true.
export async function streamChat(body, answer, onUpdate, signal) {
  const started = performance.now();
  let response;
  try {
    response = await api("v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal,
      headers: { "Content-Type": "application/json" },
    });
    answer.trace = response.headers.get("traceparent") ?? "";
    if (!response.ok) {
      answer.error = await errorText(response);
      return answer;
    }
    for await (const data of sseData(response)) {
      addChunk(answer, JSON.parse(data), started);
      onUpdate(answer);
    }
  } catch (error) {
    if (signal.aborted) answer.stopped = true;
    else answer.error = String(error?.message ?? error);
  }
  answer.seconds = (performance.now() - started) / 1000;
  return answer;
}

function addChunk(answer, chunk, started) {
  if (chunk.error) {
    answer.error = chunk.error.message ?? "the stream ended with an error";
    return;
  }
  if (chunk.usage) answer.usage = chunk.usage;
  const delta = chunk.choices?.[0]?.delta;
  if (!delta) return;
  const reasoning = delta.reasoning_content ?? delta.reasoning;
  if (answer.ttft === undefined && (delta.content || reasoning || delta.tool_calls)) {
    answer.ttft = (performance.now() - started) / 1000;
    answer.firstAt = performance.now();
  }
  answer.chunks = (answer.chunks ?? 0) + 1;
  if (delta.content) answer.content += delta.content;
  if (reasoning) answer.reasoning = (answer.reasoning ?? "") + reasoning;
  for (const call of delta.tool_calls ?? []) addToolCall(answer, call);
}

function addToolCall(answer, call) {
  answer.tool_calls ??= [];
  const index = call.index ?? answer.tool_calls.length;
  const entry = answer.tool_calls[index] ??= { name: "", arguments: "" };
  if (call.function?.name) entry.name += call.function.name;
  if (call.function?.arguments) entry.arguments += call.function.arguments;
}

// Tokens, time to first token and tokens/s of a finished answer.
export function answerStats(answer) {
  const tokens = answer.usage?.completion_tokens ?? answer.chunks ?? 0;
  const decodeSeconds = answer.firstAt ? answer.seconds - answer.ttft : 0;
  return {
    tokens,
    ttft: answer.ttft ?? null,
    tokensPerSecond: decodeSeconds > 0 && tokens > 1 ? (tokens - 1) / decodeSeconds : null,
  };
}
