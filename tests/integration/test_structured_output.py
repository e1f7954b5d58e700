"""Structured outputs and forced tool calls through real processes on the default model
(req P-6, P-8, O-4, C-1, C-3): every output must fit its constraint, every time."""

import concurrent.futures
import json
import math
import re

import httpx
import jsonschema
import pytest

# Strings, arrays and decimals are bounded: a grammar cannot make a small model stop talking,
# and an unbounded one may run to max_tokens (finish "length", JSON cut short).
S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100,
                                                "multipleOf": 0.01}}, "required": ["price"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                         "nick": S}, "required": ["id", "nick"]}},
     "required": ["user"]},
    {"type": "object", "properties": {"a": S, "b": {"type": "integer", "minimum": -5,
                                                    "maximum": 5}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
     "maxItems": 4},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}}, "required": ["points"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"enum": [200, 404]}},
     "required": ["status", "code"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0,
                                                           "maximum": 50}, {"type": "null"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1900,
                                                           "maximum": 2030}},
     "required": ["title", "year"], "additionalProperties": False},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "object", "properties": {"email": {"type": "string",
                                                "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0,
                                                  "maximum": 3}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1.5,
                                                "maximum": 1.5, "multipleOf": 0.25}},
     "required": ["score"]},
    {"type": "object", "properties": {"first": S, "middle": S, "last": S},
     "required": ["first", "last"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                           "maximum": 9}},
        "required": ["sku", "qty"]}}, "total": {"type": "integer", "minimum": 0,
                                                "maximum": 99}},
     "required": ["items", "total"]},
    {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]},
                                      "notes": {"type": "array", "items": S, "maxItems": 2}},
     "required": ["level"]},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "count": {
        "type": "integer", "minimum": 0, "maximum": 10}, "label": S},
     "required": ["flag", "count", "label"]},
    {"type": "object", "properties": {"geo": {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.5},
        "lon": {"type": "number", "minimum": -180, "maximum": 180,
                "multipleOf": 0.5}}, "required": ["lat", "lon"]},
        "city": S}, "required": ["geo", "city"]},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": S, "unit": {
        "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": S}, "required": ["zone"],
                   "additionalProperties": False}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def url(shared_engine, tmp_path_factory):
    """A frontend with the hermes tool-call parser over the session's engine (a frontend
    flag: no model of its own to load)."""
    front = shared_engine.frontend(str(tmp_path_factory.mktemp("structured")), "structured",
                                   "--tool-call-parser", "hermes")
    yield front.base_url
    front.stop()


