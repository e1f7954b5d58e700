"""Per-request metrics of a frontend (req L-3), with vLLM's meanings and units.

Under `sluice frontend` and `sluice serve` prometheus_client runs in multiprocess mode (see
`shared.prometheus_dir`): these values live in files that a scrape of any frontend process
of the same directory sums. Timings are taken on the frontend's clock, from the moment the
HTTP request arrived. The engine's own iteration stats come from `frontend.http.metrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets, so its Grafana dashboards read these unchanged.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))  # 1 .. 5M

TIME_TO_FIRST_TOKEN = Histogram(
    "sluice:time_to_first_token_seconds",
    "Seconds from a request's arrival to its first generated token.",
    buckets=_TTFT_BUCKETS, registry=None,
)
INTER_TOKEN_LATENCY = Histogram(
    "sluice:inter_token_latency_seconds",
    "Seconds between consecutive generated tokens of a request.",
    buckets=_ITL_BUCKETS, registry=None,
)
E2E_LATENCY = Histogram(
    "sluice:e2e_request_latency_seconds",
    "Seconds from a request's arrival to its last token, for requests that finished.",
    buckets=_E2E_BUCKETS, registry=None,
)
PROMPT_TOKENS = Histogram(
    "sluice:request_prompt_tokens", "Prompt tokens of each finished request.",
    buckets=_TOKEN_BUCKETS, registry=None,
)
GENERATION_TOKENS = Histogram(
    "sluice:request_generation_tokens", "Generated tokens of each finished request.",
    buckets=_TOKEN_BUCKETS, registry=None,
)
PROMPT_TOKENS_TOTAL = Counter(
    "sluice:prompt_tokens", "Prompt tokens of finished requests.", registry=None,
)
GENERATION_TOKENS_TOTAL = Counter(
    "sluice:generation_tokens", "Generated tokens, counted as they arrive.", registry=None,
)
REQUEST_SUCCESS = Counter(
    "sluice:request_success",
    "Engine requests that ended normally, by finish reason (stop, length, abort).",
    ["finished_reason"], registry=None,
)
REQUEST_ERRORS = Counter(
    "sluice:request_errors",
    "Engine requests that ended with an error, by HTTP status (503 engine lost or shutdown, "
    "504 --request-timeout, 400 refused by the engine).",
    ["status"], registry=None,
)
REJECTED = Counter(
    "sluice:requests_rejected",
    "HTTP requests refused before any work, by reason (unauthorized, body_too_large, "
    "queue_full, draining; with --api-keys-file also expired and the limit's name).",
    ["reason"], registry=None,
)
# vLLM's per-request parameter histograms: one observation per prompt (vLLM's request).
PARAMS_N = Histogram(
    "sluice:request_params_n", "The n of each request (answers per prompt).",
    buckets=(1, 2, 5, 10, 20), registry=None,
)
PARAMS_MAX_TOKENS = Histogram(
    "sluice:request_params_max_tokens", "The max_tokens each prompt ran with.",
    buckets=_TOKEN_BUCKETS, registry=None,
)
MAX_NUM_GENERATION_TOKENS = Histogram(
    "sluice:request_max_num_generation_tokens",
    "The most tokens any answer of a finished prompt generated (its n answers and best_of).",
    buckets=_TOKEN_BUCKETS, registry=None,
)
QUEUED = Gauge(
    "sluice:frontend_queued_requests",
    "Requests this frontend accepted that have no generated token yet (--max-queued-requests).",
    multiprocess_mode="livesum", registry=None,
)
IN_FLIGHT = Gauge(
    "sluice:frontend_requests_in_flight", "HTTP requests this frontend is answering.",
    multiprocess_mode="livesum", registry=None,
)

_ALL = (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_LATENCY, PROMPT_TOKENS, GENERATION_TOKENS,
        PROMPT_TOKENS_TOTAL, GENERATION_TOKENS_TOTAL, REQUEST_SUCCESS, REQUEST_ERRORS, REJECTED,
        PARAMS_N, PARAMS_MAX_TOKENS, MAX_NUM_GENERATION_TOKENS, QUEUED, IN_FLIGHT)


def register_request_metrics(registry: CollectorRegistry) -> None:
    """Single-process mode only: multiprocess mode reads every metric from its files."""
    for metric in _ALL:
        registry.register(metric)
