"""The engine's histograms, kept as plain counts so they ride in `EngineStats`.

The engine observes into `Buckets` (no prometheus_client in its loop); whoever exports them
(the engine's own /metrics, or a `sluice serve` frontend) turns the counts into Prometheus
histograms (`shared.metrics_export`). Bounds are vLLM's, so its dashboards' quantiles and
heatmaps read the same buckets.
"""

from __future__ import annotations

from bisect import bisect_left

from shared.protocol import HistogramCounts
from shared.speculative import MAX_SPECULATIVE_TOKENS

# vLLM's request_latency_buckets: queue, prefill, decode, inference (and e2e) time.
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens per engine step (vLLM: its CUDA-graph sizes up to the step budget).
ITERATION_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                           4096.0, 8192.0, 16384.0)

ITERATION_TOKENS = "iteration_tokens"
QUEUE_TIME = "queue_time"
PREFILL_TIME = "prefill_time"
DECODE_TIME = "decode_time"
INFERENCE_TIME = "inference_time"

BOUNDS = {
    ITERATION_TOKENS: ITERATION_TOKEN_BUCKETS,
    QUEUE_TIME: REQUEST_TIME_BUCKETS,
    PREFILL_TIME: REQUEST_TIME_BUCKETS,
    DECODE_TIME: REQUEST_TIME_BUCKETS,
    INFERENCE_TIME: REQUEST_TIME_BUCKETS,
}

# Speculative decoding (--speculative-config), one observation per verified draft: its
# length, and how many of its tokens were accepted. vLLM's spec_decode counters all follow
# from these (drafts: the count; draft and accepted tokens: the sums; accepted per position:
# the drafts that accepted more than that many). Only an engine that drafts has them.
SPEC_DRAFT_TOKENS = "spec_decode_draft_tokens"
SPEC_ACCEPTED_TOKENS = "spec_decode_accepted_tokens"
SPEC_TOKEN_BUCKETS = tuple(float(i) for i in range(MAX_SPECULATIVE_TOKENS + 1))
SPEC_BOUNDS = {SPEC_DRAFT_TOKENS: SPEC_TOKEN_BUCKETS, SPEC_ACCEPTED_TOKENS: SPEC_TOKEN_BUCKETS}


class Buckets:
    """Counts per bucket (le semantics: a value equal to a bound falls in that bound's)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramCounts:
        return HistogramCounts(list(self.counts), self.total)


def engine_histograms() -> dict[str, Buckets]:
    return {name: Buckets(bounds) for name, bounds in BOUNDS.items()}


def spec_decode_histograms() -> dict[str, Buckets]:
    return {name: Buckets(bounds) for name, bounds in SPEC_BOUNDS.items()}
