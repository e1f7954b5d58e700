"""GET /openapi.json: every route, its request Struct's schema, and a document Schemathesis
loads and can generate requests from."""

from __future__ import annotations

from types import SimpleNamespace

import jsonschema
import msgspec
import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from frontend.base.api_models import ChatCompletionRequest
from frontend.http import openapi
from frontend.http.app import build_app
from shared.config import FrontendConfig

MODEL = "SmolLM2-135M-Instruct"


def _app():
    ctx = SimpleNamespace(client=SimpleNamespace(engine_alive=False, stats=None),
                          model_name=MODEL, vocab_size=49152)
    config = FrontendConfig(model="m", served_model_name=MODEL, engine_address="tcp://x:1")
    return build_app(ctx, config)


def test_the_document_lists_exactly_the_apps_routes():
    routes = {(method.lower(), openapi._openapi_path(route.path)) for route in _app().routes
              if isinstance(route, Route) and route.include_in_schema  # not the web UI
              for method in route.methods if method != "HEAD"}
    documented = {(method, path) for path, item in openapi.document(MODEL, "0")["paths"].items()
                  for method in item}
    assert documented == routes


def test_served_without_the_engine():
    # No lifespan: the route needs no engine, and the document is plain JSON.
    response = TestClient(_app()).get("/openapi.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json()["openapi"] == "3.1.0"


def test_request_bodies_are_the_structs_schemas():
    doc = openapi.document(MODEL, "0")
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False  # forbid_unknown_fields
    # messages may be left out for prompt_token_ids (a 400 when both are missing).
    assert chat.get("required", []) == [] and "messages" in chat["properties"]
    assert set(chat["properties"]) == {f.encode_name
                                       for f in msgspec.structs.fields(ChatCompletionRequest)}


def test_model_is_pinned_to_the_served_name():
    schemas = openapi.document(MODEL, "0")["components"]["schemas"]
    assert {"type": "string", "enum": [MODEL]} in schemas["ChatCompletionRequest"][
        "properties"]["model"]["anyOf"]
    assert schemas["MessagesRequest"]["properties"]["model"] == {"type": "string",
                                                                 "enum": [MODEL]}


def test_unsupported_fields_admit_only_what_the_server_takes():
    schemas = openapi.document(MODEL, "0")["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["audio"]["enum"] == [None]
    assert schemas["CompletionRequest"]["properties"]["suffix"]["enum"] == [None]
    assert schemas["ResponsesRequest"]["properties"]["prompt"]["enum"] == [None]
    assert schemas["MessagesRequest"]["properties"]["mcp_servers"]["enum"] == [None]


def test_errors_are_declared_in_each_apis_shape():
    paths = openapi.document(MODEL, "0")["paths"]
    openai_error = paths["/v1/completions"]["post"]["responses"]["4XX"]
    anthropic_error = paths["/v1/messages"]["post"]["responses"]["5XX"]
    assert openai_error["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ErrorResponse")
    assert anthropic_error["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ErrorBody")


def test_every_schema_is_valid_json_schema():
    doc = openapi.document(MODEL, "0")
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


def _examples(operation, count: int = 3) -> list:
    from hypothesis import HealthCheck, given, settings

    seen = []

    @settings(max_examples=count, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy())
    def draw(case):
        seen.append(case)

    draw()
    return seen


def test_schemathesis_loads_it_and_generates_every_operation():
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_dict(openapi.document(MODEL, "0"))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == len(openapi.OPERATIONS)
    for operation in operations:
        seen = _examples(operation)
        assert seen, operation.label
        if operation.label == "POST /v1/messages":
            assert all(case.body["model"] == MODEL for case in seen)
