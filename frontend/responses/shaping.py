"""Frames -> output items: one response under way (`Shaper`: its skeleton, item ids and the
stream's sequence numbers) as the whole response or as the Responses event stream's events,
and the answer as the assistant turn a follow-up continues from."""

from __future__ import annotations

import time

import msgspec

from frontend.base.api_models import ChatMessage
from frontend.base.errors import APIError
from frontend.pipeline.protocol_edge import Block, BlockEvent, Blocks, Outcome, sse
from frontend.pipeline.serving_context import ServingContext
from frontend.responses.chat_request import conversation_id
from frontend.responses.models import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ConversationRef,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    LifecycleEvent,
    MessageItem,
    OutputItem,
    OutputItemEvent,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseFormatOut,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamError,
    TextDeltaEvent,
    TextDoneEvent,
    TextOut,
)

_json = msgspec.json.Encoder()


class Shaper(msgspec.Struct):
    """One response under way: its skeleton, ids and the stream's sequence numbers."""

    base: ResponseObject
    hex: str
    prompt_tokens: int
    seq: int = 0

    def item_id(self, block: Block) -> str:
        prefix = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}[block.kind]
        return f"{prefix}_{self.hex}{block.index}"

    def item(self, block: Block, status: str) -> OutputItem:
        item_id = self.item_id(block)
        if block.kind == "reasoning":
            return ReasoningItem(item_id, status, [ReasoningText(block.text)])
        if block.kind == "text":
            return MessageItem(item_id, status, [OutputText(block.text)])
        return FunctionCallItem(item_id, status, block.call_id, block.name, block.text)

    def final(self, outcome: Outcome) -> ResponseObject:
        last = outcome.last
        items = [self.item(b, "completed") for b in outcome.blocks]
        changes: dict = {}
        if last.finish_reason == "length":
            changes.update(status="incomplete",
                           incomplete_details=IncompleteDetails("max_output_tokens"))
            if items:
                items[-1] = self.item(outcome.blocks[-1], "incomplete")
        elif last.finish_reason == "abort":
            changes.update(status="cancelled")
        else:
            changes.update(status="completed", completed_at=int(time.time()))
        output_tokens = last.num_output_tokens
        usage = ResponseUsage(self.prompt_tokens, output_tokens,
                              self.prompt_tokens + output_tokens,
                              InputTokensDetails(outcome.num_cached_tokens),
                              OutputTokensDetails(last.num_reasoning_tokens or 0))
        return msgspec.structs.replace(self.base, output=items, usage=usage, **changes)

    # ------------------------------------------------------------ stream events

    def event(self, event_type: str, make) -> bytes:
        """`make(type, sequence_number)` builds the event; numbers count from 0."""
        data = _json.encode(make(event_type, self.seq))
        self.seq += 1
        return sse(event_type, data)

    def lifecycle(self, event_type: str, response: ResponseObject) -> bytes:
        return self.event(event_type, lambda t, s: LifecycleEvent(t, s, response))

    def error(self, error: APIError) -> bytes:
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        return self.event("error", lambda t, s: StreamError(s, error.message, code, error.param))

    def block_events(self, ev: BlockEvent, done: str = "completed") -> list[bytes]:
        """A block's open, delta or close as events; `done` is the closed item's status."""
        block = ev.block
        item_id = self.item_id(block)
        out = []

        def emit(event_type: str, make) -> None:
            out.append(self.event(event_type, make))

        text_kind = "output_text" if block.kind == "text" else "reasoning_text"
        part = OutputText if block.kind == "text" else ReasoningText
        logprobs = [] if block.kind == "text" else None
        if ev.what == "open":
            empty = self.item(block, "in_progress")
            if block.kind != "tool_call":
                empty.content = []
            emit("response.output_item.added",
                 lambda t, s: OutputItemEvent(t, s, block.index, empty))
            if block.kind != "tool_call":
                emit("response.content_part.added",
                     lambda t, s: ContentPartEvent(t, s, item_id, block.index, 0, part("")))
        elif ev.what == "delta":
            if block.kind == "tool_call":
                emit("response.function_call_arguments.delta",
                     lambda t, s: ArgumentsDeltaEvent(s, item_id, block.index, ev.delta))
            else:
                emit(f"response.{text_kind}.delta", lambda t, s: TextDeltaEvent(
                    t, s, item_id, block.index, 0, ev.delta, logprobs))
        else:
            if block.kind == "tool_call":
                emit("response.function_call_arguments.done", lambda t, s: ArgumentsDoneEvent(
                    s, item_id, block.index, block.name, block.text))
            else:
                emit(f"response.{text_kind}.done", lambda t, s: TextDoneEvent(
                    t, s, item_id, block.index, 0, block.text, logprobs))
                emit("response.content_part.done",
                     lambda t, s: ContentPartEvent(t, s, item_id, block.index, 0,
                                                   part(block.text)))
            emit("response.output_item.done", lambda t, s: OutputItemEvent(
                t, s, block.index, self.item(block, done)))
        return out


def answer_message(blocks: list[Block]) -> ChatMessage:
    """The answer as the assistant turn a follow-up's conversation continues from."""
    text = "".join(b.text for b in blocks if b.kind == "text")
    reasoning = "\n".join(b.text for b in blocks if b.kind == "reasoning")
    calls = [{"id": b.call_id, "type": "function",
              "function": {"name": b.name, "arguments": b.text}}
             for b in blocks if b.kind == "tool_call"]
    # "" rather than null beside tool calls: templates that concatenate content (SmolLM2's)
    # fail on null, and the ones that render calls treat both alike.
    return ChatMessage(role="assistant", content=text,
                       tool_calls=calls or None, reasoning_content=reasoning or None)


def response_skeleton(ctx: ServingContext, request: ResponsesRequest, response_id: str
                      ) -> ResponseObject:
    """The response as it starts: the request's settings, no output yet."""
    fmt = request.text.format if request.text is not None else None
    text = TextOut(ResponseFormatOut(type="text") if fmt is None else ResponseFormatOut(
        type=fmt.type, name=fmt.name, description=fmt.description, schema=fmt.schema,
        strict=fmt.strict))
    return ResponseObject(
        id=response_id, created_at=int(time.time()), model=ctx.model_name,
        status="in_progress", output=[],
        parallel_tool_calls=(True if request.parallel_tool_calls is None
                             else request.parallel_tool_calls),
        tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
        tools=list(request.tools or []), text=text, store=request.store is not False,
        instructions=request.instructions, max_output_tokens=request.max_output_tokens,
        previous_response_id=request.previous_response_id, reasoning=request.reasoning,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        metadata=request.metadata or {}, user=request.user,
        background=bool(request.background),
        conversation=(None if (conv_id := conversation_id(request)) is None
                      else ConversationRef(conv_id)),
    )


def failed_response(shaper: Shaper, error: APIError, blocks: Blocks) -> ResponseObject:
    code = "server_error" if error.status >= 500 else "invalid_prompt"
    return msgspec.structs.replace(
        shaper.base, status="failed", error=ResponseError(code, error.message),
        output=[shaper.item(b, "incomplete") for b in blocks.blocks])
