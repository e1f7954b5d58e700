"""The OpenAPI 3.1 document of the HTTP API, served at `GET /openapi.json`.

Request bodies are the msgspec Structs the routes decode (msgspec writes their JSON Schema,
2020-12 as OpenAPI 3.1 uses, with `additionalProperties: false` where a Struct forbids
unknown fields), so the document cannot drift from what the server accepts. `model` is
pinned to the served model's name: any other name is a 404. Error answers are OpenAI's
shape, or Anthropic's under `/v1/messages` (`frontend.base.errors`).

Like vLLM's, the document needs no API key (`frontend.http.limits.OPEN_PATHS`); it says nothing a
client could not learn from the 400s. Schemathesis fuzzes every operation listed here
(tests/integration/test_schemathesis.py), and a unit test keeps this table equal to the
app's routes.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.anthropic import models as anthropic_models
from frontend.anthropic.models import CountTokensRequest, ErrorBody, MessagesRequest
from frontend.base import api_models
from frontend.base.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from frontend.base.errors import is_anthropic_path
from frontend.batches.models import (
    AnthropicBatchCreate,
    BatchCreate,
    BatchList,
    BatchObject,
    Deleted,
    FileList,
    FileObject,
    MessageBatch,
    MessageBatchList,
)
from frontend.embeddings.embeddings_models import (
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingResponse,
)
from frontend.embeddings.scoring_models import (
    ClassifyRequest,
    ClassifyResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from frontend.engine_client.engine_list import EngineList
from frontend.http.engine_ops import ClockOffset, EnergyMetrics, ProfileStopped
from frontend.responses import models as responses_models
from frontend.responses.conversation_models import (
    Conversation,
    ConversationCreate,
    ConversationUpdate,
    DeletedConversation,
    ItemList,
    ItemsCreate,
)
from frontend.responses.models import InputTokensRequest, ResponsesRequest
from postproc.openai_shapes import (
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)

REF = "#/components/schemas/{name}"
# Fields known but not run here: any value but these (the default, values meaning the same,
# and null, which means the default) is a 400, so the document says so.
_UNSUPPORTED: dict[type, tuple[tuple[str, Any], ...]] = {
    ChatCompletionRequest: api_models.UNSUPPORTED_WHEN_SET
    + api_models.CHAT_UNSUPPORTED_WHEN_SET,
    CompletionRequest: api_models.UNSUPPORTED_WHEN_SET
    + api_models.COMPLETION_UNSUPPORTED_WHEN_SET,
    ResponsesRequest: responses_models.UNSUPPORTED_WHEN_SET,
    MessagesRequest: tuple((name, None) for name in anthropic_models.UNSUPPORTED_WHEN_SET),
    CountTokensRequest: tuple((name, None) for name in anthropic_models.UNSUPPORTED_WHEN_SET),
}
_NEUTRAL = {**api_models.NEUTRAL_VALUES, **responses_models.NEUTRAL_VALUES}


class Operation(NamedTuple):
    method: str
    path: str
    summary: str
    body: type | None = None  # the request Struct; None: no body
    answer: type | None = None  # the 200 body's Struct, where it has one
    streams: bool = False  # `"stream": true` answers with server-sent events
    answer_type: str = "application/json"


OPERATIONS: tuple[Operation, ...] = (
    Operation("get", "/health", "200 while the engine is reachable and not draining, else 503 "
              "(with a JSON reason when the engine serves another model or tokenizer)",
              answer_type=""),
    Operation("get", "/ping", "SageMaker's health check: the same answer as /health",
              answer_type=""),
    Operation("post", "/ping", "SageMaker's health check: the same answer as /health",
              answer_type=""),
    Operation("get", "/load", "Requests being answered now: {\"server_load\": N}"),
    Operation("get", "/health_generate", "TensorRT-LLM's: a one-token generation through the "
              "stack; 200, or 503 past --health-generate-timeout", answer_type="text/plain"),
    Operation("get", "/server_info", "TensorRT-LLM's: disaggregated_params (null here), model, "
              "version, steady-clock offset, live engines"),
    Operation("get", "/steady_clock_offset", "TensorRT-LLM's: the steady clock at arrival and "
              "answer: {\"receive_ts\", \"transmit_ts\"}"),
    Operation("post", "/steady_clock_offset", "TensorRT-LLM's: record a router's clock offset",
              ClockOffset, answer_type=""),
    Operation("post", "/start_profile", "Start the torch profiler in every engine (404 without "
              "--profile-dir)", answer_type=""),
    Operation("post", "/stop_profile", "Stop it; each engine's trace file", answer=ProfileStopped),
    Operation("get", "/energy_metrics", "Energy counters of each engine's machine (404: none)",
              answer=EnergyMetrics),
    Operation("post", "/kv_cache_events", "TensorRT-LLM's: the engines' KV events since the "
              "last call (created, stored, removed), as trtllm-serve's list"),
    Operation("post", "/reset_prefix_cache", "vLLM's: every engine forgets its cached prefixes "
              "(409 while requests run)", answer_type=""),
    Operation("get", "/version", "The server's version"),
    Operation("get", "/metrics", "Prometheus metrics", answer_type="text/plain"),
    Operation("get", "/openapi.json", "This document"),
    Operation("get", "/v1/models", "The served model", answer=ModelList),
    Operation("get", "/v1/engines", "The engines as this frontend sees them: state, load, KV "
              "pages, LoRA adapters, moves and its requests on each (llama-server's /slots)",
              answer=EngineList),
    Operation("get", "/v1/models/{model_id:path}", "One served model by name (404 if unknown)",
              answer=ModelCard),
    Operation("post", "/v1/chat/completions", "OpenAI chat completion",
              ChatCompletionRequest, streams=True),
    Operation("post", "/v1/completions", "OpenAI (legacy) text completion",
              CompletionRequest, streams=True),
    Operation("post", "/v1/responses", "OpenAI Responses API: create a response",
              ResponsesRequest, streams=True),
    Operation("post", "/v1/responses/input_tokens", "Input tokens a response would take",
              InputTokensRequest),
    Operation("post", "/v1/responses/compact", "Not supported: always 404"),
    Operation("get", "/v1/responses/{response_id}", "A stored response; with stream=true "
              "(and starting_after=N), a background response's events, stored then live"),
    Operation("delete", "/v1/responses/{response_id}", "Delete a stored response"),
    Operation("post", "/v1/responses/{response_id}/cancel",
              "Cancel a background response (any frontend on the same state store)"),
    Operation("get", "/v1/responses/{response_id}/input_items",
              "A stored response's input items (limit, order, after)"),
    Operation("post", "/v1/conversations", "OpenAI Conversations API: create a conversation "
              "(items, metadata)", ConversationCreate, answer=Conversation),
    Operation("get", "/v1/conversations/{conversation_id}", "A conversation",
              answer=Conversation),
    Operation("post", "/v1/conversations/{conversation_id}", "Update a conversation's metadata",
              ConversationUpdate, answer=Conversation),
    Operation("delete", "/v1/conversations/{conversation_id}", "Delete a conversation",
              answer=DeletedConversation),
    Operation("get", "/v1/conversations/{conversation_id}/items",
              "A conversation's items (limit, order, after)", answer=ItemList),
    Operation("post", "/v1/conversations/{conversation_id}/items",
              "Add items to a conversation (at most 20 at a time)", ItemsCreate,
              answer=ItemList),
    Operation("get", "/v1/conversations/{conversation_id}/items/{item_id}",
              "One item of a conversation"),
    Operation("delete", "/v1/conversations/{conversation_id}/items/{item_id}",
              "Delete one item of a conversation (answers with the conversation)",
              answer=Conversation),
    Operation("post", "/v1/messages", "Anthropic Messages API", MessagesRequest, streams=True),
    Operation("post", "/v1/messages/count_tokens", "Input tokens a message would take",
              CountTokensRequest),
    Operation("get", "/v1/messages/batches", "Anthropic Message Batches: the caller's "
              "(limit, after_id)", answer=MessageBatchList),
    Operation("post", "/v1/messages/batches", "Create a message batch", AnthropicBatchCreate,
              answer=MessageBatch),
    Operation("get", "/v1/messages/batches/{batch_id}/results",
              "An ended batch's results, JSONL", answer_type="application/binary"),
    Operation("post", "/v1/messages/batches/{batch_id}/cancel", "Cancel a message batch",
              answer=MessageBatch),
    Operation("get", "/v1/messages/batches/{batch_id}", "A message batch",
              answer=MessageBatch),
    Operation("delete", "/v1/messages/batches/{batch_id}", "Delete an ended message batch"),
    Operation("post", "/v1/files", "Upload a JSONL file (multipart: file, purpose batch)",
              answer=FileObject),
    Operation("get", "/v1/files", "The caller's files (purpose, limit, order, after)",
              answer=FileList),
    Operation("get", "/v1/files/{file_id}", "A file", answer=FileObject),
    Operation("delete", "/v1/files/{file_id}", "Delete a file", answer=Deleted),
    Operation("get", "/v1/files/{file_id}/content", "A file's bytes",
              answer_type="application/octet-stream"),
    Operation("post", "/v1/batches", "Create a batch from an uploaded file", BatchCreate,
              answer=BatchObject),
    Operation("get", "/v1/batches", "The caller's batches (limit, after)", answer=BatchList),
    Operation("get", "/v1/batches/{batch_id}", "A batch", answer=BatchObject),
    Operation("post", "/v1/batches/{batch_id}/cancel", "Cancel a batch", answer=BatchObject),
    Operation("post", "/invocations", "SageMaker's route: a chat completion when the body "
              "has messages, else a completion when it has prompt", streams=True),
    Operation("post", "/v1/embeddings", "OpenAI embeddings (a pooling model; 404 on a "
              "generating one)", EmbeddingRequest, answer=EmbeddingResponse),
    Operation("post", "/pooling", "vLLM's pooling: an embeddings request answered with the "
              "pooled vectors (a pooling model; 404 on a generating one)", EmbeddingRequest,
              answer=PoolingResponse),
    *(Operation("post", path, "vLLM's score: text pairs to relevance scores (a "
                "cross-encoder; 404 on other models)", ScoreRequest, answer=ScoreResponse)
      for path in ("/score", "/v1/score")),
    *(Operation("post", path, "Rerank documents against a query, best first (a "
                "cross-encoder; 404 on other models)", RerankRequest, answer=RerankResponse)
      for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    Operation("post", "/classify", "vLLM's classify: texts to label probabilities (a "
              "cross-encoder; 404 on other models)", ClassifyRequest, answer=ClassifyResponse),
    Operation("post", "/tokenize", "vLLM's /tokenize: a prompt or chat messages to token ids",
              TokenizeRequest, answer=TokenizeResponse),
    Operation("post", "/detokenize", "vLLM's /detokenize: token ids to text",
              DetokenizeRequest, answer=DetokenizeResponse),
)


def document(model_name: str, version: str) -> dict[str, Any]:
    """The whole OpenAPI 3.1 document, as a JSON-ready dict."""
    types = [t for op in OPERATIONS for t in (op.body, op.answer) if t is not None]
    refs, components = msgspec.json.schema_components(
        [*types, ErrorResponse, ErrorBody], ref_template=REF)
    ref_of = dict(zip([*types, ErrorResponse, ErrorBody], refs, strict=True))
    for op in OPERATIONS:
        if op.body is not None:
            _pin_model(components[op.body.__name__], model_name)
            _pin_unsupported(components[op.body.__name__], _UNSUPPORTED.get(op.body, ()))
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(_openapi_path(op.path), {})[op.method] = _operation(op, ref_of)
    return {
        "openapi": "3.1.0",
        "info": {"title": "sluice", "version": version,
                 "description": "OpenAI- and Anthropic-compatible LLM serving."},
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "paths": paths,
        "components": {"schemas": components},
    }


def endpoint(model_name: str, version: str):
    """The `GET /openapi.json` handler: the document, encoded once."""
    body = msgspec.json.encode(document(model_name, version))

    async def openapi_json(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return openapi_json


def _openapi_path(path: str) -> str:
    """Starlette's `{name:path}` (a parameter that may hold slashes) is OpenAPI's `{name}`."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


