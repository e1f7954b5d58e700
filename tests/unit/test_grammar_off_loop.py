"""Grammars are built off the event loop (seed 000-51, issue 57): a request whose tool
grammar takes long to build (here: tools of near-limit schemas under tool_choice
"required", refused by the size check only once built) holds up no other request's
grammar, nor anything else the loop runs."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from frontend.base.api_models import ChatCompletionRequest
from frontend.base.errors import APIError
from frontend.input.structured import StructuredSettings, constraint_for

SETTINGS = StructuredSettings(tool_call_parser="hermes")
SCHEMA = {"type": "object", "properties": {
    f"p{i}": {"type": "string", "enum": [f"v{i}a", f"v{i}b"]} for i in range(900)}}


def _chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def test_a_slow_grammar_build_does_not_hold_up_the_loop():
    huge = _chat(tool_choice="required", tools=[
        {"type": "function", "function": {"name": f"t{k}", "parameters": SCHEMA}}
        for k in range(24)])
    small = _chat(response_format={"type": "json_object"})
    done: list[str] = []

    async def both() -> None:
        big = asyncio.create_task(constraint_for(huge, SETTINGS))
        big.add_done_callback(lambda _: done.append("huge"))
        await asyncio.sleep(0)  # the huge one begins to build (on the loop, it ends there)
        quick = asyncio.create_task(constraint_for(small, SETTINGS))
        quick.add_done_callback(lambda _: done.append("small"))
        assert (await quick).kind == "json_object"
        with pytest.raises(APIError) as refused:
            await big
        assert refused.value.status == 400 and "too large" in refused.value.message

    asyncio.run(both())
    # The small request, sent while the huge one built, had its grammar first.
    assert done == ["small", "huge"]
