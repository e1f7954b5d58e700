"""Protocol fidelity, second pass (issue 17): what peers' endpoint tests expect, through the
HTTP API with the official client, on the session's shared stacks."""

from __future__ import annotations

import json

import httpx
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


FRANCE = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: ..."


def _greedy(client, **extra):
    return client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=6, temperature=0,
                                     extra_body=extra)


def test_bad_words_are_never_generated(client):
    """Item 17: vLLM's bad_words, at the start of the text or after a space."""
    assert "Paris" in _greedy(client).choices[0].text
    text = _greedy(client, bad_words=["Paris"]).choices[0].text
    assert "Paris" not in text and text


def test_allowed_token_ids_and_tokens_as_ids(client, base_url):
    """Item 17: only allowed ids come out; return_tokens_as_token_ids names tokens by id."""
    ids = httpx.post(f"{base_url}/tokenize", json={"prompt": " Rome. Rome"}).json()["tokens"]
    allowed = sorted(set(ids))
    answer = client.completions.create(
        model=MODEL, prompt=FRANCE, max_tokens=5, temperature=0, logprobs=2,
        extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True})
    tokens = answer.choices[0].logprobs.tokens
    assert len(tokens) == 5 and all(t.startswith("token_id:") for t in tokens)
    assert {int(t.split(":")[1]) for t in tokens} <= set(allowed)
    for top in answer.choices[0].logprobs.top_logprobs:
        assert all(k.startswith("token_id:") for k in top)
    chat = client.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=2, logprobs=True, top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True})
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)


@pytest.mark.parametrize("extra, field", [
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),  # vLLM refuses it too
    ({"bad_words": ["x"] * 129}, "bad_words"),
    ({"bad_words": ["x" * 257]}, "bad_words"),
    ({"bad_words": ["a " * 100]}, "bad_words"),  # about 100 tokens: over 64
    ({"best_of": 2, "n": 1, "temperature": 0}, "best_of"),
])
def test_request_extras_out_of_bounds_are_a_400(client, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
    assert refused.value.body["param"] == field


def test_completion_top_logprobs_always_hold_the_sampled_token(client):
    """Item 2: with logprobs 0 each top_logprobs entry is the sampled token alone (OpenAI's
    legacy API and vLLM), not {}; with logprobs 1 at temperature 1 the sampled token is
    there even when it was not the most likely."""
    zero = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4, logprobs=0,
                                     temperature=0).choices[0].logprobs
    assert [list(top) for top in zero.top_logprobs] == [[t] for t in zero.tokens]
    assert [top[t] for top, t in zip(zero.top_logprobs, zero.tokens, strict=True)] == \
        zero.token_logprobs
    sampled = client.completions.create(model=MODEL, prompt="Once upon a", max_tokens=16,
                                        logprobs=1, temperature=1.5, seed=7
                                        ).choices[0].logprobs
    assert all(t in top and len(top) in (1, 2)
               for t, top in zip(sampled.tokens, sampled.top_logprobs, strict=True))


def test_continuous_usage_needs_include_usage(base_url):
    """Item 3: vLLM's continuous_usage_stats applies only with include_usage, which defaults
    to true once stream_options is sent: alone it gives usage on every chunk, and
    include_usage false turns it off."""
    def chunks(options):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True,
                "stream_options": options}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
            return [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: {")]

    off = chunks({"continuous_usage_stats": True, "include_usage": False})
    assert off and all(c.get("usage") is None for c in off)
    alone = chunks({"continuous_usage_stats": True})
    assert all(c.get("usage") for c in alone)
    both = chunks({"continuous_usage_stats": True, "include_usage": True})
    assert all(c.get("usage") for c in both)


def test_tokenize_returns_token_strings_on_request(base_url):
    """Item 4: vLLM's return_token_strs gives token_strs, the vocabulary's spelling of each."""
    plain = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hello Paris"}).json()
    assert plain["token_strs"] is None and plain["count"] == len(plain["tokens"])
    asked = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hello Paris",
                                                     "return_token_strs": True}).json()
    assert asked["tokens"] == plain["tokens"] and len(asked["token_strs"]) == asked["count"]
    assert asked["token_strs"][-1] == "ĠParis"
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": PARIS,
                                                    "return_token_strs": True}).json()
    assert "<|im_start|>" in chat["token_strs"]
    refused = httpx.post(f"{base_url}/tokenize", json={"prompt": "x", "return_token_strs": 3})
    assert refused.status_code == 400


def test_echo_of_a_truncated_prompt_is_what_was_sent(client):
    """Item 9: echo with truncate_prompt_tokens echoes the ids actually sent, agreeing with
    the echoed logprobs, not the prompt as written."""
    answer = client.completions.create(
        model=MODEL, prompt=FRANCE, max_tokens=2, temperature=0, echo=True, logprobs=0,
        extra_body={"truncate_prompt_tokens": 3}).choices[0]
    assert answer.logprobs.tokens[:3] == [" of", " France", " is"]
    assert answer.text.startswith(" of France is") and not answer.text.startswith("The")
    assert "".join(answer.logprobs.tokens) == answer.text
    whole = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=2,
                                      temperature=0, echo=True).choices[0]
    assert whole.text.startswith(FRANCE)


