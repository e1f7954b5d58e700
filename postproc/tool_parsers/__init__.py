"""Tool-call parsers, registered by name (`--tool-call-parser NAME`).

    parser = get_tool_parser("hermes")(request_tools)   # one per request
    delta = parser.feed(text)       # ToolDelta(content, calls): what can no longer change
    delta = parser.finish()         # at the end of the output
    parsed = parser.parse(text)     # one-shot: ParsedTools(content, calls)

See docs/parsers.md.
"""

from __future__ import annotations

from postproc.parser_registry import lookup, registry
from postproc.tool_parsers.base import (
    FunctionCall,
    FunctionCallDelta,
    ParsedTools,
    ToolCall,
    ToolCallDelta,
    ToolDelta,
    ToolParser,
    collect,
)
from postproc.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from postproc.tool_parsers.glm45 import Glm45ToolParser
from postproc.tool_parsers.gpt_oss import OpenAIToolParser
from postproc.tool_parsers.granite import GraniteToolParser
from postproc.tool_parsers.hermes import HermesToolParser
from postproc.tool_parsers.kimi_k2 import KimiK2ToolParser
from postproc.tool_parsers.llama3_json import Llama3JsonToolParser
from postproc.tool_parsers.llama4 import Llama4JsonToolParser, Llama4PythonicToolParser
from postproc.tool_parsers.mistral import MistralToolParser
from postproc.tool_parsers.pythonic import PythonicToolParser
from postproc.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = registry(
    HermesToolParser,
    Llama3JsonToolParser,
    # issue 52's families
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    Glm45ToolParser,
    GraniteToolParser,
    KimiK2ToolParser,
    Llama4JsonToolParser,
    Llama4PythonicToolParser,
    MistralToolParser,
    OpenAIToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError naming the known ones if none."""
    return lookup(TOOL_PARSERS, name, "tool-call parser")


__all__ = [
    "TOOL_PARSERS",
    "FunctionCall",
    "FunctionCallDelta",
    "ParsedTools",
    "ToolCall",
    "ToolCallDelta",
    "ToolDelta",
    "ToolParser",
    "collect",
    "get_tool_parser",
]
