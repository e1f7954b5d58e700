"""`/metrics` during and after load (req L-3): the request histograms and counters move by
exactly what the load did, and the engine's iteration stats show it working."""

from __future__ import annotations

import json
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

# 20 tokens (the top of the 10-20 token bucket): a stream's server side cannot be held
# (the socket buffers its events), so it must outlast the other streams' start.
N, TOKENS = 4, 20
MODEL = "SmolLM2-135M-Instruct"  # every series carries the served name as model_name


def scrape(base_url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value}, every sample kept."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    labels = {"model_name": MODEL, **labels}
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def engine_id(samples: dict) -> str:
    """The stack's one engine's id, as the frontend labels it."""
    ids = {dict(labels).get("engine") for (series, labels) in samples
           if series == "sluice:engine_live"}
    assert len(ids) == 1, f"expected one engine, the frontend exports {ids}"
    return ids.pop()


def engine(samples: dict, name: str) -> float:
    """The one engine's sample of `name` (the stack's engine, whatever its id)."""
    return value(samples, name, engine=engine_id(samples))


def _stream(base_url: str, i: int, out: dict, barrier: threading.Barrier) -> None:
    barrier.wait()  # all N requests leave together, so all run in the same steps
    body = {"messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=300) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                out.setdefault("chunks", {}).setdefault(i, 0)
                out["chunks"][i] += 1
                if len(events) == 3:
                    out.setdefault("started", set()).add(i)
                    while not out.get("scraped"):  # hold the stream open for the scrape
                        time.sleep(0.05)
    out[i] = json.loads(events[-2])["usage"]


def test_metrics_follow_the_load(base_url):
    before = scrape(base_url)
    out: dict = {}
    barrier = threading.Barrier(N)
    threads = [threading.Thread(target=_stream, args=(base_url, i, out, barrier))
               for i in range(N)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(out.get("started", ())) < N and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        during = scrape(base_url)
    finally:
        out["scraped"] = True
    for t in threads:
        t.join(timeout=300)

    # During: four HTTP requests in flight, none queued, the engine running them on KV pages.
    assert value(during, "sluice:frontend_requests_in_flight") == N
    assert value(during, "sluice:frontend_queued_requests") == 0
    assert engine(during, "sluice:num_requests_running") == N
    assert engine(during, "sluice:kv_cache_usage_perc") > 0

    after = scrape(base_url)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    prompt_tokens = sum(out[i]["prompt_tokens"] for i in range(N))
    assert all(out[i]["completion_tokens"] == TOKENS for i in range(N))
    assert delta("sluice:request_success_total", finished_reason="length") == N
    assert delta("sluice:time_to_first_token_seconds_count") == N
    assert delta("sluice:e2e_request_latency_seconds_count") == N
    assert delta("sluice:inter_token_latency_seconds_count") == N * (TOKENS - 1)
    assert delta("sluice:request_generation_tokens_count") == N
    assert delta("sluice:request_generation_tokens_sum") == N * TOKENS
    assert delta("sluice:generation_tokens_total") == N * TOKENS
    assert delta("sluice:request_prompt_tokens_sum") == prompt_tokens
    assert delta("sluice:prompt_tokens_total") == prompt_tokens
    # Latencies are real durations: a token came before its request ended.
    ttft = delta("sluice:time_to_first_token_seconds_sum")
    e2e = delta("sluice:e2e_request_latency_seconds_sum")
    assert 0 < ttft < e2e
    # Everything fits the smallest token bucket that holds TOKENS, none in a smaller one.
    assert delta("sluice:request_generation_tokens_bucket", le="10.0") == 0
    assert delta("sluice:request_generation_tokens_bucket", le="20.0") == N
    # The engine stepped (at least one step per generated token of the longest request).
    assert engine(after, "sluice:engine_step_duration_seconds_count") - engine(
        before, "sluice:engine_step_duration_seconds_count") >= TOKENS
    assert engine(after, "sluice:engine_step_duration_seconds_sum") > engine(
        before, "sluice:engine_step_duration_seconds_sum")
    # Only whole KV pages of a prompt are looked up in the prefix cache.
    assert engine(after, "sluice:prefix_cache_queries_total") > engine(
        before, "sluice:prefix_cache_queries_total")
    assert value(after, "sluice:frontend_requests_in_flight") == 0
    # The postproc fleet as the engine sees it, exported with or without a fleet (the plain
    # stack has none: its frontend post-processes every request). Each request goes to a
    # worker when one is live, and no worker died here, so nothing was replayed.
    fleet = ("sluice:postproc_workers", "sluice:postproc_requests_assigned_total",
             "sluice:postproc_requests_replayed_total")
    for name in fleet:
        key = (name, (("engine", engine_id(after)), ("model_name", MODEL)))
        assert key in after, f"{name} is not exported"
    workers = engine(after, "sluice:postproc_workers")
    assigned = engine(after, fleet[1]) - engine(before, fleet[1])
    assert assigned == (N if workers else 0)
    assert engine(after, fleet[2]) == engine(before, fleet[2])
    # vLLM's names beside ours, same values; the engine's phase histograms, once per request.
    assert delta("vllm:generation_tokens_total") == N * TOKENS
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:request_success_total", finished_reason="length") == N
    assert delta("vllm:time_per_output_token_seconds_count") == N * (TOKENS - 1)
    for phase in ("queue", "prefill", "decode", "inference"):
        name = f"vllm:request_{phase}_time_seconds_count"
        assert delta(name, engine=engine_id(after)) == N, name
    decode = delta("vllm:request_decode_time_seconds_sum", engine=engine_id(after))
    inference = delta("vllm:request_inference_time_seconds_sum", engine=engine_id(after))
    assert 0 < decode < inference <= e2e
    assert delta("vllm:iteration_tokens_total_count", engine=engine_id(after)) >= TOKENS
    assert engine(after, "vllm:num_requests_running") == 0
    # vLLM's request parameter histograms: n 1 and max_tokens TOKENS for each request, and
    # its longest answer TOKENS long.
    assert delta("vllm:request_params_n_count") == N
    assert delta("vllm:request_params_n_sum") == N
    assert delta("vllm:request_params_max_tokens_sum") == N * TOKENS
    assert delta("vllm:request_max_num_generation_tokens_count") == N
    assert delta("vllm:request_max_num_generation_tokens_sum") == N * TOKENS
