"""Structured outputs and forced tool calls: a request -> one llguidance grammar (req P-6,
P-8, C-1 to C-3).

A request's own constraint comes from at most one of: `response_format` (json_object,
json_schema), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) or the
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. Chat tools add
theirs: `tool_choice: "required"` forces at least one call of a declared tool, a named
`tool_choice` forces that function (its begin marker is injected after the prompt, and the
grammar covers the rest of the call), and strict tools under `"auto"` constrain a call's
arguments once the model opens one (only when the request has no constraint of its own).
Tool grammars are spelled by the configured tool-call parser (`--tool-call-parser`).

Every grammar is first held to the limits of `shared.grammar_limits` (a 400 naming the field
past one), then checked by llguidance the way the engine will run it (compiled against the
model's tokenizer, first mask computed) in `frontend.input.grammar_check`'s worker processes, once
per request: a bad schema, regex or grammar is a 400 quoting llguidance's message before the
engine sees it, and a grammar that crashes llguidance costs only its own request.

Building a grammar (seed 000-51) is off the event loop too, on threads of its own: it is
Python (128 tools of near-limit schemas take seconds before the size check refuses them),
which yields the GIL every few milliseconds, so the loop goes on answering others meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import msgspec
from llguidance import LLMatcher, grammar_from

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from frontend.base.errors import APIError, bad_request
from frontend.input.harmony_grammar import harmony_answer_source
from postproc.reasoning import get_reasoning_parser
from postproc.tool_parsers import ToolParser, get_tool_parser
from shared.grammar_limits import (
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    DeepStackThreads,
    grammar_problem,
    parsed_schema,
    schema_problem,
    validation_problem,
)
from shared.grammar_parts import bounded_schema, regex_literal
from shared.protocol import Constraint
from shared.tool_specs import FunctionDefinition, repeated_name, tools_by_name

Request = ChatCompletionRequest | CompletionRequest

# JSON layout for schemas: the spacing models write and no free whitespace, which a small
# model could otherwise repeat until it runs out of tokens. A schema's own x-guidance wins.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = {"type": "object"}


class StructuredSettings(msgspec.Struct, frozen=True):
    """Server-wide choices, fixed at start-up."""

    tool_call_parser: str | None = None  # --tool-call-parser: how forced calls are spelled
    reasoning_parser: str | None = None  # --reasoning-parser: its thinking stays free (C-1)
    # llguidance's LLTokenizer for the model: validation then also checks special tokens and
    # token-level limits. None: grammar-only validation (the engine checks the rest).
    tokenizer: Any = None
    # frontend.input.grammar_check.GrammarChecker: validation in worker processes. None: on a
    # thread of this process (unit tests).
    checker: Any = None


class _Source(msgspec.Struct):
    """One place in the request that asks for a constraint."""

    param: str
    kind: str
    build: Callable[[], str]  # -> llguidance grammar; ValueError for malformed input


# ---------------------------------------------------------------- checks (no prompt needed)


def check_structured(request: Request, settings: StructuredSettings) -> None:
    """P-6 combinations and what the server must be configured for."""
    own = _sources(request)
    if len(own) > 1:
        names = ", ".join(s.param for s in own)
        raise bad_request(
            f"only one structured output constraint may be given; got {names}", own[1].param
        )
    if isinstance(request, ChatCompletionRequest):
        _check_tools(request, settings, has_own=bool(own))


def _check_tools(request: ChatCompletionRequest, settings: StructuredSettings,
                 *, has_own: bool) -> None:
    check_tool_names([t.function.name for t in request.tools or ()], "tools[{}].function.name")
    choice = request.tool_choice
    if choice == "none" or not request.tools:
        return  # tool_choice without tools is refused with the other P-6 checks
    if settings.tool_call_parser is None:
        raise bad_request(
            "tools need a tool-call parser, and this server has none: start it with "
            "--tool-call-parser (e.g. hermes), or send tool_choice \"none\"", "tools")
    named = _named_function(choice)
    if named is not None and named not in tools_by_name(request.tools):
        raise bad_request(f"tool_choice names {named!r}, which is not among the tools",
                          "tool_choice.function.name")
    forced = named is not None or choice == "required"
    if forced and has_own:
        raise bad_request(
            "a forced tool call (tool_choice required or a named function) cannot be combined "
            "with response_format or structured outputs", "tool_choice")
    strict = any(t.function.strict is True for t in request.tools)
    if strict and has_own:
        # Each needs the whole output's grammar; picking one would silently drop the other.
        raise bad_request(
            "strict tools (tools[].function.strict true) cannot be combined with "
            "response_format or structured outputs: both constrain the whole answer; send "
            "one of them", "response_format")
    parser = get_tool_parser(settings.tool_call_parser)
    if forced and not parser.begin_lark:
        raise bad_request(
            f"the {parser.name} tool-call parser has no grammar to force a call with; "
            'use tool_choice "auto" or "none"', "tool_choice")


def check_tool_names(names: list[str], field: str) -> None:
    """Every API's tools, after their shapes decoded: a 400 naming the second of two tools
    with one name. `field` is the name's path with `{}` for the tool's index."""
    i = repeated_name(names)
    if i is not None:
        raise bad_request(f"{field.format(i)}: {names[i]!r} is the name of an earlier tool; "
                          "tool names must be unique", field.format(i))


def forces_call(request: Request) -> bool:
    """Whether the request forces a tool call: tool_choice "required" or a named function."""
    return (isinstance(request, ChatCompletionRequest) and bool(request.tools)
            and (request.tool_choice == "required" or _named_function(request.tool_choice)
                 is not None))


def _named_function(choice: Any) -> str | None:
    return choice.function.name if isinstance(choice, NamedToolChoice) else None


# ---------------------------------------------------------------- the constraint


class Translated(msgspec.Struct, frozen=True):
    """A request's grammar before llguidance has checked it; `param` names its field."""

    param: str
    kind: str
    grammar: str


