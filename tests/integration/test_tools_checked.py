"""Issue 40, through the real server: a malformed tool is a 400 naming its field in chat,
Responses and Messages alike, and a forced call is made whatever reasoning parser is set.

The shapes run on the shared `edge_url` stack (hermes tool-call parser, qwen3 reasoning
parser); the forced calls also on a stack of this module with the deepseek_r1 reasoning
parser, whose output starts inside thinking unless told otherwise. The default model never
opens a thinking section itself, and before the fix it wrote free text until max_tokens. A
hypothesis property sends arbitrary JSON as `tools` and `tool_choice` to the three APIs:
never a 5xx, and the stack stays healthy.
"""

from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_checks import answer_problem
from tests.servers import metrics

pytestmark = pytest.mark.slow  # a stack of its own and forced calls on the default model

MODEL = "SmolLM2-135M-Instruct"
CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


def post(url: str, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def refusal(url: str, path: str, body: dict) -> str:
    """The field a 400 names: OpenAI's `param`; Anthropic's shape has none, so the message."""
    r = post(url, path, body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    return error["message"] if path == MESSAGES else error["param"]


# ---------------------------------------------------------------- shapes (chat)


def fn(**fields) -> dict:
    return {"type": "function", "function": {"name": "f", **fields}}


CHAT_SHAPES = [
    ([{"type": "function", "function": {"name": 5}}], "tools[0].function.name"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": "x"}], "tools[0].function"),
    ([fn(parameters=5)], "tools[0].function.parameters"),
    ([fn(parameters=[])], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "n" * 65}}], "tools[0].function.name"),
    ([fn(), fn()], "tools[1].function.name"),
    ([{"type": "nope", "function": {"name": "f"}}], "tools[0].type"),
    ([fn(description=3)], "tools[0].function.description"),
    ([fn(strict="yes")], "tools[0].function.strict"),
    ([fn(paramters={})], "tools[0].function.paramters"),  # a typo is not dropped
    (["f"], "tools[0]"),
    ({"f": {}}, "tools"),
]


@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("tools, field", CHAT_SHAPES)
def test_a_malformed_chat_tool_is_a_400_naming_its_field(edge_url, tools, field, choice):
    body = {"messages": ASK, "max_tokens": 2, "tools": tools, "tool_choice": choice}
    assert refusal(edge_url, CHAT, body) == field


@pytest.mark.parametrize("choice, field", [
    ("sometimes", "tool_choice"),
    (5, "tool_choice"),
    ({"type": "function", "function": {"name": 5}}, "tool_choice.function.name"),
    ({"type": "function"}, "tool_choice.function"),
    ({"type": "function", "function": {"name": "get_time"}}, "tool_choice.function.name"),
    ({"type": "custom", "function": {"name": "get_weather"}}, "tool_choice.type"),
])
def test_a_malformed_chat_tool_choice_is_a_400_naming_its_field(edge_url, choice, field):
    body = {"messages": ASK, "max_tokens": 2, "tools": [WEATHER], "tool_choice": choice}
    assert refusal(edge_url, CHAT, body) == field


def test_names_are_vllms_any_characters_up_to_64(edge_url):
    """OpenAI limits names to a-z A-Z 0-9 _ -; vLLM does not (bridges send dotted names)."""
    name = "mcp.weather/" + "x" * 52
    body = {"messages": ASK, "max_tokens": 1, "tools": [fn(), {**WEATHER, "function": {
        "name": name}}], "tool_choice": {"type": "function", "function": {"name": name}}}
    r = post(edge_url, CHAT, body)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- shapes (Responses, Messages)


@pytest.mark.parametrize("tools, field", [
    ([{"type": "function", "name": 5}], "tools[0].name"),
    ([{"type": "function", "name": ""}], "tools[0].name"),
    ([{"type": "function", "name": "n" * 65}], "tools[0].name"),
    ([{"type": "function"}], "tools[0].name"),
    ([{"type": "function", "name": "f", "parameters": 5}], "tools[0].parameters"),
    ([{"type": "function", "name": "f", "description": 3}], "tools[0].description"),
    ([{"type": "function", "name": "f"}, {"type": "function", "name": "f"}], "tools[1].name"),
    ([{"type": "nope", "name": "f"}], "tools[0].type"),
])
def test_a_malformed_responses_tool_is_a_400_naming_its_field(edge_url, tools, field):
    body = {"input": "Hi", "max_output_tokens": 2, "tools": tools, "tool_choice": "required"}
    assert refusal(edge_url, RESPONSES, body) == field


