"""vLLM's cross-encoder routes over a pooling engine serving a `*ForSequenceClassification`
checkpoint: /score and /v1/score (text pairs to relevance scores), /rerank, /v1/rerank and
/v2/rerank (a query against documents, best first, `top_n`, `return_documents`), and
/classify (texts to label probabilities).

A pair is tokenized as the model's tokenizer joins two segments (`[CLS] a [SEP] b [SEP]` for
BERT), with its token types, and runs as one engine request (task `score`). Both /score and
/classify get the sigmoid of a one-label head and the softmax over two or more labels
(vLLM's). Every input is checked first (kind, emptiness, count, length), each failure a 400
naming it.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.base.errors import APIError, bad_request
from frontend.embeddings.embeddings import run_pooling
from frontend.embeddings.scoring_models import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from frontend.input.budgets import BudgetError, TokenizeParams
from frontend.pipeline.serving_context import ServingContext, check_model, max_model_len
from shared.config import FrontendConfig
from shared.param_ranges import RangeProblem, check_priority
from shared.protocol import (
    EngineRequest,
    PoolingParams,
    SamplingParams,
    pack_ids,
    unpack_tensor,
)
from shared.runner_config import PoolingFacts, pooling_facts, resolve_runner

_UNUSED_SAMPLING = SamplingParams(max_tokens=1)
_ENCODER = msgspec.json.Encoder()


class Encoded(msgspec.Struct):
    ids: list[int]
    token_types: list[int]


def routes(ctx: ServingContext, config: FrontendConfig, decode_body, guarded) -> list[Route]:
    facts = None
    if resolve_runner(config.model, config.runner, config.hf_overrides) == "pooling":
        facts = pooling_facts(config.model, config.pooler_config, config.hf_overrides)
    limit = config.max_embedding_inputs

    def need_cross_encoder() -> PoolingFacts:
        if facts is None or "score" not in facts.tasks:
            raise APIError(404, "This route needs a cross-encoder (a *ForSequenceClassification "
                                "model, or a decoder reranker started with --hf-overrides) "
                                "served with --runner pooling.")
        return facts

    def answer(body) -> Response:
        return Response(_ENCODER.encode(body), media_type="application/json")

    async def score(request: Request) -> Response:
        facts = need_cross_encoder()
        body = await decode_body(request, ScoreRequest)
        return answer(await create_score(ctx, body, limit, not facts.score_tokens))

    async def rerank(request: Request) -> Response:
        facts = need_cross_encoder()
        body = await decode_body(request, RerankRequest)
        return answer(await create_rerank(ctx, body, limit, not facts.score_tokens))

    async def classify(request: Request) -> Response:
        facts = need_cross_encoder()
        body = await decode_body(request, ClassifyRequest)
        return answer(await create_classify(ctx, body, facts, limit))

    post = ["POST"]
    return [Route("/score", guarded(score), methods=post),
            Route("/v1/score", guarded(score), methods=post),
            Route("/rerank", guarded(rerank), methods=post),
            Route("/v1/rerank", guarded(rerank), methods=post),
            Route("/v2/rerank", guarded(rerank), methods=post),
            Route("/classify", guarded(classify), methods=post)]


# ---------------------------------------------------------------- inputs


def _texts(value, field: str, limit: int) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not items:
        raise bad_request(f"{field} must not be empty", field)
    if not all(isinstance(t, str) for t in items):
        raise bad_request(f"{field} must be a string or a list of strings", field)
    if len(items) > limit:
        raise bad_request(f"{field} has {len(items)} items; at most {limit} are allowed", field)
    for i, text in enumerate(items):
        if not text:
            raise bad_request(f"{field}[{i}] is empty", field)
    return items


def _pairs(text_1, text_2, limit: int) -> list[tuple[str, str]]:
    """vLLM's pairing: 1:1, 1:N (the one repeated) or N:N (zipped)."""
    firsts, seconds = _texts(text_1, "text_1", limit), _texts(text_2, "text_2", limit)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise bad_request(f"text_1 has {len(firsts)} items and text_2 {len(seconds)}: pair "
                          "one with many, or as many with as many", "text_1")
    return list(zip(firsts, seconds, strict=True))


def _check_common(ctx: ServingContext, model: str | None, priority: int | None,
                  truncate: int | None) -> int:
    """Checks what every route shares; returns the context length."""
    check_model(ctx, model)
    try:
        check_priority(priority or 0)
    except RangeProblem as problem:
        raise bad_request(problem.message, "priority") from None
    limit = max_model_len(ctx)
    if truncate is not None and truncate != -1 and not 1 <= truncate <= limit:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {limit}]",
                          "truncate_prompt_tokens")
    return limit


