"""`GET /v1/engines` (like llama-server's `/slots`): each engine this frontend knows, as its
client sees it: state, load and KV pages from its last heartbeat, its LoRA adapters, and
this frontend's own requests on it and moves onto and off it. Read at request time from
the engine client (`frontend.engine_client.client`); nothing is asked of the engines.
docs/observability.md names every field."""

from __future__ import annotations

import time

import msgspec

from frontend.engine_client.connection import EngineConnection


class EngineRequestInfo(msgspec.Struct):
    id: str  # the request's id (the frontend's, as in its logs)
    age_s: float  # since it arrived at this frontend
    output_tokens: int  # tokens its client has been sent so far


class EngineInfo(msgspec.Struct):
    id: str  # the engine's --engine-id (its address until its first heartbeat)
    address: str
    role: str  # "both": prefill and decode (disaggregation comes later)
    state: str  # "up" | "down" (silent past the heartbeat timeout, or gone) | "draining"
    running: int
    waiting: int
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_used: int
    page_size: int
    prefix_cache_hit_rate: float | None  # of prompt tokens looked up since start; None: none yet
    loras: list[str]
    postproc_workers: int
    migrated_in: int  # this frontend's requests moved onto it
    migrated_out: int  # and off it
    preemptions: int
    requests: list[EngineRequestInfo]


class EngineList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[EngineInfo]


def engine_list(client) -> EngineList:
    """Every engine of `client` (an EngineClient), ordered by address."""
    now = time.monotonic()
    held: dict[int, list[EngineRequestInfo]] = {}
    for request_id, stream in client.requests_in_flight():
        if stream.engine is None:
            continue  # between engines: it shows once it is placed again
        arrived = client.tracker.arrived(request_id)
        held.setdefault(id(stream.engine), []).append(EngineRequestInfo(
            id=request_id, age_s=round(now - arrived, 3) if arrived is not None else 0.0,
            output_tokens=len(stream.output_ids) // 4))
    return EngineList(data=[_engine_info(conn, _state(conn, client.heartbeat_timeout_s),
                                    held.get(id(conn), []))
                       for conn in sorted(client.engines.values(), key=lambda c: c.address)])


def _state(conn: EngineConnection, heartbeat_timeout_s: float) -> str:
    if not conn.alive(heartbeat_timeout_s):
        return "down"
    # Draining (SIGTERM), or its name no longer resolves to it: it takes nothing new.
    return "draining" if conn.draining or conn.retired else "up"


def _engine_info(conn: EngineConnection, state: str,
                 requests: list[EngineRequestInfo]) -> EngineInfo:
    """The engine's numbers are those of its last heartbeat (zeros before the first)."""
    stats = conn.stats
    total = stats.num_total_pages if stats else 0
    free = stats.num_free_pages if stats else 0
    queries = stats.prefix_cache_queries if stats else 0
    return EngineInfo(
        id=conn.engine_id, address=conn.address, role="both", state=state,
        running=stats.num_running if stats else 0, waiting=stats.num_waiting if stats else 0,
        kv_pages_total=total, kv_pages_free=free, kv_pages_used=total - free,
        page_size=stats.page_size if stats else 0,
        prefix_cache_hit_rate=stats.prefix_cache_hits / queries if queries else None,
        loras=[a.name for a in stats.lora_adapters] if stats else [],
        postproc_workers=stats.num_postproc_workers if stats else 0,
        migrated_in=conn.migrated_in, migrated_out=conn.migrated_out,
        preemptions=stats.num_preemptions if stats else 0,
        requests=sorted(requests, key=lambda r: r.id))
