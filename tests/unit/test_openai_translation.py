"""The request models and the one translation function (req P-1 to P-7, P-10, P-12), without
processes: what each request becomes, and which ones are a 400 before any work."""

import msgspec
import pytest

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest, StreamOptions
from frontend.base.errors import APIError
from frontend.input.budgets import PromptTokens
from frontend.pipeline.input_stage import PromptInput
from frontend.pipeline.pipeline import build_job
from frontend.pipeline.sampling import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    check_request,
    logit_bias_pairs,
    plan_request,
)
from shared.generation_config import GenerationDefaults
from tests.tiny_tokenizer import MAX_CHARS_PER_TOKEN, tiny_tokenizer
from tests.unit.frontend_builders import serving_context

VOCAB = 1000
MAX_LEN = 100
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return msgspec.json.decode(
        msgspec.json.encode({"messages": USER, **fields}), type=ChatCompletionRequest
    )


def completion(**fields) -> CompletionRequest:
    return msgspec.json.decode(
        msgspec.json.encode({"prompt": "hi", **fields}), type=CompletionRequest
    )


def plan(request, prompt_len=10):
    endpoint = "chat" if isinstance(request, ChatCompletionRequest) else "completions"
    check_request(request)
    return plan_request(
        request, endpoint=endpoint, prompt_len=prompt_len, max_model_len=MAX_LEN,
        vocab_size=VOCAB,
    )


def rejected(make, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        plan(make(**fields))
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- P-1: nulls mean defaults


def test_null_means_default_for_every_defaulted_field():
    request = chat(n=None, stream=None, presence_penalty=None, frequency_penalty=None,
                   min_p=None, repetition_penalty=None, echo=None)
    assert (request.n, request.stream, request.echo) == (1, False, False)
    assert (request.presence_penalty, request.frequency_penalty) == (0.0, 0.0)
    # These two are "left out" as None, so a model's generation defaults can fill them.
    assert (request.min_p, request.repetition_penalty) == (None, None)
    options = msgspec.json.decode(b'{"include_usage": null}', type=StreamOptions)
    assert options.include_usage is True  # null is the default: true, as vLLM's


def test_null_default_survives_plan():
    p = plan(completion(n=None, presence_penalty=None, echo=None))
    assert p.n == 1 and p.params.presence_penalty == 0.0


@pytest.mark.parametrize("fields", [
    {"store": True}, {"metadata": {"k": "v"}}, {"service_tier": "flex"}, {"user": "u"},
    {"prompt_cache_key": "k"}, {"safety_identifier": "s"}, {"reasoning_effort": "high"},
    {"verbosity": "low"}, {"parallel_tool_calls": False}, {"prompt_cache_retention": "24h"},
    {"prompt_cache_options": {"mode": "implicit"}}, {"modalities": ["text"]},
    {"prediction": {"type": "content", "content": "x"}}, {"response_format": {"type": "text"}},
    {"tool_choice": "none"}, {"function_call": "none"},
    {"spaces_between_special_tokens": False},
    {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}},
])
def test_ignored_and_neutral_fields_pass(fields):
    plan(chat(**fields))


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("web_search_options", {}), ("moderation", {"model": "omni-moderation-latest"}),
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
])
def test_unsupported_chat_fields_are_named(field, value):
    error = rejected(chat, **{field: value})
    assert error.param == field and "not supported" in error.message


@pytest.mark.parametrize("field, value", [("suffix", "end")])
def test_unsupported_completion_fields_are_named(field, value):
    error = rejected(completion, **{field: value})
    assert error.param == field and "not supported" in error.message


# ---------------------------------------------------------------- P-4, P-5: pinned defaults


def test_pinned_defaults():
    p = plan(chat())
    assert (p.params.temperature, p.params.top_p, p.params.top_k) == (1.0, 1.0, 0)
    assert p.params.max_tokens == MAX_LEN - 10  # chat: all the room left
    assert plan(completion()).params.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS


def test_max_completion_tokens_wins_and_is_named():
    assert plan(chat(max_tokens=5, max_completion_tokens=7)).params.max_tokens == 7
    error = rejected(chat, max_completion_tokens=0)
    assert error.param == "max_completion_tokens"
    assert rejected(chat, max_tokens=MAX_LEN).param == "max_tokens"


def test_no_room_is_a_400_not_a_zero_token_answer():
    with pytest.raises(APIError) as info:
        plan(chat(), prompt_len=MAX_LEN)
    assert info.value.status == 400 and info.value.param == "messages"
    with pytest.raises(APIError):
        plan(completion(), prompt_len=MAX_LEN)


# ---------------------------------------------------------------- P-6: combinations


