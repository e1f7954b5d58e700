"""Prometheus exposition for a frontend: this frontend's own request and input metrics, whether
its engine answers, and (only with --export-engine-metrics) the engine's latest stats as the
heartbeat saw them. Every series carries `model_name`; vLLM's names come beside ours
(`shared.metrics_export`).

The frontend's metrics live in prometheus_client's multiprocess files when
PROMETHEUS_MULTIPROC_DIR was set before the library was imported (the CLI does that), so
every frontend process sharing the directory is summed in one scrape; without it (unit
tests) they are read from this process.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily

from frontend.engine_client.client import EngineClient
from frontend.engine_client.engine_metrics import connection_families, every_engine_families
from frontend.engine_client.request_metrics import register_request_metrics
from frontend.http.key_metrics import register_key_metrics
from frontend.input.input_metrics import register_input_metrics
from shared.metrics_export import with_model_name, with_vllm_names
from shared.tracing import dropped_spans_counter

# The library chose its storage when it was imported, i.e. by now: read the same setting.
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class EngineStatsCollector:
    """What this frontend knows of its engine: whether it answers heartbeats (always), and,
    with `--export-engine-metrics` (`sluice serve`), the engine's own series as its last
    heartbeat carried them. Off by default: with several frontends per engine, each would
    export the same engine numbers and a `sum()` would count them once per frontend; the
    engine serves them itself (`sluice engine --metrics-port`)."""

    def __init__(self, client: EngineClient, model_name: str, export_engine: bool) -> None:
        self.client = client
        self.model_name = model_name
        self.export_engine = export_engine

    def collect(self):
        stats = self.client.stats
        alive = GaugeMetricFamily("sluice:engine_up", "1 while the engine answers heartbeats.",
                                  labels=["model_name"])
        alive.add_metric([self.model_name], 1.0 if self.client.engine_alive else 0.0)
        yield alive
        yield from connection_families(self.client, self.model_name)  # one per engine
        if stats is not None and self.export_engine:  # every engine's (serve -dp N: N)
            yield from with_vllm_names(every_engine_families(self.client))


class FrontendSeries:
    """This frontend's own request and input series (summed over its processes in
    multiprocess mode), labelled with the served model and doubled under vLLM's names."""

    def __init__(self, source, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self):
        yield from with_vllm_names(with_model_name(self.source.collect(), self.model_name))


def metrics_registry(client: EngineClient, model_name: str = "",
                     export_engine: bool = False) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(client, model_name, export_engine))
    own = CollectorRegistry(auto_describe=False)
    if MULTIPROCESS:
        multiprocess.MultiProcessCollector(own)
    else:
        register_input_metrics(own)
        register_request_metrics(own)
        register_key_metrics(own)
        own.register(dropped_spans_counter())
    registry.register(FrontendSeries(own, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def process_exiting() -> None:
    """Drop this process's live gauges from the shared directory (counters stay summed)."""
    if MULTIPROCESS:
        multiprocess.mark_process_dead(os.getpid())
