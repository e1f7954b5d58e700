"""Prometheus exposition for a frontend: the engine's latest stats, as the heartbeat saw them,
and this frontend's own request and input metrics.

The frontend's metrics live in prometheus_client's multiprocess files when
PROMETHEUS_MULTIPROC_DIR was set before the library was imported (the CLI does that), so
every frontend process sharing the directory is summed in one scrape; without it (unit
tests) they are read from this process.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from frontend.engine_client import EngineClient
from frontend.input_metrics import register_input_metrics
from frontend.request_metrics import register_request_metrics

# The library chose its storage when it was imported, i.e. by now: read the same setting.
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

_GAUGES = (
    ("num_running", "sluice:num_requests_running", "Requests in the engine's running batch."),
    ("num_waiting", "sluice:num_requests_waiting", "Requests queued in the engine."),
    ("num_total_pages", "sluice:kv_cache_total_pages", "KV cache pages in the engine."),
    ("num_free_pages", "sluice:kv_cache_free_pages", "KV cache pages not owned by a request."),
    ("max_seqs_in_step", "sluice:max_seqs_in_step", "Most sequences one engine step has run."),
    ("num_postproc_workers", "sluice:postproc_workers",
     "Postproc workers the engine hears from (0: frontends post-process every request)."),
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
    ("postproc_assigned", "sluice:postproc_requests_assigned",
     "Requests the engine assigned to a postproc worker."),
    ("postproc_replayed", "sluice:postproc_requests_replayed",
     "Assigned requests moved off a dead postproc worker (to another, or to their frontend)."),
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
        yield from _derived(stats)


def _derived(stats):
    """The series vLLM's dashboards expect that are computed from the raw stats."""
    usage = GaugeMetricFamily(
        "sluice:kv_cache_usage_perc",
        "Fraction of KV cache pages in use by requests (1 = full), as vLLM's.", labels=["engine"])
    used = stats.num_total_pages - stats.num_free_pages
    usage.add_metric([stats.engine_id], used / stats.num_total_pages if stats.num_total_pages
                     else 0.0)
    yield usage
    # A summary (count and sum): mean step time = rate(_sum) / rate(_count).
    step = SummaryMetricFamily(
        "sluice:engine_step_duration_seconds", "Wall time of the engine's model steps.",
        labels=["engine"])
    step.add_metric([stats.engine_id], stats.num_steps, stats.step_time_total_s)
    yield step


def metrics_registry(client: EngineClient) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(client))
    if MULTIPROCESS:
        multiprocess.MultiProcessCollector(registry)
    else:
        register_input_metrics(registry)
        register_request_metrics(registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def process_exiting() -> None:
    """Drop this process's live gauges from the shared directory (counters stay summed)."""
    if MULTIPROCESS:
        multiprocess.mark_process_dead(os.getpid())
