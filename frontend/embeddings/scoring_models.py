"""Request and response bodies of vLLM's cross-encoder routes: /score, /rerank (Jina's and
Cohere's shape, also under /v1 and /v2) and /classify."""

from __future__ import annotations

from typing import Any

import msgspec


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # A string or a list of strings each; pairs are 1:1, 1:N or N:N.
    text_1: str | list[Any]
    text_2: str | list[Any]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None
    priority: int | None = 0


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    query: str
    documents: list[Any]
    model: str | None = None
    top_n: int | None = None  # None or 0: every document
    return_documents: bool | None = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None
    priority: int | None = 0


class ClassifyRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None
    priority: int | None = 0


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassifyData(msgspec.Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ClassifyData]
    usage: PoolingUsage
    object: str = "list"
