"""KV-cache events on vLLM's wire (issue 50), over real processes and sockets: two engines
with --kv-events-config (the second as data-parallel rank 1, its ports offset), a ZeroMQ
subscriber that decodes their batches with vLLM's own Struct shapes, the replay socket, and
`--routing kv` across two frontends, the second of which never saw the first request."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from frontend.engine_client.placement import prefix_key, rank
from shared.page_hash import prompt_page_hashes
from shared.protocol import SamplingParams, pack_ids
from shared.transport import free_tcp_port
from tests.engine_client import RawEngineClient, engine_stats
from tests.servers import Proc, start_frontend, wait_healthy, wait_until

pytestmark = pytest.mark.slow  # two engines, two frontends of its own


# vLLM's definitions (vllm/distributed/kv_events.py, v0.26 on), as a consumer copies them.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM = msgspec.msgpack.Decoder(KVEventBatch)
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


class Collector:
    """A SUB on one engine's events, connected before the engine binds, keeping every
    message: (topic, sequence number, payload)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.messages: list[tuple[bytes, int, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                self.messages.append((topic, int.from_bytes(seq, "big"), payload))

    def events(self) -> list:
        return [e for _, _, p in list(self.messages) for e in VLLM.decode(p).events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sub.close(linger=0)


def _config(port: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}",
                       "topic": "kv", "buffer_steps": 1000})


class Setup:
    def __init__(self, tmp_dir: str) -> None:
        self.ctx = zmq.Context()
        self.addresses = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
        # Rank 1 adds one to both ports, as vLLM's data-parallel ranks do.
        ports = [(free_tcp_port(), free_tcp_port()) for _ in range(2)]
        self.replays = [f"tcp://127.0.0.1:{r}" for _, r in ports]
        self.collectors = [Collector(self.ctx, f"tcp://127.0.0.1:{p}") for p, _ in ports]
        common = ["--threads", "1", "--max-model-len", "192"]
        self.engines = [
            Proc(["engine", "--engine-address", self.addresses[0], "--engine-id", "engine-0",
                  *common, "--kv-events-config", _config(*ports[0])],
                 os.path.join(tmp_dir, "engine-0.log")),
            Proc(["engine", "--engine-address", self.addresses[1], "--engine-id", "engine-1",
                  *common, "--num-kv-pages", "12", "--data-parallel-rank", "1",
                  "--kv-events-config", _config(ports[1][0] - 1, ports[1][1] - 1)],
                 os.path.join(tmp_dir, "engine-1.log")),
        ]
        # A reaches engine-0 only; B reaches both. Both route by the events.
        a, self.url_a = start_frontend(tmp_dir, self.addresses[0], "frontend-a", "--routing", "kv")
        b, self.url_b = start_frontend(tmp_dir, self.addresses[0], "frontend-b", "--routing", "kv",
                                       "--engine-address", self.addresses[1])
        self.frontends = [a, b]
        procs = [*self.engines, *self.frontends]
        for url in (self.url_a, self.url_b):
            wait_healthy(url, procs)
        wait_until(lambda: _series(self.url_b, "sluice:engine_live") == 2, 60, "both engines")

    def stop(self) -> None:
        for p in [*self.frontends, *self.engines]:
            p.stop()
        for c in self.collectors:
            c.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    s = Setup(str(tmp_path_factory.mktemp("kv-events")))
    try:
        yield s
    finally:
        s.stop()


def _series(url: str, name: str, address: str | None = None) -> float:
    """The sum of a /metrics family's samples (those for `address` only, if given)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and (address is None or f'address="{address}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 20000 for i in range(n)]


def _stored_for(collector: Collector, tokens: list[int]) -> list[BlockStored]:
    return [e for e in collector.events()
            if isinstance(e, BlockStored) and e.token_ids[:16] == tokens[:16]]


def test_stored_pages_decode_with_vllms_structs(setup):
    prompt = _prompt(1, 70)  # four full pages and a partial one
    RawEngineClient(setup.addresses[0]).generate([prompt], GREEDY)
    x = setup.collectors[0]
    wait_until(lambda: _stored_for(x, prompt), 10, "BlockStored for the prompt")
    topics = {t for t, _, _ in x.messages}
    seqs = [s for _, s, _ in x.messages]
    assert topics == {b"kv"} and seqs == list(range(len(seqs)))
    first = VLLM.decode(x.messages[0][2])
    assert isinstance(first.events[0], AllBlocksCleared) and first.data_parallel_rank == 0
    stored = _stored_for(x, prompt)
    hashes = [h for e in stored for h in e.block_hashes]
    # What a router recomputes from the prompt alone: the same hashes, page for page.
    assert hashes == list(prompt_page_hashes(prompt, 16, None))[:4]
    assert b"".join(pack_ids(e.token_ids) for e in stored) == pack_ids(prompt[:64])
    parent = None
    for e in stored:
        assert e.parent_block_hash == parent  # each run hangs on the page before it
        assert (e.block_size, e.medium, e.lora_id, e.lora_name) == (16, "GPU", None, None)
        assert len(e.token_ids) == 16 * len(e.block_hashes)
        parent = e.block_hashes[-1]
    plain = msgspec.msgpack.decode(x.messages[-1][2])  # without any Struct: vLLM's shape
    assert isinstance(plain, list) and len(plain) == 3 and plain[1][0]["type"]
    # The other engine is rank 1: its ports were offset by one, its batches say so.
    wait_until(lambda: setup.collectors[1].messages, 10, "engine-1's first batch")
    assert VLLM.decode(setup.collectors[1].messages[0][2]).data_parallel_rank == 1


def test_replay_answers_from_a_sequence_number(setup):
    RawEngineClient(setup.addresses[0]).generate([_prompt(2, 40)], GREEDY)
    x = setup.collectors[0]
    wait_until(lambda: len(x.messages) >= 3, 10, "three batches")
    live = {s: p for _, s, p in list(x.messages)}
    dealer = setup.ctx.socket(zmq.DEALER)
    dealer.connect(setup.replays[0])
    try:
        dealer.send_multipart([b"bad", (0).to_bytes(8, "big")])  # not REQ's empty delimiter
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])  # as vLLM's REQ subscriber asks
        got = _replayed(dealer, [b""])
        assert [s for s, _ in got] == list(range(1, 1 + len(got))) and len(got) >= 2
        assert all(live[s] == p for s, p in got if s in live)
        dealer.send((10**9).to_bytes(8, "big"))  # a bare DEALER's form; past the end
        assert _replayed(dealer, []) == []
    finally:
        dealer.close(linger=0)


def _replayed(dealer, head: list[bytes]) -> list[tuple[int, bytes]]:
    """The answer to one replay request: (seq, payload) until the end marker."""
    got = []
    while True:
        assert dealer.poll(5000), "the replay never ended"
        parts = dealer.recv_multipart()
        assert parts[:len(head)] == head and len(parts) == len(head) + 2, parts[:3]
        seq = int.from_bytes(parts[-2], "big", signed=True)
        if seq == -1:
            assert parts[-1] == b""
            return got
        got.append((seq, parts[-1]))


def test_eviction_sends_block_removed(setup):
    """engine-1 has 12 pages: four 64-token prompts (four full pages each) recycle the
    first one's."""
    prompts = [_prompt(10 + i, 64) for i in range(4)]
    client = RawEngineClient(setup.addresses[1])
    for prompt in prompts:
        client.generate([prompt], GREEDY)
    y = setup.collectors[1]
    first = set(prompt_page_hashes(prompts[0], 16, None))

    def removed():
        return {h for e in y.events() if isinstance(e, BlockRemoved) for h in e.block_hashes}

    wait_until(lambda: first & removed(), 10, "BlockRemoved for the first prompt's pages")
    assert all(e.medium == "GPU" for e in y.events() if isinstance(e, BlockRemoved))
    stored = {h for e in y.events() if isinstance(e, BlockStored) for h in e.block_hashes}
    assert removed() <= stored  # only what was announced is taken back


def test_routing_kv_follows_the_events_across_frontends(setup):
    """A prompt whose rendezvous choice is engine-1 is cached on engine-0 through frontend
    A (which reaches engine-0 only); frontend B, which never saw it, sends the same prefix
    to engine-0 because engine-0's events say it holds it (`prefix` would pick engine-1)."""
    seed = next(s for s in range(100, 200)
                if rank(prefix_key(pack_ids(_prompt(s, 64)), None, 16),
                        ["engine-0", "engine-1"])[0] == "engine-1")
    prompt = _prompt(seed, 64)
    body = {"model": "x", "max_tokens": 1, "temperature": 0}
    model = httpx.get(f"{setup.url_a}/v1/models", timeout=10).json()["data"][0]["id"]
    body["model"] = model
    r = httpx.post(f"{setup.url_a}/v1/completions", json={**body, "prompt": prompt}, timeout=60)
    assert r.status_code == 200, r.text
    wait_until(lambda: _series(setup.url_b, "sluice:kv_events_pages", setup.addresses[0]) >= 4,
               10, "frontend B to learn engine-0's pages")
    before = [engine_stats(a) for a in setup.addresses]
    r = httpx.post(f"{setup.url_b}/v1/completions",
                   json={**body, "prompt": prompt + _prompt(seed + 1, 20)}, timeout=60)
    assert r.status_code == 200, r.text
    after = [engine_stats(a) for a in setup.addresses]
    assert after[0].num_finished == before[0].num_finished + 1
    assert after[1].num_finished == before[1].num_finished
    assert after[0].prefix_cache_hits - before[0].prefix_cache_hits == 64
    assert _series(setup.url_b, "sluice:kv_events_malformed") == 0



def _hits_after(address: str, prompt: list[int]) -> int:
    """The engine's prefix-cache hit tokens once `prompt` has run on it once more."""
    finished = engine_stats(address).num_finished
    RawEngineClient(address).generate([prompt], GREEDY)
    wait_until(lambda: engine_stats(address).num_finished > finished, 10, "the stats")
    return engine_stats(address).prefix_cache_hits


def test_reset_prefix_cache_clears_every_engine(setup):
    """vLLM's POST /reset_prefix_cache: each engine forgets its prefixes and says so with
    AllBlocksCleared; a prompt sent again is computed again (no prefix hit)."""
    x, address = setup.collectors[0], setup.addresses[0]
    prompt = _prompt(40, 32)  # two full pages
    cold = _hits_after(address, prompt)
    warm = _hits_after(address, prompt)
    assert warm > cold  # the control: without a reset the pages are found
    before = sum(isinstance(e, AllBlocksCleared) for e in x.events())
    assert httpx.post(f"{setup.url_a}/reset_prefix_cache", timeout=30).status_code == 200
    wait_until(lambda: sum(isinstance(e, AllBlocksCleared) for e in x.events()) > before, 10,
               "AllBlocksCleared after the reset")
    assert _hits_after(address, prompt) == warm


def _drain(url: str, seen: list[dict]) -> list[dict]:
    r = httpx.post(f"{url}/kv_cache_events", timeout=10)
    assert r.status_code == 200, r.text
    seen.extend(r.json())
    return seen


def _stored_blocks(events: list[dict]) -> list[dict]:
    return [b for e in events if e["data"]["type"] == "stored" for b in e["data"]["blocks"]]


def test_trtllm_kv_cache_events_since_the_last_call(setup, tmp_path):
    """TensorRT-LLM's POST /kv_cache_events on a frontend without --routing kv (over
    engine-1: 12 pages, data-parallel rank 1): trtllm-serve's list of {event_id, data,
    window_size, attention_dp_rank}, from the engine's first event (the replay) on; each call
    answers only what came since the one before."""
    proc, url = start_frontend(str(tmp_path), setup.addresses[1], "frontend-c")
    try:
        wait_healthy(url, [proc, *setup.engines])
        seen: list[dict] = []
        wait_until(lambda: _drain(url, seen), 10, "engine-1's events through the replay")
        created = seen[0]
        assert created == {"event_id": 0, "window_size": 192, "engine_id": "engine-1",
                           "attention_dp_rank": 1,
                           "data": {"type": "created", "num_blocks_per_cache_level": [12, 0]}}
        prompt = _prompt(60, 64)  # four full pages
        hashes = list(prompt_page_hashes(prompt, 16, None))[:4]
        RawEngineClient(setup.addresses[1]).generate([prompt], GREEDY)
        wait_until(lambda: {b["block_hash"] for b in _stored_blocks(_drain(url, seen))}
                   >= set(hashes), 10, "the prompt's stored blocks")
        assert [e["event_id"] for e in seen] == list(range(len(seen)))  # each event once
        assert _drain(url, []) == []  # nothing new since the last call
        mine = [b for b in _stored_blocks(seen) if b["block_hash"] in hashes]
        assert [b["block_hash"] for b in mine] == hashes
        for i, block in enumerate(mine):
            assert block == {"type": "stored_block", "block_hash": hashes[i],
                             "cache_level": 0, "priority": 35,
                             "tokens": [{"type": "unique_token", "token_id": t,
                                         "token_extra_id": 0}
                                        for t in prompt[16 * i:16 * (i + 1)]]}
        first = next(e["data"] for e in seen if e["data"]["type"] == "stored"
                     and e["data"]["blocks"][0]["block_hash"] == hashes[0])
        assert first["parent_hash"] is None
        # Three more prompts recycle the 12 pages: the first prompt's come back removed.
        for seed in (61, 62, 63):
            RawEngineClient(setup.addresses[1]).generate([_prompt(seed, 64)], GREEDY)
        after: list[dict] = []
        wait_until(lambda: set(hashes) & {h for e in _drain(url, after)
                                          if e["data"]["type"] == "removed"
                                          for h in e["data"]["block_hashes"]},
                   10, "removed events for the first prompt's pages")
        assert after[0]["event_id"] == seen[-1]["event_id"] + 1
        assert httpx.get(f"{url}/kv_cache_events", timeout=10).status_code == 405
    finally:
        proc.stop()
