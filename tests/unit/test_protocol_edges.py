"""The Responses and Anthropic Messages translation layers without a model: requests ->
chat requests, frames -> blocks, the stored-response LRU, and errors in each API's shape
(auth included) on the routes' paths."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from frontend.anthropic import api as anthropic_api
from frontend.anthropic.models import MessagesRequest
from frontend.base.errors import APIError
from frontend.http.auth import AuthMiddleware
from frontend.pipeline.protocol_edge import Blocks, gather
from frontend.responses import chat_request as responses_api
from frontend.responses.models import ResponsesRequest
from shared.protocol import FunctionCallDelta, TextFrame, ToolCallDelta


def responses(**body) -> ResponsesRequest:
    return msgspec.json.decode(msgspec.json.encode(body), type=ResponsesRequest)


def messages(**body) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 16, **body}
    return msgspec.json.decode(msgspec.json.encode(body), type=MessagesRequest)


def frame(text="", reasoning="", calls=(), finish=None) -> TextFrame:
    return TextFrame("r", 0, text, b"", 1, 1, finish_reason=finish, reasoning=reasoning,
                     tool_calls=list(calls))


# ---------------------------------------------------------------- Responses


def test_input_items_become_chat_messages():
    request = responses(input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ])
    out = responses_api.input_messages(request.input)
    assert [m.role for m in out] == ["developer", "user", "assistant", "tool"]
    assistant = out[2]
    assert (assistant.content, assistant.reasoning_content) == ("Let me look.", "think")
    assert assistant.tool_calls == [{"id": "call_1", "type": "function",
                                     "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert (out[3].tool_call_id, out[3].content) == ("call_1", "42")


def test_responses_request_to_chat_request():
    request = responses(
        input="Hi", instructions="Be kind.", max_output_tokens=7, temperature=0.5,
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"},
                "strict": True}],
        tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
    )
    chat = responses_api.to_chat(request, responses_api.input_messages(request.input), "id1")
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be kind."),
                                                             ("user", "Hi")]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and not chat.stream
    assert msgspec.to_builtins(chat.tools) == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "strict": True}}]
    assert msgspec.to_builtins(chat.tool_choice) == {"type": "function",
                                                     "function": {"name": "f"}}
    assert chat.parallel_tool_calls is False and chat.request_id == "id1"
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema == {"type": "object"}


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "background_options": {}}, "background_options"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options"),
])
def test_unsupported_responses_fields_are_400s(body, param):
    with pytest.raises(APIError) as err:
        responses_api.check_unsupported(responses(**body))
    assert (err.value.status, err.value.param) == (400, param)


def test_unknown_item_types_and_tools_are_400s():
    with pytest.raises(APIError) as err:
        responses_api.input_messages(responses(input=[{"type": "item_reference",
                                                       "id": "x"}]).input)
    assert err.value.param == "input[0]"
    with pytest.raises(APIError) as err:
        responses_api.chat_tools(responses(tools=[{"type": "file_search"}]))
    assert err.value.param == "tools[0].type"


# ---------------------------------------------------------------- Anthropic


def test_anthropic_blocks_become_chat_messages():
    request = messages(
        system=[{"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
                {"type": "text", "text": "Thanks"}]},
        ],
        tools=[{"name": "w", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"], thinking={"type": "enabled", "budget_tokens": 100},
    )
    chat = anthropic_api.to_chat(request, "id")
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assistant = chat.messages[2]
    assert (assistant.content, assistant.reasoning_content) == ("Checking.", "hmm")
    assert assistant.tool_calls[0]["function"] == {"name": "w",
                                                   "arguments": '{"city": "Paris"}'}
    assert (chat.messages[3].tool_call_id, chat.messages[3].content) == ("t1", "Sunny")
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == {"type": "object"}
    assert chat.stop == ["END"] and chat.max_completion_tokens == 16
    assert chat.chat_template_kwargs == {"enable_thinking": True, "thinking": True}
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_a_last_assistant_message_is_a_prefill():
    chat = anthropic_api.to_chat(messages(messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]), "id")
    assert chat.continue_final_message and not chat.add_generation_prompt


def test_anthropic_stop_reasons():
    request = messages(messages=[{"role": "user", "content": "x"}], stop_sequences=["END"])
    assert anthropic_api.stop_reason(request, frame(finish="stop")) == ("end_turn", None)
    assert anthropic_api.stop_reason(request, frame(finish="length")) == ("max_tokens", None)
    assert anthropic_api.stop_reason(request, frame(finish="tool_calls"))[0] == "tool_use"
    stopped = msgspec.structs.replace(frame(finish="stop"), stop_reason="END")
    assert anthropic_api.stop_reason(request, stopped) == ("stop_sequence", "END")


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"messages": [{"role": "user", "content": "x"}],
     "tools": [{"name": "web_search", "type": "web_search_20250305"}]},
    {"messages": [{"role": "user", "content": "x"}], "mcp_servers": []},
    {"messages": []},
])
def test_unsupported_anthropic_requests_are_400s(body):
    with pytest.raises(APIError) as err:
        anthropic_api.to_chat(messages(**body), "id")
    assert err.value.status == 400


# ---------------------------------------------------------------- frames -> blocks


def test_blocks_open_and_close_as_the_output_changes_kind():
    blocks = Blocks()
    events = []
    for f in [frame(reasoning="I think"), frame(reasoning=" so", text="Answer"),
              frame(text=" here"),
              frame(calls=[ToolCallDelta(index=0, id="call_1", type="function",
                                         function=FunctionCallDelta(name="f", arguments="")),
                           ToolCallDelta(index=0, function=FunctionCallDelta(
                               arguments='{"a": 1}'))], finish="tool_calls")]:
        events += blocks.feed(f)
    events += blocks.finish()
    assert [(e.what, e.block.kind) for e in events] == [
        ("open", "reasoning"), ("delta", "reasoning"), ("delta", "reasoning"),
        ("close", "reasoning"), ("open", "text"), ("delta", "text"), ("delta", "text"),
        ("close", "text"), ("open", "tool_call"), ("delta", "tool_call"),
        ("close", "tool_call")]
    assert [(b.kind, b.text, b.index) for b in blocks.blocks] == [
        ("reasoning", "I think so", 0), ("text", "Answer here", 1),
        ("tool_call", '{"a": 1}', 2)]
    assert (blocks.blocks[2].call_id, blocks.blocks[2].name) == ("call_1", "f")


# ---------------------------------------------------------------- errors and auth by path


def test_errors_and_auth_take_each_apis_shape():
    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/messages", ok, methods=["POST"]),
                            Route("/v1/responses", ok, methods=["POST"])])
    http = TestClient(AuthMiddleware(app, keys=["k"]))
    anthropic_401 = http.post("/v1/messages")
    assert anthropic_401.status_code == 401
    assert anthropic_401.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": anthropic_401.json()["error"]["message"]}}
    openai_401 = http.post("/v1/responses")
    assert openai_401.status_code == 401 and openai_401.json()["error"]["code"] == 401
    assert http.post("/v1/messages", headers={"x-api-key": "k"}).text == "ok"
    assert http.post("/v1/responses", headers={"Authorization": "Bearer k"}).text == "ok"
    assert http.post("/v1/messages/count_tokens").json()["type"] == "error"


# The ways postproc may cut a thinking-then-answer output into frames (issue 49: a Messages
# stream with thinking once carried no text_delta while the whole answer had the text).
THINK_THEN_ANSWER = {
    "apart": [frame(reasoning="Let me"), frame(reasoning=" think."), frame(text="Paris"),
              frame(text=" it is.", finish="stop")],
    "one frame turns": [frame(reasoning="Let me think."), frame(reasoning="", text="Paris"),
                        frame(text=" it is.", finish="stop")],
    "answer with the finish": [frame(reasoning="Let me think."),
                               frame(text="Paris it is.", finish="stop")],
    "all in one": [frame(reasoning="Let me think.", text="Paris it is.", finish="stop")],
    "answer only": [frame(text="Paris"), frame(text=" it is.", finish="length")],
}


async def _frames(frames):
    for f in frames:
        yield 0, f


def _streamed_blocks(body: bytes) -> list[tuple[str, str]]:
    """(type, text) per content block, read back from a Messages event stream."""
    blocks: dict[int, list[str]] = {}
    for event in body.decode().split("\n\n"):
        data = next((line[6:] for line in event.splitlines() if line.startswith("data: ")), "")
        if not data:
            continue
        ev = msgspec.json.decode(data)
        if ev["type"] == "content_block_start":
            blocks[ev["index"]] = [ev["content_block"]["type"], ""]
        elif ev["type"] == "content_block_delta":
            delta = ev["delta"]
            blocks[ev["index"]][1] += delta.get("text", delta.get("thinking", ""))
    return [tuple(blocks[i]) for i in sorted(blocks)]


@pytest.mark.parametrize("cut", THINK_THEN_ANSWER)
def test_a_messages_stream_carries_what_the_whole_answer_has(cut):
    request = messages(stream=True, messages=[{"role": "user", "content": "Capital?"}],
                       thinking={"type": "enabled", "budget_tokens": 1024})
    ctx = SimpleNamespace(model_name="m")
    frames = THINK_THEN_ANSWER[cut]

    async def both():
        whole = await gather(_frames(frames))
        streamed = b"".join([chunk async for chunk in anthropic_api._stream(
            ctx, request, "msg_1", 3, _frames(frames))])
        return whole, streamed

    whole, streamed = asyncio.run(both())
    expected = [(type(b).__struct_config__.tag or "", b.text if hasattr(b, "text")
                 else b.thinking) for b in (anthropic_api._content(b) for b in whole.blocks)]
    assert _streamed_blocks(streamed) == expected
    assert ("text", "Paris it is.") in expected  # the answer is there to be lost
