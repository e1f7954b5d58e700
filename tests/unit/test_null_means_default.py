"""docs/openai-compat.md: `null` in any field of the OpenAI routes (Responses too) means its
default (OpenAI marks its fields nullable, and clients send them as null)."""

from __future__ import annotations

import msgspec
import pytest

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.responses.models import ResponsesRequest

# The least each body needs besides the field under test.
BASES = {ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]},
         CompletionRequest: {"prompt": "hi"}, ResponsesRequest: {"input": "hi"}}


def _defaulted_fields(cls):
    return [f for f in msgspec.structs.fields(cls)
            if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT]


@pytest.mark.parametrize("cls", list(BASES))
def test_every_field_sent_as_null_takes_its_default(cls):
    for field in _defaulted_fields(cls):
        body = {**BASES[cls], field.name: None}
        decoded = msgspec.convert(body, cls)
        default = (field.default if field.default is not msgspec.NODEFAULT
                   else field.default_factory())
        assert getattr(decoded, field.name) == default, field.name


def test_null_messages_beside_prompt_token_ids_is_a_token_prompt():
    body = b'{"messages": null, "prompt_token_ids": [1, 2, 3]}'
    first = msgspec.json.decode(body, type=ChatCompletionRequest)
    second = msgspec.json.decode(body, type=ChatCompletionRequest)
    assert first.messages == [] and first.prompt_token_ids == [1, 2, 3]
    first.messages.append("x")
    assert second.messages == []  # a default list is each request's own
