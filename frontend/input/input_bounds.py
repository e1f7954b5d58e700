"""What one request may ask for: every number in a range the engine can carry, JSON nested
at most `max_json_depth` levels, and bounded fan-out, checked before any work (issue 15).

`check_bounds` is the one validation pass over a request's numbers, counts and JSON strings.
It runs on the chat or completions request every route ends up with (`sampling.check_request`;
Responses and Messages translate into chat requests first), before rendering, before the
constraint is built and before one candidate is planned, so `n = 2**63` is refused at once.
The ranges of what reaches `SamplingParams` live in `shared.param_ranges` (the engine checks
them again); the server's maxima here come from the frontend's flags (docs/operations.md).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.base.errors import APIError, bad_request
from frontend.input.json_depth import TooDeep, check_depth
from shared.param_ranges import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_BAD_WORD_SEQUENCES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    logprobs_cap,
)

Request = ChatCompletionRequest | CompletionRequest

# bad_words: each word becomes up to two token sequences (shared.param_ranges bounds those).
MAX_BAD_WORDS = MAX_BAD_WORD_SEQUENCES // 2
MAX_BAD_WORD_CHARS = 256
MAX_ROLE_CHARS = 64  # a custom role is a name, not a second message

# logit_bias keys: a token id in plain ASCII decimal. int() would also take " 5", "1_0",
# "٣" or 5,000 digits (a ValueError past 4,300); 18 digits is past any vocabulary already.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")


class RequestLimits(msgspec.Struct, frozen=True):
    """The server's maxima per request (frontend flags; defaults as in shared.config)."""

    max_json_depth: int = 64  # levels of any JSON: the body, and JSON strings we parse
    max_n: int = 128  # n and best_of: engine requests per prompt
    max_prompts_per_request: int = 128  # prompts in one completions request
    max_messages: int = 2048  # as OpenAI's limit
    max_tools: int = 128  # as OpenAI's limit
    max_stop_strings: int = 64  # each is matched against every new piece of text
    # --max-logprobs, already capped at the vocabulary (shared.param_ranges.logprobs_cap)
    max_logprobs: int = MAX_LOGPROBS

    @classmethod
    def from_config(cls, config, vocab_size: int) -> RequestLimits:
        fields = {f: getattr(config, f) for f in cls.__struct_fields__}
        fields["max_logprobs"] = logprobs_cap(config.max_logprobs, vocab_size)
        return cls(**fields)


def json_depth_error(exc: TooDeep, field: str | None = None) -> APIError:
    """The 400 for JSON nested too deep, at `field` (a JSON string) or at exc.path (a body)."""
    where = field or exc.path or None
    return bad_request(
        f"{where or 'the request body'} nests JSON deeper than {exc.limit} levels, the "
        "server's limit (--max-json-depth)", where)


# ---------------------------------------------------------------- the validation pass


def check_bounds(request: Request, limits: RequestLimits) -> None:
    """400 naming the field for the first number, count or JSON string out of bounds."""
    _check_counts(request, limits)
    _check_integers(request)
    _check_logprobs(request, limits.max_logprobs)
    _check_logit_bias(request.logit_bias)
    _check_json_strings(request, limits.max_json_depth)


def check_at_most(count: int, limit: int, field: str, what: str, flag: str | None) -> None:
    if count > limit:
        source = f" (--{flag})" if flag else ""
        raise bad_request(f"{field}: at most {limit} {what} per request{source}; got {count}",
                          field)


def _check_counts(request: Request, limits: RequestLimits) -> None:
    """Fan-out: what multiplies the work of one request."""
    n = request.n
    _check_range("n", n, 1, limits.max_n, "--max-n")
    if isinstance(request, CompletionRequest):
        if request.best_of is not None:
            _check_range("best_of", request.best_of, 1, limits.max_n, "--max-n")
        check_at_most(_num_prompts(request), limits.max_prompts_per_request, "prompt", "prompts",
                      "max-prompts-per-request")
    else:
        check_at_most(len(request.messages), limits.max_messages, "messages", "messages",
                      "max-messages")
        _check_roles(request.messages)
        if request.tools is not None and not request.tools:
            # As OpenAI and vLLM: leave tools out rather than send none.
            raise bad_request("tools must hold at least one tool when given; leave it out "
                              "for none", "tools")
        check_at_most(len(request.tools or ()), limits.max_tools, "tools", "tools",
                      "max-tools")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or ()
    check_at_most(len(stops), limits.max_stop_strings, "stop", "stop strings",
                  "max-stop-strings")
    check_at_most(len(request.stop_token_ids or ()), MAX_STOP_TOKEN_IDS, "stop_token_ids",
                  "stop token ids", None)
    check_at_most(len(request.bad_words or ()), MAX_BAD_WORDS, "bad_words", "bad words", None)
    if any(len(word) > MAX_BAD_WORD_CHARS for word in request.bad_words or ()):
        raise bad_request(f"each of bad_words may have at most {MAX_BAD_WORD_CHARS} "
                          "characters", "bad_words")
    check_at_most(len(request.logit_bias or ()), MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
                  "logit_bias entries", None)


