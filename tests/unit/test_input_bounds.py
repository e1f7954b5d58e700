"""Bounds on what one request may ask for (issue 15 items 1, 2, 6), without processes: the
flat JSON depth scan, the one validation pass over numbers, counts and JSON strings, and the
engine's parameter ranges as 400s naming the field. tests/integration/test_input_bounds.py
sends the same over HTTP to every route."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.base.errors import APIError
from frontend.http.decoding import decode_body
from frontend.input.input_bounds import RequestLimits
from frontend.input.json_depth import TooDeep, check_depth, max_depth
from frontend.pipeline.protocol_edge import renamed
from frontend.pipeline.sampling import check_request, plan_request
from shared.param_ranges import INT32_MAX, INT64_MAX, INT64_MIN

VOCAB = 1000
DEFAULTS = RequestLimits()
USER = [{"role": "user", "content": "hi"}]
SMALL = RequestLimits(max_json_depth=8, max_n=3, max_prompts_per_request=2, max_messages=2,
                      max_tools=2, max_stop_strings=2)


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": USER, **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def completion(**fields) -> CompletionRequest:
    body = {"prompt": "hi", **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=CompletionRequest)


def refused(request, limits: RequestLimits = DEFAULTS) -> APIError:
    with pytest.raises(APIError) as info:
        check_request(request, limits=limits)
    assert info.value.status == 400
    return info.value


def planned(request):
    check_request(request)
    endpoint = "chat" if isinstance(request, ChatCompletionRequest) else "completions"
    return plan_request(request, endpoint=endpoint, prompt_len=5, max_model_len=100,
                        vocab_size=VOCAB)


# ---------------------------------------------------------------- the depth scan


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def depth_of(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


# Strings full of what could fool a scan: brackets, quotes, runs of backslashes.
_tricky = st.text(alphabet='[]{}"\\ax,:', max_size=8)
_json = st.recursive(
    st.none() | st.integers() | _tricky,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_tricky, inner, max_size=3),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_json, st.booleans())
def test_the_scan_measures_what_a_parser_would(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert max_depth(text.encode()) == depth_of(value)


@pytest.mark.parametrize("limit", [1, 8, 64])
def test_the_limit_itself_passes_and_one_more_level_does_not(limit):
    check_depth(nested(limit), limit)
    with pytest.raises(TooDeep):
        check_depth(nested(limit + 1), limit)


def test_brackets_inside_strings_nest_nothing():
    check_depth(json.dumps({"a": "[" * 1000, "b": '\\"[[[' * 100}), 2)
    with pytest.raises(TooDeep):
        check_depth('["\\\\", [[1]]]', 2)  # an escaped backslash ends the string before [[


def test_the_path_names_the_field():
    body = json.dumps({"model": "m", "messages": [{"role": "user"}, {"x": [[1], [2, 3],
                                                   json.loads(nested(20))]}]})
    with pytest.raises(TooDeep) as info:
        check_depth(body, 8)
    assert info.value.path == "messages[1].x[2][0][0]"  # the first six segments


def test_the_scan_is_linear_on_hostile_bytes():
    # An unterminated string of escaped quotes would make a naive string regex quadratic;
    # its brackets are inside the string, so it nests nothing.
    start = time.perf_counter()
    check_depth(b'"' + b'\\"' * 500_000 + b"[" * 100, 64)
    for data in (b"[" * 1_000_000, b'{"a": [' + b'"",' * 300_000 + nested(100).encode() + b"]}"):
        with pytest.raises(TooDeep):
            check_depth(data, 64)
    assert time.perf_counter() - start < 3.0


def test_a_1mb_body_scans_in_milliseconds():
    body = json.dumps({
        "messages": [{"role": "user", "content": 'Line\n with "quotes" and {braces} [x]. ' * 25}
                     for _ in range(1000)],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string"}}}}}] * 100,
    }).encode()
    assert len(body) > 1_000_000
    runs = 10
    start = time.perf_counter()
    for _ in range(runs):
        check_depth(body, 64)
    per_body = (time.perf_counter() - start) / runs
    print(f"depth scan of a {len(body) / 1e6:.1f} MB body: {per_body * 1e3:.1f} ms")
    assert per_body < 0.25  # about 6 ms on the development machine; generous for busy CI


def test_a_json_string_is_checked_on_its_own():
    check_depth(nested(3), 3)
    with pytest.raises(TooDeep) as info:
        check_depth(nested(5000), 64)  # json.loads alone: RecursionError
    assert info.value.path == "[0][0][0][0][0][0]"


def test_the_body_decoder_answers_400_for_deep_json():
    class Body:
        headers = {"content-type": "application/json"}

        def __init__(self, data: bytes) -> None:
            self.data = data

        async def body(self) -> bytes:
            return self.data

    deep = b'{"messages": [], "metadata": {"a": ' + nested(5000).encode() + b"}}"
    with pytest.raises(APIError) as info:
        asyncio.run(decode_body(Body(deep), ChatCompletionRequest, 64))
    assert info.value.status == 400 and info.value.param.startswith("metadata.a[0]")
    assert "64" in info.value.message
    ok = asyncio.run(decode_body(Body(b'{"messages": [], "metadata": {"a": [[1]]}}'),
                                 ChatCompletionRequest, 64))
    assert ok.metadata == {"a": [[1]]}


# ---------------------------------------------------------------- integer ranges

# (field, last value inside, first value outside) on both endpoints.
SHARED_RANGES = [
    ("seed", INT64_MAX, INT64_MAX + 1),
    ("seed", INT64_MIN, INT64_MIN - 1),
    ("priority", INT64_MAX, INT64_MAX + 1),
    ("priority", INT64_MIN, INT64_MIN - 1),
    ("top_k", INT32_MAX, INT32_MAX + 1),
    ("top_k", -1, -2),
    ("min_tokens", 0, -1),
    ("min_tokens", INT32_MAX, INT32_MAX + 1),
    ("max_tokens", 1, 0),
    ("max_tokens", INT32_MAX, INT32_MAX + 1),
    ("truncate_prompt_tokens", -1, -2),
    ("n", 1, 0),
    ("n", 128, 129),
]


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize("field, inside, outside", SHARED_RANGES)
def test_every_integer_has_a_range(make, field, inside, outside):
    check_request(make(**{field: inside}))
    error = refused(make(**{field: outside}))
    assert error.param == field and field in error.message


@pytest.mark.parametrize("field, inside, outside", [
    ("max_completion_tokens", INT32_MAX, INT32_MAX + 1),
    ("max_completion_tokens", 1, 0),
    ("top_logprobs", 20, 21),
])
def test_chat_integers(field, inside, outside):
    check_request(chat(logprobs=True, **{field: inside}))
    assert refused(chat(logprobs=True, **{field: outside})).param == field


def test_best_of_is_bounded_like_n():
    check_request(completion(n=3, best_of=3), limits=SMALL)
    assert refused(completion(best_of=4), SMALL).param == "best_of"
    assert refused(completion(n=2**63), SMALL).param == "n"  # before any candidate exists


def test_top_k_of_2_to_the_63_is_a_400_not_a_dead_engine():
    assert refused(chat(top_k=2**63)).param == "top_k"


@pytest.mark.parametrize("seed, engine_seed", [(-1, 2**64 - 1), (INT64_MIN, 2**63),
                                               (INT64_MAX, INT64_MAX)])
def test_any_int64_seed_wraps_into_the_generators_range(seed, engine_seed):
    assert planned(chat(seed=seed)).params.seed == engine_seed


# ---------------------------------------------------------------- sampling parameter ranges


@pytest.mark.parametrize("field, inside, outside", [
    ("temperature", 100.0, 100.5),
    ("top_p", 1e-6, 1e-7),
    ("top_p", 1.0, 1.5),
    ("min_p", 1.0, 1.1),
    ("presence_penalty", -2.0, -2.5),
    ("frequency_penalty", 2.0, 2.5),
    ("repetition_penalty", 0.01, 0.001),
    ("repetition_penalty", 2.0, 2.1),
])
def test_floats_stay_where_float32_sampling_stays_finite(field, inside, outside):
    planned(chat(**{field: inside}))
    with pytest.raises(APIError) as info:
        planned(chat(**{field: outside}))
    assert info.value.status == 400 and info.value.param == field


def test_a_subnormal_temperature_is_greedy_not_infinite():
    assert planned(chat(temperature=1e-45)).params.temperature == 1e-45  # engine: < 1e-5 greedy


# ---------------------------------------------------------------- logit_bias


@pytest.mark.parametrize("key", ["--5", " 5", "5 ", "1_0", "+5", "٣", "", "0x5", "5" * 5000])
def test_logit_bias_keys_are_ascii_integers(key):
    error = refused(chat(logit_bias={key: 1}))
    assert error.param == "logit_bias"


def test_logit_bias_ids_and_values():
    assert planned(chat(logit_bias={"-0": 1, "999": -300})).params.logit_bias == [
        (0, 1.0), (999, -100.0)]
    with pytest.raises(APIError) as info:
        planned(chat(logit_bias={"-5": 1}))
    assert info.value.param == "logit_bias"


# ---------------------------------------------------------------- fan-out


@pytest.mark.parametrize("field, inside, outside", [
    ("messages", USER * 2, USER * 3),
    ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)],
     [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)]),
    ("stop", ["a", "b"], ["a", "b", "c"]),
    ("n", 3, 4),
])
def test_chat_fan_out_is_bounded(field, inside, outside):
    extra = {"tool_choice": "none"} if field == "tools" else {}
    check_request(chat(**{field: inside}, **extra), limits=SMALL)
    error = refused(chat(**{field: outside}, **extra), SMALL)
    assert error.param == field and "3" in error.message


@pytest.mark.parametrize("prompt, ok", [
    (["a", "b"], True), (["a", "b", "c"], False), ([[1], [2], [3]], False),
    ([1, 2, 3, 4, 5], True),  # token ids: one prompt
])
def test_prompts_per_completions_request(prompt, ok):
    request = completion(prompt=prompt)
    if ok:
        check_request(request, limits=SMALL)
    else:
        assert refused(request, SMALL).param == "prompt"


@pytest.mark.parametrize("field, inside, outside", [
    ("stop_token_ids", list(range(128)), list(range(129))),
    ("logit_bias", {str(i): 1 for i in range(1024)}, {str(i): 1 for i in range(1025)}),
])
def test_engine_fixed_counts(field, inside, outside):
    check_request(completion(**{field: inside}))
    assert refused(completion(**{field: outside})).param == field


# ---------------------------------------------------------------- JSON strings we parse


@pytest.mark.parametrize("fields, param", [
    ({"guided_json": nested(9)}, "guided_json"),
    ({"structured_outputs": {"json": nested(9)}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": nested(9)}}},
     "response_format.json_schema.schema"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": nested(9)}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_json_strings_are_depth_checked_before_parsing(fields, param):
    error = refused(chat(**fields), SMALL)
    assert error.param == param and "8" in error.message
    inside = json.loads(json.dumps(fields).replace(nested(9), nested(8)))
    with pytest.raises(APIError) as info:  # passes the bound; fails later checks, or none
        check_request(chat(**inside), limits=SMALL)
        raise APIError(200, "passed")
    assert info.value.param != param


# ---------------------------------------------------------------- other APIs' names


def test_errors_use_the_translating_apis_names():
    error = renamed(APIError(400, "max_completion_tokens must lie in [1, 5]",
                             "max_completion_tokens"), {"max_completion_tokens": "max_tokens"})
    assert (error.param, error.message) == ("max_tokens", "max_tokens must lie in [1, 5]")
    other = APIError(400, "x", "messages[0].content")
    assert renamed(other, {"messages": "input"}) is other
