"""Per-engine series of one frontend's engine connections (issue 18): which engines it hears,
how many of its requests each holds, how many requests moved off a lost engine. Read
from the engine client at scrape time, labelled `engine` (the engine's id) and `address`."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def connection_families(client, model_name: str = ""):
    labels = ["model_name", "engine", "address"]
    live = GaugeMetricFamily("sluice:engine_live",
                             "1 while this engine answers this frontend's heartbeats.",
                             labels=labels)
    held = GaugeMetricFamily("sluice:engine_requests",
                             "This frontend's requests running on this engine.", labels=labels)
    for conn in sorted(client.engines.values(), key=lambda c: c.address):
        key = [model_name, conn.engine_id, conn.address]
        live.add_metric(key, 1.0 if conn.alive(client.heartbeat_timeout_s) else 0.0)
        held.add_metric(key, float(len(conn.requests)))
    yield live
    yield held
    moved = CounterMetricFamily(
        "sluice:requests_migrated",
        "Requests moved to another engine (as a continuation when they had streamed), by "
        "why their engine was lost: death, freeze or drain.",
        labels=["model_name", "reason"])
    for reason, count in client.migrated.items():
        moved.add_metric([model_name, reason], float(count))
    yield moved
    failed = CounterMetricFamily(
        "sluice:migration_failures",
        "Requests that lost their engine and could not move (no engine within "
        "--engine-timeout, or --migration-limit reached): they ended with an error.",
        labels=["model_name"])
    failed.add_metric([model_name], float(client.migration_failures))
    yield failed
    if client.kv_events is not None and client.kv_events.index is not None:
        yield from kv_event_families(client, model_name)


def kv_event_families(client, model_name: str = ""):
    """--routing kv: what this frontend took from the engines' KV events."""
    subscriber = client.kv_events
    pages = GaugeMetricFamily("sluice:kv_events_pages",
                              "KV pages this engine's events say it holds now.",
                              labels=["model_name", "engine", "address"])
    for conn in sorted(client.engines.values(), key=lambda c: c.address):
        pages.add_metric([model_name, conn.engine_id, conn.address],
                         float(subscriber.index.pages_of(conn.address)))
    yield pages
    for name, value, text in (
            ("batches", subscriber.batches, "KV-event batches applied."),
            ("malformed", subscriber.malformed, "KV-event messages dropped as malformed."),
            ("gaps", subscriber.gaps, "Holes in an engine's KV events no replay filled "
                                      "(its entries were dropped).")):
        family = CounterMetricFamily(f"sluice:kv_events_{name}", text, labels=["model_name"])
        family.add_metric([model_name], float(value))
        yield family


def every_engine_families(client):
    """`shared.metrics_export.engine_families` of every engine this frontend has stats from,
    one family per name with a sample per engine (`sluice serve --data-parallel-size N`
    exports all N engines on its one frontend's /metrics)."""
    from shared.metrics_export import engine_families

    merged: dict = {}
    for conn in sorted(client.engines.values(), key=lambda c: c.address):
        if conn.stats is None or not conn.alive(client.heartbeat_timeout_s):
            continue  # a dead engine's last gauges would read as alive and busy
        for family in engine_families(conn.stats):
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
    yield from merged.values()