def translate(request: Request, settings: StructuredSettings,
              in_reasoning: bool = False) -> Translated | None:
    """The request's grammar (own constraint, else forced or strict tools), held to the
    limits but not yet checked by llguidance. `in_reasoning`: the rendered prompt leaves the
    output inside a thinking section (a template that pre-fills `<think>`)."""
    own = _sources(request)
    source = own[0] if own else _tool_source(request, settings, in_reasoning)
    if own and settings.reasoning_parser == "openai_gptoss":
        source = harmony_answer_source(request, source)  # the final channel only
    if source is None:
        return None
    try:
        grammar = source.build()
    except (ValueError, TypeError, RecursionError) as exc:
        raise bad_request(f"invalid {source.param}: {exc}", source.param) from exc
    problem = grammar_problem(grammar)
    if problem is not None:
        raise bad_request(f"{source.param} is too large: {problem}", source.param)
    return Translated(source.param, source.kind, grammar)


async def constraint_for(request: Request, settings: StructuredSettings,
                         in_reasoning: bool = False) -> Constraint | None:
    """The request's constraint, checked by llguidance off the event loop (once per
    request: every prompt and candidate of it shares the result), built off the loop."""
    translated = await asyncio.wrap_future(
        _build_threads().submit(translate, request, settings, in_reasoning))
    if translated is None:
        return None
    if settings.checker is None:
        future = _local_threads().submit(validation_problem, settings.tokenizer,
                                          translated.grammar)
        problem = await asyncio.wrap_future(future)
    else:
        from frontend.input.grammar_check import GrammarCheckFailed, GrammarCheckUnavailable

        try:
            problem = await settings.checker.problem(translated.grammar)
        except GrammarCheckFailed as exc:
            problem = str(exc)
        except GrammarCheckUnavailable as exc:
            raise APIError(503, str(exc)) from exc
    return _checked(translated, problem)


def build_constraint(request: Request, settings: StructuredSettings,
                     in_reasoning: bool = False) -> Constraint | None:
    """`constraint_for` for callers without an event loop (tests): checked in this process."""
    translated = translate(request, settings, in_reasoning)
    if translated is None:
        return None
    future = _local_threads().submit(validation_problem, settings.tokenizer, translated.grammar)
    return _checked(translated, future.result())


def _checked(translated: Translated, problem: str | None) -> Constraint:
    if problem is not None:
        raise bad_request(f"invalid {translated.param}: {problem}", translated.param)
    return Constraint(translated.kind, translated.grammar)


_threads: DeepStackThreads | None = None
_builders: DeepStackThreads | None = None
BUILD_THREADS = 2  # one huge build holds one; another request's grammar takes the other


def _build_threads() -> DeepStackThreads:
    """Daemon threads: a build still running never holds up the frontend's exit."""
    global _builders
    _builders = _builders or DeepStackThreads(BUILD_THREADS, "grammar-build")
    return _builders


def _local_threads() -> DeepStackThreads:
    global _threads
    if _threads is None:
        _threads = DeepStackThreads(1, "grammar-check")
    return _threads


def forced_call_prefix(request: ChatCompletionRequest, settings: StructuredSettings) -> str:
    """What a named tool_choice injects after the rendered prompt: the parser's begin marker
    (C-3); the grammar then constrains the rest of the call."""
    if _named_function(request.tool_choice) is None or not request.tools:
        return ""
    if settings.tool_call_parser is None:
        return ""
    return get_tool_parser(settings.tool_call_parser).begin_marker


