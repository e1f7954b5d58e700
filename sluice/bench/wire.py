"""The OpenAI wire format `sluice bench` reads: the chat request it sends, the stream's
chunks and its SSE lines, the model list."""

from typing import Any

import msgspec


class Message(msgspec.Struct):
    role: str
    content: str


class StreamOptions(msgspec.Struct):
    include_usage: bool = True


class ChatRequest(msgspec.Struct):
    model: str
    messages: list[Message]
    max_tokens: int
    temperature: float
    stream: bool = True
    stream_options: StreamOptions = msgspec.field(default_factory=StreamOptions)
    # UNSET fields are left out of the JSON: servers other than ours and vLLM may reject
    # an unknown ignore_eos, so it is sent only when asked for.
    ignore_eos: bool | msgspec.UnsetType = msgspec.UNSET


class Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # newer vLLM names the reasoning field this way

    def text(self) -> str:
        return (self.content or "") + (self.reasoning_content or "") + (self.reasoning or "")


class ChunkChoice(msgspec.Struct):
    delta: Delta = msgspec.field(default_factory=Delta)


class Usage(msgspec.Struct):
    completion_tokens: int = 0


class ChatChunk(msgspec.Struct):
    choices: list[ChunkChoice] = []
    usage: Usage | None = None
    error: Any = None  # vLLM reports mid-stream failures as a data chunk with "error"

    def text(self) -> str:
        return "".join(choice.delta.text() for choice in self.choices)


class Done(msgspec.Struct):
    """The `data: [DONE]` terminator."""


class StreamError(msgspec.Struct):
    """An error reported inside an otherwise-200 stream."""

    message: str


DONE = Done()
SseEvent = ChatChunk | Done | StreamError


class ModelCard(msgspec.Struct):
    id: str


class ModelList(msgspec.Struct):
    data: list[ModelCard]


_CHUNK_DECODER = msgspec.json.Decoder(ChatChunk)


def parse_sse_line(line: str) -> SseEvent | None:
    """Decode one SSE line; None for blank separators, `:` keep-alive comments, other fields.

    OpenAI-style servers put each JSON chunk on a single `data:` line, so multi-line data
    events are not reassembled. Malformed JSON raises msgspec.DecodeError.
    """
    if line.startswith("error:"):  # llama-server's mid-stream error field
        return StreamError(line[len("error:") :].strip())
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if not payload:
        return None
    if payload == "[DONE]":
        return DONE
    chunk = _CHUNK_DECODER.decode(payload)
    if chunk.error is not None:
        return StreamError(str(chunk.error))
    return chunk
