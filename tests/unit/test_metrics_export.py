"""The engine's histograms and the exposition of its stats (issue 19 item 4): vLLM's phase
times observed once per request that ran, tokens per step, and every series under our name
and vLLM's, labelled model_name and engine, with cumulative buckets."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared import histograms as h
from shared.metrics_export import (
    VLLM_NAMES,
    engine_families,
    with_model_name,
    with_vllm_names,
)
from tests.unit.engine_builders import build_core, prompts, random_weights, request, run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def weights():
    return random_weights()


def samples(families) -> dict:
    class Source:
        def collect(self):
            yield from families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Source())
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_buckets_follow_prometheus_le():
    b = h.Buckets((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 9.0):
        b.observe(v)
    assert b.snapshot().counts == [2, 2, 1] and b.snapshot().total == 14.0


def test_engine_observes_each_finished_request_once(weights):
    core, _ = build_core(weights, page_size=4, budget=8)
    run(core, [request(f"r{i}", p, max_tokens=4) for i, p in enumerate(prompts([10, 3, 5]))])
    core.add(request("gone", prompts([6])[0], max_tokens=50))
    core.step()
    core.abort(["gone"])  # it ran: its phases so far count too
    core.add(request("never", prompts([6])[0], max_tokens=50))
    core.abort(["never"])  # never scheduled: nothing to observe
    stats = core.stats()
    counts = {name: sum(c.counts) for name, c in stats.histograms.items()}
    assert counts[h.QUEUE_TIME] == counts[h.PREFILL_TIME] == 4
    assert counts[h.DECODE_TIME] == counts[h.INFERENCE_TIME] == 4
    steps = stats.histograms[h.ITERATION_TOKENS]
    assert sum(steps.counts) == stats.num_steps
    assert steps.total == stats.num_computed_tokens  # every token the model ran, per step
    assert stats.page_size == 4


def test_every_engine_series_has_its_vllm_twin(weights):
    core, _ = build_core(weights)
    run(core, [request("a", prompts([6])[0], max_tokens=3)])
    stats = core.stats()
    got = samples(with_vllm_names(engine_families(stats)))
    labels = (("engine", stats.engine_id), ("model_name", stats.model_name))
    for ours, twins in VLLM_NAMES.items():
        for twin in twins:
            for suffix in ("", "_total", "_count", "_sum"):
                if (ours + suffix, labels) in got:
                    assert got[(twin + suffix, labels)] == got[(ours + suffix, labels)], twin
    assert got[("vllm:num_requests_running", labels)] == 0
    assert got[("vllm:request_prefill_time_seconds_count", labels)] == 1
    # Buckets are cumulative and end at the count.
    bucket = [v for (name, lab), v in got.items()
              if name == "vllm:iteration_tokens_total_bucket"]
    assert bucket == sorted(bucket)
    assert bucket[-1] == got[("vllm:iteration_tokens_total_count", labels)] == stats.num_steps
    [info] = [lab for (name, lab) in got if name == "vllm:cache_config_info"]
    assert dict(info)["num_gpu_blocks"] == str(stats.num_total_pages)


def test_frontend_series_get_the_model_name():
    from prometheus_client.core import CounterMetricFamily

    tokens = CounterMetricFamily("sluice:generation_tokens", "doc", labels=[])
    tokens.add_metric([], 7)
    got = samples(with_vllm_names(with_model_name([tokens], "m")))
    assert got[("sluice:generation_tokens_total", (("model_name", "m"),))] == 7
    assert got[("vllm:generation_tokens_total", (("model_name", "m"),))] == 7


def test_the_engine_endpoint_answers_empty_while_the_model_loads():
    """The engine binds its metrics port before loading (engine.process.server.run_engine), so a
    scrape can come before there are stats: it gets no series, not an error."""
    from engine.process.metrics_server import _EngineCollector

    assert list(_EngineCollector(lambda: None).collect()) == []
