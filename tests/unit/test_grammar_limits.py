"""Grammars cannot crash or wedge a process (issue 15 item 3): the limits in
shared.grammar_limits, the frontend's checker pool, and the engine's refusals."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time

import llguidance.hf
import msgspec
import pytest
from llguidance import grammar_from

from engine.request.grammar import GrammarBackend
from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.base.errors import APIError
from frontend.input.grammar_check import GrammarChecker
from frontend.input.structured import StructuredSettings, build_constraint, constraint_for
from shared import grammar_limits
from shared.grammar_limits import MAX_LARK_RULES, grammar_problem, lark_rule_count
from shared.model_source import default_model_path
from shared.protocol import Constraint
from shared.tokenizer import load_tokenizer, tokenizer_facts
from tests.unit.grammar_check_helpers import chained_rules, crash_on_boom

EOS = 2


def chained_refs(n: int) -> dict:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


NO_PARSERS = StructuredSettings()


def refused(request, settings=NO_PARSERS) -> APIError:
    with pytest.raises(APIError) as info:
        build_constraint(request, settings)
    assert info.value.status == 400
    return info.value


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def llt(smol):
    return llguidance.hf.from_tokenizer(smol, eos_token=[EOS])


# ---------------------------------------------------------------- the limits


def big_tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("fields, param, quoted", [
    ({"guided_grammar": chained_rules(5000)}, "guided_grammar", "rules"),
    ({"structured_outputs": {"grammar": "start: " + " | ".join(
        f'"word{i}"' for i in range(20_000))}}, "structured_outputs.grammar", "characters"),
    ({"guided_regex": "(a|b)" * 5000}, "guided_regex", "characters"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested(40)}}}, "response_format.json_schema", "deeper"),
    ({"guided_json": '{"items": ' * 5000 + "{}" + "}" * 5000}, "guided_json", "JSON"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(10_000)}}}}, "structured_outputs.json",
     "values"),
    ({"guided_json": chained_refs(2000)}, "guided_json", "values"),
    ({"guided_choice": [f"option number {i}" for i in range(10_000)]}, "guided_choice",
     "characters"),
])
def test_limit_busters_are_400s_naming_the_field(fields, param, quoted):
    error = refused(chat(**fields))
    assert error.param == param and quoted in error.message


def test_a_tools_schema_past_the_limits_is_a_400_naming_its_parameters():
    settings = StructuredSettings(tool_call_parser="hermes")
    tools = [{"type": "function", "function": {"name": "small"}}, big_tool(nested(40))]
    error = refused(chat(tools=tools, tool_choice="required"), settings)
    assert error.param == "tools[1].function.parameters"


def test_grammars_inside_the_limits_still_pass(llt):
    settings = StructuredSettings(tokenizer=llt)
    assert build_constraint(chat(guided_grammar=chained_rules(MAX_LARK_RULES - 10)), settings)
    assert build_constraint(chat(guided_json=chained_refs(200)), settings)


def test_the_engine_side_check_reads_both_grammar_forms():
    assert lark_rule_count(chained_rules(10)) == 12
    assert lark_rule_count('start: A\n?b.2: "x"\nA[lazy]: /a/\n  | "b"\n') == 3
    assert "rules" in grammar_problem(grammar_from("lark", chained_rules(5000)))
    wrapped = json.dumps({"grammars": [{"lark_grammar": chained_rules(2000)}]})
    assert "rules" in grammar_problem(wrapped)
    wrapped = json.dumps({"grammars": [{"json_schema": nested(40)}]})
    assert "deeper" in grammar_problem(wrapped)
    assert "characters" in grammar_problem("x" * (grammar_limits.MAX_GRAMMAR_CHARS + 1))
    assert grammar_problem(grammar_from("regex", "[0-9]+")) is None


@pytest.mark.slow
def test_the_deep_stack_holds_chains_far_past_the_limits():
    """The stack our compile threads get holds 5x the rules llguidance crashes on with a
    default stack; run in a child so a crash fails this test, not the test run."""
    code = textwrap.dedent(f"""
        from llguidance import LLMatcher, grammar_from
        from shared.grammar_limits import DeepStackThreads
        from tests.unit.grammar_check_helpers import chained_rules
        grammar = grammar_from("lark", chained_rules(10 * {MAX_LARK_RULES}))
        check = LLMatcher.validate_grammar_with_warnings
        print(DeepStackThreads(1).submit(check, grammar).result(timeout=120))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(False, [])" in done.stdout


