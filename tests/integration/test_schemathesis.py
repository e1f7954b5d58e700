"""Schemathesis over every operation of /openapi.json, against a live `sluice serve
--postproc-workers 2 --tool-call-parser hermes` (issue 15 item 8).

Per operation, two of Schemathesis's phases:
- coverage, negative cases only: each field in turn with a wrong type, a missing required
  one, an unknown one, a wrong method (its positive cases add nothing our schema's lack of
  bounds does not already give the fuzzing phase, and would cost a generation each);
- fuzzing, positive (every field any value its type allows: huge and negative ints, odd
  floats and strings, arbitrary JSON in free-form fields) and negative, EXAMPLES each.
Each answer must pass `not_a_server_error` and the error-shape check (tests.fuzz_checks).
Failures are collected, one per operation and kind, so one run reports them all; a stack
that died is reported with the request that was in flight. Afterwards every process must be
alive, /health 200 and the engine idle.

Schemathesis alone rarely draws the values where types end (int32, int64, uint64, float32):
a `flatmap_body` hook swaps each number and free string of a drawn body, one time in three,
for one of tests.fuzz_checks' boundary values (2**63, 1e-45, deep JSON text, ...). Most
positive cases are still refused for what the schema cannot say (an empty `messages`, a
missing `prompt`, out-of-range numbers): the boundary suite in test_fuzz.py goes deeper.

A positive case that leaves the output length unset gets a small one (an explicit value,
huge or not, is sent as drawn), so accepted requests cost a few tokens each.
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import requests

from tests import fuzz_checks

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.hypothesis.builder import (  # noqa: E402
    HypothesisTestConfig,
    HypothesisTestMode,
    create_test,
)

pytestmark = pytest.mark.slow

# Per operation and mode. 10 reach the same 122 (operation, status) answers 25 did (issue 29,
# measured: 4,258 requests in 44 s against 5,173 in 78 s); most of a fuzz case's cost is
# drawing it, not the server. SLUICE_FUZZ_EXAMPLES raises it for a deeper local run.
EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "10"))
REQUEST_TIMEOUT_S = 120  # past the stack's own --request-timeout
# The field that bounds the output of each generating route, and the default we give it.
OUTPUT_LENGTH = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
                 "/v1/completions": ("max_tokens",), "/v1/responses": ("max_output_tokens",)}
CHEAP_OUTPUT = 4
# Values that select a branch rather than carry data: swapping them only makes another 400.
KEEP = frozenset({"role", "type", "model"})


def extremes(value, key: str | None = None) -> st.SearchStrategy:
    """The body with each number and free string, one time in three, at a boundary value."""
    if isinstance(value, bool) or value is None or key in KEEP:
        return st.just(value)
    if isinstance(value, int | float):
        pool = fuzz_checks.BOUNDARY_INTS if isinstance(value, int) else fuzz_checks.BOUNDARY_FLOATS
        return st.one_of(st.just(value), st.just(value), st.sampled_from(pool))
    if isinstance(value, str):
        return st.one_of(st.just(value), st.just(value),
                         st.sampled_from(fuzz_checks.BOUNDARY_STRINGS))
    if isinstance(value, dict):
        return st.fixed_dictionaries({k: extremes(v, k) for k, v in value.items()})
    if isinstance(value, list):
        return st.tuples(*[extremes(v) for v in value]).map(list)
    return st.just(value)


def error_shape(ctx, response, case) -> None:
    """A Schemathesis check: refusals in the API's error shape, no 5xx inside a stream."""
    problem = fuzz_checks.answer_problem(
        case.operation.path, response.status_code,
        (response.headers.get("content-type") or [""])[0], response.content)
    if problem and response.status_code < 500:  # a 5xx is not_a_server_error's to report
        raise AssertionError(problem)


CHECKS = [not_a_server_error, error_shape]


class Run:
    """Sends cases and keeps the first failure of each (operation, status) for the report."""

    def __init__(self, base_url: str, session: requests.Session) -> None:
        self.base_url = base_url
        self.session = session
        self.failures: dict[tuple[str, str], str] = {}
        self.sent = 0
        self.last = None
        self.statuses: collections.Counter = collections.Counter()  # (operation, status)

    def probe(self, case) -> None:
        positive = case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE
        if positive and isinstance(case.body, dict):
            fields = OUTPUT_LENGTH.get(case.operation.path, ())
            if fields and all(case.body.get(f) is None for f in fields):
                case.body[fields[0]] = CHEAP_OUTPUT
        self.last = case
        self.sent += 1
        try:
            response = case.call(base_url=self.base_url, session=self.session,
                                 timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            return self.record(case, "no answer", f"{type(exc).__name__}: {exc}")
        self.statuses[case.operation.label, response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except Exception as exc:  # noqa: BLE001 - schemathesis's failures are the report
            problem = fuzz_checks.answer_problem(
                case.operation.path, response.status_code,
                response.headers.get("content-type", [""])[0], response.content)
            self.record(case, str(response.status_code), problem or str(exc))

    def record(self, case, kind: str, detail: str) -> None:
        key = (case.operation.label, kind)
        if key not in self.failures:
            curl = case.as_curl_command(base_url=self.base_url)
            self.failures[key] = f"{case.operation.label}: {detail[:1500]}\n  {curl[:3000]}"

    def coverage(self, schema, operation) -> None:
        def negative_only(case):
            if case.meta is None or case.meta.generation.mode == GenerationMode.NEGATIVE:
                self.probe(case)

        config = HypothesisTestConfig(project=schema.config,
                                      modes=[HypothesisTestMode.COVERAGE],
                                      settings=settings(database=None, deadline=None))
        create_test(operation=operation, test_func=negative_only, config=config)()

    def fuzz(self, operation, mode: GenerationMode) -> None:
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy(generation_mode=mode))
        def fuzz(case):
            self.probe(case)

        fuzz()


def test_schemathesis_finds_no_server_error(fuzz_stack):
    stack = fuzz_stack
    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json")
    schema.hook("flatmap_body")(lambda ctx, body: extremes(body))
    pids = stack.pids
    started = time.monotonic()
    with requests.Session() as session:
        run = Run(stack.base_url, session)
        for result in schema.get_all_operations():
            operation = result.ok()
            # Without a body (only path strings) nothing can be made invalid.
            stages = ["coverage", "positive", "negative"] if operation.body else [
                "coverage", "positive"]
            for stage in stages:
                if stage == "coverage":
                    run.coverage(schema, operation)
                else:
                    run.fuzz(operation, GenerationMode(stage))
                broken = [p for p in fuzz_checks.stack_problems(stack, pids, idle_within_s=60)
                          if "exited" in p or "/health" in p or "did not answer" in p]
                if broken:
                    curl = run.last.as_curl_command(base_url=stack.base_url) if run.last else ""
                    pytest.fail(f"the stack broke in {operation.label} ({stage}); the last "
                                f"request:\n{curl[:3000]}\n" + "\n".join(broken)
                                + "\n\n" + "\n\n".join(run.failures.values()))
    elapsed = time.monotonic() - started
    problems = fuzz_checks.stack_problems(stack, pids)
    report = "\n\n".join([*run.failures.values(), *problems])
    print(f"schemathesis: {run.sent} requests in {elapsed:.0f} s; answers by operation:")
    for (label, status), count in sorted(run.statuses.items()):
        print(f"  {label} {status}: {count}")
    assert not run.failures and not problems, (
        f"{len(run.failures)} failing kinds in {run.sent} requests, {elapsed:.0f} s:\n{report}")