@pytest.mark.parametrize("make, fields, param", [
    (chat, {"stream_options": {"include_usage": True}}, "stream_options"),
    (chat, {"top_logprobs": 2}, "top_logprobs"),
    (chat, {"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (chat, {"tool_choice": "required"}, "tool_choice"),
    (chat, {"tool_choice": "auto"}, "tool_choice"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "response_format": {"type": "json_object"}}, "response_format"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "prompt_token_ids": [1, 2]}, "tool_choice"),
    (completion, {"suffix": "x"}, "suffix"),
    (completion, {"logprobs": 21}, "logprobs"),
    (completion, {"logprobs": True}, "logprobs"),
    (completion, {"best_of": 1, "n": 2}, "best_of"),
    (completion, {"best_of": 3, "n": 1, "stream": True}, "best_of"),
    (completion, {"logit_bias": {"abc": 1}}, "logit_bias"),
    (completion, {"logit_bias": {"1.5": 1}}, "logit_bias"),
    (completion, {"logit_bias": {" 5": 1}}, "logit_bias"),
    (completion, {"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    (completion, {"logit_bias": {"-1": 1}}, "logit_bias"),
    (completion, {"n": 0}, "n"),
    (chat, {"n": -1}, "n"),
    (completion, {"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    (completion, {"stop": ["ok", ""]}, "stop"),
    (completion, {"cache_salt": ""}, "cache_salt"),
    (completion, {"temperature": -0.1}, "temperature"),
    (completion, {"top_k": -2}, "top_k"),
    (completion, {"min_p": 1.5}, "min_p"),
    (completion, {"presence_penalty": 2.5}, "presence_penalty"),
    (completion, {"repetition_penalty": 0}, "repetition_penalty"),
    (completion, {"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    (chat, {"tools": []}, "tools"),  # as OpenAI and vLLM: leave tools out for none
])
def test_combination_checks(make, fields, param):
    assert rejected(make, **fields).param == param


def test_tool_choice_none_without_tools_is_fine():
    plan(chat(tool_choice="none"))


def test_tools_with_tool_choice_none_are_only_rendered():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    plan(chat(tools=tools, tool_choice="none"))
    assert rejected(chat, tools=tools).param == "tools"  # auto would need a tool parser


# ---------------------------------------------------------------- P-7, P-10


def test_logit_bias_uses_the_vocabulary_it_is_given_and_clamps():
    assert logit_bias_pairs({"0": 5, "999": -300, "7": 250.5}, 1000) == [
        (0, 5.0), (999, -100.0), (7, 100.0)
    ]
    with pytest.raises(APIError):
        logit_bias_pairs({"999": 1}, 999)


def test_best_of_needs_ranking_logprobs_but_returns_none():
    p = plan(completion(best_of=3, n=1))
    assert (p.n, p.candidates, p.params.logprobs) == (1, 3, 0)
    assert plan(completion(n=2)).candidates == 2


def test_logprob_translation():
    assert plan(chat(logprobs=True, top_logprobs=3)).params.logprobs == 3
    assert plan(chat(logprobs=True)).params.logprobs == 0
    assert plan(chat(logprobs=False)).params.logprobs is None
    p = plan(completion(logprobs=2, echo=True))
    assert (p.params.logprobs, p.params.prompt_logprobs) == (2, 2)


# ---------------------------------------------------------------- P-12: pass-through


@pytest.fixture(scope="module")
def ctx():
    with serving_context(tiny_tokenizer(), max_model_len=MAX_LEN,
                         max_chars_per_token=MAX_CHARS_PER_TOKEN, vocab_size=VOCAB) as ctx:
        yield ctx


def _prompt(ids: list[int]) -> PromptInput:
    return PromptInput(PromptTokens(ids=ids))


def test_cache_salt_and_priority_reach_every_engine_request(ctx):
    job = build_job(ctx, completion(n=2, cache_salt="tenant-a", priority=-3),
                    [_prompt([1, 2, 3])], "completions", "cmpl")
    assert len(job.candidates) == 2
    for request in job.candidates:
        assert (request.cache_salt, request.priority) == ("tenant-a", -3)
    plain = build_job(ctx, completion(), [_prompt([1])], "completions", "cmpl").candidates[0]
    assert (plain.cache_salt, plain.priority) == (None, 0)


def test_candidate_seeds_differ_and_stay_in_range(ctx):
    job = build_job(ctx, completion(n=3, seed=-1), [_prompt([1])], "completions", "cmpl")
    seeds = [c.params.seed for c in job.candidates]
    assert seeds == [2**64 - 1, 0, 1]  # -1 wraps; seed + i wraps instead of overflowing
    assert [c.request_id for c in job.candidates] == [
        f"{job.request_id}-{i}" for i in range(3)
    ]


# ---------------------------------------------------------------- one plan per request


def test_a_batched_completion_is_planned_once_and_sized_per_prompt(ctx, monkeypatch):
    """The plan (sampling params, logit_bias, constraint) does not depend on the prompt, so
    it is built and checked once; only max_tokens follows each prompt's room (here the
    model's default of 30 new tokens, within the room left)."""
    import frontend.pipeline.pipeline as pipeline

    built = []
    real = pipeline.request_plan
    monkeypatch.setattr(pipeline, "request_plan",
                        lambda *a, **kw: built.append(1) or real(*a, **kw))
    sized = msgspec.structs.replace(ctx, generation_defaults=GenerationDefaults(max_tokens=30))
    prompts = [_prompt([1] * 3), _prompt([1] * (MAX_LEN - 10)), _prompt([1] * 50)]
    job = build_job(sized, completion(n=2, logit_bias={"5": 1}), prompts, "completions",
                    "cmpl")
    assert len(built) == 1
    assert [c.params.max_tokens for c in job.candidates] == [30, 30, 10, 10, 30, 30]
    assert all(c.params.logit_bias == [(5, 1.0)] for c in job.candidates)


def test_min_tokens_is_held_to_each_prompts_room(ctx):
    """A chat request without max_tokens gets the room its prompt leaves, which min_tokens
    may not pass."""
    request = chat(min_tokens=12)
    assert build_job(ctx, request, [_prompt([1] * 50)], "chat", "chatcmpl")
    with pytest.raises(APIError) as info:
        build_job(ctx, request, [_prompt([1] * (MAX_LEN - 10))], "chat", "chatcmpl")
    assert (info.value.status, info.value.param) == (400, "min_tokens")
