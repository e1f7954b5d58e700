"""The parts grammars are built from, for both tiers that build them: the frontend's
structured outputs and forced calls (`frontend/input/structured.py`, `harmony_grammar.py`)
and the parsers' own call grammars (`postproc/tool_parsers/`, `postproc/reasoning/`).

- JSON schemas as llguidance should hold a model to them: numbers bounded
  (`bound_numbers`, `bounded_schema`, `any_json_object`), local `$ref`s re-rooted where a
  schema is nested (`rebase_refs`), and the layout forced calls are written in
  (`call_json_schema`, `json_layout`).
- Lark text: a literal inside a /regex/ (`regex_literal`), a special token by id
  (`special_token_lark`).

What a grammar may be before llguidance compiles it is `shared/grammar_limits.py`.
"""

from __future__ import annotations

from typing import Any

# JSON layout inside forced calls: the spacing models write, and no free whitespace, which a
# small model could otherwise repeat until it runs out of tokens.
_CALL_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_json_schema(functions: dict[str, Any], arguments_key: str, *, strict: bool) -> dict:
    """JSON schema of `{"name": <one of functions>, arguments_key: <its arguments>}`, for
    llguidance (`%json` in Lark); keys in that order."""
    many = len(functions) > 1
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                # The arguments' local $refs (#/$defs/X, what pydantic writes) point into the
                # arguments schema, which sits deeper here: re-rooted to where it now is.
                arguments_key: rebase_refs(
                    bounded_schema(schema),
                    (f"/anyOf/{i}" if many else "") + f"/properties/{arguments_key}"),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for i, (name, schema) in enumerate(functions.items())
    ]
    body = options[0] if not many else {"anyOf": options}
    return {**body, "x-guidance": {**_CALL_JSON_LAYOUT, "lenient": not strict}}


# Keywords whose values are data, not schemas: a {"$ref": ...} inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})


def rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` (`#...`, a JSON pointer into `schema` itself) made to
    point at the same place once `schema` sits at JSON pointer `base` inside a larger
    document. Without this, a tool whose parameters use `$defs` (pydantic's nested models)
    fails to compile inside a call grammar: `/$defs/X` does not exist at the new root."""
    if isinstance(schema, list):
        return [rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas
            out[key] = {name: rebase_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = rebase_refs(value, base)
    return out


# Digits of a JSON number the grammars let a model write, unless the schema bounds it
# itself: a small model can otherwise write `1111…` until it runs out of tokens. llama.cpp's
# converter caps both parts at 16 digits. llguidance has no option for it, so the schema is
# rewritten: an open side of an integer / number range is closed at ±10**16 (at most 16
# integral digits, no exponent), and a number without `multipleOf` gets `multipleOf: 1e-10`
# (at most 10 fraction digits: llguidance reads multipleOf through a float and refuses any
# finer step, "too many digits").
INTEGRAL_DIGITS = 16
FRACTION_DIGITS = 10
_NUMBER_LIMIT = 10**INTEGRAL_DIGITS
_NUMBER_STEP = float(f"1e-{FRACTION_DIGITS}")


def bound_numbers(schema: Any) -> Any:
    """`schema` with every `integer` / `number` it types held to INTEGRAL_DIGITS integral
    and FRACTION_DIGITS fraction digits, where the schema leaves them open (its own bounds
    and `multipleOf` win)."""
    if isinstance(schema, list):
        return [bound_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: bound_numbers(sub) for name, sub in value.items()}
        else:
            out[key] = bound_numbers(value)
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if not kinds & {"integer", "number"}:
        return out
    low, high = _bound(schema, "minimum", "exclusiveMinimum"), _bound(
        schema, "maximum", "exclusiveMaximum")
    if low is None and (high is None or high > -_NUMBER_LIMIT):
        out["exclusiveMinimum"] = -_NUMBER_LIMIT
    if high is None and (low is None or low < _NUMBER_LIMIT):
        out["exclusiveMaximum"] = _NUMBER_LIMIT
    if "number" in kinds and "multipleOf" not in schema:
        out["multipleOf"] = _NUMBER_STEP
    return out


def _bound(schema: dict, inclusive: str, exclusive: str) -> float | None:
    """The schema's own bound on one side (draft 4's boolean exclusive* included)."""
    for key in (exclusive, inclusive):
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value
    return None


def any_json_object() -> dict:
    """A schema for any JSON object whose numbers are bounded as `bound_numbers` bounds
    them (`{"type": "object"}` would let llguidance's own any-value write endless digits):
    what json_object and tools without parameters are held to."""
    number = bound_numbers({"type": "number"})
    value = {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "string"}, number,
                       {"type": "array", "items": {"$ref": "#/$defs/json_value"}},
                       {"type": "object",
                        "additionalProperties": {"$ref": "#/$defs/json_value"}}]}
    return {"$defs": {"json_value": value}, "type": "object",
            "additionalProperties": {"$ref": "#/$defs/json_value"}}


def bounded_schema(schema: Any) -> Any:
    """What a grammar holds JSON to for `schema`: its numbers bounded (`bound_numbers`), and
    a bare `{"type": "object"}` (json_object, tools without parameters) as `any_json_object`."""
    if schema == {"type": "object"}:
        return any_json_object()
    return bound_numbers(schema)


def json_layout(schema: Any, *, strict: bool) -> dict:
    """A JSON schema for `%json` in a call grammar, with the layout forced calls use."""
    schema = bounded_schema(schema)
    base = schema if isinstance(schema, dict) else {} if schema is True else {"not": {}}
    return {**base, "x-guidance": {**_CALL_JSON_LAYOUT, "lenient": not strict}}


def special_token_lark(tokenizer: Any, text: str) -> str | None:
    """`<[id]>` when `text` is one special token of `tokenizer` (an llguidance LLTokenizer),
    else None (no tokenizer, or the text is ordinary there)."""
    if tokenizer is None:
        return None
    try:
        ids = tokenizer.tokenize_str(text, parse_special=True)
    except (TypeError, ValueError):
        return None
    if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return None


def regex_literal(text: str) -> str:
    """`text` inside a Lark /regex/: regex metacharacters and the slash escaped."""
    out = []
    for ch in text:
        out.append("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch)
    return "".join(out)
