"""The engine's span of a traced request (engine.step.tracing) on a real EngineCore: one span
per request whichever way it ends, its prefill chunks, preemptions and a continuation's
resumed tokens counted, and a missing, malformed or unsampled context traced not at all."""

import msgspec
import pytest

from engine.step.tracing import EngineTraces
from shared.protocol import Continuation, TraceContext, pack_ids
from tests.unit.engine_builders import (
    build_core,
    collect,
    drain,
    prompts,
    random_weights,
    request,
    run,
)

TRACE, SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
SAMPLED = TraceContext(f"00-{TRACE}-{SPAN}-01", "congo=t61rcWkgMzE")


class Sink:
    """Stands in for shared.tracing.Tracing: keeps what the engine emits."""

    def __init__(self) -> None:
        self.spans = []

    def emit(self, data) -> None:
        self.spans.append(data)


@pytest.fixture(scope="module")
def weights():
    return random_weights()


def traced_core(weights, **kwargs):
    core, rec = build_core(weights, **kwargs)
    assert core.traces is None  # tracing is off in this process
    core.traces = EngineTraces(Sink(), "test-engine", "tiny")
    return core, rec, core.traces.sink


def traced(request_id, prompt, context=SAMPLED, **params):
    return msgspec.structs.replace(request(request_id, prompt, **params), trace_context=context)


def test_one_span_per_request_with_its_phases(weights):
    core, _, sink = traced_core(weights, budget=7)
    results = run(core, [traced("a", prompts([17])[0], max_tokens=5, temperature=0.7, top_p=0.8,
                                seed=3), request("plain", prompts([4])[0])])
    (span,) = sink.spans  # the untraced request has none
    assert span.name == "llm_request" and span.kind == "server" and span.error is None
    assert (f"{span.parent.trace_id:032x}", f"{span.parent.span_id:016x}") == (TRACE, SPAN)
    assert span.parent.tracestate == "congo=t61rcWkgMzE"
    a = span.attributes
    assert a["gen_ai.request.id"] == "a" and a["gen_ai.response.model"] == "tiny"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"],
            a["gen_ai.request.top_p"], a["gen_ai.request.seed"]) == (5, 0.7, 0.8, 3)
    assert a["gen_ai.usage.input_tokens"] == a["gen_ai.usage.prompt_tokens"] == 17
    assert a["gen_ai.usage.output_tokens"] == len(results["a"].tokens) == 5
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["sluice.prefill.chunks"] == 3  # 7 + 7 + 3 prompt tokens under a budget of 7
    assert a["sluice.preemptions"] == 0 and a["sluice.prefix_cache.hit_tokens"] == 0
    for name in ("time_in_queue", "time_to_first_token", "time_in_model_prefill",
                 "time_in_model_decode", "time_in_model_inference", "e2e"):
        assert a[f"gen_ai.latency.{name}"] >= 0, name
    assert [e.name for e in span.events] == ["scheduled", "first_token", "finished"]
    assert span.start_s <= span.events[0].time_s <= span.events[-1].time_s <= span.end_s


@pytest.mark.parametrize("context", [
    None, TraceContext("00-garbage-01"), TraceContext(f"ff-{TRACE}-{SPAN}-01"),
    TraceContext(f"00-{TRACE}-{SPAN}-00"),  # not sampled: the client's choice
    TraceContext("x" * 100_000, "y" * 100_000),
])
def test_no_span_without_a_sampled_well_formed_context(weights, context):
    core, _, sink = traced_core(weights)
    results = run(core, [traced("a", prompts([5])[0], context=context, max_tokens=3)])
    assert results["a"].finish_reason == "length" and len(results["a"].tokens) == 3
    assert sink.spans == []


def test_preemptions_aborts_and_rejections_end_their_spans(weights):
    core, rec, sink = traced_core(weights, num_pages=16)
    for i, p in enumerate(prompts([5, 17, 1, 40, 9, 23])):
        core.add(traced(f"p{i}", p, max_tokens=12))
    results = drain(core)
    assert rec.preemptions > 0
    assert sum(s.attributes["sluice.preemptions"] for s in sink.spans) == rec.preemptions
    assert sum(e.name == "preempted" for s in sink.spans for e in s.events) == rec.preemptions
    assert len(sink.spans) == len(results) == 6
    sink.spans.clear()
    core.add(traced("gone", prompts([9])[0], max_tokens=50))
    more: dict = {}
    collect(more, core.step())
    core.abort(["gone"])
    core.add(traced("bad", [1, 2], max_tokens=10_000, temperature=-1.0))
    drain(core, more)
    gone, bad = sink.spans
    assert gone.attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert bad.error and bad.attributes["sluice.error.status"] == 400
    assert bad.attributes["gen_ai.response.finish_reasons"] == ["error"]


def test_a_continuation_says_how_many_tokens_it_resumed(weights):
    core, _, sink = traced_core(weights)
    moved = msgspec.structs.replace(
        traced("m", prompts([6])[0], max_tokens=6),
        continuation=Continuation(pack_ids([3, 4]), frame_sizes=[2]))
    core.add(moved)
    while core.has_work:
        core.step()
    (span,) = sink.spans
    assert span.attributes["sluice.migration.resumed_tokens"] == 2
    assert span.attributes["gen_ai.usage.output_tokens"] == 6  # the resumed 2 count as usage
    assert span.events[0].name == "migrated_in"