def test_token_ids_pass_through_a_multi_turn_chat(client):
    """Item 16: chat with prompt_token_ids and no messages; return_token_ids gives the
    prompt's and the answer's ids, so the next turn can be sent as ids alone."""
    first = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=4,
                                           temperature=0,
                                           extra_body={"return_token_ids": True})
    prompt_ids, answer_ids = first.prompt_token_ids, first.choices[0].token_ids
    assert prompt_ids and len(answer_ids) == first.usage.completion_tokens
    again = client.chat.completions.create(
        model=MODEL, messages=[], max_tokens=4, temperature=0,
        extra_body={"prompt_token_ids": prompt_ids, "return_token_ids": True})
    assert again.choices[0].token_ids == answer_ids  # the same prompt, greedy: the same ids
    assert again.choices[0].message.content == first.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=1)
    assert plain.prompt_token_ids is None  # present and null, as vLLM, unless asked for
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)


def test_completions_return_token_ids_per_prompt(client):
    answer = client.completions.create(model=MODEL, prompt=["Hi", FRANCE], max_tokens=3,
                                       temperature=0, extra_body={"return_token_ids": True})
    texts = {c.index: c for c in answer.choices}
    assert len(texts[0].prompt_token_ids) < len(texts[1].prompt_token_ids)
    assert all(len(c.token_ids) == 3 for c in answer.choices)


def test_strict_tools_with_a_response_format_are_refused(edge):
    """Item 11: the strict-tool grammar and a response_format both hold the whole answer;
    the server says so instead of dropping one."""
    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    with pytest.raises(openai.BadRequestError, match="strict tools") as refused:
        edge.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2, tools=[strict],
                                     response_format={"type": "json_object"})
    assert refused.value.body["param"] == "response_format"


def test_thinking_token_budget_closes_thinking(edge, client):
    """Item 17: vLLM's thinking_token_budget. The prompt opens thinking (a continued
    assistant turn that starts with <think>); after 3 thinking tokens the engine writes
    </think> and the rest is the answer."""
    messages = [*PARIS, {"role": "assistant", "content": "<think>\n"}]
    body = {"add_generation_prompt": False, "continue_final_message": True,
            "thinking_token_budget": 3}
    answer = edge.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                          temperature=0, extra_body=body)
    reasoning = answer.choices[0].message.model_extra["reasoning_content"]
    unbounded = edge.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0,
        extra_body={k: v for k, v in body.items() if k != "thinking_token_budget"})
    assert reasoning and len(reasoning) < len(
        unbounded.choices[0].message.model_extra.get("reasoning_content") or "x" * 1000)
    assert answer.usage.completion_tokens > 3
    with pytest.raises(openai.BadRequestError, match="reasoning parser"):
        client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2,
                                       extra_body={"thinking_token_budget": 3})
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        edge.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2,
                                     extra_body={"thinking_token_budget": -1})


def test_prompt_logprobs_in_vllms_shape(client):
    """Item 17: vLLM's prompt_logprobs: null for the first prompt token, then the token
    itself (its logprob and rank) and the n most likely alternatives."""
    answer = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=1,
                                       extra_body={"prompt_logprobs": 2,
                                                   "return_token_ids": True})
    choice = answer.choices[0]
    ids, positions = choice.prompt_token_ids, choice.prompt_logprobs
    assert len(positions) == len(ids) and positions[0] is None
    for token_id, position in zip(ids[1:], positions[1:], strict=True):
        own = position[str(token_id)]
        assert own["rank"] >= 1 and own["decoded_token"]
        ranked = sorted(position.values(), key=lambda p: p["rank"])
        assert 2 <= len(position) <= 3 and [p["rank"] for p in ranked][:2] == [1, 2]
        assert ranked[0]["logprob"] >= own["logprob"]
        # Rank 1 is the likeliest: the token's own rank agrees with the alternatives.
        assert (own["rank"] == 1) == (own["logprob"] >= ranked[0]["logprob"])
        assert own["rank"] > 2 or own in ranked[:2]
    assert choice.logprobs is None  # the answer's own logprobs were not asked for
    chat = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None
    assert all(len(p) == 1 and next(iter(p.values()))["rank"] >= 1
               for p in chat.prompt_logprobs[1:])
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                {"prompt_logprobs": 1, "stream": True}):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                      extra_body=bad)