def _check_roles(messages) -> None:
    """A role is OpenAI's or a custom one (vLLM's): a short printable name, which the
    chat template writes into the prompt."""
    for i, message in enumerate(messages):
        role = message.role
        if not 0 < len(role) <= MAX_ROLE_CHARS or not role.isprintable():
            raise bad_request(f"messages[{i}].role must be 1 to {MAX_ROLE_CHARS} printable "
                              "characters", f"messages[{i}].role")


def _num_prompts(request: CompletionRequest) -> int:
    """A list holding any string or list is a batch; a list of ints is one prompt."""
    prompt = request.prompt if request.prompt_token_ids is None else request.prompt_token_ids
    if isinstance(prompt, list) and not all(isinstance(x, int) for x in prompt):
        return len(prompt)
    return 1


def _check_integers(request: Request) -> None:
    """Each integer in a range the wire (msgpack int64) and the engine (int32 counts) carry."""
    ranges: list[tuple[str, Any, int, int]] = [
        ("max_tokens", request.max_tokens, 1, INT32_MAX),
        ("min_tokens", request.min_tokens, 0, INT32_MAX),
        # vLLM takes any signed 64-bit seed and wraps it into the generators' [0, 2**64).
        ("seed", request.seed, INT64_MIN, INT64_MAX),
        ("priority", request.priority, INT64_MIN, INT64_MAX),
        ("truncate_prompt_tokens", request.truncate_prompt_tokens, -1, INT32_MAX),
    ]
    if isinstance(request, ChatCompletionRequest):
        ranges += [
            ("max_completion_tokens", request.max_completion_tokens, 1, INT32_MAX),
            ("thinking_token_budget", request.thinking_token_budget, 0, INT32_MAX),
        ]
    for field, value, low, high in ranges:
        if value is not None:
            _check_range(field, value, low, high)
    top_k = request.top_k
    if top_k is not None and top_k != -1 and not 0 <= top_k <= INT32_MAX:
        raise bad_request(f"top_k must be -1 (off) or lie in [0, {INT32_MAX}], not {top_k}",
                          "top_k")


def _check_logprobs(request: Request, cap: int) -> None:
    """top_logprobs (chat) or logprobs (completions): a count of alternatives per token."""
    if isinstance(request, ChatCompletionRequest):
        field, value = "top_logprobs", request.top_logprobs
    else:
        field, value = "logprobs", request.logprobs
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad_request("logprobs must be an integer for completions", "logprobs")
    if value is not None:
        _check_range(field, value, 0, cap, "--max-logprobs")
    if request.prompt_logprobs is not None:
        _check_range("prompt_logprobs", request.prompt_logprobs, 0, cap, "--max-logprobs")


def _check_range(field: str, value: int, low: int, high: int, flag: str | None = None) -> None:
    if not low <= value <= high:
        source = f" (the server's {flag})" if flag else ""
        raise bad_request(f"{field} must lie in [{low}, {high}]{source}, not {value}", field)


def _check_logit_bias(bias: dict[str, float] | None) -> None:
    """Keys are written token ids (their vocabulary is checked when planned)."""
    for key in bias or ():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad_request(f"logit_bias key {key[:40]!r} is not a token id (an integer "
                              "written in ASCII digits)", "logit_bias")


def _check_json_strings(request: Request, limit: int) -> None:
    """JSON text inside the request that we parse ourselves: schemas and tool arguments."""
    strings: list[tuple[str, Any]] = [("guided_json", request.guided_json)]
    if request.structured_outputs is not None:
        strings.append(("structured_outputs.json", request.structured_outputs.json))
    if isinstance(request, ChatCompletionRequest):
        fmt = request.response_format
        if fmt is not None and fmt.json_schema is not None:
            strings.append(("response_format.json_schema.schema", fmt.json_schema.schema))
        strings += _tool_call_arguments(request)
    for field, value in strings:
        if isinstance(value, str):
            try:
                check_depth(value, limit)
            except TooDeep as exc:
                raise json_depth_error(exc, field) from exc


def _tool_call_arguments(request: ChatCompletionRequest) -> list[tuple[str, Any]]:
    out = []
    for i, message in enumerate(request.messages):
        for j, call in enumerate(message.tool_calls or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                out.append((f"messages[{i}].tool_calls[{j}].function.arguments",
                            function.get("arguments")))
    return out
