"""`/v1/responses` end to end with the official `openai` client's `responses` API (req R-2):
created, streamed, stored, chained, with function tools, reasoning items and structured
output, on a server with the hermes tool-call parser and the qwen3 reasoning parser
(`edge_url` in conftest). The chat pipeline underneath is the same one /v1/chat/completions
uses, so greedy answers agree across the two."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                     "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
THINK = [{"role": "user", "content": "Is 91 a prime number?"},
         {"role": "assistant", "content": "<think>\nLet me check"}]


@pytest.fixture(scope="module")
def client(edge_url):
    return openai.OpenAI(base_url=f"{edge_url}/v1", api_key="unused", max_retries=0)


def events_of(client, **kwargs) -> list:
    return list(client.responses.create(stream=True, **kwargs))


def test_create_stream_and_chat_agree(client, edge_url):
    ask = dict(model=MODEL, input="Say hello.", max_output_tokens=12, temperature=0)
    # This stack runs bf16: a prompt prefilled whole and one whose leading pages come from
    # the prefix cache compute its last rows in different batches, which can tip a near tie
    # (seen on AMD Zen). One request first puts the pages in the cache, so the three
    # compared below all compute the same rows.
    client.responses.create(**{**ask, "max_output_tokens": 1})
    r = client.responses.create(**ask)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text
    assert r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    # The warm-up left the prompt's whole pages in the prefix cache; the usage says so.
    assert 0 < r.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
    chat = httpx.post(f"{edge_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
        "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == r.output_text
    assert chat["usage"]["prompt_tokens"] == r.usage.input_tokens

    events = events_of(client, **ask)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text
    final = events[-1].response
    assert final.output_text == r.output_text and final.id == events[0].response.id
    assert events[-2].item.status == final.output[-1].status == "incomplete"


def test_stored_responses_retrieve_delete_and_lru(client):
    first = client.responses.create(model=MODEL, input="One.", max_output_tokens=2)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    unstored = client.responses.create(model=MODEL, input="Two.", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # The server keeps 3: a fourth evicts the least recently used.
    ids = [client.responses.create(model=MODEL, input=f"N{i}.", max_output_tokens=2).id
           for i in range(3)]
    client.responses.retrieve(ids[0])  # now the most recently used
    client.responses.create(model=MODEL, input="N3.", max_output_tokens=2)
    client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="Name a color.", max_output_tokens=6,
                                    temperature=0, instructions="Answer briefly.")
    follow = dict(model=MODEL, previous_response_id=first.id, input="And another?")
    second = client.responses.create(max_output_tokens=4, temperature=0, **follow)
    assert second.previous_response_id == first.id
    # The follow-up's prompt holds the first turn and its answer (not its instructions).
    assert second.usage.input_tokens > first.usage.input_tokens
    count = client.responses.input_tokens.count(**follow)
    assert count.input_tokens == second.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, previous_response_id="resp_missing", input="x",
                                max_output_tokens=1)
    assert err.value.body["param"] == "previous_response_id"


def test_function_call_round_trip(client):
    ask = dict(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER],
               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    r = client.responses.create(**ask)
    assert r.status == "completed"
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)

    with client.responses.stream(**ask) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    assert types[-1] == "response.completed"
    streamed = [item for item in final.output if item.type == "function_call"]
    assert len(streamed) == 1 and json.loads(streamed[0].arguments)

    # The tool's result goes back as a function_call_output item, chained to the call.
    answer = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 21 C"}])
    assert answer.output_text and answer.output[0].type == "message"
    # The same conversation sent as items instead of chained gives the same prompt.
    items = [{"role": "user", "content": "What's the weather in Paris?"},
             {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
              "arguments": calls[0].arguments},
             {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": "Sunny, 21 C"}]
    count = client.responses.input_tokens.count(model=MODEL, input=items, tools=[WEATHER])
    assert count.input_tokens == answer.usage.input_tokens


def test_structured_output_follows_the_schema(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=MODEL, input="Invent a person.", text={"format": fmt},
                                max_output_tokens=60, temperature=0.7)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and 0 <= person["age"] <= 120
    events = events_of(client, model=MODEL, input="Invent a person.", text={"format": fmt},
                       max_output_tokens=60)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert set(json.loads(streamed)) == {"name", "age"}


def test_reasoning_items_from_the_reasoning_parser(client):
    # The prompt ends inside `<think>` (an assistant prefill, continued), so the answer is
    # thinking: a reasoning item, before any message.
    ask = dict(model=MODEL, input=THINK, max_output_tokens=30, temperature=0,
               extra_body={"continue_final_message": True})
    r = client.responses.create(**ask)
    assert r.output[0].type == "reasoning"
    thinking = r.output[0].content[0].text
    assert thinking.strip() and r.output_text == ""
    # Every output token is inside the thinking block the prompt opened: all reasoning.
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens
    events = events_of(client, **ask)
    streamed_usage = events[-1].response.usage  # (its prompt may be cached by now)
    assert (streamed_usage.output_tokens, streamed_usage.output_tokens_details) == (
        r.usage.output_tokens, r.usage.output_tokens_details)
    assert events[2].item.type == "reasoning"
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thinking
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[0].item.content[0].text == thinking


def test_errors_in_openai_shape(client, edge_url):
    def error(**body):
        response = httpx.post(f"{edge_url}/v1/responses", json=body, timeout=30)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert error(input="x", temprature=0)["param"] == "temprature"
    assert error(input="x", background=True, store=False)["param"] == "store"
    assert error(input="x", conversation="conv_x", previous_response_id="resp_x"
                 )["param"] == "conversation"
    # An image for a text-only model (tests/integration/test_multimodal.py serves a VLM).
    assert "takes no images" in error(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}])["message"]
    assert error(input=[{"role": "user", "content": [
        {"type": "input_file", "file_id": "f"}]}])["param"] == "input[0].content"
    assert error(input="x", tools=[{"type": "web_search"}])["param"] == "tools[0].type"
    assert error(input="x", tool_choice="required")["param"] == "tool_choice"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
