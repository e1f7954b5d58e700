"""vLLM's metrics against a running stack with two frontends (issue 19 item 4): every series
the shipped Grafana dashboard queries exists with the served `model_name`, the engine's
series come from the engine alone (its --metrics-port), and summing any counter over every
target (two frontends and the engine, as Prometheus scrapes them through the shipped
ServiceMonitor) counts each token and request once."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow  # the cluster: its own engine and two frontends

MODEL = "SmolLM2-135M-Instruct"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "sluice-dashboard.json"
SERIES = re.compile(r"\bvllm:[A-Za-z0-9_:]+")
# The engine's series: exported by the engine, never by a frontend.
ENGINE_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:prefix_cache_queries_total",
                 "vllm:num_preemptions_total", "vllm:iteration_tokens_total_count",
                 "vllm:request_queue_time_seconds_count", "sluice:num_requests_running")
PHASES = ("queue", "prefill", "decode", "inference")


def dashboard_series() -> set[str]:
    """Every vllm:* name in the dashboard's queries (panels and template variables)."""
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in doc["panels"] for t in panel["targets"]]
    exprs += [v["query"]["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    names = {name for expr in exprs for name in SERIES.findall(expr)}
    assert len(names) >= 20, names
    return names


def scrape(url: str) -> list:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list, name: str, **labels) -> float:
    """The sum over matching samples, as PromQL's sum() over one scrape target."""
    want = {"model_name": MODEL, **labels}
    return sum(s.value for s in samples
               if s.name == name and want.items() <= s.labels.items())


def _complete(url: str, i: int) -> dict:
    body = {"model": MODEL, "prompt": f"Tell me about the number {i}.", "max_tokens": 5 + i,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_dashboard_series_exist_once_per_engine(cluster):
    targets = [*cluster.base_urls, cluster.engine_metrics_url]
    before = {url: scrape(url) for url in targets}
    calls = [(url, i) for url in cluster.base_urls for i in range(3)]
    with ThreadPoolExecutor(len(calls)) as pool:
        usage = list(pool.map(lambda call: _complete(*call), calls))
    after = {url: scrape(url) for url in targets}

    # Every series a dashboard panel queries is there, labelled with the served model.
    present = {s.name for url in targets for s in after[url]
               if s.labels.get("model_name") == MODEL}
    missing = dashboard_series() - present
    assert not missing, f"the dashboard queries series nobody exports: {sorted(missing)}"
    # Every vllm:* and sluice:* sample carries model_name, the engine's also its engine id.
    for url in targets:
        for s in after[url]:
            assert s.labels.get("model_name") == MODEL, (url, s)
    assert len({s.labels["engine"] for s in after[cluster.engine_metrics_url]}) == 1

    # The engine's series come from one target, the engine: no frontend re-exports them.
    for name in ENGINE_SERIES:
        owners = [url for url in targets if any(s.name == name for s in after[url])]
        assert owners == [cluster.engine_metrics_url], (name, owners)

    def delta(name: str, **labels) -> float:
        """sum(increase(name)) over every target, as a dashboard computes it."""
        return sum(total(after[url], name, **labels) - total(before[url], name, **labels)
                   for url in targets)

    generated = sum(u["completion_tokens"] for u in usage)
    prompted = sum(u["prompt_tokens"] for u in usage)
    assert generated == sum(5 + i for _, i in calls)
    # Counted once, not once per frontend.
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:prompt_tokens_total") == prompted
    assert delta("sluice:generation_tokens_total") == generated
    assert delta("vllm:request_success_total", finished_reason="length") == len(calls)
    assert delta("vllm:e2e_request_latency_seconds_count") == len(calls)
    assert delta("vllm:time_to_first_token_seconds_count") == len(calls)
    assert delta("vllm:request_generation_tokens_sum") == generated
    for phase in PHASES:
        assert delta(f"vllm:request_{phase}_time_seconds_count") == len(calls), phase
    # The engine ran every generated token after the first of each request in some step.
    assert delta("vllm:iteration_tokens_total_sum") >= generated - len(calls)
    # Each frontend counts what it answered.
    for url in cluster.base_urls:
        mine = sum(u["completion_tokens"] for (where, _), u in zip(calls, usage, strict=True)
                   if where == url)
        assert (total(after[url], "vllm:generation_tokens_total")
                - total(before[url], "vllm:generation_tokens_total")) == mine
    # Idle again: nothing running, and the cache config names the engine's KV cache.
    engine = after[cluster.engine_metrics_url]
    assert total(engine, "vllm:num_requests_running") == 0
    [config] = [s for s in engine if s.name == "vllm:cache_config_info"]
    assert config.value == 1 and int(config.labels["num_gpu_blocks"]) > 0
    assert int(config.labels["block_size"]) > 0
