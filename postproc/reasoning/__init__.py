"""Reasoning parsers, registered by name (`--reasoning-parser NAME`).

    parser = get_reasoning_parser("qwen3")(rendered_prompt_text)   # one per request
    delta = parser.feed(text)       # ReasoningDelta(reasoning, content)
    delta = parser.finish()         # at the end of the output
    reasoning, content = parser.parse(text)   # one-shot

See docs/parsers.md.
"""

from __future__ import annotations

from postproc.parser_registry import lookup, registry
from postproc.reasoning.base import ReasoningDelta, ReasoningParser, prompt_think_state
from postproc.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from postproc.reasoning.families import (
    DeepSeekV3ReasoningParser,
    Glm45ReasoningParser,
    GraniteReasoningParser,
    KimiK2ReasoningParser,
)
from postproc.reasoning.gpt_oss import GptOssReasoningParser
from postproc.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = registry(
    DeepSeekR1ReasoningParser, GptOssReasoningParser, Qwen3ReasoningParser,
    DeepSeekV3ReasoningParser, Glm45ReasoningParser, GraniteReasoningParser,
    KimiK2ReasoningParser)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; ValueError naming the known ones if none."""
    return lookup(REASONING_PARSERS, name, "reasoning parser")


__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "get_reasoning_parser",
    "prompt_think_state",
]
