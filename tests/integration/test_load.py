"""Load (issue 9): 64 concurrent streams for 60 seconds, zero errors, and every KV page back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.servers import metrics

STREAMS, SECONDS, TOKENS = 64, 60, 8


async def _worker(client: httpx.AsyncClient, i: int, stop_at: float, tally: dict) -> None:
    while time.monotonic() < stop_at:
        body = {"prompt": f"Item {i}: a short list of fruit.", "max_tokens": TOKENS,
                "temperature": 0.7, "seed": i, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events = []
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                status = r.status_code
        except httpx.HTTPError as exc:
            tally["errors"].append(repr(exc))
            continue
        ok = (status == 200 and events[-1:] == ["[DONE]"]
              and json.loads(events[-2])["usage"]["completion_tokens"] == TOKENS)
        if ok:
            tally["done"] += 1
        else:
            tally["errors"].append(f"{status}: {events[-2:]}")


async def _load(base_url: str) -> dict:
    tally = {"done": 0, "errors": []}
    stop_at = time.monotonic() + SECONDS
    limits = httpx.Limits(max_connections=STREAMS + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        await asyncio.gather(*(_worker(client, i, stop_at, tally) for i in range(STREAMS)))
    return tally


@pytest.mark.slow
def test_64_streams_for_a_minute(base_url):
    before = metrics(base_url)
    tally = asyncio.run(_load(base_url))
    assert tally["errors"] == []
    assert tally["done"] >= STREAMS
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = metrics(base_url)
        if now["sluice:num_requests_running"] == 0 and (
                now["sluice:kv_cache_free_pages"] == before["sluice:kv_cache_free_pages"]):
            break
        time.sleep(0.5)
    assert now["sluice:num_requests_running"] == now["sluice:num_requests_waiting"] == 0
    assert now["sluice:kv_cache_free_pages"] == before["sluice:kv_cache_free_pages"]
    assert now["sluice:max_seqs_in_step"] >= STREAMS // 2  # they really ran together