async def _encode(ctx: ServingContext, pairs: list[tuple[str, str | None]], limit: int,
                  truncate: int | None, field: str, segments: bool = True) -> list[Encoded]:
    """Token ids and types of each pair (or single text) under the prompt budgets of every
    route (character ceiling, capped tokenizer output, truncation that keeps the separators,
    length check): cut to `truncate_prompt_tokens`, else a 400 when one does not fit."""
    params = TokenizeParams(max_total_tokens=limit, generation=False,
                            truncate_prompt_tokens=truncate)

    async def one(i: int, a: str, b: str | None) -> Encoded:
        try:
            tokens = await ctx.tokenization.tokenize_pair(a, b, params, segments)
        except BudgetError as exc:
            raise bad_request(f"{field}[{i}]: {exc}", exc.param or field) from exc
        return Encoded(tokens.ids, tokens.token_types or [0] * len(tokens.ids))

    return list(await asyncio.gather(*(one(i, a, b) for i, (a, b) in enumerate(pairs))))


async def _run(ctx: ServingContext, encoded: list[Encoded], task: str, priority: int | None,
               prefix: str) -> tuple[str, int, list[np.ndarray]]:
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    now = time.time()
    requests = [
        EngineRequest(request_id=f"{request_id}-{i}", prompt_token_ids=pack_ids(e.ids),
                      params=_UNUSED_SAMPLING, reply_to=ctx.client.result_address,
                      arrival_time=now, priority=priority or 0,
                      pooling=PoolingParams(task=task, token_type_ids=pack_ids(e.token_types)))
        for i, e in enumerate(encoded)
    ]
    frames = await run_pooling(ctx, requests, [e.ids for e in encoded])
    vectors = []
    for r in requests:
        try:
            vectors.append(unpack_tensor(frames[r.request_id].pooled).reshape(-1))
        except ValueError as exc:
            raise APIError(500, f"the engine sent unreadable scores: {exc}") from exc
    return request_id, int(now), vectors


def _usage(encoded: list[Encoded]) -> int:
    return sum(len(e.ids) for e in encoded)


# ---------------------------------------------------------------- the routes


async def create_score(ctx: ServingContext, body: ScoreRequest, limit: int,
                       segments: bool = True) -> ScoreResponse:
    context = _check_common(ctx, body.model, body.priority, body.truncate_prompt_tokens)
    pairs = _pairs(body.text_1, body.text_2, limit)
    encoded = await _encode(ctx, pairs, context, body.truncate_prompt_tokens, "text_2",
                            segments)
    request_id, created, vectors = await _run(ctx, encoded, "score", body.priority, "score")
    used = _usage(encoded)
    return ScoreResponse(request_id, created, ctx.model_name,
                         [ScoreData(i, float(v[0])) for i, v in enumerate(vectors)],
                         PoolingUsage(used, used))


async def create_rerank(ctx: ServingContext, body: RerankRequest, limit: int,
                        segments: bool = True) -> RerankResponse:
    context = _check_common(ctx, body.model, body.priority, body.truncate_prompt_tokens)
    if not body.query:
        raise bad_request("query must not be empty", "query")
    documents = _texts(body.documents, "documents", limit)
    if body.top_n is not None and body.top_n < 0:
        raise bad_request("top_n must be at least 0 (0: every document)", "top_n")
    pairs = [(body.query, d) for d in documents]
    encoded = await _encode(ctx, pairs, context, body.truncate_prompt_tokens, "documents",
                            segments)
    request_id, _, vectors = await _run(ctx, encoded, "score", body.priority, "rerank")
    order = sorted(range(len(documents)), key=lambda i: -float(vectors[i][0]))
    if body.top_n:
        order = order[: body.top_n]
    results = [RerankResult(i, float(vectors[i][0]),
                            RerankDocument(documents[i]) if body.return_documents is not False
                            else None)
               for i in order]
    return RerankResponse(request_id, ctx.model_name, RerankUsage(_usage(encoded)), results)


async def create_classify(ctx: ServingContext, body: ClassifyRequest, facts: PoolingFacts,
                          limit: int) -> ClassifyResponse:
    context = _check_common(ctx, body.model, body.priority, body.truncate_prompt_tokens)
    texts = _texts(body.input, "input", limit)
    encoded = await _encode(ctx, [(t, None) for t in texts], context,
                            body.truncate_prompt_tokens, "input")
    request_id, created, vectors = await _run(ctx, encoded, "classify", body.priority,
                                              "classify")
    data = []
    for i, probs in enumerate(vectors):
        best = int(np.argmax(probs))
        label = facts.labels[best] if best < len(facts.labels) else f"LABEL_{best}"
        data.append(ClassifyData(i, label, [float(p) for p in probs], len(probs)))
    used = _usage(encoded)
    return ClassifyResponse(request_id, created, ctx.model_name, data, PoolingUsage(used, used))