def chat(url: str, content: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 120,
            "temperature": 0.7, "seed": 1, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def answer(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def stream(url: str, content: str, **extra) -> list[dict]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 120,
            "temperature": 0.7, "seed": 2, "stream": True, **extra}
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# ---------------------------------------------------------------- JSON


def closed(schema):
    """Objects without additionalProperties: false let a small model invent keys until it runs
    out of tokens; OpenAI's strict mode closes them too."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


@pytest.mark.slow
def test_every_schema_is_followed(url):
    def ask(i: int) -> tuple[dict, dict]:
        schema = closed(SCHEMAS[i])
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        return SCHEMAS[i], answer(chat(url, "Give me an example as JSON.", seed=i,
                                       response_format=fmt))

    assert len(SCHEMAS) >= 20
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(len(SCHEMAS))))
    for schema, choice in results:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.slow
def test_streamed_json_follows_its_schema(url):
    schema = SCHEMAS[9]
    chunks = stream(url, "Some points, as JSON.", structured_outputs={"json": schema})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_json_object_parses(url):
    # Any object: nothing bounds its strings, so the prompt asks for a short one.
    ask = 'Answer in JSON like {"answer": 5}. What is 2 + 2?'
    for extra in ({"response_format": {"type": "json_object"}},
                  {"structured_outputs": {"json_object": True}}):
        choice = answer(chat(url, ask, temperature=0, max_tokens=200, **extra))
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_completions_take_response_format_too(url):
    """vLLM's completions accept chat's response_format: json_object and a json_schema
    constrain the text; a json_schema without its schema, or an unknown type, is a 400."""
    def complete(fmt, **extra):
        body = {"prompt": 'A JSON object like {"a": 1}:', "max_tokens": 60, "temperature": 0,
                "response_format": fmt, **extra}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    text = complete({"type": "json_object"}).json()["choices"][0]["text"]
    assert isinstance(json.loads(text), dict)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = complete({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert isinstance(json.loads(r.json()["choices"][0]["text"])["a"], int)
    assert complete({"type": "text"}).status_code == 200
    for bad, words in (({"type": "json_schema"}, "needs a json_schema"),
                       ({"type": "sound"}, "response_format.type")):
        r = complete(bad)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = complete({"type": "json_object"}, guided_regex="a+")
    assert r.status_code == 400 and "guided_regex" in r.json()["error"]["message"]


# ---------------------------------------------------------------- regex, choice, grammar


def test_regex_choice_and_grammar_outputs_match(url):
    choice = answer(chat(url, "Phone number?", guided_regex="[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", choice["message"]["content"])
    options = ["positive", "negative", "neutral"]
    choice = answer(chat(url, "Sentiment of: I love it", structured_outputs={"choice": options}))
    assert choice["message"]["content"] in options and choice["finish_reason"] == "stop"
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/'
    choice = answer(chat(url, "What is 6 times 7?", guided_grammar=grammar))
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", choice["message"]["content"])
    body = {"prompt": "The capital of France is", "max_tokens": 8,
            "structured_outputs": {"regex": " [A-Z][a-z]{2,9}"}}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert re.fullmatch(r" [A-Z][a-z]{2,9}", r.json()["choices"][0]["text"])


def test_streamed_choice(url):
    chunks = stream(url, "Yes or no?", guided_choice=["yes", "no"])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text in ("yes", "no")


@pytest.mark.parametrize("extra, quoted", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "objekt"),
    ({"guided_regex": "([a-z]"}, "unclosed group"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "missing_rule"),
    ({"guided_json": "{not json"}, "not valid JSON"),
])
def test_invalid_constraints_are_400s_quoting_the_problem(url, extra, quoted):
    r = chat(url, "hi", **extra)
    assert r.status_code == 400, r.text
    assert quoted in r.json()["error"]["message"]


def test_logprobs_under_a_grammar_have_no_mass_outside_it(url):
    options = ["apple", "banana", "cherry"]
    choice = answer(chat(url, "A fruit?", guided_choice=options, logprobs=True, top_logprobs=5))
    so_far = ""
    for entry in choice["logprobs"]["content"]:
        # Forbidden tokens are reported at -9999.0, as vLLM does (JSON has no -inf).
        assert all(t["logprob"] is not None for t in entry["top_logprobs"]), entry
        live = [t for t in entry["top_logprobs"] if t["logprob"] > -9999.0]
        assert live, entry
        assert math.fsum(math.exp(t["logprob"]) for t in live) <= 1.0 + 1e-3
        for t in live:
            if t["token"] == "<|im_end|>":  # EOS: allowed once the answer is complete
                assert so_far in options
                continue
            assert any(o.startswith(so_far + t["token"]) for o in options), (so_far, t)
        if entry["token"] != "<|im_end|>":
            so_far += entry["token"]
    assert so_far in options


# ---------------------------------------------------------------- tools (C-1, C-3)


def calls_of(message: dict) -> list[tuple[str, dict]]:
    assert message.get("tool_calls"), message
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]]


def streamed_calls(chunks: list[dict]) -> list[tuple[str, dict]]:
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for call in choice["delta"].get("tool_calls") or ():
                i = call["index"]
                if call.get("function", {}).get("name"):
                    names[i] = call["function"]["name"]
                args[i] = args.get(i, "") + (call.get("function", {}).get("arguments") or "")
    assert names, chunks
    return [(names[i], json.loads(args[i])) for i in sorted(names)]


def assert_valid(calls: list[tuple[str, dict]], only: str | None = None) -> None:
    assert calls
    for name, arguments in calls:
        assert name in SCHEMA_OF and (only is None or name == only)
        jsonschema.validate(arguments, SCHEMA_OF[name])


@pytest.mark.slow
def test_tool_choice_required_returns_valid_calls(url):
    ask = "What's the weather in Paris?"
    choice = answer(chat(url, ask, tools=[WEATHER, TIME], tool_choice="required",
                         parallel_tool_calls=False))
    assert choice["finish_reason"] == "tool_calls"
    calls = calls_of(choice["message"])
    assert len(calls) == 1
    assert_valid(calls)
    # Parallel calls allowed: a small model may keep calling until max_tokens; every call
    # that came back is still valid.
    assert_valid(streamed_calls(stream(url, ask, tools=[WEATHER, TIME], tool_choice="required")))


@pytest.mark.slow
def test_named_tool_choice_returns_that_function(url):
    named = {"type": "function", "function": {"name": "get_time"}}
    ask = "What's the weather in Paris?"  # the model would pick the other tool by itself
    choice = answer(chat(url, ask, tools=[WEATHER, TIME], tool_choice=named))
    assert_valid(calls_of(choice["message"]), only="get_time")
    assert not choice["message"].get("content")
    assert_valid(streamed_calls(stream(url, ask, tools=[WEATHER, TIME], tool_choice=named)),
                 only="get_time")


def test_tool_conflicts_are_400s(url):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(url, "hi", tools=[WEATHER], tool_choice=named)
    assert r.status_code == 400 and "not among" in r.json()["error"]["message"]
    r = chat(url, "hi", tools=[WEATHER], tool_choice="required",
             response_format={"type": "json_object"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


@pytest.mark.slow
def test_a_tool_round_trip_with_the_official_client(url):
    """The OpenAI tool loop end to end: a forced call comes back as tool_calls, the client
    sends it back (assistant content null) with the tool's result, and the model answers in
    plain content with tool_choice none."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80, temperature=0)
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and first.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF["get_weather"])
    messages += [
        first.choices[0].message.model_dump(exclude_none=False, include={"role", "content",
                                                                        "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    assert messages[1]["content"] is None  # as the client sends it back
    final = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER], tool_choice="none",
        max_tokens=20, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