# ---------------------------------------------------------------- the request's own sources


def _sources(request: Request) -> list[_Source]:
    found: list[_Source] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None and response_format.type != "text":
        found.append(_response_format_source(response_format))
    so = request.structured_outputs
    if so is not None:
        ws = so.whitespace_pattern
        if so.disable_additional_properties:
            raise bad_request("structured_outputs.disable_additional_properties is not "
                              "supported; set additionalProperties in the schema",
                              "structured_outputs")
        found += _kinds("structured_outputs.", so.json, so.regex, so.choice, so.grammar, ws)
        if so.json_object:
            found.append(_Source("structured_outputs.json_object", "json_object",
                                 lambda: _json_grammar(_ANY_OBJECT, strict=True, ws=ws)))
        if so.structural_tag is not None:
            raise bad_request("structured_outputs.structural_tag is not supported",
                              "structured_outputs")
    found += _kinds("guided_", request.guided_json, request.guided_regex, request.guided_choice,
                    request.guided_grammar, None)
    return found


def _kinds(prefix: str, schema, regex, choice, grammar, ws) -> list[_Source]:
    out = []
    if schema is not None:
        out.append(_Source(prefix + "json", "json_schema",
                           lambda: _json_grammar(parsed_schema(schema), strict=False, ws=ws)))
    if regex is not None:
        out.append(_Source(prefix + "regex", "regex", lambda: _regex_grammar(regex)))
    if choice is not None:
        out.append(_Source(prefix + "choice", "choice", lambda: _choice_grammar(choice)))
    if grammar is not None:
        out.append(_Source(prefix + "grammar", "grammar", lambda: _grammar(grammar)))
    return out


def _regex_grammar(regex: str) -> str:
    if len(regex) > MAX_REGEX_CHARS:
        raise ValueError(f"the regex has {len(regex)} characters; at most {MAX_REGEX_CHARS} "
                         "are allowed")
    return grammar_from("regex", regex)


def _grammar(text: str) -> str:
    # Before the GBNF-to-Lark conversion, which is Python and takes time in the text's size.
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the grammar has {len(text)} characters; at most "
                         f"{MAX_GRAMMAR_CHARS} are allowed")
    return grammar_from("grammar", text)


def _response_format_source(fmt) -> _Source:
    if fmt.type == "json_object":
        return _Source("response_format", "json_object",
                       lambda: _json_grammar(_ANY_OBJECT, strict=True))
    spec = fmt.json_schema
    if spec is None:
        raise bad_request("response_format json_schema needs a json_schema object",
                          "response_format")
    schema = _ANY_OBJECT if spec.schema is None else spec.schema
    # strict: every keyword must be enforced (one llguidance cannot is a 400); otherwise the
    # schema guides as far as llguidance supports it.
    return _Source("response_format.json_schema", "json_schema",
                   lambda: _json_grammar(parsed_schema(schema), strict=bool(spec.strict)))


def _json_grammar(schema: dict | bool, *, strict: bool, ws: str | None = None) -> str:
    # Numbers the schema leaves open get at most 16 integral and 10 fraction digits.
    schema = bounded_schema(schema)
    layout = dict(_JSON_LAYOUT, lenient=not strict)
    if ws is not None:
        layout.update(whitespace_flexible=True, whitespace_pattern=ws)
    return LLMatcher.grammar_from_json_schema(schema, defaults=layout)


def _choice_grammar(choices: list[str]) -> str:
    if not choices:
        raise ValueError("the list of choices is empty")
    return grammar_from("lark", "start: " + " | ".join(_lark_string(c) for c in choices))


def _lark_string(text: str) -> str:
    return json.dumps(text)


# ---------------------------------------------------------------- tools (C-1 to C-3)


def _tool_source(request: Request, settings: StructuredSettings,
                 in_reasoning: bool) -> _Source | None:
    if not isinstance(request, ChatCompletionRequest) or not request.tools:
        return None
    choice = request.tool_choice
    if choice == "none" or settings.tool_call_parser is None:
        return None
    parser = get_tool_parser(settings.tool_call_parser).for_vocabulary(settings.tokenizer)
    if not parser.begin_lark:
        return None  # forced calls were refused by the checks; auto stays free
    functions = tools_by_name(request.tools)
    _check_tool_schemas(functions)
    named = _named_function(choice)
    if named is not None:
        chosen = {named: functions[named]}
        return _Source("tool_choice", "tools", lambda: _named_grammar(parser, chosen))
    if choice == "required":
        once = request.parallel_tool_calls is False
        thinking = _thinking_lark(settings, inside=in_reasoning)
        return _Source("tool_choice", "tools", lambda: _required_grammar(
            parser, functions, once=once, thinking=thinking, inside=in_reasoning))
    if any(f.strict is True for f in functions.values()):
        return _Source("tools", "tools", lambda: _strict_grammar(parser, functions))
    return None


