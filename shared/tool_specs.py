"""A request's tools as Structs: what the frontend checks, templates render and parsers read.

A chat request's `tools` decode into `ChatTool`s, so a tool of the wrong shape is a 400 naming
its path (`tools[0].function.name`) like every other field. The Responses and Anthropic
Messages APIs declare their tools in their own shapes, with the same `ToolName` and the same
types for description and parameters, and are translated into `ChatTool`s; every API then
refuses a repeated name (`repeated_name`). The postproc workers read the same Structs back
from the JSON the frontend sends them, so a tool that passed the checks is never dropped on
the way to a grammar or a parser.

Names follow vLLM rather than OpenAI: any non-empty string of at most 64 characters (OpenAI
also limits the characters to `a-z A-Z 0-9 _ -`; MCP bridges send dotted names).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

MAX_TOOL_NAME_CHARS = 64
ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TOOL_NAME_CHARS)]


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, kw_only=True,
                         omit_defaults=True):
    """A chat tool's `function`. Fields left out stay out of what templates see."""

    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # True: calls' arguments are held to `parameters` (req C-2)


class ChatTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One entry of a chat request's `tools`. `type` may be left out, as vLLM allows."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


def repeated_name(names: list[str]) -> int | None:
    """The index of the first name an earlier tool already has, or None: a call names its
    function, so two tools with one name could not be told apart."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            return i
        seen.add(name)
    return None


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them: plain dicts, without the fields left out."""
    return None if tools is None else msgspec.to_builtins(tools)


def tools_by_name(tools: list[Any] | None) -> dict[str, FunctionDefinition]:
    """A request's tools (`ChatTool`s, or their JSON as dicts) by function name. The frontend
    has checked them (shapes, unique names): one that does not read as a tool here is a
    ValueError, never left out."""
    typed = msgspec.convert(list(tools or ()), list[ChatTool])
    return {tool.function.name: tool.function for tool in typed}
