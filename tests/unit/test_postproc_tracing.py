"""A postproc worker's span of a traced request (postproc.tracing) over the real processor:
its phase times summed per frame, its parsers, tokens and finish, a stop string's early
end; an untraced or malformed-context request costs no timing and makes no span."""

import pytest

from postproc.processor import OutputProcessor
from postproc.tracing import PostprocTraces
from shared.protocol import (
    EngineRequest,
    OutputParams,
    RequestOutput,
    SamplingParams,
    TraceContext,
    pack_ids,
)
from shared.tokenizer import load_tokenizer

SAMPLED = TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")


class Sink:
    def __init__(self) -> None:
        self.spans = []

    def emit(self, data) -> None:
        self.spans.append(data)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def _request(request_id: str, context, **output) -> EngineRequest:
    return EngineRequest(request_id, pack_ids([1, 2]), SamplingParams(max_tokens=8), "ipc://x",
                         0.0, output=OutputParams(**output), trace_context=context)


def _run(tokenizer, requests, texts: dict[str, str], finish: str = "length"):
    """Registers the requests as the worker does and feeds each its text in two outputs
    (the last token alone in the second)."""
    processor, traces = OutputProcessor(tokenizer), PostprocTraces(Sink(), "worker-1")
    timings = {}
    for r in requests:
        processor.register(r.request_id, [1, 2], r.output, None, traces.assigned(r))
    for last in (False, True):
        outputs = []
        for request_id, text in texts.items():
            ids = tokenizer.encode(text, add_special_tokens=False)
            half = ids[-1:] if last else ids[:-1]
            outputs.append(RequestOutput(request_id, pack_ids(half), 2,
                                         len(ids) if last else len(half),
                                         finish_reason=finish if last else None))
        processed = processor.process(outputs)
        traces.finished(processed)
        timings.update(processed.timings)
    return traces.sink.spans, timings


def test_a_traced_request_gets_one_span_with_its_phases(tokenizer):
    spans, timings = _run(tokenizer, [
        _request("a", SAMPLED, reasoning_parser="qwen3", stop=["STOP"]),
        _request("plain", None), _request("broken", TraceContext("00-nonsense")),
        _request("unsampled", TraceContext(SAMPLED.traceparent[:-2] + "00")),
    ], {"a": "<think>hmm</think>Hi STOP and then more", "plain": "Hi all",
        "broken": "Hi you", "unsampled": "Hi"})
    assert set(timings) == {"a"}  # the others pay for no clock
    (span,) = spans
    assert span.name == "postproc" and span.kind == "consumer"
    assert f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    a = span.attributes
    assert a["gen_ai.request.id"] == "a" and a["sluice.postproc.frames"] == 1
    assert a["gen_ai.response.finish_reasons"] == ["stop"]  # the stop string ended it
    assert a["sluice.postproc.stop_string"] is True
    assert a["sluice.postproc.reasoning_parser"] == "qwen3"
    assert a["sluice.usage.reasoning_tokens"] > 0
    assert a["sluice.postproc.detokenize_seconds"] > 0 and a["sluice.postproc.parse_seconds"] > 0
    assert [e.name for e in span.events] == ["first_frame", "stop_string"]


def test_a_forgotten_request_makes_no_span(tokenizer):
    processor, traces = OutputProcessor(tokenizer), PostprocTraces(Sink(), "worker-1")
    request = _request("a", SAMPLED)
    processor.register("a", [1, 2], request.output, None, traces.assigned(request))
    traces.forget("a")  # its engine reset us: another worker replays it
    traces.finished(processor.process([RequestOutput("a", pack_ids([9]), 2, 1, "length")]))
    assert traces.sink.spans == []
