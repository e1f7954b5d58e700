"""GET /v1/engines' answer from the engine client's state (frontend.engine_client.engine_list):
each state (up, down, draining, retired), the numbers before the first heartbeat, the
prefix-cache hit rate's edge (no lookups yet), and requests between engines left out. The
live route, its key and a real frozen engine: tests/integration/test_observability.py."""

from __future__ import annotations

import time

import msgspec

from frontend.engine_client.connection import EngineConnection, RequestStream
from frontend.engine_client.engine_list import engine_list
from shared.protocol import EngineStats, LoraAdapterInfo

TIMEOUT_S = 5.0


def _stats(**changes) -> EngineStats:
    stats = EngineStats(
        engine_id="e", model_name="m", max_model_len=2048, num_total_pages=100,
        num_free_pages=60, num_running=3, num_waiting=2, num_steps=9, max_seqs_in_step=3,
        num_finished=1, num_aborted=0, sent_at=0.0, num_preemptions=4,
        prefix_cache_queries=200, prefix_cache_hits=50, num_postproc_workers=2, page_size=16,
        lora_adapters=[LoraAdapterInfo("sql", "/a/sql")])
    return msgspec.structs.replace(stats, **changes)


def _engine(address: str, stats: EngineStats | None, heard_s_ago: float | None = 0.1):
    conn = EngineConnection(address, address)
    conn.stats = stats
    conn.last_heard = 0.0 if heard_s_ago is None else time.monotonic() - heard_s_ago
    return conn


class _Tracker:
    def __init__(self, arrived: dict[str, float]) -> None:
        self._arrived = arrived

    def arrived(self, request_id: str) -> float | None:
        return self._arrived.get(request_id)


class _Client:
    """What engine_list reads of an EngineClient."""

    def __init__(self, engines, streams, arrived) -> None:
        self.engines = {c.address: c for c in engines}
        self.heartbeat_timeout_s = TIMEOUT_S
        self._streams = streams
        self.tracker = _Tracker(arrived)

    def requests_in_flight(self):
        return list(self._streams.items())


def test_states_numbers_and_requests():
    up = _engine("tcp://a:1", _stats(engine_id="a"))
    up.migrated_in = 2
    down = _engine("tcp://b:1", _stats(engine_id="b"), heard_s_ago=TIMEOUT_S + 1)
    down.migrated_out = 2
    draining = _engine("tcp://c:1", _stats(engine_id="c", draining=True))
    retired = _engine("tcp://d:1", _stats(engine_id="d", prefix_cache_queries=0))
    retired.retired = True
    never = _engine("tcp://e:1", None, heard_s_ago=None)
    on_up = RequestStream(None, None, None, engine=up, output_ids=bytearray(12))
    between = RequestStream(None, None, None, engine=None)  # lost its engine, waiting
    now = time.monotonic()
    client = _Client([never, retired, draining, down, up], {"r-1": on_up, "r-2": between},
                     {"r-1": now - 2.5, "r-2": now - 9})
    body = msgspec.json.decode(msgspec.json.encode(engine_list(client)))
    assert body["object"] == "list"
    by_id = {e["id"]: e for e in body["data"]}
    assert [e["address"] for e in body["data"]] == sorted(c.address for c in
                                                         client.engines.values())
    assert {i: e["state"] for i, e in by_id.items()} == {
        "a": "up", "b": "down", "c": "draining", "d": "draining", "tcp://e:1": "down"}
    a = by_id["a"]
    assert (a["running"], a["waiting"], a["kv_pages_total"], a["kv_pages_free"],
            a["kv_pages_used"], a["page_size"]) == (3, 2, 100, 60, 40, 16)
    assert (a["prefix_cache_hit_rate"], a["loras"], a["postproc_workers"],
            a["preemptions"]) == (0.25, ["sql"], 2, 4)
    assert (a["migrated_in"], a["migrated_out"], by_id["b"]["migrated_out"]) == (2, 0, 2)
    [request] = a["requests"]
    assert request["id"] == "r-1" and request["output_tokens"] == 3
    assert 2.4 < request["age_s"] < 5
    assert all(not e["requests"] for i, e in by_id.items() if i != "a")  # r-2 is nowhere
    assert by_id["d"]["prefix_cache_hit_rate"] is None  # nothing looked up yet
    first = by_id["tcp://e:1"]  # no heartbeat yet: its address names it, numbers are 0
    assert (first["kv_pages_total"], first["running"], first["loras"], first["role"],
            first["prefix_cache_hit_rate"]) == (0, 0, [], "both", None)
