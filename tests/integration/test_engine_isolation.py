"""The engine trusts no client (issue 15, item 4): a raw wire client sends values no frontend
would let through, each gets its own 400 while a concurrent request completes, and the engine
stays up. The engine is the session's shared one (`shared_engine`): a crash here would fail
every later test on it too."""

from __future__ import annotations

import time

import msgspec
import pytest

from shared.codec import encode
from shared.protocol import EngineRequest, OutputBatch, SamplingParams, pack_ids, unpack_ids
from tests.engine_client import RawEngineClient, engine_stats

pytestmark = pytest.mark.slow

PROMPT = [1, 9690, 28, 253, 3575, 282, 4649, 314]
GOOD = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
INF, NAN = float("inf"), float("nan")

BAD_PARAMS = {
    "top_k-2**63": {"top_k": 2**63},
    "top_k-uint64-max": {"top_k": 2**64 - 1},
    "max_tokens-2**63": {"max_tokens": 2**63},
    "temperature-inf": {"temperature": INF},
    "temperature-nan": {"temperature": NAN},
    "temperature-negative": {"temperature": -1.0},
    "top_p-nan": {"top_p": NAN},
    "min_p-inf": {"min_p": INF},
    "repetition_penalty-0": {"repetition_penalty": 0.0},
    "presence_penalty-inf": {"presence_penalty": INF},
    "seed-negative": {"seed": -1, "temperature": 1.0},
    "min_tokens-2**63": {"min_tokens": 2**63},
    "logit_bias-inf": {"logit_bias": [(5, INF)]},
    "logit_bias-id-huge": {"logit_bias": [(2**63, 1.0)]},
    "stop_token_ids-huge": {"stop_token_ids": [2**64 - 1]},
    "logprobs-2**63": {"logprobs": 2**63},
    "prompt_logprobs-huge": {"prompt_logprobs": 2**40},
}
# Odd but inside the ranges: they must simply run (1e-45 is below the sampler's greedy
# epsilon, so it never divides a logit).
ODD_BUT_FINE = {
    "temperature-1e-45": {"temperature": 1e-45},
    "seed-2**64-1": {"seed": 2**64 - 1, "temperature": 1.0},
    "top_p-1e-6": {"top_p": 1e-6, "temperature": 1.0},
}
BAD_REQUESTS = {
    "priority-2**63": {"priority": 2**63},
    "cache_salt-huge": {"cache_salt": "s" * 100_000},
    "prompt-token-huge": {"prompt_token_ids": pack_ids([1, 2**31 - 1])},
    "prompt-odd-bytes": {"prompt_token_ids": b"\x01\x02\x03\x04\x05"},
}


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine.proc, shared_engine.address


def _request(client: RawEngineClient, request_id: str, params=GOOD, **fields) -> EngineRequest:
    base = EngineRequest(request_id, pack_ids(PROMPT), params, client.reply_to, time.time())
    return msgspec.structs.replace(base, **fields)


def test_each_bad_value_fails_only_its_request(engine):
    proc, address = engine
    client = RawEngineClient(address)
    try:
        requests = [_request(client, "good")]
        for name, odd in ODD_BUT_FINE.items():
            requests.append(_request(client, name, msgspec.structs.replace(GOOD, **odd)))
        for name, bad in BAD_PARAMS.items():
            requests.append(_request(client, name, msgspec.structs.replace(GOOD, **bad)))
        for name, fields in BAD_REQUESTS.items():
            requests.append(_request(client, name, **fields))
        for request in requests:
            client.dealer.send(encode(request))
        errors, good_tokens, finished = {}, [], set()
        deadline = time.monotonic() + 120
        while len(finished) < len(requests):
            assert client.pull.poll(int(max(0, deadline - time.monotonic()) * 1000)), (
                f"unfinished: {sorted({r.request_id for r in requests} - finished)}")
            batch = client.decoder.decode(client.pull.recv())
            assert isinstance(batch, OutputBatch)
            for out in batch.outputs:
                if out.request_id == "good":
                    assert out.error is None, out.error
                    good_tokens.extend(unpack_ids(out.new_token_ids).tolist())
                elif out.finish_reason is not None:
                    errors[out.request_id] = (out.finish_reason, out.error_status, out.error)
                if out.finish_reason is not None:
                    finished.add(out.request_id)
        assert len(good_tokens) == GOOD.max_tokens
        for name in ODD_BUT_FINE:
            assert errors[name][:2] == ("length", 0), (name, errors[name])
        for name in [*BAD_PARAMS, *BAD_REQUESTS]:
            reason, status, message = errors[name]
            assert (reason, status) == ("error", 400), (name, errors[name])
            assert message, name
        assert proc.popen.poll() is None
        stats = engine_stats(address)
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_free_pages == stats.num_total_pages
    finally:
        client.close()
