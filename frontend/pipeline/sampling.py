"""The one place an OpenAI request becomes engine parameters (req P-4 to P-7, P-10).

Defaults are pinned here, not inherited from the engine: a missing temperature or top_p
means 1.0, completions default to 16 new tokens, chat to whatever room the context leaves.
Every field-combination check of P-6 lives here too, so each is a 400 before any work, after
the bounds on every number, count and JSON string (`frontend.input.input_bounds`); the sampling
parameters a plan holds are checked against `shared.param_ranges`, the engine's own table.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from frontend.base.api_models import (
    CHAT_UNSUPPORTED_WHEN_SET,
    COMPLETION_UNSUPPORTED_WHEN_SET,
    NEUTRAL_VALUES,
    UNSUPPORTED_WHEN_SET,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
)
from frontend.base.errors import bad_request
from frontend.input.input_bounds import RequestLimits, check_bounds
from frontend.input.scheduling_hints import check_scheduling_fields
from frontend.input.structured import StructuredSettings, check_structured
from frontend.pipeline.beam_checks import check_beam_fields
from shared.generation_config import GenerationDefaults
from shared.param_ranges import (
    LOGIT_BIAS_LIMIT,
    MAX_TOKENS_MAX,
    SEED_RANGE,
    UNBOUNDED_LOGPROBS,
    RangeProblem,
    check_sampling_params,
)
from shared.protocol import (
    GREEDY_TEMPERATURE,
    Constraint,
    OutputParams,
    SamplingParams,
    ThinkingBudget,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16

Request = ChatCompletionRequest | CompletionRequest


class Plan(msgspec.Struct, frozen=True):
    """What the engine should run for one request: `candidates` copies, `n` returned."""

    params: SamplingParams
    output: OutputParams
    n: int
    candidates: int  # best_of; equals n unless the best n of more are wanted


_NO_STRUCTURED_SETTINGS = StructuredSettings()
_DEFAULT_LIMITS = RequestLimits()


def check_request(request: Request, structured: StructuredSettings = _NO_STRUCTURED_SETTINGS,
                  limits: RequestLimits = _DEFAULT_LIMITS) -> None:
    """Bounds (numbers, counts, JSON depth), combination checks that need no prompt (req
    P-6), then unsupported fields.

    `structured`: the server's tool-call and reasoning parsers; without them, tools (other
    than with tool_choice "none") are refused. `limits`: the server's maxima per request."""
    check_bounds(request, limits)
    check_beam_fields(request)
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if request.cache_salt is not None and not request.cache_salt:
        raise bad_request("cache_salt must be a non-empty string when given", "cache_salt")
    check_scheduling_fields(request)
    if request.stream and request.prompt_logprobs:
        # As vLLM: prompt logprobs come with the whole answer only (0 asks for none).
        raise bad_request("prompt_logprobs is not available when stream is true",
                          "prompt_logprobs")
    if isinstance(request, ChatCompletionRequest):
        _check_chat(request)
        if request.thinking_token_budget is not None and structured.reasoning_parser is None:
            raise bad_request("thinking_token_budget needs a reasoning parser, and this "
                              "server has none (--reasoning-parser)", "thinking_token_budget")
        unsupported = UNSUPPORTED_WHEN_SET + CHAT_UNSUPPORTED_WHEN_SET
    else:
        _check_completion(request)
        unsupported = UNSUPPORTED_WHEN_SET + COMPLETION_UNSUPPORTED_WHEN_SET
    for field, default in unsupported:
        value = getattr(request, field, default)
        if value != default and value not in NEUTRAL_VALUES.get(field, ()):
            raise bad_request(f"'{field}' is not supported by this server yet", field)
    check_structured(request, structured)


def _check_chat(request: ChatCompletionRequest) -> None:
    if request.top_logprobs is not None and request.logprobs is not True:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if request.logprobs is not None and not isinstance(request.logprobs, bool):
        raise bad_request("logprobs must be a boolean for chat completions", "logprobs")
    if request.tool_choice not in (None, "none") and not request.tools:
        raise bad_request("tool_choice requires tools", "tool_choice")
    named = isinstance(request.tool_choice, NamedToolChoice)
    # {"type": "text"} asks for no constraint (vLLM's default), so it leaves the call free.
    constrains = request.response_format is not None and request.response_format.type != "text"
    if named and constrains:
        raise bad_request(
            "a named tool_choice cannot be combined with response_format", "response_format"
        )
    if named and request.prompt_token_ids is not None:
        raise bad_request(
            "a named tool_choice cannot be combined with prompt_token_ids", "tool_choice"
        )