@pytest.mark.parametrize("tools, field", [
    ([{"name": 5}], "tools[0].name"),
    ([{"name": ""}], "tools[0].name"),
    ([{"name": "n" * 65}], "tools[0].name"),
    ([{"description": "no name"}], "tools[0]"),
    ([{"name": "f", "input_schema": 5}], "tools[0].input_schema"),
    ([{"name": "f", "description": 3}], "tools[0].description"),
    ([{"name": "f"}, {"name": "f"}], "tools[1].name"),
    ([{"name": "f", "type": "web_search_20250305"}], "tools[0].type"),
])
def test_a_malformed_messages_tool_is_a_400_naming_its_field(edge_url, tools, field):
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK, "tools": tools,
            "tool_choice": {"type": "any"}}
    assert field in refusal(edge_url, MESSAGES, body)


# ---------------------------------------------------------------- forced calls are made


@pytest.fixture(scope="module")
def deepseek_url(shared_engine, tmp_path_factory):
    """deepseek_r1 reads a silent prompt's output as thinking; requests may bring their own
    chat template (one that opens thinking). Frontend flags only: a frontend over the
    session's engine."""
    s = shared_engine.frontend(str(tmp_path_factory.mktemp("deepseek")), "deepseek",
                               "--tool-call-parser", "hermes", "--reasoning-parser",
                               "deepseek_r1", "--trust-request-chat-template")
    yield s.base_url
    s.stop()


@pytest.fixture(params=["qwen3", "deepseek_r1"])
def reasoning(request) -> tuple[str, str]:
    """(reasoning parser, base url of a stack that runs it)."""
    fixture = "edge_url" if request.param == "qwen3" else "deepseek_url"
    return request.param, request.getfixturevalue(fixture)


