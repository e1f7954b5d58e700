"""/v1/embeddings (OpenAI's shape) over a pooling engine (vLLM's --runner pooling).

Each input becomes one engine request carrying `PoolingParams`; the engine prefills it whole,
pools it and sends the vector back on the request's only frame (`TextFrame.pooled`). Inputs
are checked here first, each failure a 400 naming `input`: the kind of every element (all
strings, or token ids, or lists of token ids), nothing empty, at most
--max-embedding-inputs of them, ids inside the vocabulary, and each prompt within the
model's context unless `truncate_prompt_tokens` asks for a cut (pooling keeps a document's
opening: frontend.input.budgets). `dimensions` (Matryoshka) is taken only where the checkpoint
says it was trained for it (shared.runner_config), as vLLM does.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.base.errors import APIError, bad_request
from frontend.embeddings.embeddings_models import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PoolingData,
    PoolingResponse,
    PoolingUsage,
)
from frontend.engine_client.client import EngineUnavailable
from frontend.input.budgets import BudgetError, PromptTokens, TokenizeParams, check_truncation
from frontend.pipeline.serving_context import (
    ServingContext,
    check_model,
    frame_error,
    max_model_len,
)
from frontend.pipeline.tracing import engine_context, note_embeddings, phase
from shared.config import FrontendConfig
from shared.param_ranges import RangeProblem, check_priority
from shared.protocol import (
    EngineRequest,
    PoolingParams,
    SamplingParams,
    TextFrame,
    pack_ids,
    unpack_tensor,
)
from shared.runner_config import PoolingFacts, pooling_facts, resolve_runner

_UNUSED_SAMPLING = SamplingParams(max_tokens=1)  # a pooling request samples nothing
_ENCODER = msgspec.json.Encoder()


def routes(ctx: ServingContext, config: FrontendConfig, decode_body, guarded) -> list[Route]:
    """The pooling routes; on a generating model they answer 404 saying how to serve one."""
    facts = None
    if resolve_runner(config.model, config.runner, config.hf_overrides) == "pooling":
        facts = pooling_facts(config.model, config.pooler_config, config.hf_overrides)

    async def embeddings(request: Request) -> Response:
        if facts is None:
            raise APIError(404, "This model generates text; /v1/embeddings needs an embedding "
                                "model served with --runner pooling.")
        body = await decode_body(request, EmbeddingRequest)
        result = await create_embeddings(ctx, body, facts, config.max_embedding_inputs)
        return Response(_ENCODER.encode(result), media_type="application/json")

    async def pooling(request: Request) -> Response:
        # vLLM's /pooling: an embeddings request, answered with the raw pooled vectors.
        if facts is None:
            raise APIError(404, "This model generates text; /pooling needs a pooling model "
                                "served with --runner pooling.")
        body = await decode_body(request, EmbeddingRequest)
        result = await create_embeddings(ctx, body, facts, config.max_embedding_inputs)
        return Response(_ENCODER.encode(as_pooling(result)), media_type="application/json")

    return [Route("/v1/embeddings", guarded(embeddings), methods=["POST"]),
            Route("/pooling", guarded(pooling), methods=["POST"])]


def as_pooling(result: EmbeddingResponse) -> PoolingResponse:
    return PoolingResponse(
        result.id.replace("embd-", "pool-", 1), result.created, result.model,
        [PoolingData(d.embedding, d.index) for d in result.data],
        PoolingUsage(result.usage.prompt_tokens, result.usage.total_tokens))


# ---------------------------------------------------------------- inputs


def read_inputs(value, max_inputs: int) -> list[str | list[int]]:
    """The request's inputs as texts and token-id lists; a 400 for any other shape."""
    if isinstance(value, str):
        inputs = [value]
    elif not value:
        raise bad_request("input must not be empty", "input")
    elif all(isinstance(v, str) for v in value):
        inputs = list(value)
    elif all(_is_id(v) for v in value):
        inputs = [list(value)]
    elif all(isinstance(v, list) and all(_is_id(i) for i in v) for v in value):
        inputs = list(value)
    else:
        raise bad_request("input must be a string, a list of strings, a list of token ids "
                          "(integers) or a list of lists of token ids", "input")
    if len(inputs) > max_inputs:
        raise bad_request(f"input has {len(inputs)} items; at most {max_inputs} are allowed "
                          "per request", "input")
    for i, item in enumerate(inputs):
        if len(item) == 0:
            raise bad_request(f"input[{i}] is empty; every input needs at least one "
                              "character or token", "input")
    return inputs


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pooling_params(request: EmbeddingRequest, facts: PoolingFacts) -> PoolingParams:
    dims = request.dimensions
    if dims is not None:
        if not facts.is_matryoshka:
            raise bad_request("This model does not support matryoshka representation; "
                              "dimensions cannot be set.", "dimensions")
        allowed = facts.matryoshka_dimensions
        if dims < 1 or (allowed and dims not in allowed):
            raise bad_request(f"dimensions must be one of {allowed}" if allowed else
                              "dimensions must be at least 1", "dimensions")
    return PoolingParams(normalize=request.normalize, dimensions=dims)