def _check_completion(request: CompletionRequest) -> None:
    if request.best_of is not None:
        if request.best_of < request.n:
            raise bad_request("best_of must be greater than or equal to n", "best_of")
        if request.stream and request.best_of > request.n:
            raise bad_request("best_of > n cannot be streamed", "best_of")


def plan_request(
    request: Request,
    *,
    endpoint: Literal["chat", "completions"],
    prompt_len: int,
    max_model_len: int,
    vocab_size: int,
    constraint: Constraint | None = None,
    defaults: GenerationDefaults | None = None,
) -> Plan:
    """The plan of a one-prompt request: `request_plan` with that prompt's max_tokens."""
    max_tokens = prompt_max_tokens(request, endpoint, prompt_len, max_model_len, defaults)
    plan = request_plan(request, vocab_size=vocab_size, constraint=constraint,
                        defaults=defaults)
    return msgspec.structs.replace(plan, params=prompt_params(plan, max_tokens))


def request_plan(
    request: Request,
    *,
    vocab_size: int,
    constraint: Constraint | None = None,
    defaults: GenerationDefaults | None = None,
    bad_words: list[list[int]] | None = None,
    thinking: ThinkingBudget | None = None,
) -> Plan:
    """Everything but max_tokens, built and checked once per request: the prompts of a
    batched completion share it, so its grammar, logit_bias and ranges are not redone per
    prompt. max_tokens depends on each prompt's length (`prompt_params`); until then
    `params.max_tokens` holds the request's own ask, or the most any prompt could get.

    `constraint`: the request's, checked once (`frontend.input.structured.constraint_for`).
    `defaults`: the model's generation defaults (`--generation-config`) for the fields the
    request leaves out; request values win. `bad_words`: the request's, as token sequences
    (`Tokenization.bad_word_ids`); `thinking`: its thinking_token_budget, with the parser's
    tags and the prompt's thinking state (`pipeline.thinking_budget`)."""
    asked, _ = _asked_max_tokens(request)
    candidates, logprobs, prompt_logprobs = _candidates_and_logprobs(request)
    params = SamplingParams(
        max_tokens=MAX_TOKENS_MAX if asked is None else asked,
        **_sampled_fields(request, defaults or _NO_DEFAULTS, vocab_size),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        constraint=constraint,
        allowed_token_ids=request.allowed_token_ids or [],
        bad_words=bad_words or [],
        thinking=thinking,
    )
    _check_plan(request, params, vocab_size)
    output = OutputParams(
        skip_special_tokens=request.skip_special_tokens,
        stop=_stop_strings(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        min_tokens=request.min_tokens,  # stop strings wait for it too (req P-9)
        logprobs=logprobs is not None or prompt_logprobs is not None,
        tokens_as_ids=bool(request.return_tokens_as_token_ids),
    )
    return Plan(params, output, request.n, candidates)


def _candidates_and_logprobs(request: Request) -> tuple[int, int | None, int | None]:
    """(engine requests per prompt, logprobs, prompt_logprobs): best_of runs more
    candidates than n, and ranking them needs their cumulative logprobs."""
    logprobs, prompt_logprobs = _logprobs(request)
    candidates = request.n
    if isinstance(request, CompletionRequest) and request.best_of is not None:
        candidates = request.best_of
        if candidates > request.n and logprobs is None:
            logprobs = 0  # ranking the candidates needs their cumulative logprobs
    return candidates, logprobs, prompt_logprobs


def _sampled_fields(request: Request, d: GenerationDefaults, vocab_size: int) -> dict:
    """The sampling fields, the request's own or else the model's defaults (`d`)."""
    return dict(
        temperature=_given(request.temperature, None, d.temperature, 1.0),
        top_p=_given(request.top_p, None, d.top_p, 1.0),
        top_k=0 if request.top_k == -1 else _given(request.top_k, None, d.top_k, 0),
        # Any int64 seed (check_bounds), wrapped into the engine generators' [0, 2**64).
        seed=None if request.seed is None else request.seed % SEED_RANGE,
        stop_token_ids=_stop_token_ids(request.stop_token_ids, vocab_size),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        min_p=_given(request.min_p, None, d.min_p, 0.0),
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=_given(request.repetition_penalty, None, d.repetition_penalty,
                                  1.0),
        logit_bias=logit_bias_pairs(request.logit_bias, vocab_size),
    )


def _check_plan(request: Request, params: SamplingParams, vocab_size: int) -> None:
    """What no engine could sample: values out of range, nothing allowed, best_of greedy."""
    _check_ranges(params, vocab_size)
    if request.allowed_token_ids == []:
        # Nothing allowed could never be sampled; the engine's [] means "no restriction".
        raise bad_request("allowed_token_ids may not be empty (leave it out for no "
                          "restriction)", "allowed_token_ids")
    if (isinstance(request, CompletionRequest) and (request.best_of or 1) > 1
            and params.greedy and not request.use_beam_search):
        # Greedy candidates are all the same answer: nothing to pick the best of. Greedy is
        # the engine's own definition (shared.protocol), so 1e-6 counts as 0 here too.
        raise bad_request("best_of must be 1 when sampling greedily (temperature below "
                          f"{GREEDY_TEMPERATURE:g})", "best_of")


def prompt_max_tokens(request: Request, endpoint: str, prompt_len: int, max_model_len: int,
                      defaults: GenerationDefaults | None = None) -> int:
    """One prompt's max_tokens: the request's ask when the context has room for it (else a
    400); without one, the model's default or the endpoint's, within the room left."""
    return _max_tokens(request, endpoint, prompt_len, max_model_len,
                       (defaults or _NO_DEFAULTS).max_tokens)


def prompt_params(plan: Plan, max_tokens: int) -> SamplingParams:
    """The plan's params with one prompt's max_tokens (`prompt_max_tokens`), and the one
    range that depends on it."""
    if plan.params.min_tokens > max_tokens:
        raise bad_request("min_tokens must not exceed max_tokens", "min_tokens")
    return msgspec.structs.replace(plan.params, max_tokens=max_tokens)


_NO_DEFAULTS = GenerationDefaults()


def _given(value, left_out, default, fallback):
    """The request's value; when it left the field out, the model's default, else fallback."""
    if value is not None and value != left_out:
        return value
    return fallback if default is None else default


def _max_tokens(request: Request, endpoint: str, prompt_len: int, max_model_len: int,
                default: int | None = None) -> int:
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt "
            f"has {prompt_len} tokens, which leaves no room for the answer.",
            "messages" if endpoint == "chat" else "prompt",
        )
    asked, field = _asked_max_tokens(request)
    if asked is None:
        if default is not None:  # the model's max_new_tokens, within the room left
            return min(default, room)
        return COMPLETIONS_DEFAULT_MAX_TOKENS if endpoint == "completions" else room
    if asked > room:
        raise bad_request(
            f"{field}={asked} is too large: the prompt has {prompt_len} tokens and this "
            f"model's maximum context length is {max_model_len}.",
            field,
        )
    return asked