def test_echo_logprobs_keep_their_count_beside_prompt_logprobs(client):
    answer = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=2, echo=True,
                                       logprobs=1, temperature=0,
                                       extra_body={"prompt_logprobs": 3}).choices[0]
    assert all(top is None or len(top) <= 2 for top in answer.logprobs.top_logprobs)
    assert all(p is None or len(p) >= 3 for p in answer.prompt_logprobs)


def test_required_tool_call_after_a_prefilled_think(edge):
    """Item 10: the prompt leaves the output inside <think> (a continued assistant turn);
    tool_choice required must let thinking close first, so the call reaches tool_calls
    instead of being filed as thinking. The thinking budget keeps the section short."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "<think>\n"}]
    answer = edge.chat.completions.create(
        model=MODEL, messages=messages, tools=[TOOL], tool_choice="required", max_tokens=120,
        temperature=0, extra_body={"add_generation_prompt": False,
                                   "continue_final_message": True,
                                   "thinking_token_budget": 4})
    message = answer.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(message.tool_calls[0].function.arguments), dict)
    assert message.model_extra["reasoning_content"]


@pytest.mark.parametrize("content_type, status", [
    ("application/x-www-form-urlencoded", 415), ("text/plain", 415),
    ("multipart/form-data; boundary=x", 415), ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200), ("application/vnd.api+json", 200), (None, 200)])
def test_a_body_must_be_sent_as_json(base_url, content_type, status):
    """As vLLM: a JSON body labelled as another media type (curl -d without -H) is a 415
    with the usual error shape, on every JSON route; no Content-Type reads as JSON."""
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(f"{base_url}/v1/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    if status == 415:
        error = r.json()["error"]
        assert error["code"] == 415 and error["type"] == "invalid_request_error"
        assert "application/json" in error["message"]
        chat = httpx.post(f"{base_url}/v1/chat/completions", content=b"{}", headers=headers)
        tokenize = httpx.post(f"{base_url}/tokenize", content=b"{}", headers=headers)
        assert chat.status_code == tokenize.status_code == 415


def test_a_custom_role_is_rendered_by_the_template(client):
    """As vLLM: a role beyond OpenAI's is passed to the chat template, which writes it; the
    same text as a string or as a text part gives the same greedy answer."""
    answers = [client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0,
        messages=[{"role": "my-custom-role", "content": content}]).choices[0].message.content
        for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])]
    assert answers[0] and answers[0] == answers[1]



def test_the_template_writes_a_custom_role(base_url):
    ids = httpx.post(f"{base_url}/tokenize", timeout=30, json={
        "messages": [{"role": "my-custom-role", "content": "hi"}]}).json()["tokens"]
    text = httpx.post(f"{base_url}/detokenize", json={"tokens": ids}, timeout=30).json()
    assert "<|im_start|>my-custom-role\nhi<|im_end|>" in text["prompt"]


@pytest.mark.parametrize("role, ok", [("r" * 64, True), ("r" * 65, False), ("", False),
                                      ("two\nlines", False), ("tab\there", False)])
def test_a_role_is_a_short_printable_name(base_url, role, ok):
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": role, "content": "hi"}]}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == (200 if ok else 400), r.text
    if not ok:
        assert r.json()["error"]["param"] == "messages[0].role"
    for bad in (123, None, ["user"], {"a": 1}):
        r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                       json={**body, "messages": [{"role": bad, "content": "hi"}]})
        assert r.status_code == 400 and "role" in r.json()["error"]["message"]


SAYING = [{"role": "user", "content": "tell me a common saying"},
          {"role": "assistant", "content": "An apple a day, keeps"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_chat_echo_puts_the_continued_message_first(client):
    """vLLM's chat echo (its test_chat_echo): the continued assistant text comes before the
    answer, whole and streamed; with a generation prompt there is nothing to continue."""
    def ask(echo, **extra):
        return client.chat.completions.create(model=MODEL, messages=SAYING, max_tokens=6,
                                              temperature=0,
                                              extra_body={**CONTINUE, "echo": echo}, **extra)

    plain, echoed = ask(False).choices[0].message, ask(True).choices[0].message
    assert echoed.content == "An apple a day, keeps" + plain.content
    chunks = list(ask(True, stream=True, n=2))
    echo_chunks = [c for c in chunks[2:4]]
    assert {c.choices[0].index for c in echo_chunks} == {0, 1}
    assert all(c.choices[0].delta.content == "An apple a day, keeps" for c in echo_chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices and c.choices[0].index == 0)
    assert streamed == echoed.content
    fresh = client.chat.completions.create(model=MODEL, messages=SAYING[:1], max_tokens=4,
                                           temperature=0, extra_body={"echo": True})
    again = client.chat.completions.create(model=MODEL, messages=SAYING[:1], max_tokens=4,
                                           temperature=0)
    assert fresh.choices[0].message.content == again.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.chat.completions.create(model=MODEL, messages=SAYING, max_tokens=1,
                                       extra_body={**CONTINUE, "echo": "yes"})