async def _tokens(ctx: ServingContext, item: str | list[int], params: TokenizeParams,
                  index: int) -> PromptTokens:
    try:
        if isinstance(item, str):
            return await ctx.tokenization.tokenize(item, params)
        low, high = min(item), max(item)
        if low < 0 or high >= ctx.vocab_size:
            raise bad_request(f"input[{index}] has token id {low if low < 0 else high}: token "
                              f"ids must lie in [0, {ctx.vocab_size})", "input")
        return await ctx.tokenization.fit_ids(item, params)
    except BudgetError as exc:
        raise bad_request(f"input[{index}]: {exc}", exc.param or "input") from exc


# ---------------------------------------------------------------- the request


async def create_embeddings(ctx: ServingContext, request: EmbeddingRequest,
                            facts: PoolingFacts, max_inputs: int) -> EmbeddingResponse:
    check_model(ctx, request.model)
    inputs = read_inputs(request.input, max_inputs)
    pooling = pooling_params(request, facts)
    try:
        check_priority(request.priority or 0)
    except RangeProblem as problem:
        raise bad_request(problem.message, "priority") from None
    params = TokenizeParams(
        max_total_tokens=max_model_len(ctx), generation=False,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        add_special_tokens=request.add_special_tokens is not False,
    )
    try:
        check_truncation(params)
    except BudgetError as exc:
        raise bad_request(str(exc), exc.param) from exc
    with phase("tokenize"):
        prompts = await asyncio.gather(*(_tokens(ctx, item, params, i)
                                         for i, item in enumerate(inputs)))
    request_id = f"embd-{request.request_id or uuid.uuid4().hex}"
    now = time.time()
    trace_context = engine_context()  # the engine's spans join this request's trace
    engine_requests = [
        EngineRequest(request_id=f"{request_id}-{i}", prompt_token_ids=pack_ids(p.ids),
                      params=_UNUSED_SAMPLING, reply_to=ctx.client.result_address,
                      arrival_time=now, priority=request.priority or 0, pooling=pooling,
                      trace_context=trace_context)
        for i, p in enumerate(prompts)
    ]
    note_embeddings(request_id, request.model or ctx.model_name,
                    sum(len(p.ids) for p in prompts), len(prompts))
    frames = await run_pooling(ctx, engine_requests, [p.ids for p in prompts])
    data = [Embedding(_encode(frames[r.request_id], request.encoding_format), i)
            for i, r in enumerate(engine_requests)]
    used = sum(len(p.ids) for p in prompts)
    return EmbeddingResponse(request_id, int(now), ctx.model_name, data,
                             EmbeddingUsage(prompt_tokens=used, total_tokens=used))


async def run_pooling(ctx: ServingContext, requests: list[EngineRequest], ids: list[list[int]]
               ) -> dict[str, TextFrame]:
    """Submits every request and waits for each one's last frame; the first error frame
    ends the request with its status (the others are aborted)."""
    queue: asyncio.Queue = asyncio.Queue()
    pending = {r.request_id for r in requests}
    for r in requests:
        if ctx.client.in_flight(r.request_id):
            raise bad_request(f"a request with request_id {r.request_id!r} is already running",
                              "request_id")
    done: dict[str, TextFrame] = {}
    try:
        for r, prompt_ids in zip(requests, ids, strict=True):
            await ctx.client.submit(r, prompt_ids, queue)
        while pending:
            frame: TextFrame = await queue.get()
            if frame.finish_reason is None:
                continue
            pending.discard(frame.request_id)
            if frame.finish_reason == "error" or frame.pooled is None:
                raise frame_error(frame)
            done[frame.request_id] = frame
    except EngineUnavailable as exc:
        raise APIError(503, str(exc)) from exc
    finally:
        for request_id in pending:
            await ctx.client.abort(request_id)
        for r in requests:
            ctx.client.release(r.request_id)
    return done


def _encode(frame: TextFrame, encoding_format: str | None) -> list[float] | str:
    try:
        vector = unpack_tensor(frame.pooled).astype("<f4").reshape(-1)
    except ValueError as exc:  # an engine that sent a broken tensor: our fault
        raise APIError(500, f"the engine sent an unreadable embedding: {exc}") from exc
    if encoding_format == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float64).tolist()
