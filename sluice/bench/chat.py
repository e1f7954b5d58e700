"""`sluice bench`: N concurrent streaming chat clients against an OpenAI-compatible server.

Only the public /v1 wire format is used, so the same run can target sluice, vLLM or
llama.cpp's llama-server and the numbers are comparable. Each client POSTs
/chat/completions with stream=true, stamps time-to-first-token at the first chunk that
carries text, inter-token latency between successive text chunks, and takes the output
token count from the final usage chunk (falling back to counting text chunks).
"""

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import msgspec

from shared.command_line import int_at_least
from sluice.bench.stats import BenchResult, RequestStats, error_samples, summarize
from sluice.bench.wire import (
    ChatChunk,
    ChatRequest,
    Done,
    Message,
    ModelList,
    StreamError,
    parse_sse_line,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
# Long generations on a loaded server can stall for minutes between bytes; only a truly
# hung server should trip the read timeout.
READ_TIMEOUT_S = 600.0
ERROR_DETAIL_CHARS = 200

_PASSAGE = (
    "The river town grew up around a wooden sluice that diverted water to three mills. "
    "Each spring the snowmelt raised the river, and the miller opened the gates a little "
    "wider; each autumn he closed them again so the mill ponds would not drain. When a "
    "flood in the fourth year tore the upper gate loose, the townspeople argued for a "
    "month over whether to rebuild it in stone or in oak. The stone faction won, but the "
    "mason they hired died before the work was finished, and his apprentice completed the "
    "gate with a design of his own: two narrow channels instead of one wide one, so that "
    "either could be closed for repair while the other kept the wheels turning. The mills "
    "never stopped again, and the apprentice's double channel was copied by every town "
    "downstream within a generation."
)

# Built-in prompt sets, cycled across requests: "mixed" varies topic and length so prefix
# caching and batching see a realistic spread; "short" is decode-heavy; "long" is
# prefill-heavy (a shared passage with different questions, which also exercises prefix
# caching).
BUILTIN_PROMPTS: dict[str, tuple[str, ...]] = {
    "mixed": (
        "Explain how a hash map handles collisions, with a short example.",
        "Write a haiku about a lighthouse in winter.",
        "What are the main differences between TCP and UDP? Answer in a few bullet points.",
        "Summarise the plot of Romeo and Juliet in three sentences.",
        "Give me a Python function that checks whether a string is a palindrome.",
        "Why is the sky blue? Explain it to a ten-year-old.",
        "List five practical tips for keeping a sourdough starter healthy.",
        "Translate 'The weather is lovely today, shall we walk?' into French and Spanish.",
        "Describe the water cycle, then name one way climate change affects it.",
        "Draft a polite email asking a colleague to review a pull request by Friday.",
    ),
    "short": (
        "Say hello.",
        "Name a prime number.",
        "What colour is grass?",
        "Count to five.",
    ),
    "long": (
        f"{_PASSAGE}\n\nWhy did the apprentice build two channels instead of one?",
        f"{_PASSAGE}\n\nRetell this story from the point of view of the miller.",
        f"{_PASSAGE}\n\nList every event in this story in chronological order.",
    ),
}


# ---- per-request measurement --------------------------------------------------------


class StreamTally(msgspec.Struct):
    """Timing and token counts accumulated while one stream is read."""

    start: float
    first_at: float | None = None
    last_at: float | None = None
    gaps: list[float] = []
    content_chunks: int = 0
    usage_tokens: int | None = None
    done: bool = False

    def observe(self, event: ChatChunk | Done, now: float) -> None:
        if self.done:
            return  # anything after [DONE] is ignored
        if isinstance(event, Done):
            self.done = True
            return
        if event.usage is not None:
            # Some servers repeat usage on every chunk; the last one is the total.
            self.usage_tokens = event.usage.completion_tokens
        if event.text():
            self._stamp(now)

    def _stamp(self, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        else:
            self.gaps.append(now - self.last_at)
        self.last_at = now
        self.content_chunks += 1

    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.content_chunks


class RequestFailed(Exception):
    """A request the server answered, but not with a complete stream."""


async def _stream_chat(client: httpx.AsyncClient, url: str, body: bytes) -> StreamTally:
    tally = StreamTally(start=time.perf_counter())
    async with client.stream("POST", url, content=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread())[:ERROR_DETAIL_CHARS].decode(errors="replace")
            raise RequestFailed(f"HTTP {resp.status_code}: {detail}")
        # Read to the end even after [DONE] so the connection can go back to the pool.
        async for line in resp.aiter_lines():
            event = parse_sse_line(line)
            if isinstance(event, StreamError):
                raise RequestFailed(f"stream error: {event.message[:ERROR_DETAIL_CHARS]}")
            if event is not None:
                tally.observe(event, time.perf_counter())
    if not tally.done:
        raise RequestFailed("stream ended without [DONE]")
    return tally


def _describe(exc: Exception) -> str:
    text = str(exc)
    return text if isinstance(exc, RequestFailed) else f"{type(exc).__name__}: {text}"


async def one_request(client: httpx.AsyncClient, url: str, body: bytes) -> RequestStats:
    """Run one streaming request; any failure becomes an errored RequestStats, never a raise."""
    start = time.perf_counter()
    try:
        tally = await _stream_chat(client, url, body)
    except Exception as exc:  # a failed request is data for the report, not a crash
        return RequestStats(ok=False, latency_s=time.perf_counter() - start, error=_describe(exc))
    ttft = None if tally.first_at is None else tally.first_at - tally.start
    return RequestStats(
        ok=True,
        latency_s=time.perf_counter() - start,
        ttft_s=ttft,
        itl_s=tally.gaps,
        output_tokens=tally.output_tokens(),
    )


async def run_requests(
    client: httpx.AsyncClient, url: str, bodies: Sequence[bytes], concurrency: int
) -> list[RequestStats]:
    """Keep `concurrency` requests in flight until every body has been sent once."""
    results: list[RequestStats | None] = [None] * len(bodies)
    # One iterator shared by all workers: a worker takes the next body the moment it frees
    # up, so the server always sees exactly `concurrency` streams (asyncio is
    # single-threaded, so next() needs no lock).
    pending: Iterator[tuple[int, bytes]] = iter(enumerate(bodies))

    async def worker() -> None:
        for index, body in pending:
            results[index] = await one_request(client, url, body)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    return [r for r in results if r is not None]


# ---- configuration and driver -------------------------------------------------------


class BenchConfig(msgspec.Struct):
    base_url: str
    model: str | None
    concurrency: int
    num_requests: int
    max_tokens: int
    temperature: float
    ignore_eos: bool
    api_key: str | None
    fresh_connections: bool
    warmup: int
    prompts: list[str]
    cpu_pids: list[int] = []


_positive_int = int_at_least(1)
_non_negative_int = int_at_least(0)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `sluice bench` options on `parser`."""
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI-compatible /v1 URL")
    parser.add_argument("--model", help="model id (default: first id from GET /models)")
    parser.add_argument("--concurrency", type=_positive_int, default=8, help="streams in flight")
    parser.add_argument(
        "--num-requests", type=_positive_int, help="timed requests (default: 4 x concurrency)"
    )
    parser.add_argument("--max-tokens", type=_positive_int, default=128,
                        help="max_tokens of every request")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="temperature of every request")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos so every answer has exactly max-tokens (sluice, vLLM)",
    )
    parser.add_argument(
        "--prompt-set", choices=sorted(BUILTIN_PROMPTS), default="mixed", help="built-in prompts"
    )
    parser.add_argument("--prompt-file", type=Path, help="one prompt per line; overrides the set")
    parser.add_argument("--api-key", help="sent as a Bearer token")
    parser.add_argument(
        "--fresh-connections",
        action="store_true",
        help="new HTTP connection per request (llama-server drops kept-alive ones under load)",
    )
    parser.add_argument("--warmup", type=_non_negative_int, default=1, help="untimed requests")
    parser.add_argument(
        "--cpu-pid", type=int, action="append", default=[], metavar="PID",
        help="a server process on this machine whose CPU time (user + system) to measure over "
             "the timed run, reported per output token; repeat to sum several (Linux)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    # Embeddings mode (sluice.bench.embeddings).
    parser.add_argument("--embeddings", action="store_true",
                        help="load-test /v1/embeddings instead of chat completions")
    parser.add_argument("--batch-size", type=_positive_int, default=1,
                        help="--embeddings: inputs per request (default: %(default)s)")


def _load_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt_file is None:
        return list(BUILTIN_PROMPTS[args.prompt_set])
    prompts = [line.strip() for line in args.prompt_file.read_text().splitlines()]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise SystemExit(f"no prompts in {args.prompt_file}")
    return prompts


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url.rstrip("/"),
        model=args.model,
        concurrency=args.concurrency,
        num_requests=args.num_requests or 4 * args.concurrency,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        fresh_connections=args.fresh_connections,
        warmup=args.warmup,
        prompts=_load_prompts(args),
        cpu_pids=args.cpu_pid,
    )


def make_client(config: BenchConfig) -> httpx.AsyncClient:
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    if config.fresh_connections:
        headers["Connection"] = "close"  # tell the server too, not just our pool
    limits = httpx.Limits(
        max_connections=config.concurrency,
        # No keep-alive slots means every connection is closed once its response ends.
        max_keepalive_connections=0 if config.fresh_connections else config.concurrency,
    )
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=30.0, write=60.0)
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout)


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        resp = await client.get(f"{base_url}/models")
        resp.raise_for_status()
        models = msgspec.json.decode(resp.content, type=ModelList)
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        raise SystemExit(f"cannot list models at {base_url}/models: {exc}") from exc
    if not models.data:
        raise SystemExit(f"{base_url}/models lists no models; pass --model")
    return models.data[0].id


def build_bodies(config: BenchConfig, model: str, count: int) -> list[bytes]:
    """Encode `count` request bodies up front, cycling through the prompts."""
    bodies = []
    for i in range(count):
        request = ChatRequest(
            model=model,
            messages=[Message("user", config.prompts[i % len(config.prompts)])],
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            ignore_eos=True if config.ignore_eos else msgspec.UNSET,
        )
        bodies.append(msgspec.json.encode(request))
    return bodies


async def bench(config: BenchConfig) -> BenchResult:
    async with make_client(config) as client:
        model = config.model or await discover_model(client, config.base_url)
        url = f"{config.base_url}/chat/completions"
        if config.warmup:
            warm = await run_requests(
                client, url, build_bodies(config, model, config.warmup), config.concurrency
            )
            for failure in error_samples(warm):
                print(f"warmup request failed: {failure}", file=sys.stderr)
        bodies = build_bodies(config, model, config.num_requests)
        cpu_before = processes_cpu_s(config.cpu_pids)
        spec_before = await spec_decode_counts(client, config.base_url)
        start = time.perf_counter()
        stats = await run_requests(client, url, bodies, config.concurrency)
        duration = time.perf_counter() - start
        cpu = processes_cpu_s(config.cpu_pids) - cpu_before if config.cpu_pids else None
        spec_after = await spec_decode_counts(client, config.base_url)
    result = summarize(stats, model, config.concurrency, duration)
    if spec_before is not None and spec_after is not None:
        drafts, drafted, accepted = (int(b - a) for a, b in zip(spec_before, spec_after,
                                                                 strict=True))
        result = msgspec.structs.replace(result, spec_drafts=drafts, spec_draft_tokens=drafted,
                                         spec_accepted_tokens=accepted)
    if cpu is not None:
        per_token = cpu * 1000 / result.output_tokens if result.output_tokens else None
        result = msgspec.structs.replace(result, process_cpu_s=cpu, cpu_ms_per_token=per_token)
    return result


SPEC_SERIES = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
               "vllm:spec_decode_num_accepted_tokens_total")


async def spec_decode_counts(client: httpx.AsyncClient, base_url: str
                             ) -> tuple[float, float, float] | None:
    """(drafts, draft tokens, accepted tokens) so far from the server's /metrics (summed
    over label sets); None when it has no such series or no /metrics."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        response = await client.get(f"{root}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals = dict.fromkeys(SPEC_SERIES, 0.0)
    found = set()
    for line in response.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
            found.add(name)
    return tuple(totals.values()) if found == set(SPEC_SERIES) else None


def processes_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes have used so far (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                # The command name may hold spaces; the fields after its ')' are fixed.
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError as exc:
            raise SystemExit(f"cannot read the CPU time of process {pid}: {exc}") from exc
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks
