"""Per-key metrics of the keys file (`--api-keys-file`), labelled by the entry's `name`:
never the secret, nor its hash. Multiprocess-safe like the request metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

REQUESTS = Counter("sluice:api_key_requests", "Requests admitted, by API key name.",
                   ["key_name"], registry=None)
PROMPT_TOKENS = Counter("sluice:api_key_prompt_tokens",
                        "Prompt tokens of finished requests, by API key name.",
                        ["key_name"], registry=None)
GENERATION_TOKENS = Counter("sluice:api_key_generation_tokens",
                            "Generated tokens of finished requests, by API key name.",
                            ["key_name"], registry=None)
REFUSALS = Counter(
    "sluice:api_key_refusals",
    "Requests refused, by API key name and reason (requests_per_minute, tokens_per_minute, "
    "max_concurrent, max_tokens_per_request, model_not_found, expired, "
    "rate_limit_store_unavailable).", ["key_name", "reason"], registry=None)
IN_FLIGHT = Gauge("sluice:api_key_requests_in_flight",
                  "Requests this frontend is answering, by API key name.", ["key_name"],
                  multiprocess_mode="livesum", registry=None)
STORE_FAILURES = Counter(
    "sluice:rate_limit_store_failures",
    "Rate-limit store calls that failed, by what was done (open: admitted, closed: refused, "
    "settle: a settle lost).", ["policy"], registry=None)

_ALL = (REQUESTS, PROMPT_TOKENS, GENERATION_TOKENS, REFUSALS, IN_FLIGHT, STORE_FAILURES)


def register_key_metrics(registry: CollectorRegistry) -> None:
    """Single-process mode only, as `register_request_metrics`."""
    for metric in _ALL:
        registry.register(metric)
