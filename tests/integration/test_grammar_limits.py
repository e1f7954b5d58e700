"""Grammars cannot crash or wedge a process (issue 15 item 3), through real processes: the
fuzzer's 5,000 chained rules and other limit-busters are 400s naming their field, from the
frontend over HTTP and from the engine to a raw wire client, and both stay up: the session's
shared engine and default frontend (`shared_engine`, `stack`), which later tests then use."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from llguidance import grammar_from

from shared.codec import encode
from shared.protocol import Constraint, EngineRequest, OutputBatch, SamplingParams, pack_ids
from tests.engine_client import RawEngineClient, engine_stats

pytestmark = pytest.mark.slow

PROMPT = [1, 9690, 28, 253, 3575, 282, 4649, 314]


def chained_rules(n: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1} | "b"' for i in range(n)),
                      f'r{n}: "c"'])


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.fixture(scope="module")
def servers(shared_engine, stack):
    """(engine process, frontend process, engine address, frontend URL)."""
    return shared_engine.proc, stack.proc, shared_engine.address, stack.base_url


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"max_tokens": 8, "temperature": 0, **body},
                      timeout=120)


CHAT = {"messages": [{"role": "user", "content": "Say something."}]}
BUSTERS = [
    ("chat/completions", {**CHAT, "guided_grammar": chained_rules(5000)}, "guided_grammar"),
    ("completions", {"prompt": "x", "guided_grammar": chained_rules(5000)}, "guided_grammar"),
    ("chat/completions", {**CHAT, "guided_regex": "(a|b)" * 5000}, "guided_regex"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested(40)}}}, "response_format.json_schema"),
    ("chat/completions", {**CHAT, "structured_outputs": {"json": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(10_000)}}}}, "structured_outputs.json"),
    ("chat/completions", {**CHAT, "guided_grammar": "start: " + " | ".join(
        f'"w{i}"' for i in range(30_000))}, "guided_grammar"),
]


def test_limit_busters_are_400s_naming_the_field_and_the_stack_stays_up(servers):
    engine, frontend, _, url = servers
    for route, body, param in BUSTERS:
        response = post(url, route, body)
        assert response.status_code == 400, (param, response.text[:300])
        assert response.json()["error"]["param"] == param, response.text[:300]
    assert engine.popen.poll() is None and frontend.popen.poll() is None
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    ok = post(url, "chat/completions", {**CHAT, "guided_regex": "[0-9]{3}"})
    assert ok.status_code == 200
    assert re.fullmatch("[0-9]{3}", ok.json()["choices"][0]["message"]["content"])


def test_a_batched_completion_with_a_grammar_runs_every_prompt(servers):
    url = servers[3]
    response = post(url, "completions", {"prompt": [f"Number {i}:" for i in range(8)],
                                         "guided_regex": "[0-9]{2}"})
    assert response.status_code == 200, response.text[:300]
    texts = [c["text"] for c in response.json()["choices"]]
    assert len(texts) == 8 and all(re.fullmatch("[0-9]{2}", t) for t in texts), texts


def test_the_engine_refuses_grammars_past_the_limits_from_a_raw_client(servers):
    engine, _, address, _ = servers
    client = RawEngineClient(address)
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    grammars = {
        "chain": grammar_from("lark", chained_rules(5000)),
        "wrapped-chain": json.dumps({"grammars": [{"lark_grammar": chained_rules(3000)}]}),
        "deep-schema": json.dumps({"grammars": [{"json_schema": nested(40)}]}),
        "huge": "start: " + " | ".join(f'"w{i}"' for i in range(30_000)),
        "invalid": grammar_from("regex", "(a"),
    }
    try:
        requests = [EngineRequest("good", pack_ids(PROMPT), free, client.reply_to, time.time())]
        for name, grammar in grammars.items():
            params = SamplingParams(max_tokens=16, constraint=Constraint("grammar", grammar))
            requests.append(EngineRequest(name, pack_ids(PROMPT), params, client.reply_to,
                                          time.time()))
        for request in requests:
            client.dealer.send(encode(request))
        finished: dict[str, tuple] = {}
        deadline = time.monotonic() + 120
        while len(finished) < len(requests):
            assert client.pull.poll(int(max(0, deadline - time.monotonic()) * 1000))
            batch = client.decoder.decode(client.pull.recv())
            assert isinstance(batch, OutputBatch)
            for out in batch.outputs:
                if out.finish_reason is not None:
                    finished[out.request_id] = (out.finish_reason, out.error_status, out.error)
        assert finished["good"][0] == "length"
        for name in grammars:
            reason, status, message = finished[name]
            assert (reason, status) == ("error", 400) and message, (name, finished[name])
        assert "rules" in finished["chain"][2] and "rules" in finished["wrapped-chain"][2]
        assert engine.popen.poll() is None
        stats = engine_stats(address)
        assert stats.num_running == stats.num_waiting == 0
    finally:
        client.close()
