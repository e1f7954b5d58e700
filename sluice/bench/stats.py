"""`sluice bench`'s numbers: percentiles over the requests' timings, the run's
`BenchResult` and its report."""

from collections.abc import Sequence

import msgspec

ERROR_SAMPLES = 3  # distinct error messages kept for the report


class RequestStats(msgspec.Struct):
    """One request's outcome and timings."""

    ok: bool
    latency_s: float
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = []
    output_tokens: int = 0


def percentile(values: Sequence[float], pct: float) -> float | None:
    """The pct-th percentile by linear interpolation between closest ranks.

    This is numpy's default ("linear") method: the rank is pct/100 * (n - 1) over the
    sorted values, interpolated between its neighbours. None for an empty sample, so an
    absent metric is never reported as 0.
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = pct / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class BenchResult(msgspec.Struct):
    model: str
    concurrency: int
    num_requests: int
    completed: int
    errors: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    mean_output_tokens: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    error_samples: list[str] = []
    # With --cpu-pid: CPU time those processes spent during the timed run, per output token.
    process_cpu_s: float | None = None
    cpu_ms_per_token: float | None = None
    # From the server's /metrics around the timed run, where it has vLLM's spec_decode
    # series (sluice with --speculative-config, vLLM with a speculative config).
    spec_drafts: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _per_second(count: int, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def error_samples(stats: Sequence[RequestStats]) -> list[str]:
    samples: list[str] = []
    for s in stats:
        if s.error is not None and s.error not in samples:
            samples.append(s.error)
        if len(samples) == ERROR_SAMPLES:
            break
    return samples


def summarize(
    stats: Sequence[RequestStats], model: str, concurrency: int, duration_s: float
) -> BenchResult:
    """Aggregate per-request stats; tokens and latencies come from completed requests only."""
    done = [s for s in stats if s.ok]
    tokens = sum(s.output_tokens for s in done)
    ttfts = [s.ttft_s for s in done if s.ttft_s is not None]
    itls = [gap for s in done for gap in s.itl_s]  # pooled: every gap weighs the same
    return BenchResult(
        model=model,
        concurrency=concurrency,
        num_requests=len(stats),
        completed=len(done),
        errors=len(stats) - len(done),
        duration_s=duration_s,
        output_tokens=tokens,
        output_tokens_per_s=_per_second(tokens, duration_s),
        requests_per_s=_per_second(len(done), duration_s),
        mean_output_tokens=tokens / len(done) if done else 0.0,
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_p50_ms=_ms(percentile(itls, 50)),
        itl_p99_ms=_ms(percentile(itls, 99)),
        error_samples=error_samples(stats),
    )


def _fmt(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.1f} {unit}"


def format_report(result: BenchResult, base_url: str) -> str:
    """A short aligned table for humans; --json gives the machine-readable form."""
    rows = [
        ("target", f"{base_url}  model={result.model}"),
        ("concurrency", str(result.concurrency)),
        ("requests", f"{result.completed} ok, {result.errors} errors"),
        ("duration", f"{result.duration_s:.2f} s"),
        ("output tokens", f"{result.output_tokens} ({result.mean_output_tokens:.1f}/request)"),
        ("throughput", f"{result.output_tokens_per_s:.1f} tok/s"),
        ("request rate", f"{result.requests_per_s:.2f} req/s"),
        ("TTFT p50 / p99", f"{_fmt(result.ttft_p50_ms, 'ms')} / {_fmt(result.ttft_p99_ms, 'ms')}"),
        ("ITL p50 / p99", f"{_fmt(result.itl_p50_ms, 'ms')} / {_fmt(result.itl_p99_ms, 'ms')}"),
    ]
    if result.process_cpu_s is not None:
        per_token = ("-" if result.cpu_ms_per_token is None
                     else f"{result.cpu_ms_per_token:.3f} ms")
        rows.append(("server CPU", f"{result.process_cpu_s:.2f} s, {per_token} per output token"))
    if result.spec_draft_tokens is not None:
        drafted, accepted = result.spec_draft_tokens, result.spec_accepted_tokens
        share = f"{accepted / drafted:.1%}" if drafted else "-"
        per_draft = f"{accepted / result.spec_drafts:.2f}" if result.spec_drafts else "-"
        rows.append(("speculative", f"{result.spec_drafts} drafts, {accepted}/{drafted} draft "
                                    f"tokens accepted ({share}), {per_draft} per draft"))
    rows += [("error", sample) for sample in result.error_samples]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
