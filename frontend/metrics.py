"""Prometheus exposition for a frontend: the engine's latest stats, as the heartbeat saw them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from frontend.engine_client import EngineClient
from frontend.input_metrics import register_input_metrics

_GAUGES = (
    ("num_running", "sluice:num_requests_running", "Requests in the engine's running batch."),
    ("num_waiting", "sluice:num_requests_waiting", "Requests queued in the engine."),
    ("num_total_pages", "sluice:kv_cache_total_pages", "KV cache pages in the engine."),
    ("num_free_pages", "sluice:kv_cache_free_pages", "KV cache pages not owned by a request."),
    ("max_seqs_in_step", "sluice:max_seqs_in_step", "Most sequences one engine step has run."),
)
_COUNTERS = (
    ("num_steps", "sluice:engine_steps", "Model steps the engine has run."),
    ("num_finished", "sluice:requests_finished", "Requests the engine finished."),
    ("num_aborted", "sluice:requests_aborted", "Requests aborted before they finished."),
    ("num_preemptions", "sluice:num_preemptions", "Sequences preempted for lack of KV pages."),
    ("num_computed_tokens", "sluice:computed_tokens", "Tokens fed through the model."),
    ("prefix_cache_queries", "sluice:prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "sluice:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
)


class EngineStatsCollector:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def collect(self):
        stats = self.client.stats
        alive = GaugeMetricFamily("sluice:engine_up", "1 while the engine answers heartbeats.")
        alive.add_metric([], 1.0 if self.client.engine_alive else 0.0)
        yield alive
        if stats is None:
            return
        for field, name, doc in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["engine"])
            family.add_metric([stats.engine_id], float(getattr(stats, field)))
            yield family
        for field, name, doc in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["engine"])
            family.add_metric([stats.engine_id], float(getattr(stats, field)))
            yield family


def metrics_registry(client: EngineClient) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(client))
    register_input_metrics(registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
