"""A null means the field's default, on every face (chat, completions, Responses, Messages,
tokenize), in every request Struct a body can reach, nested ones included: OpenAI marks its
optional fields nullable and clients send `"seed": null` for "not set", and the vLLM
extensions (`ignore_eos`, `min_tokens`, `priority`, `continue_final_message`, ...) are read
the same way. One place does it (`frontend.base.api_models.NullMeansDefault`); these tests
walk the Structs, so a field added later without it fails here."""

from __future__ import annotations

import msgspec
import pytest
from msgspec import inspect as mi

from frontend.anthropic.api import to_chat as messages_to_chat
from frontend.anthropic.models import CountTokensRequest, MessagesRequest
from frontend.base.api_models import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from frontend.responses.models import InputTokensRequest, ResponsesRequest
from shared.tool_specs import ChatTool

FACES = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, ResponsesRequest,
         InputTokensRequest, MessagesRequest, CountTokensRequest)
# The least body of each Struct with required fields (the others decode from {}).
LEAST = {
    "MessagesRequest": {"model": "m", "messages": [], "max_tokens": 1},
    "CountTokensRequest": {"model": "m", "messages": []},
    "Message": {"role": "user", "content": "x"},
    "ContentBlock": {"type": "text"},
    "Tool": {"name": "t"},
    "ToolChoice": {"type": "auto"},
    "Thinking": {"type": "enabled"},
    "OutputFormat": {"type": "json_schema", "schema": {}},
    "ChatMessage": {"role": "user"},
    "ContentPart": {"type": "text"},
    "ResponseFormat": {"type": "text"},
    "NamedFunction": {"name": "f"},
    "ConversationParams": {"conversation_id": "c"},
    "NamedToolChoice": {"type": "function", "function": {"name": "f"}},
    "FunctionDefinition": {"name": "f"},
    "ChatTool": {"function": {"name": "f"}},
    "InputPart": {"type": "input_text"},
    "FunctionTool": {"type": "function"},
    "TextFormat": {"type": "text"},
    "ConversationRef": {"id": "c"},
}
# A tool's `type` names what the entry is; vLLM refuses a null there too.
NULL_REFUSED = {(ChatTool, "type")}


def _structs() -> list[type]:
    """Every Struct a request body of any face can reach."""
    found: dict[type, None] = {}
    stack = [mi.type_info(face) for face in FACES]
    while stack:
        t = stack.pop()
        if isinstance(t, mi.StructType):
            if t.cls not in found:
                found[t.cls] = None
                stack.extend(f.type for f in t.fields)
        elif isinstance(t, mi.UnionType):
            stack.extend(t.types)
        elif isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
            stack.append(t.item_type)
        elif isinstance(t, mi.DictType):
            stack.append(t.value_type)
        elif isinstance(t, mi.Metadata):
            stack.append(t.type)
    return list(found)


def _defaulted_fields():
    for cls in _structs():
        for field in msgspec.structs.fields(cls):
            if (field.default is not msgspec.NODEFAULT
                    or field.default_factory is not msgspec.NODEFAULT):
                if (cls, field.name) not in NULL_REFUSED:
                    yield pytest.param(cls, field.name, id=f"{cls.__name__}.{field.name}")


def test_every_struct_with_required_fields_has_a_least_body():
    for cls in _structs():
        required = [f.name for f in msgspec.structs.fields(cls) if f.required]
        assert not required or cls.__name__ in LEAST, (cls, required)


@pytest.mark.parametrize("cls, name", list(_defaulted_fields()))
def test_null_decodes_as_the_default(cls, name):
    least = LEAST.get(cls.__name__, {})
    absent = msgspec.json.decode(msgspec.json.encode(least), type=cls)
    null = msgspec.json.decode(msgspec.json.encode({**least, name: None}), type=cls)
    assert null == absent


VLLM_EXTENSIONS = {
    ChatCompletionRequest: ("ignore_eos", "min_tokens", "priority", "continue_final_message",
                            "skip_special_tokens", "spaces_between_special_tokens",
                            "include_stop_str_in_output", "repetition_penalty", "top_k",
                            "min_p", "seed", "add_generation_prompt", "echo",
                            "return_token_ids", "add_special_tokens"),
    ResponsesRequest: ("ignore_eos", "min_tokens", "priority", "continue_final_message",
                       "repetition_penalty", "top_k", "min_p", "seed", "stop", "store",
                       "stream", "presence_penalty", "frequency_penalty"),
}


@pytest.mark.parametrize("cls", list(VLLM_EXTENSIONS))
def test_the_vllm_extensions_are_declared(cls):
    """The fields the issue names exist on their faces (so the walk above reads them)."""
    assert set(VLLM_EXTENSIONS[cls]) <= set(cls.__struct_fields__)


def test_a_messages_request_of_nulls_translates_as_one_without_them():
    least = LEAST["MessagesRequest"] | {"messages": [{"role": "user", "content": "x"}]}
    nulls = {f.name: None for f in msgspec.structs.fields(MessagesRequest) if not f.required}
    absent = msgspec.json.decode(msgspec.json.encode(least), type=MessagesRequest)
    null = msgspec.json.decode(msgspec.json.encode(least | nulls), type=MessagesRequest)
    assert messages_to_chat(null, "r") == messages_to_chat(absent, "r")
    assert null.stream is False


def test_null_messages_beside_prompt_token_ids_is_a_token_prompt():
    body = b'{"messages": null, "prompt_token_ids": [1, 2, 3]}'
    first = msgspec.json.decode(body, type=ChatCompletionRequest)
    second = msgspec.json.decode(body, type=ChatCompletionRequest)
    assert first.messages == [] and first.prompt_token_ids == [1, 2, 3]
    first.messages.append("x")
    assert second.messages == []  # a default list is each request's own
