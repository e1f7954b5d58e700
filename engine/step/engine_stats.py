"""The engine's numbers: a finished request's phase times into vLLM's histograms, and the
`EngineStats` snapshot the frontends poll."""

from __future__ import annotations

import time

from engine.request.sequence import Sequence
from shared import histograms as h
from shared.protocol import EngineStats


def observe_times(histograms: dict[str, h.Buckets], seq: Sequence) -> None:
    """vLLM's phases of a request that ended: waiting (queued until first scheduled),
    prefill (to the first token), decode (first to last token), inference (running)."""
    if seq.scheduled_time is None:
        return  # never ran: refused, or aborted while waiting
    hist = histograms
    hist[h.QUEUE_TIME].observe(max(0.0, seq.scheduled_time - seq.queued_time))
    if seq.first_token_time is None:
        return
    hist[h.PREFILL_TIME].observe(max(0.0, seq.first_token_time - seq.scheduled_time))
    hist[h.DECODE_TIME].observe(max(0.0, seq.last_token_time - seq.first_token_time))
    hist[h.INFERENCE_TIME].observe(max(0.0, seq.last_token_time - seq.scheduled_time))


def _histograms(core) -> dict[str, h.Buckets]:
    drafter = core.scheduler.drafter
    return core.histograms if drafter is None else core.histograms | drafter.histograms

def engine_stats(core) -> EngineStats:
    """The engine's counters and gauges as the frontends read them (`core`: the EngineCore)."""
    return EngineStats(
        engine_id=core.engine_id,
        model_name=core.model_name,
        max_model_len=core.max_model_len,
        num_total_pages=core.allocator.num_pages,
        num_free_pages=core.allocator.num_free,
        num_running=len(core.scheduler.running),
        num_waiting=len(core.scheduler.waiting),
        num_steps=core.num_steps,
        max_seqs_in_step=core.max_seqs_in_step,
        num_finished=core.num_finished,
        num_aborted=core.num_aborted,
        sent_at=time.time(),
        num_preemptions=core.num_preemptions,
        num_computed_tokens=core.num_computed_tokens,
        prefix_cache_queries=core.allocator.prefix_queries,
        prefix_cache_hits=core.allocator.prefix_hits,
        step_time_total_s=core.step_time_total_s,
        page_size=core.allocator.page_size,
        histograms={name: b.snapshot() for name, b in _histograms(core).items()},
        lora_adapters=core.lora.infos() if core.lora is not None else [],
        tokenizer_fingerprint=core.tokenizer_fingerprint,
        speculative=core.scheduler.drafter is not None,
    )