# ---------------------------------------------------------------- the checker pool


async def _problems(checker: GrammarChecker, grammars: list[str]) -> list:
    out = []
    for grammar in grammars:
        try:
            out.append(await checker.problem(grammar))
        except Exception as exc:  # noqa: BLE001 - the test looks at which
            out.append(type(exc).__name__ + ": " + str(exc))
    return out


@pytest.mark.slow
def test_a_crashing_or_hanging_check_costs_one_request_and_the_pool_is_replaced():
    checker = GrammarChecker(None, timeout_s=3.0, check=crash_on_boom)
    try:
        got = asyncio.run(_problems(checker, ["start: x", "boom", "start: y", "hang",
                                              "nope", "start: z"]))
    finally:
        checker.close()
    assert got[0] is None and got[2] is None and got[5] is None
    assert "crashed" in got[1] and "longer than 3 s" in got[3]
    assert got[4] == "bad"


def test_the_real_worker_checks_compile_and_first_mask():
    checker = GrammarChecker(None)
    try:
        got = asyncio.run(_problems(checker, [grammar_from("regex", "[0-9]+"),
                                              grammar_from("regex", "[a-z+"),
                                              grammar_from("lark", chained_rules(5000))]))
    finally:
        checker.close()
    assert got[0] is None and "unclosed character class" in got[1] and "rules" in got[2]


class CountingChecker:
    def __init__(self) -> None:
        self.num_checks = 0

    async def problem(self, grammar: str) -> str | None:
        self.num_checks += 1
        return None


def test_a_batched_completion_is_checked_once_and_its_prompts_share_the_constraint(smol):
    from frontend.input.budgets import PromptTokens
    from frontend.pipeline.input_stage import PromptInput
    from frontend.pipeline.pipeline import build_job
    from tests.unit.frontend_builders import serving_context

    checker = CountingChecker()
    request = msgspec.convert({"prompt": [f"p{i}" for i in range(8)], "n": 2,
                               "guided_regex": "[0-9]+"}, CompletionRequest)
    constraint = asyncio.run(constraint_for(request, StructuredSettings(checker=checker)))
    prompts = [PromptInput(PromptTokens(ids=[1, i + 2])) for i in range(8)]
    facts = tokenizer_facts(smol, default_model_path())
    with serving_context(smol, max_model_len=64, max_chars_per_token=facts.max_chars_per_token,
                         vocab_size=facts.max_token_id + 1) as ctx:
        job = build_job(ctx, request, prompts, "completions", "cmpl", constraint)
    assert checker.num_checks == 1 and len(job.candidates) == 16
    assert all(c.params.constraint is constraint for c in job.candidates)


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def backend(smol):
    return GrammarBackend(smol, 49152, [EOS], mask_threads=1)


def compiled(backend: GrammarBackend, grammar: str):
    request_grammar = backend.compile(Constraint("grammar", grammar))
    deadline = time.monotonic() + 60
    while not request_grammar.compiled:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return request_grammar


def test_the_engine_refuses_a_grammar_past_the_limits_before_llguidance(backend):
    problem = compiled(backend, grammar_from("lark", chained_rules(5000))).poll()
    assert "rules" in problem


def test_a_grammar_that_fails_at_its_first_mask_fails_at_compile(backend, monkeypatch):
    """Before, such a grammar compiled, llguidance then allowed only EOS at the first step,
    and the EOS it sampled was 'rejected': a 500."""
    monkeypatch.setitem(grammar_limits.PARSER_LIMITS, "step_max_items", 2000)
    lark = ("start: " + " ".join(f"x{i}" for i in range(500)) + "\n"
            + "\n".join(f'x{i}: "a" | ""' for i in range(500)))
    problem = compiled(backend, grammar_from("lark", lark)).poll()
    assert "Too many items" in problem
