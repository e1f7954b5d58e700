"""What the engine refuses before a request reaches a tensor: every check on an incoming
request (its ids, prompt, sampling and pooling parameters, continuation), each answering why
it cannot run, or None. The engine trusts no frontend: a custom client can speak the wire
protocol. `core` is the `EngineCore` whose limits (read live) the request must fit."""

from __future__ import annotations

import math

from shared.param_ranges import (
    RangeProblem,
    check_priority,
    check_priority_tier,
    check_sampling_params,
)
from shared.protocol import EngineRequest, unpack_ids

# Bounds on strings the engine keeps per request (hashing and logging cost, nothing more).
MAX_REQUEST_ID_CHARS = 1024
MAX_CACHE_SALT_CHARS = 4096
MAX_ADDRESS_CHARS = 1024


def is_result_address(address: str) -> bool:
    return (len(address) <= MAX_ADDRESS_CHARS
            and address.startswith(("tcp://", "ipc://", "inproc://")))


def request_problem(core, request: EngineRequest, prompt: list[int]) -> str | None:
    """Why this request cannot run, or None. The engine trusts no frontend (a custom
    client can speak the wire protocol): whatever could break a step is refused here,
    per request, before it reaches a tensor."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        return f"request ids may have at most {MAX_REQUEST_ID_CHARS} characters"
    if request.request_id in core.sequences:
        return f"request id {request.request_id!r} is already running"
    if not is_result_address(request.reply_to):
        return "reply_to must be a tcp://, ipc:// or inproc:// address"
    if not prompt:
        return "the prompt is empty"
    wrong_for_pooling = pooling_problem(core, request, prompt)
    if wrong_for_pooling is not None:
        return wrong_for_pooling
    if request.pooling is None and len(prompt) >= core.max_model_len:
        return (
            f"the prompt has {len(prompt)} tokens, which leaves no room to generate "
            f"within max_model_len={core.max_model_len}"
        )
    if min(prompt) < 0 or max(prompt) >= core.vocab_size:
        return f"prompt token ids must lie in [0, {core.vocab_size})"
    if request.lora_name is not None and len(request.lora_name) > MAX_REQUEST_ID_CHARS:
        return f"lora_name may have at most {MAX_REQUEST_ID_CHARS} characters"
    if request.cache_salt is not None and len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
        return f"cache_salt may have at most {MAX_CACHE_SALT_CHARS} characters"
    params = request.params
    if params.constraint is not None and core.grammar is None:
        return "structured output is not available: this engine has no grammar backend"
    try:
        # Integers off msgpack may be anything up to 2**64-1 and floats inf or NaN.
        check_sampling_params(params, core.vocab_size, core.max_logprobs)
        check_priority(request.priority)
        check_priority_tier(request.priority_tier)
    except RangeProblem as problem:
        return problem.message
    return None

def pooling_problem(core, request: EngineRequest, prompt: list[int]) -> str | None:
    """A pooling engine takes pooling requests only, and a generating one none (vLLM
    serves one runner per engine)."""
    params = request.pooling
    if core.pooling is None:
        if params is not None:
            return "this engine generates text; pooling needs an engine with --runner pooling"
        return None
    if params is None:
        return "this engine runs a pooling model (--runner pooling): it does not generate"
    if params.task not in core.pooling.tasks:
        return (f"pooling task {params.task!r} is not served by this model (it serves "
                f"{', '.join(core.pooling.tasks)})")
    types = params.token_type_ids
    if types:
        values = unpack_ids(types) if len(types) % 4 == 0 else None
        if values is None or len(values) != len(prompt):
            return "token_type_ids must be one int32 per prompt token"
        if values.min() < 0 or values.max() >= core.type_vocab_size:
            return f"token_type_ids must lie in [0, {core.type_vocab_size})"
    if len(prompt) > core.max_model_len:
        return (f"the prompt has {len(prompt)} tokens, more than "
                f"max_model_len={core.max_model_len}")
    if request.images or request.continuation is not None:
        return "a pooling request takes neither images nor a continuation"
    dims = params.dimensions
    if dims is not None:
        if not core.pooling.is_matryoshka:
            return "this model does not support matryoshka representation (dimensions)"
        allowed = core.pooling.matryoshka_dimensions
        if not 1 <= dims <= core.hidden_size or (allowed and dims not in allowed):
            return (f"dimensions must be one of {allowed}" if allowed else
                    f"dimensions must lie in [1, {core.hidden_size}]")
    return None

def resumed_ids(request: EngineRequest) -> list[int] | None:
    if request.continuation is None:
        return None
    ids = request.continuation.output_token_ids
    return unpack_ids(ids).tolist() if len(ids) % 4 == 0 else None

def continuation_problem(core, request: EngineRequest, prompt: list[int],
                         resumed: list[int] | None) -> str | None:
    """Why a continuation cannot run here, or None (none to check: None)."""
    continuation = request.continuation
    if continuation is None:
        return None
    if resumed is None:
        return "continuation output_token_ids must be a buffer of int32 values"
    if resumed and (min(resumed) < 0 or max(resumed) >= core.vocab_size):
        return f"continuation token ids must lie in [0, {core.vocab_size})"
    if len(resumed) >= request.params.max_tokens:
        return "a continuation must leave max_tokens room for at least one token"
    if len(prompt) + len(resumed) >= core.max_model_len:
        return f"prompt + continuation leave no room within max_model_len={core.max_model_len}"
    sizes = continuation.frame_sizes
    if (len(sizes) > len(resumed) + 1 or any(n < 0 for n in sizes)
            or sum(sizes) != len(resumed)):
        return "continuation frame_sizes must be counts that sum to its tokens"
    if not math.isfinite(continuation.cumulative_logprob):
        return "continuation cumulative_logprob must be finite"
    return None
