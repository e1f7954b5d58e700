"""The fuzz suites' own checks (tests.fuzz_checks) must fail on what they exist to catch:
a 5xx, an error body out of shape, a 5xx reported inside a stream."""

from __future__ import annotations

from tests.fuzz_checks import answer_problem

OPENAI_400 = b'{"error": {"message": "x", "type": "t", "param": null, "code": 400}}'
ANTHROPIC_400 = b'{"type": "error", "error": {"type": "invalid_request_error", "message": "x"}}'


def test_a_server_error_is_a_problem_whatever_its_body():
    assert answer_problem("/v1/completions", 500, "application/json", OPENAI_400)
    assert answer_problem("/v1/messages", 503, "application/json", ANTHROPIC_400)
    assert answer_problem("/v1/chat/completions", 504, "text/plain", b"")


def test_refusals_must_be_in_their_apis_shape():
    assert answer_problem("/v1/completions", 400, "application/json", OPENAI_400) is None
    assert answer_problem("/v1/messages", 400, "application/json", ANTHROPIC_400) is None
    assert answer_problem("/v1/completions", 400, "application/json", b'{"detail": "bad"}')
    assert answer_problem("/v1/completions", 400, "text/plain", b"Bad Request")
    assert answer_problem("/v1/completions", 404, "application/json", OPENAI_400)  # code 400
    assert answer_problem("/v1/messages", 400, "application/json", OPENAI_400)
    assert answer_problem("/v1/completions", 400, "application/json", ANTHROPIC_400)


def test_a_server_error_inside_a_stream_is_a_problem():
    chat = (b'data: {"error": {"message": "boom", "type": "internal_server_error",'
            b' "param": null, "code": 500}}\n\ndata: [DONE]\n\n')
    responses = (b'event: error\ndata: {"type": "error", "sequence_number": 3,'
                 b' "message": "boom", "code": "server_error", "param": null}\n\n')
    messages = (b'event: error\ndata: {"type": "error", "error": {"type": "api_error",'
                b' "message": "boom"}}\n\n')
    assert answer_problem("/v1/chat/completions", 200, "text/event-stream", chat)
    assert answer_problem("/v1/responses", 200, "text/event-stream", responses)
    assert answer_problem("/v1/messages", 200, "text/event-stream", messages)
    ok = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
    assert answer_problem("/v1/completions", 200, "text/event-stream", ok) is None
    refused = chat.replace(b"500", b"400").replace(b"internal_server_error", b"invalid")
    assert answer_problem("/v1/chat/completions", 200, "text/event-stream", refused) is None
