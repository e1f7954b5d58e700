"""The engine's own Prometheus endpoint (`sluice engine --metrics-port`).

Its series (batch, queue, KV cache, prefix cache, per-step and per-request histograms) are
exported here once per engine, however many frontends it serves; frontends export only the
requests they answered (docs/operations.md, *Health and metrics*). Read at scrape time from
the stats the busy loop keeps (`EngineServer._stats`), on prometheus_client's own HTTP
thread: nothing is written per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shared.protocol import EngineStats

log = logging.getLogger("sluice.engine")


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.stats = stats

    def collect(self):
        from shared.metrics_export import engine_families, with_vllm_names

        stats = self.stats()
        if stats is not None:  # None: the engine is still loading
            yield from with_vllm_names(engine_families(stats))


def start_metrics_server(host: str, port: int,
                         stats: Callable[[], EngineStats | None]) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(stats))
    from shared.tracing import dropped_spans_counter

    registry.register(dropped_spans_counter())  # spans this engine could not export
    start_http_server(port, addr=host, registry=registry)  # a daemon thread
    log.info("engine metrics on http://%s:%d/metrics", host, port)
