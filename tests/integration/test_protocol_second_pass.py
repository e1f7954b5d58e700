"""Protocol fidelity, second pass (issue 17): what peers' endpoint tests expect, through the
HTTP API with the official client, on the session's shared stacks."""

from __future__ import annotations

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def edge(edge_url):
    """The stack with the hermes tool-call parser."""
    return openai.OpenAI(base_url=f"{edge_url}/v1", api_key="unused", max_retries=0)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_an_empty_tools_array_is_refused(edge):
    """Item 5: OpenAI and vLLM reject `tools: []`; leaving tools out is the way to send none."""
    with pytest.raises(openai.BadRequestError, match="at least one tool") as refused:
        edge.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2, tools=[])
    assert refused.value.body["param"] == "tools"
    answer = edge.chat.completions.create(model=MODEL, messages=PARIS,
                                          max_tokens=2, tools=[TOOL])
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_responses_accepts_its_default_tool_choice_without_tools(edge):
    """Item 6: `tool_choice: "auto"` is the Responses API's default; sending it is always
    fine. "required" without tools still has nothing to call."""
    model = MODEL
    response = edge.responses.create(model=model, input="Hi", max_output_tokens=16,
                                     tool_choice="auto", store=False)
    assert response.status == "completed" or response.incomplete_details is not None
    response = edge.responses.create(model=model, input="Hi", max_output_tokens=16, tools=[],
                                     store=False)
    assert response.output
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        edge.responses.create(model=model, input="Hi", max_output_tokens=16,
                              tool_choice="required", store=False)


@pytest.mark.parametrize("body, field, hint", [
    ({"max_token": 5}, "max_token", "max_tokens"),
    ({"temprature": 0.5}, "temprature", "temperature"),
    ({"stream_options": {"include_usages": True}, "stream": True}, "include_usages",
     "include_usage"),
])
def test_unknown_fields_name_the_closest_known_one(client, body, field, hint):
    """Item 19: unknown fields stay a 400 (req P-1) and the message suggests a field."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=PARIS, extra_body=body)
    message = refused.value.body["message"]
    assert f"unknown field `{field}`" in message and f'did you mean "{hint}"?' in message


def test_unknown_fields_inside_messages_and_far_from_any_name(client):
    with pytest.raises(openai.BadRequestError, match='did you mean "content"') as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "contnet": "x"}])
    assert refused.value.body["param"] == "messages[0].contnet"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"zqxv_wy": 1})
    assert "did you mean" not in refused.value.body["message"]


def test_reasoning_sent_back_under_vllms_name_is_accepted(client):
    """Item 17: a client echoing an answer made with --reasoning-field reasoning sends the
    thinking back as `reasoning`; that is a message field, not an unknown one."""
    history = [*PARIS, {"role": "assistant", "content": "Paris.", "reasoning": "Easy."},
               {"role": "user", "content": "And Spain?"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=2)
    assert answer.choices[0].message.content
