"""A postproc worker over several engines (issue 18 item 5): the addresses it is given (a
dns+tcp:// name through an injected resolver), and a reset from one engine dropping only
that engine's requests. No sockets: the bookkeeping alone."""

from __future__ import annotations

import pytest

from postproc.worker import PostprocWorker
from shared.protocol import EngineRequest, OutputParams, SamplingParams, WorkBatch, pack_ids
from shared.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def test_addresses_static_and_resolved(tokenizer):
    answers = {"engines": ["10.0.0.1", "10.0.0.2"]}
    worker = PostprocWorker(tokenizer, ["tcp://fixed:5556", "dns+tcp://engines:5556"],
                            resolver=lambda host, port: answers[host])
    assert worker._wanted() == {"tcp://fixed:5556", "tcp://10.0.0.1:5556",
                                "tcp://10.0.0.2:5556"}
    answers["engines"] = ["fd00::3"]
    assert worker._wanted() == {"tcp://fixed:5556", "tcp://[fd00::3]:5556"}
    with pytest.raises(ValueError, match="dns\\+tcp://NAME:PORT"):
        PostprocWorker(tokenizer, "dns+tcp://no-port")


class _Sent:
    def __init__(self) -> None:
        self.messages: list[bytes] = []

    def send(self, payload) -> None:
        self.messages.append(payload)


def _assign(request_id: str) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_token_ids=pack_ids([1, 2]),
                         params=SamplingParams(max_tokens=4), reply_to="inproc://x",
                         arrival_time=0.0, output=OutputParams())


def test_a_reset_from_one_engine_keeps_the_others_requests(tokenizer):
    worker = PostprocWorker(tokenizer, ["tcp://a:1", "tcp://b:1"])
    sent, frontends = _Sent(), _Sent()
    worker._handle(WorkBatch([_assign("ra")], [], 0.0), sent, frontends, "tcp://a:1")
    worker._handle(WorkBatch([_assign("rb")], [], 0.0), sent, frontends, "tcp://b:1")
    assert set(worker._reply_to) == {"ra", "rb"}
    worker._handle(WorkBatch([], [], 0.0, reset=True), sent, frontends, "tcp://a:1")
    assert set(worker._reply_to) == {"rb"}
    assert worker._owned["tcp://b:1"] == {"rb"} and not worker._owned["tcp://a:1"]