def _operation(op: Operation, ref_of: dict[type, dict]) -> dict[str, Any]:
    path = _openapi_path(op.path)
    name = path.strip("/").replace("/", "_").replace("{", "").replace("}", "").replace(".", "_")
    spec: dict[str, Any] = {"operationId": f"{op.method}_{name}", "summary": op.summary}
    parameters = [
        {"name": part[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
        for part in path.split("/") if part.startswith("{")
    ]
    if parameters:
        spec["parameters"] = parameters
    if op.body is not None:
        spec["requestBody"] = {"required": True,
                               "content": {"application/json": {"schema": ref_of[op.body]}}}
    ok: dict[str, Any] = {"description": "OK"}
    if op.answer_type:
        content = {op.answer_type: {"schema": ref_of[op.answer]} if op.answer else {}}
        if op.streams:
            content["text/event-stream"] = {}
        ok["content"] = content
    error = ref_of[ErrorBody] if is_anthropic_path(op.path) else ref_of[ErrorResponse]
    failed = {"content": {"application/json": {"schema": error}}}
    spec["responses"] = {
        "200": ok,
        "4XX": {"description": "The request was refused", **failed},
        "5XX": {"description": "Overloaded, timed out or failed", **failed},
    }
    return spec


def _pin_model(component: dict[str, Any], model_name: str) -> None:
    """A request's `model` may only name the served model (or be left out, where optional)."""
    field = component.get("properties", {}).get("model")
    if field is None:
        return
    for alternative in field.get("anyOf", [field]):
        if alternative.get("type") == "string":
            alternative["enum"] = [model_name]


def _pin_unsupported(component: dict[str, Any], fields: tuple[tuple[str, Any], ...]) -> None:
    properties = component.get("properties", {})
    for name, default in fields:
        if name in properties:
            allowed = [default, *_NEUTRAL.get(name, ()), *([] if default is None else [None])]
            properties[name] = {"enum": allowed, "default": default,
                                "description": "Not supported by this server: any other "
                                               "value is a 400."}
