"""Anthropic-compatible `/v1/messages` end to end with the official `anthropic` client (req
R-2): text, streaming, stop_sequences, a tool_use / tool_result round trip, structured output,
thinking blocks from the reasoning parser, count_tokens and Anthropic-shaped errors, on a
server with the hermes tool-call parser and the qwen3 reasoning parser (`edge_url`)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # not a parameter of the newest client's create(): extra_body
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                                       "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(edge_url):
    return anthropic.Anthropic(base_url=edge_url, api_key="unused", max_retries=0)


def raw_events(edge_url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed request, as sent."""
    events, name = [], None
    with httpx.stream("POST", f"{edge_url}/v1/messages", json={**body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append((name, data))
    return events


def test_text_streamed_and_not(client, edge_url):
    m = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO,
                               system="You are a friendly assistant.", extra_body=GREEDY)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert (m.stop_reason, m.usage.output_tokens == 12) in (("max_tokens", True),
                                                             ("end_turn", False))
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    with client.messages.stream(model=MODEL, max_tokens=12, messages=HELLO,
                                system="You are a friendly assistant.",
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    assert final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.input_tokens == m.usage.input_tokens
    system_less = client.messages.count_tokens(model=MODEL, messages=HELLO)
    assert system_less.input_tokens != m.usage.input_tokens  # the system prompt took its place

    events = raw_events(edge_url, {"model": MODEL, "max_tokens": 5, "messages": HELLO,
                                   **GREEDY})
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert events[0][1]["message"]["usage"]["output_tokens"] == 0
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2][1]["usage"]["output_tokens"] == 5


def test_stop_sequences(client):
    free = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO,
                                  extra_body=GREEDY).content[0].text
    word = free.split()[2]
    m = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO,
                               stop_sequences=[word], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.content[0].text == free[:free.index(word)]


def test_tool_use_round_trip(client):
    ask = dict(model=MODEL, max_tokens=60, tools=[WEATHER],
               tool_choice={"type": "tool", "name": "get_weather"},
               messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    m = client.messages.create(**ask)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert isinstance(uses[0].input["city"], str) and uses[0].id

    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    assert len(streamed) == 1 and isinstance(streamed[0].input["city"], str)

    follow = [*ask["messages"], {"role": "assistant", "content": m.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                            "content": "Sunny, 21 C"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER],
                                    messages=follow)
    assert answer.content[0].type == "text" and answer.content[0].text
    count = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=follow)
    assert count.input_tokens == answer.usage.input_tokens


def test_structured_output(client):
    fmt = {"format": {"type": "json_schema", "schema": PERSON}}
    m = client.messages.create(model=MODEL, max_tokens=60, output_config=fmt,
                               messages=[{"role": "user", "content": "Invent a person."}])
    person = json.loads(m.content[0].text)
    assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120
    with client.messages.stream(model=MODEL, max_tokens=60, output_config=fmt,
                                messages=[{"role": "user", "content": "Invent a person."}]
                                ) as stream:
        assert set(json.loads("".join(stream.text_stream))) == {"name", "age"}


def test_thinking_blocks_from_the_reasoning_parser(client, edge_url):
    # A last assistant message is a prefill; this one opens `<think>`, so the answer is
    # thinking.
    messages = [{"role": "user", "content": "Is 91 a prime number?"},
                {"role": "assistant", "content": "<think>\nLet me check"}]
    m = client.messages.create(model=MODEL, max_tokens=30, messages=messages,
                               extra_body=GREEDY)
    assert m.content[0].type == "thinking" and m.content[0].thinking.strip()
    events = raw_events(edge_url, {"model": MODEL, "max_tokens": 30, "messages": messages,
                                   **GREEDY})
    assert events[1][1]["content_block"] == {"type": "thinking", "thinking": "",
                                             "signature": ""}
    thinking = "".join(d["delta"]["thinking"] for name, d in events
                       if name == "content_block_delta")
    assert thinking == m.content[0].thinking


def test_count_tokens_matches_the_prompt(client):
    count = client.messages.count_tokens(model=MODEL, messages=HELLO, system="Be brief.")
    m = client.messages.create(model=MODEL, max_tokens=1, messages=HELLO, system="Be brief.")
    assert count.input_tokens == m.usage.input_tokens


def test_errors_in_anthropic_shape(client, edge_url):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=HELLO)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=HELLO,
                               extra_body={"temprature": 0})
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "temprature" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    with pytest.raises(anthropic.NotFoundError) as err:  # batches: test_batches.py
        client.messages.batches.retrieve("msgbatch_unknown")
    assert err.value.body["error"]["type"] == "not_found_error"
    missing = httpx.get(f"{edge_url}/v1/messages/nothing/here", timeout=10)
    assert missing.status_code == 404 and missing.json()["type"] == "error"
