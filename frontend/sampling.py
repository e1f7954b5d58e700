"""The one place an OpenAI request becomes engine SamplingParams (SPEC P-4, P-5).

Defaults are pinned here, not inherited from the engine: a missing temperature or top_p
means 1.0, completions default to 16 new tokens, chat to whatever room the context leaves.
"""

from __future__ import annotations

from typing import Literal

from frontend.api_models import UNSUPPORTED_WHEN_SET, ChatCompletionRequest, CompletionRequest
from frontend.errors import bad_request
from shared.protocol import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_SEED_RANGE = 2**64


def reject_unsupported(request: ChatCompletionRequest | CompletionRequest) -> None:
    for field, default in UNSUPPORTED_WHEN_SET:
        value = getattr(request, field, default)
        if value != default:
            raise bad_request(f"'{field}' is not supported by this server yet", field)


def to_sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    *,
    endpoint: Literal["chat", "completions"],
    prompt_len: int,
    max_model_len: int,
) -> SamplingParams:
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt "
            f"has {prompt_len} tokens, which leaves no room for the answer.",
            "messages" if endpoint == "chat" else "prompt",
        )
    max_tokens = _requested_max_tokens(request)
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if endpoint == "completions" else room
    if max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", "max_tokens")
    if max_tokens > room:
        raise bad_request(
            f"max_tokens={max_tokens} is too large: the prompt has {prompt_len} tokens and "
            f"this model's maximum context length is {max_model_len}.",
            "max_tokens",
        )
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    top_k = 0 if request.top_k is None or request.top_k == -1 else request.top_k
    _check_ranges(temperature, top_p, top_k, request.min_tokens, max_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=None if request.seed is None else request.seed % _SEED_RANGE,
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
    )


def _requested_max_tokens(request) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def _check_ranges(temperature, top_p, top_k, min_tokens, max_tokens) -> None:
    if temperature < 0:
        raise bad_request("temperature must be non-negative", "temperature")
    if not 0 < top_p <= 1:
        raise bad_request("top_p must be in (0, 1]", "top_p")
    if top_k < 0:
        raise bad_request("top_k must be -1 (disabled) or at least 1", "top_k")
    if min_tokens < 0:
        raise bad_request("min_tokens must be non-negative", "min_tokens")
    if min_tokens > max_tokens:
        raise bad_request("min_tokens must not exceed max_tokens", "min_tokens")
