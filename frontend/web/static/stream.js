// Server-sent events from a fetch() response body: each event's data, as the stream
// delivers them, until the body ends or "[DONE]".

export async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = eventData(event);
      if (data === "[DONE]") return;
      if (data !== null) yield data;
    }
  }
}

function eventData(event) {
  const lines = event.split(/\r?\n/).filter((line) => line.startsWith("data:"));
  if (!lines.length) return null;  // a comment or keep-alive
  return lines.map((line) => line.slice(5).replace(/^ /, "")).join("\n");
}
