"""`sluice bench --embeddings`: load-test an embeddings server (/v1/embeddings, any
OpenAI-compatible one). Each request carries `--batch-size` inputs cycled from the prompt
set; `--concurrency` requests stay in flight. Reports embeddings/s, input tokens/s (the
server's usage) and request latency."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence

import httpx
import msgspec

from sluice.bench.chat import BenchConfig, discover_model, make_client
from sluice.bench.stats import percentile


class EmbedRequest(msgspec.Struct):
    model: str
    input: list[str]
    encoding_format: str = "base64"  # what the openai client sends: the cheaper encoding


class _Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0


class _Answer(msgspec.Struct):
    data: list[msgspec.Raw]
    usage: _Usage = _Usage()


class EmbedStats(msgspec.Struct):
    ok: bool
    latency_s: float
    embeddings: int = 0
    prompt_tokens: int = 0
    error: str | None = None


class EmbedResult(msgspec.Struct):
    model: str
    concurrency: int
    batch_size: int
    num_requests: int
    completed: int
    errors: int
    duration_s: float
    embeddings: int
    embeddings_per_s: float
    prompt_tokens: int
    prompt_tokens_per_s: float
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    error_samples: list[str] = []


async def _one(client: httpx.AsyncClient, url: str, body: bytes) -> EmbedStats:
    start = time.perf_counter()
    try:
        response = await client.post(url, content=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        answer = msgspec.json.decode(response.content, type=_Answer)
    except Exception as exc:  # a failed request is data for the report
        return EmbedStats(False, time.perf_counter() - start, error=f"{exc}"[:300])
    return EmbedStats(True, time.perf_counter() - start, len(answer.data),
                      answer.usage.prompt_tokens)


async def _run(client, url: str, bodies: Sequence[bytes], concurrency: int) -> list[EmbedStats]:
    results: list[EmbedStats] = []
    pending: Iterator[bytes] = iter(bodies)

    async def worker() -> None:
        for body in pending:
            results.append(await _one(client, url, body))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    return results


def _bodies(config: BenchConfig, model: str, count: int, batch_size: int) -> list[bytes]:
    prompts = config.prompts
    return [msgspec.json.encode(EmbedRequest(
        model, [prompts[(i * batch_size + j) % len(prompts)] for j in range(batch_size)]))
        for i in range(count)]


async def bench_embeddings(config: BenchConfig, batch_size: int) -> EmbedResult:
    async with make_client(config) as client:
        model = config.model or await discover_model(client, config.base_url)
        url = f"{config.base_url}/embeddings"
        if config.warmup:
            await _run(client, url, _bodies(config, model, config.warmup, batch_size),
                       config.concurrency)
        bodies = _bodies(config, model, config.num_requests, batch_size)
        start = time.perf_counter()
        stats = await _run(client, url, bodies, config.concurrency)
        duration = time.perf_counter() - start
    done = [s for s in stats if s.ok]
    embeddings = sum(s.embeddings for s in done)
    tokens = sum(s.prompt_tokens for s in done)
    latencies = [s.latency_s for s in done]
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    return EmbedResult(
        model=model, concurrency=config.concurrency, batch_size=batch_size,
        num_requests=len(stats), completed=len(done), errors=len(stats) - len(done),
        duration_s=duration, embeddings=embeddings,
        embeddings_per_s=embeddings / duration if duration > 0 else 0.0,
        prompt_tokens=tokens, prompt_tokens_per_s=tokens / duration if duration > 0 else 0.0,
        latency_p50_ms=ms(percentile(latencies, 50)), latency_p99_ms=ms(percentile(latencies, 99)),
        error_samples=sorted({s.error for s in stats if s.error})[:3],
    )


def format_embed_report(result: EmbedResult, base_url: str) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
    rows = [
        ("target", f"{base_url}  model={result.model}"),
        ("concurrency", f"{result.concurrency} requests of {result.batch_size} inputs"),
        ("requests", f"{result.completed} ok, {result.errors} errors"),
        ("duration", f"{result.duration_s:.2f} s"),
        ("embeddings", f"{result.embeddings} ({result.embeddings_per_s:.1f}/s)"),
        ("input tokens", f"{result.prompt_tokens} ({result.prompt_tokens_per_s:.1f}/s)"),
        ("latency p50 / p99", f"{fmt(result.latency_p50_ms)} / {fmt(result.latency_p99_ms)}"),
    ]
    rows += [("error", sample) for sample in result.error_samples]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
