"""Structured output for gpt-oss (the Harmony format): `response_format` constrains only the
`final` channel's message. The output may first think in one `analysis` message, freely;
then it must open the final channel, and its body is held to the JSON schema. Other
structured-output kinds (regex, choice, grammar) still constrain the whole output."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
from llguidance import grammar_from

from postproc.reasoning.gpt_oss import GptOssReasoningParser
from shared.grammar_limits import parsed_schema
from shared.grammar_parts import json_layout


class AnswerSource(msgspec.Struct):
    param: str
    kind: str
    build: Callable[[], str]


def harmony_answer_source(request: Any, source: Any) -> Any:
    """`source` (the request's own constraint) moved into the final channel when it is a
    response_format; any other source is returned as it is."""
    fmt = getattr(request, "response_format", None)
    if source is None or fmt is None or not source.param.startswith("response_format"):
        return source
    if fmt.type == "json_object":
        schema: Any = {"type": "object"}
        strict = True
    else:
        spec = fmt.json_schema
        if spec is None:
            return source  # the generic path reports it
        schema = {"type": "object"} if spec.schema is None else spec.schema
        strict = bool(spec.strict)
    return AnswerSource(source.param, source.kind, lambda: final_json_grammar(schema, strict))


def final_json_grammar(schema: Any, strict: bool) -> str:
    schema = parsed_schema(schema)
    layout = json.dumps(json_layout(schema, strict=strict))
    return grammar_from("lark", 'start: (think /[ \\t\\r\\n]{0,8}/)? <|channel|> "final" '
                        f"<|message|> answer\nanswer: %json {layout}\n"
                        + GptOssReasoningParser.section_lark(inside=False))