def _asked_max_tokens(request: Request) -> tuple[int | None, str]:
    """The max_tokens the request asks for, and the field it came in."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        # The newer name wins when a client sends both, as in vLLM.
        return request.max_completion_tokens, "max_completion_tokens"
    return request.max_tokens, "max_tokens"


def _logprobs(request: Request) -> tuple[int | None, int | None]:
    """(logprobs per generated token, logprobs per prompt token) for the engine: the prompt's
    for vLLM's prompt_logprobs and for a completion's echo with logprobs."""
    asked = request.prompt_logprobs
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs is True else None, asked
    logprobs = request.logprobs
    echoed = logprobs if request.echo and logprobs is not None else None
    wanted = [n for n in (asked, echoed) if n is not None]
    return logprobs, max(wanted) if wanted else None


def logit_bias_pairs(bias: dict[str, float] | None, vocab_size: int) -> list[tuple[int, float]]:
    """OpenAI's {"token id": bias} -> (id, bias) pairs, checked against the real vocabulary.

    Keys were checked to be written token ids (`input_bounds`); values are clamped to
    [-100, 100] as vLLM does.
    """
    if not bias:
        return []
    pairs = []
    for key, value in bias.items():
        token_id = int(key)
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        pairs.append((token_id, max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))))
    return pairs


def _stop_token_ids(ids: list[int] | None, vocab_size: int) -> list[int]:
    if not ids:
        return []
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"stop_token_ids entry {token_id} is outside the vocabulary [0, {vocab_size})",
                "stop_token_ids",
            )
    return list(ids)


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return stops


def _check_ranges(p: SamplingParams, vocab_size: int) -> None:
    """The engine's ranges (`shared.param_ranges`), as a 400 naming the field."""
    try:
        # Logprob counts were held to --max-logprobs already (input_bounds).
        check_sampling_params(p, vocab_size, UNBOUNDED_LOGPROBS)
    except RangeProblem as exc:
        raise bad_request(exc.message, exc.field) from exc