# Each forced request asks for exactly one call, so the grammar ends the output after it.
FORCED = [
    (CHAT, {"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False}),
    (CHAT, {"messages": ASK, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    (RESPONSES, {"input": ASK, "tools": [{"type": "function", "name": "get_weather",
                                          "parameters": CITY}],
                 "tool_choice": "required", "parallel_tool_calls": False}),
    (MESSAGES, {"model": MODEL, "messages": ASK,
                "tools": [{"name": "get_weather", "input_schema": CITY}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}),
    (MESSAGES, {"model": MODEL, "messages": ASK,
                "tools": [{"name": "get_weather", "input_schema": CITY}],
                "tool_choice": {"type": "tool", "name": "get_weather"}}),
]


def calls_of(path: str, answer: dict) -> tuple[list[str], str]:
    """(called function names, why the answer ended) in each API's shape."""
    if path == CHAT:
        choice = answer["choices"][0]
        return ([c["function"]["name"] for c in choice["message"].get("tool_calls") or ()],
                choice["finish_reason"])
    if path == RESPONSES:
        return ([o["name"] for o in answer["output"] if o["type"] == "function_call"],
                answer["status"])
    return ([b["name"] for b in answer["content"] if b["type"] == "tool_use"],
            answer["stop_reason"])


@pytest.mark.parametrize("path, body", FORCED, ids=["chat-required", "chat-named",
                                                    "responses-required", "messages-any",
                                                    "messages-tool"])
def test_a_forced_call_is_made_whatever_the_reasoning_parser(reasoning, path, body):
    """Issue 40: with qwen3 the answer was free text in content until max_tokens, with
    deepseek_r1 free text in reasoning: no call either way."""
    _, url = reasoning
    limit = {"max_output_tokens": 48} if path == RESPONSES else {"max_tokens": 48}
    r = post(url, path, {**body, **limit, "temperature": 0})
    assert r.status_code == 200, r.text
    assert calls_of(path, r.json()) == (["get_weather"], {
        CHAT: "tool_calls", RESPONSES: "completed", MESSAGES: "tool_use"}[path]), r.text


OPENS_THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}<|im_start|>assistant\n<think>\n")


def test_when_the_prompt_opened_thinking_it_closes_then_the_call_is_made(reasoning):
    """The thinking section the prompt opened must close before the call (a call inside it
    would be thinking); thinking_token_budget bounds it, as the default model would not
    close it itself. deepseek_r1's stack runs a template that opens it; on qwen3's the
    prompt opens it with a prefilled assistant turn."""
    name, url = reasoning
    opened = ({"chat_template": OPENS_THINKING} if name == "deepseek_r1" else
              {"messages": [*ASK, {"role": "assistant", "content": "<think>\n"}],
               "continue_final_message": True, "add_generation_prompt": False})
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 56, "temperature": 0,
            "thinking_token_budget": 4, **opened}
    r = post(url, CHAT, body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"], message
    assert calls_of(CHAT, r.json()) == (["get_weather"], "tool_calls"), message


# ---------------------------------------------------------------- arbitrary JSON


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=6,
)
# Mostly well-formed, so that most requests get past the decoder to the checks, the
# grammars and the template; one field in four of any JSON value, and now and then
# `tools` or `tool_choice` as a whole.
valid_names = st.sampled_from(["f", "g", "a.b", "x" * 64])
schemas = st.fixed_dictionaries(
    {"type": st.sampled_from(["object", "string", "integer", "array"]) | json_values},
    optional={"properties": st.dictionaries(st.sampled_from(["a", "b"]), json_values,
                                            max_size=2),
              "required": json_values, "additionalProperties": json_values},
)


@st.composite
def functions(draw) -> dict:
    function = {"name": draw(valid_names)}
    for field, values in (("description", st.text(max_size=8)), ("parameters", schemas),
                          ("strict", st.booleans())):
        if draw(st.booleans()):
            function[field] = draw(values)
    if draw(st.integers(0, 3)) == 0:
        field = draw(st.sampled_from(["name", "description", "parameters", "strict"]))
        function[field] = draw(json_values | st.sampled_from(["", "x" * 65]))
    return function


@st.composite
def tool_requests(draw) -> tuple[str, dict]:
    """One API, with tool-ish `tools` (each API's spelling of functions) or any JSON."""
    path = draw(st.sampled_from([CHAT, RESPONSES, MESSAGES]))
    spelled = {
        CHAT: lambda f: {"type": "function", "function": f},
        RESPONSES: lambda f: {"type": "function", **f},
        MESSAGES: lambda f: {k if k != "parameters" else "input_schema": v
                             for k, v in f.items() if k != "strict"},
    }[path]
    tool_lists = st.lists(functions().map(spelled), min_size=1, max_size=3)
    tools = draw(st.one_of(tool_lists, tool_lists, tool_lists, json_values))
    kind = draw(st.sampled_from(["keyword", "named", "any JSON"]))
    if kind == "keyword":  # each API's keywords, the others' too
        word = draw(st.sampled_from(["none", "auto", "required", "any", "tool"]))
        choice = {"type": word} if path == MESSAGES else word
    elif kind == "named":
        name = draw(valid_names)
        choice = {CHAT: {"type": "function", "function": {"name": name}},
                  RESPONSES: {"type": "function", "name": name},
                  MESSAGES: {"type": "tool", "name": name}}[path]
    else:
        choice = draw(json_values)
    body = {CHAT: {"messages": ASK, "max_tokens": 2},
            RESPONSES: {"input": "Hi", "max_output_tokens": 2},
            MESSAGES: {"model": MODEL, "messages": ASK, "max_tokens": 2}}[path]
    body = {**body, "tools": tools, "tool_choice": choice, "temperature": 0}
    for key in draw(st.sets(st.sampled_from(["tools", "tool_choice"]), max_size=1)):
        del body[key]  # now and then one of them left out
    return path, body


def test_arbitrary_tools_and_tool_choice_are_never_a_5xx(edge_url):
    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(tool_requests())
    def answer_is_fine(request):
        path, body = request
        r = post(edge_url, path, body, timeout=120)
        problem = answer_problem(path, r.status_code, r.headers.get("content-type", ""),
                                 r.content)
        assert problem is None, (body, problem)

    answer_is_fine()
    assert httpx.get(f"{edge_url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while True:  # nothing left running, every KV page back
        now = metrics(edge_url)
        busy = now["sluice:num_requests_running"] + now["sluice:num_requests_waiting"]
        used = now["sluice:kv_cache_total_pages"] - now["sluice:kv_cache_free_pages"]
        if busy == 0 and used == 0:
            break
        assert time.monotonic() < deadline, (busy, used)
        time.sleep(0.5)
