"""One engine, two frontends, separate processes over tcp: both serve at the same time."""

import json
import threading

import httpx
import pytest

from tests.servers import metrics


def _stream(url: str, prompt: str, results: dict) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        results[(url, prompt, "status")] = r.status_code
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    results[(url, prompt)] = events


@pytest.mark.slow  # starts its own engine and two frontends
def test_both_frontends_serve_at_once(cluster):
    results: dict = {}
    prompts = ["Name three rivers.", "What is two plus two?"]
    threads = [
        threading.Thread(target=_stream, args=(url, p, results))
        for url in cluster.base_urls for p in prompts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for url in cluster.base_urls:
        for p in prompts:
            assert results[(url, p, "status")] == 200
            events = results[(url, p)]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 24
    # Every frontend hears the one engine, which batched across frontends (its own metrics).
    seen = [metrics(url) for url in cluster.base_urls]
    assert all(m["sluice:engine_up"] == 1.0 for m in seen)
    assert metrics(cluster.engine_metrics_url)["sluice:max_seqs_in_step"] >= 2