def _check_tool_schemas(functions: dict[str, FunctionDefinition]) -> None:
    for i, (name, function) in enumerate(functions.items()):
        problem = schema_problem(function.parameters)
        if problem is not None:
            raise bad_request(f"the parameters of tool {name!r} are too large: {problem}",
                              f"tools[{i}].function.parameters")


def _arguments_schema(function: FunctionDefinition, *, strict_only: bool) -> dict:
    if strict_only and function.strict is not True:
        return _ANY_OBJECT  # C-2: only strict tools' arguments are held to their schema
    return _ANY_OBJECT if function.parameters is None else function.parameters


def _all_strict(functions: dict[str, FunctionDefinition]) -> bool:
    return all(f.strict is True for f in functions.values())


def _named_grammar(parser: type[ToolParser], functions: dict[str, FunctionDefinition]) -> str:
    """The prompt already ends with the begin marker: the output is the rest of one call."""
    schemas = {n: _arguments_schema(f, strict_only=False) for n, f in functions.items()}
    rules = parser.call_grammar(schemas, strict=_all_strict(functions))
    return grammar_from("lark", f"start: call{_end(parser)}\n" + rules)


def _required_grammar(parser: type[ToolParser], functions: dict[str, FunctionDefinition], *,
                      once: bool, thinking: str | None, inside: bool) -> str:
    """At least one call (exactly one when parallel_tool_calls is false), right away or
    after one thinking section as the reasoning parser reads it (`thinking`: its Lark rules
    for `think`, None without a reasoning parser). `inside`: the prompt opened the section, so
    it must close before the call (a call written inside it would be read as thinking);
    otherwise the section is optional and opens with the think-start tag, so output that is
    not thinking is held to the call from its first token."""
    schemas = {n: _arguments_schema(f, strict_only=False) for n, f in functions.items()}
    rules = parser.call_grammar(schemas, strict=_all_strict(functions))
    more = ("" if once else f" ({parser.next_call_lark} call)*") + _end(parser)
    calls = f"{parser.begin_lark} call{more}"
    if thinking is None:
        return grammar_from("lark", f"start: {calls}\n" + rules)
    # A few blank characters between thinking and the call: unbounded whitespace let a
    # small model write blanks (Unicode ones too) until max_tokens instead of the call.
    think = "think /[ \\t\\r\\n]{0,8}/"
    start = f"start: {think} {calls}\n" if inside else f"start: ({think})? {calls}\n"
    return grammar_from("lark", start + thinking + rules)


def _strict_grammar(parser: type[ToolParser], functions: dict[str, FunctionDefinition]) -> str:
    """Free text, but once the model opens a call it must be one of the tools, and a strict
    tool's arguments follow its schema (a triggered grammar, C-2)."""
    schemas = {n: _arguments_schema(f, strict_only=True) for n, f in functions.items()}
    rules = parser.call_grammar(schemas, strict=True)
    custom = parser.strict_start_lark()
    if custom is not None:
        start = custom
    elif parser.calls_at_start:  # calls open the output or not at all (pythonic)
        marker = regex_literal(parser.begin_marker)
        # Nor may the text spell a delimiter that would open calls later (<|python_start|>).
        delims = "|".join(regex_literal(d) for d in parser.delimiters) or "[^\\s\\S]"
        start = (f"start: /\\s*/ {parser.begin_lark} call ({parser.next_call_lark} call)*"
                 f"{_end(parser)} TEXT | FREE\n"
                 f"TEXT: /(?s:.*)/ & ~/(?s:.*)({delims})(?s:.*)/\n"
                 f"FREE: TEXT & ~/\\s*{marker}(?s:.*)/\n")
    elif parser.begin_lark == _lark_string(parser.begin_marker):  # a text marker
        marker = regex_literal(parser.begin_marker)
        start = (f"start: (opening call)* TAIL\n"
                 f"opening[lazy]: /(?s:.*){marker}/\n"
                 f"TAIL: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/\n")
    else:  # a special token: free text can never contain it
        start = f"start: (TEXT {parser.begin_lark} call)* TEXT\nTEXT: /(?s:.*)/\n"
    return grammar_from("lark", start + rules)


def _end(parser: type[ToolParser]) -> str:
    """What closes the run of calls, as a Lark suffix ("" for formats without)."""
    return f" {parser.end_lark}" if parser.end_lark else ""


def _thinking_lark(settings: StructuredSettings, *, inside: bool) -> str | None:
    if settings.reasoning_parser is None:
        return None
    return get_reasoning_parser(settings.reasoning_parser).section_lark(inside=inside)
