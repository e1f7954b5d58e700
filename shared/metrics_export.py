"""Prometheus families for the engine's stats, and the `vllm:` twins of our series.

Imported only by exporters (the engine's `/metrics`, a frontend's), never by the CLI before
`shared.prometheus_dir` has run: it imports prometheus_client.

Every series carries `model_name` (the served name, as vLLM's); the engine's also carry
`engine` (its `--engine-id`). Each `sluice:` series that vLLM has under its own name is
yielded a second time under that name (`VLLM_NAMES`), same meaning, labels and buckets, so
vLLM's Grafana dashboards, production-stack's router and KEDA triggers read a sluice server
unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from shared import histograms as h
from shared.protocol import EngineStats

# sluice family name -> the vLLM names it is also exported under.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    # The engine's (once per engine).
    "sluice:num_requests_running": ("vllm:num_requests_running",),
    "sluice:num_requests_waiting": ("vllm:num_requests_waiting",),
    # gpu_cache_usage_perc is the name before vLLM 0.10; older dashboards still read it.
    "sluice:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    # gpu_prefix_cache_*: vLLM's names for the same counters before 0.10.
    "sluice:prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "sluice:prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "sluice:num_preemptions": ("vllm:num_preemptions",),
    "sluice:iteration_tokens_total": ("vllm:iteration_tokens_total",),
    "sluice:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "sluice:request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "sluice:request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "sluice:request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "sluice:cache_config_info": ("vllm:cache_config_info",),
    # A frontend's (each counts the requests it answered: sum them over frontends).
    "sluice:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # One observation per generated token: vLLM's inter-token latency, which it exported as
    # time_per_output_token_seconds before 0.11 (dashboards of that time read this name).
    "sluice:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                           "vllm:time_per_output_token_seconds"),
    "sluice:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "sluice:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "sluice:request_generation_tokens": ("vllm:request_generation_tokens",),
    "sluice:prompt_tokens": ("vllm:prompt_tokens",),
    "sluice:generation_tokens": ("vllm:generation_tokens",),
    "sluice:request_success": ("vllm:request_success",),
    "sluice:request_params_n": ("vllm:request_params_n",),
    "sluice:request_params_max_tokens": ("vllm:request_params_max_tokens",),
    "sluice:request_max_num_generation_tokens": ("vllm:request_max_num_generation_tokens",),
    # Speculative decoding (only an engine started with --speculative-config has them).
    "sluice:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "sluice:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "sluice:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "sluice:spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",),
}

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
_HISTOGRAMS = (
    (h.ITERATION_TOKENS, "sluice:iteration_tokens_total", "Tokens the model ran in each step."),
    (h.QUEUE_TIME, "sluice:request_queue_time_seconds",
     "Seconds each request waited in the engine before its first step (WAITING)."),
    (h.PREFILL_TIME, "sluice:request_prefill_time_seconds",
     "Seconds from each request's first step to its first token (PREFILL)."),
    (h.DECODE_TIME, "sluice:request_decode_time_seconds",
     "Seconds from each request's first token to its last (DECODE)."),
    (h.INFERENCE_TIME, "sluice:request_inference_time_seconds",
     "Seconds from each request's first step to its last token (RUNNING)."),
)
ENGINE_LABELS = ["model_name", "engine"]


def engine_families(stats: EngineStats) -> Iterator[Metric]:
    """The engine's series, sluice: names only (`with_vllm_names` adds the twins)."""
    labels = [stats.model_name, stats.engine_id]
    for field, name, doc in _GAUGES:
        family = GaugeMetricFamily(name, doc, labels=ENGINE_LABELS)
        family.add_metric(labels, float(getattr(stats, field)))
        yield family
    for field, name, doc in _COUNTERS:
        family = CounterMetricFamily(name, doc, labels=ENGINE_LABELS)
        family.add_metric(labels, float(getattr(stats, field)))
        yield family
    usage = GaugeMetricFamily(
        "sluice:kv_cache_usage_perc",
        "Fraction of KV cache pages in use by requests (1 = full), as vLLM's.",
        labels=ENGINE_LABELS)
    used = stats.num_total_pages - stats.num_free_pages
    usage.add_metric(labels, used / stats.num_total_pages if stats.num_total_pages else 0.0)
    yield usage
    # A summary (count and sum): mean step time = rate(_sum) / rate(_count).
    step = SummaryMetricFamily(
        "sluice:engine_step_duration_seconds", "Wall time of the engine's model steps.",
        labels=ENGINE_LABELS)
    step.add_metric(labels, stats.num_steps, stats.step_time_total_s)
    yield step
    for key, name, doc in _HISTOGRAMS:
        counts = stats.histograms.get(key)
        bounds = h.BOUNDS[key]
        if counts is None or len(counts.counts) != len(bounds) + 1:
            continue  # an engine of another version: leave it out rather than lie
        family = HistogramMetricFamily(name, doc, labels=ENGINE_LABELS)
        cumulative, buckets = 0, []
        for bound, count in zip([*map(repr, bounds), "+Inf"], counts.counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        family.add_metric(labels, buckets, counts.total)
        yield family
    yield from _spec_decode_families(stats, labels)
    # vLLM's cache_config_info: 1, with the KV cache's settings as labels.
    info = {"block_size": str(stats.page_size), "num_gpu_blocks": str(stats.num_total_pages),
            "enable_prefix_caching": "True", "cache_dtype": "auto"}
    config = GaugeMetricFamily("sluice:cache_config_info",
                               "The KV cache's configuration, in the labels (value 1).",
                               labels=[*ENGINE_LABELS, *info])
    config.add_metric([*labels, *info.values()], 1.0)
    yield config


def _spec_decode_families(stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
    """vLLM's spec_decode counters and our acceptance-length histogram, from the two
    per-draft histograms (shared.histograms); nothing from an engine that never drafts."""
    drafts = stats.histograms.get(h.SPEC_DRAFT_TOKENS)
    accepted = stats.histograms.get(h.SPEC_ACCEPTED_TOKENS)
    size = len(h.SPEC_TOKEN_BUCKETS) + 1
    if drafts is None or accepted is None or {len(drafts.counts), len(accepted.counts)} != {size}:
        return  # not drafting, or an engine of another version
    for name, doc, value in (
        ("sluice:spec_decode_num_drafts", "Speculative drafts verified.", sum(drafts.counts)),
        ("sluice:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
         drafts.total),
        ("sluice:spec_decode_num_accepted_tokens", "Draft tokens accepted.", accepted.total),
    ):
        family = CounterMetricFamily(name, doc, labels=ENGINE_LABELS)
        family.add_metric(labels, float(value))
        yield family
    # Position i: the drafts that accepted more than i tokens, for every position drafted.
    longest = max((i for i, c in enumerate(drafts.counts) if c), default=0)
    per_pos = CounterMetricFamily("sluice:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each position of a draft.",
                                  labels=[*ENGINE_LABELS, "position"])
    for pos in range(longest):
        per_pos.add_metric([*labels, str(pos)], float(sum(accepted.counts[pos + 1:])))
    yield per_pos
    family = HistogramMetricFamily("sluice:spec_decode_acceptance_length",
                                   "Draft tokens accepted per verified draft.",
                                   labels=ENGINE_LABELS)
    cumulative, buckets = 0, []
    for bound, count in zip([*map(repr, h.SPEC_TOKEN_BUCKETS), "+Inf"], accepted.counts,
                            strict=True):
        cumulative += count
        buckets.append((bound, float(cumulative)))
    family.add_metric(labels, buckets, accepted.total)
    yield family


def with_model_name(families: Iterable[Metric], model_name: str) -> Iterator[Metric]:
    """Adds `model_name` to every sample that lacks it: a frontend serves one model."""
    for family in families:
        out = Metric(family.name, family.documentation, family.type, family.unit)
        out.samples = [s._replace(labels={"model_name": model_name, **s.labels})
                       for s in family.samples]
        yield out


def with_vllm_names(families: Iterable[Metric]) -> Iterator[Metric]:
    """Each family, then its vLLM twins (renamed samples, same values and labels)."""
    for family in families:
        yield family
        for twin in VLLM_NAMES.get(family.name, ()):
            out = Metric(twin, family.documentation, family.type, family.unit)
            out.samples = [s._replace(name=twin + s.name[len(family.name):])
                           for s in family.samples]
            yield out
