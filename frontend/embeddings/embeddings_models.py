"""/v1/embeddings request and response bodies, in OpenAI's shape (plus vLLM's extensions:
truncate_prompt_tokens, add_special_tokens, normalize, priority, request_id)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # A string, a list of strings, a list of token ids or a list of such lists; msgspec
    # takes one array type per union, so frontend.embeddings.embeddings checks the elements.
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: keep the first N tokens (-1: as many as the model takes) instead of a 400.
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = True
    normalize: bool | None = None  # None: as the model's pooler says
    priority: int | None = 0
    request_id: str | None = None


class Embedding(msgspec.Struct):
    embedding: list[float] | str  # str: base64 of little-endian float32
    index: int
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class PoolingData(msgspec.Struct):
    data: list[float] | str
    index: int
    object: str = "pooling"


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class PoolingResponse(msgspec.Struct):
    """vLLM's /pooling answer: the pooled vector of each input, under `data`."""

    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: str = "list"


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: str = "list"
