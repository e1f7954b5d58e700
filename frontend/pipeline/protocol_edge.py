"""What the Responses and Anthropic Messages front doors share: frames -> output blocks.

Both APIs answer with an ordered list of blocks (OpenAI's output items, Anthropic's content
blocks): thinking, text, tool calls. Both run a translated chat request through the chat
pipeline (`pipeline.start_job`, stream off, so no chat-chunk bytes are written) and turn its
text frames into blocks here, one machine for streaming and non-streaming answers, so the two
always agree: a new block opens when the kind of output changes (thinking -> text) or a tool
call starts, and the open block closes when the next one opens or the output ends.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec

from frontend.base.errors import APIError
from frontend.pipeline.pipeline import Frames, frame_loop, run_frames
from shared.protocol import TextFrame
from shared.tool_specs import ChatTool, FunctionDefinition

BlockKind = Literal["reasoning", "text", "tool_call"]


class Block(msgspec.Struct):
    kind: BlockKind
    text: str = ""  # thinking, text, or a tool call's arguments (JSON text) so far
    call_id: str = ""  # tool calls: the parser's call id
    name: str = ""  # tool calls: the function's name
    index: int = 0  # position among the answer's blocks


class BlockEvent(msgspec.Struct):
    what: Literal["open", "delta", "close"]
    block: Block
    delta: str = ""


class Blocks:
    """Feeds one candidate's frames; says which blocks open, grow and close."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.last: TextFrame | None = None  # the last frame fed
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache (first frame)
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # the parser's call index -> its block

    def feed(self, frame: TextFrame) -> list[BlockEvent]:
        # Within one frame the parsers' order holds: thinking ends before content starts, and
        # content a call follows comes before it.
        self.last = frame
        if frame.num_cached_tokens is not None:
            self.num_cached_tokens = frame.num_cached_tokens
        events: list[BlockEvent] = []
        if frame.reasoning:
            self._grow("reasoning", frame.reasoning, events)
        if frame.text:
            self._grow("text", frame.text, events)
        for delta in frame.tool_calls:
            if delta.id is not None:
                block = self._start(Block("tool_call", call_id=delta.id,
                                          name=delta.function.name or ""), events)
                self._calls[delta.index] = block
            block = self._calls.get(delta.index)
            if block is not None and delta.function.arguments:
                block.text += delta.function.arguments
                events.append(BlockEvent("delta", block, delta.function.arguments))
        return events

    def finish(self) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        self._close(events)
        return events

    def outcome(self) -> Outcome:
        return Outcome(self.blocks, self.last, self.num_cached_tokens)

    def _grow(self, kind: BlockKind, piece: str, events: list[BlockEvent]) -> None:
        block = self._open
        if block is None or block.kind != kind:
            block = self._start(Block(kind), events)
        block.text += piece
        events.append(BlockEvent("delta", block, piece))

    def _start(self, block: Block, events: list[BlockEvent]) -> Block:
        self._close(events)
        block.index = len(self.blocks)
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("open", block))
        return block

    def _close(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent("close", self._open))
            self._open = None


class Outcome(msgspec.Struct):
    """A finished (or abandoned) candidate: its blocks and its last frame."""

    blocks: list[Block]
    last: TextFrame | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None


def block_events(frames: Frames, blocks: Blocks) -> AsyncIterator[BlockEvent]:
    """The pipeline's one frame loop (`frame_loop`) with `blocks` as its consumer: yields the
    block events one candidate's frames cause; an error frame raises its APIError. The
    closing events are the caller's (`blocks.finish()`), once `blocks.outcome().finished`
    says the answer ended rather than the client leaving. Closing this generator closes the
    frames (an abort)."""
    return frame_loop(frames, lambda _, frame: blocks.feed(frame))


async def gather(frames: Frames) -> Outcome:
    """A whole (single-candidate) answer; an error frame raises its APIError. The outcome is
    unfinished when the client left first."""
    blocks = Blocks()
    await run_frames(frames, lambda _, frame: blocks.feed(frame))
    blocks.finish()
    return blocks.outcome()


def call_arguments(block: Block) -> dict[str, Any]:
    """A tool call's arguments as an object (parsers always write a JSON object)."""
    try:
        value = json.loads(block.text or "{}")
    except (ValueError, RecursionError):  # model output: not JSON, or nested past recursion
        return {}
    return value if isinstance(value, dict) else {}


def function_tool(name: str, parameters: dict | None, description: str | None,
                  strict: bool | None) -> ChatTool:
    """One OpenAI chat `tools[]` entry from another API's description of a client tool."""
    return ChatTool(function=FunctionDefinition(
        name=name, description=description, strict=strict,
        parameters=parameters or {"type": "object", "properties": {}}))


def renamed(error: APIError, names: dict[str, str]) -> APIError:
    """An error about a field of the translated chat request, in the client's own names
    (e.g. `max_completion_tokens` -> `max_output_tokens`): the checks run after translation."""
    chat_name = error.param
    if chat_name not in names:
        return error
    name = names[chat_name]
    message = re.sub(rf"\b{re.escape(chat_name)}\b", name, error.message, count=1)
    return APIError(error.status, message, name)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse(event_type: str, data: bytes) -> bytes:
    """One SSE event with its name, as both APIs send them."""
    return b"event: " + event_type.encode() + b"\ndata: " + data + b"\n\n"
