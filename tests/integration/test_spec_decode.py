"""Speculative decoding through real processes (issue 21): a `sluice serve` with
--speculative-config answers what the session stack (same model, float32, no drafts)
answers, through postproc's stop strings, logprobs, streaming and n, and its /metrics
carries vLLM's spec_decode series."""

import json

import httpx
import pytest

from sluice.bench.chat import _PASSAGE
from tests.conftest import SHARED_ENGINE_ARGS
from tests.servers import Stack, metrics

pytestmark = pytest.mark.slow  # its own stack

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
COPY = f"Repeat this paragraph word for word:\n\n{_PASSAGE}"


@pytest.fixture(scope="module")
def spec_url(tmp_path_factory):
    # The session engine's settings (its answers are the reference) plus the drafts.
    stack = Stack(str(tmp_path_factory.mktemp("spec")), *SHARED_ENGINE_ARGS,
                  "--speculative-config", json.dumps(SPEC))
    yield stack.base_url
    stack.stop()


def _completion(base_url: str, **extra) -> dict:
    body = {"prompt": COPY, "temperature": 0, "max_tokens": 40, **extra}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(base_url: str, **extra) -> str:
    body = {"messages": [{"role": "user", "content": COPY}], "temperature": 0,
            "max_tokens": 40, "stream": True, **extra}
    text = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def test_answers_equal_plain_decoding_and_drafts_are_counted(spec_url, base_url):
    before = metrics(spec_url).get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    plain, spec = _completion(base_url), _completion(spec_url)
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["usage"] == plain["usage"]
    after = metrics(spec_url)
    assert after["vllm:spec_decode_num_accepted_tokens_total"] > before
    assert after["vllm:spec_decode_num_drafts_total"] > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in after
    assert "vllm:spec_decode_num_drafts_total" not in metrics(base_url)  # off by default


def test_stop_strings_logprobs_streaming_and_n_are_unchanged(spec_url, base_url):
    plain = _completion(base_url, logprobs=2)
    words = plain["choices"][0]["text"].split()
    stop = words[len(words) // 2]  # a word the copy reaches mid-way, inside some draft
    for extra in ({"stop": [stop], "logprobs": 2}, {"n": 2, "stop": [stop]}):
        a, b = _completion(base_url, **extra), _completion(spec_url, **extra)
        assert [c["text"] for c in b["choices"]] == [c["text"] for c in a["choices"]]
        assert [c["finish_reason"] for c in b["choices"]] == ["stop"] * len(b["choices"])
        assert b["usage"] == a["usage"]
        if "logprobs" in extra:
            la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
            assert lb["tokens"] == la["tokens"]
            assert lb["token_logprobs"] == pytest.approx(la["token_logprobs"], abs=1e-3)
    assert _stream_text(spec_url, stop=[stop]) == _stream_text(base_url, stop=[stop])


def test_beam_search_is_refused_where_the_engine_drafts(spec_url):
    # As vLLM: speculative decoding does not take beam search (a 400 naming the field).
    body = {"prompt": COPY, "max_tokens": 4, "n": 2, "use_beam_search": True}
    r = httpx.post(f"{spec_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "use_beam_search"
