"""What a grammar may be before it reaches llguidance, and how llguidance runs it: one table,
used by the frontend's validation and by the engine's compile (which trusts no frontend: a
custom client can speak the wire protocol).

Why these bounds. llguidance recurses once per link of a chain of rule references when it
compiles a grammar: a chain of Lark rules (`r0: "a" r1 | "b"`, ...) costs about 3 KiB of stack
per link, a chain of JSON-schema `$ref`s about 8 KiB. On a thread's default 8 MiB stack, some
2,700 chained rules or 1,060 chained `$ref`s overflow it and the process dies (SIGSEGV, no
exception). Nesting inside one rule, regex or schema is already bounded by llguidance itself
("lark grammar too deeply nested", the regex nest limit, serde's recursion limit). So chains are
bounded here by counts (rules, schema nodes, text size), and every llguidance call that
compiles a grammar runs on a thread with `GRAMMAR_STACK_BYTES` of stack, which holds chains
far longer than the counts allow. Masks and token steps do not recurse on the chain (measured
with 5,000 links): they run where they always ran.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any

MAX_GRAMMAR_CHARS = 128 * 1024  # a grammar as llguidance gets it (after translation)
MAX_LARK_RULES = 1000  # rule and terminal definitions in one Lark grammar
MAX_REGEX_CHARS = 16 * 1024
MAX_SCHEMA_DEPTH = 32  # nested objects and arrays in one JSON schema
MAX_SCHEMA_NODES = 5000  # every object, array and scalar in one JSON schema

# Stack for threads that compile grammars: address space only (pages are touched as used).
GRAMMAR_STACK_BYTES = 256 * 1024 * 1024

# llguidance's own limits, set explicitly (their defaults as of llguidance 1.9, which bound
# the time one mask may take to milliseconds), so both sides agree on what fails where.
PARSER_LIMITS = {
    "max_items_in_row": 2000,  # branching factor of one Earley row
    "initial_lexer_fuel": 1_000_000,  # building the lexer at compile (~20 ms)
    "step_lexer_fuel": 200_000,  # lexer work in one mask (~15 ms)
    "step_max_items": 50_000,  # Earley items in one mask (~2.5 ms)
    "max_lexer_states": 250_000,  # lexer states (1-2 kB each)
    "max_grammar_size": 500_000,  # symbols in all productions
    "precompute_large_lexemes": True,
    "verbose_errors": False,  # errors name the problem, without the parser's state dump
}

# A Lark rule or terminal definition: `name:`, `?name:`, `NAME.2:`, `name[lazy]:` at a line start.
_LARK_DEFINITION = re.compile(
    r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(\{[^}\n]*\})?(\[[^\]\n]*\])?(\.-?\d+)?[ \t]*:",
    re.MULTILINE)


def parser_limits():
    """`PARSER_LIMITS` as llguidance's `LLParserLimits`."""
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)


# ---------------------------------------------------------------- checks (pure Python)


def lark_rule_count(lark: str) -> int:
    return len(_LARK_DEFINITION.findall(lark))


def lark_problem(lark: str) -> str | None:
    rules = lark_rule_count(lark)
    if rules > MAX_LARK_RULES:
        return f"the grammar defines {rules} rules; at most {MAX_LARK_RULES} are allowed"
    return None


def schema_problem(schema: Any) -> str | None:
    """Depth and size of a JSON schema, walked without recursion."""
    nodes, stack = 0, [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"the JSON schema has more than {MAX_SCHEMA_NODES} values"
        if isinstance(value, dict | list):
            if depth > MAX_SCHEMA_DEPTH:
                return f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
    return None


def grammar_problem(grammar: str) -> str | None:
    """Why llguidance must not get this grammar (a Lark text, or llguidance's JSON form with
    `lark_grammar` / `json_schema` entries), or None."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        return (f"the grammar has {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS} "
                "are allowed")
    if not grammar.lstrip().startswith("{"):
        return lark_problem(grammar)
    try:
        top = json.loads(grammar)
    except (ValueError, RecursionError):
        return "the grammar is neither Lark nor llguidance's JSON form"
    entries = top.get("grammars") if isinstance(top, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        lark, schema = entry.get("lark_grammar"), entry.get("json_schema")
        problem = ((lark_problem(lark) if isinstance(lark, str) else None)
                   or (schema_problem(schema) if schema is not None else None))
        if problem is not None:
            return problem
    return None


# ---------------------------------------------------------------- running llguidance


def compile_matcher(tokenizer, grammar: str):
    """A matcher for `grammar` under the limits, its first mask computed: the matcher, or
    llguidance's error (a str) if compiling or the first mask fails. Run it on a
    `DeepStackThreads` thread."""
    from llguidance import LLMatcher

    problem = grammar_problem(grammar)
    if problem is not None:
        return problem
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if not matcher.is_error():
        # Fuel and item limits can first bite here; llguidance then allows only EOS.
        matcher.compute_bitmask()
    if matcher.is_error():
        return matcher.get_error() or "llguidance refused the grammar"
    return matcher


def validation_problem(tokenizer, grammar: str) -> str | None:
    """The frontend's check: `compile_matcher` without keeping the matcher. Without the
    model's tokenizer, llguidance's grammar-only validation."""
    from llguidance import LLMatcher

    if tokenizer is None:
        problem = grammar_problem(grammar)
        if problem is not None:
            return problem
        is_error, messages = LLMatcher.validate_grammar_with_warnings(
            grammar, None, limits=parser_limits())
        return messages[0] if is_error else None
    result = compile_matcher(tokenizer, grammar)
    return result if isinstance(result, str) else None


class DeepStackThreads:
    """A few threads with `GRAMMAR_STACK_BYTES` of stack each, for llguidance's compiles.

    (ThreadPoolExecutor takes the process-wide default stack size.) `submit` returns a
    Future; a job cancelled before it starts is skipped."""

    def __init__(self, num_threads: int, name: str = "grammar") -> None:
        self._jobs: SimpleQueue = SimpleQueue()
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(GRAMMAR_STACK_BYTES)
            try:
                for i in range(num_threads):
                    threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()
            finally:
                threading.stack_size(previous)

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - pyo3 panics are BaseExceptions
                future.set_exception(exc)


_STACK_SIZE_LOCK = threading.Lock()


def parsed_schema(value: Any) -> dict | bool:
    """A JSON schema given as an object or as JSON text, bounded and checked (ValueError
    naming the problem)."""
    if isinstance(value, str):
        if len(value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the schema has {len(value)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS} are allowed")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"the schema is not valid JSON ({exc})") from exc
    if not isinstance(value, dict | bool):
        raise ValueError("a JSON schema must be an object")
    problem = schema_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value
