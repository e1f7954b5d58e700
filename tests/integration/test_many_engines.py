"""Many engines behind every frontend (issue 18): two engines, two frontends and two postproc
workers (each registered with both engines) as separate processes over tcp; placement by
prefix affinity bounded by load; an engine killed under load loses no request that had not
started streaming, nor one that had (it goes on as a continuation on the other engine,
issue 39); an engine started later is used; the dns+tcp:// form with a resolver
the test injects."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

from shared.transport import free_tcp_port
from tests.engine_client import engine_stats
from tests.servers import Proc, start_frontend, wait_healthy, wait_until

pytestmark = pytest.mark.slow  # starts its own engines and frontends

# A shared system prompt of several 16-token pages: the affinity key (two pages) is in it.
SYSTEM = ("You are a careful assistant for a shipping company. Answer briefly, in plain "
          "words, and never invent tracking numbers, prices or delivery dates; when you do "
          "not know, say so and suggest the customer contacts the support desk by email.")


def start_engine(tmp_dir: str, name: str, address: str, *extra: str) -> Proc:
    # One thread each: the test machine has few cores and runs both engines at once.
    return Proc(["engine", "--engine-address", address, "--engine-id", name, "--threads", "1",
                 *extra], os.path.join(tmp_dir, f"{name}.log"))


class TwoEngines:
    def __init__(self, tmp_dir: str) -> None:
        self.tmp_dir = tmp_dir
        # One port on two loopback addresses: the dns+tcp:// test resolves a name to both.
        port = free_tcp_port()
        self.addresses = [f"tcp://127.0.0.{i + 1}:{port}" for i in range(2)]
        self.postproc_addresses = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
        # Two sequences at a time, so a burst leaves requests waiting in each engine.
        self.engines = [self.engine(i) for i in range(2)]
        self.frontends: list[Proc] = []
        self.urls: list[str] = []
        workers = [x for a in self.postproc_addresses for x in ("--engine-postproc-address", a)]
        self.workers = [Proc(["postproc", *workers], os.path.join(tmp_dir, f"postproc{i}.log"))
                        for i in range(2)]
        try:
            for i in range(2):
                proc, url = start_frontend(tmp_dir, self.addresses[0], f"frontend{i}",
                                           "--engine-address", self.addresses[1])
                self.frontends.append(proc)
                self.urls.append(url)
            for url in self.urls:
                wait_healthy(url, [*self.engines, *self.frontends, *self.workers])
            for url in self.urls:  # both engines live on both frontends
                wait_until(lambda url=url: _engines_up(url) == 2, 60, "both engines live")
        except Exception:
            self.stop()
            raise

    def engine(self, i: int, name: str | None = None) -> Proc:
        return start_engine(self.tmp_dir, name or f"engine-{i}", self.addresses[i],
                            "--max-num-seqs", "2",
                            "--postproc-address", self.postproc_addresses[i])

    def stats(self):
        return [engine_stats(a) for a in self.addresses]

    def stop(self) -> None:
        for p in [*self.frontends, *self.workers, *self.engines]:
            p.stop()


def _engines_up(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(1 for line in text.splitlines()
               if line.startswith("sluice:engine_live{") and line.endswith(" 1.0"))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    t = TwoEngines(str(tmp_path_factory.mktemp("many_engines")))
    yield t
    t.stop()


def _chat(url: str, user: str, max_tokens: int = 8, stream: bool = False, **extra):
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}


def _stream(url: str, body: dict, out: dict, key) -> None:
    """A streamed chat; out[key] = its data lines as they come."""
    events = out.setdefault(key, [])
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc!r}")


def test_two_engines_two_frontends_serve_concurrent_streams(two):
    # Both workers registered with both engines (item 5).
    wait_until(lambda: all(s.num_postproc_workers == 2 for s in two.stats()), 60,
               "two workers on each engine")
    before = two.stats()
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(
        url, {"messages": [{"role": "user", "content": f"Tell me a fact about {i}."}],
              "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}, out, (url, i)))
        for url in two.urls for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for key, events in out.items():
        assert events[-1] == "[DONE]", (key, events[-3:])
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 12, key
    after = two.stats()
    done = [a.num_finished - b.num_finished for a, b in zip(after, before, strict=True)]
    assert sum(done) == 12
    # Twelve at once over engines that run two each: the load bound spreads them.
    assert min(done) >= 2, done
    assert {s.engine_id for s in after} == {"engine-0", "engine-1"}
    # Each engine handed its streams to the workers, which wrote the chunks.
    assert all(a.postproc_assigned - b.postproc_assigned == d
               for a, b, d in zip(after, before, done, strict=True)), (after, before)


def test_identical_prefixes_land_on_one_engine(two):
    # Idle engines, and heartbeats that say so (load from the last test would bend the
    # first placement: the load bound is part of the policy).
    wait_until(lambda: all(s.num_running + s.num_waiting == 0 for s in two.stats()), 60,
               "idle engines")
    time.sleep(2.5)
    before = two.stats()
    for i in range(6):  # a shared system prompt, each time another question, both frontends
        url = two.urls[i % 2]
        r = httpx.post(f"{url}/v1/chat/completions", json=_chat(url, f"Where is parcel {i}?"),
                       timeout=120)
        assert r.status_code == 200, r.text
    after = two.stats()
    done = [a.num_finished - b.num_finished for a, b in zip(after, before, strict=True)]
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before,
                                                                        strict=True)]
    assert sorted(done) == [0, 6], done
    warm = done.index(6)
    # Every request after the first found the system prompt's pages cached there.
    assert hits[warm] >= 5 * 32, hits
    assert hits[1 - warm] == 0


def test_an_engine_killed_under_load_loses_no_request(two):
    out: dict = {}
    # Long streams: each engine runs two and queues the rest.
    threads = [threading.Thread(target=_stream, args=(
        url, {"messages": [{"role": "user", "content": f"Count to a thousand, {i}."}],
              "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}},
        out, (url, i))) for url in two.urls for i in range(5)]
    for t in threads:
        t.start()
    wait_until(lambda: sum(len(e) >= 2 for e in out.values()) >= 4, 120, "streams started")
    # Both hold unstarted requests, as their heartbeats say (a snapshot could be a beat old).
    wait_until(lambda: all(s.num_waiting > 0 for s in two.stats()), 30,
               "both engines holding unstarted requests")
    victim = 0
    two.engines[victim].popen.kill()  # SIGKILL: no goodbye on any socket
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    for key, events in out.items():
        assert events and events[-1] == "[DONE]", (key, events[-3:])
        assert not any("error" in json.loads(e) for e in events[:-1]), (key, events[-2])
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 60, key
    assert len(out) == 10
    # The killed engine's requests, waiting or streaming, finished on the survivor.
    logs = "".join(p.log() for p in two.frontends)
    assert "moved to engine engine-1" in logs and "(death)" in logs
    for url in two.urls:
        assert httpx.get(f"{url}/health").status_code == 200  # one engine is enough
    # Restart it on the same address: the frontends, never restarted, use it again.
    two.engines[victim].stop()
    two.engines[victim] = two.engine(victim, f"engine-{victim}-again")
    for url in two.urls:
        wait_until(lambda url=url: _engines_up(url) == 2, 120, "the engine back")
    # The workers, never restarted, register with it again.
    wait_until(lambda: engine_stats(two.addresses[victim]).num_postproc_workers == 2, 60,
               "the workers back on the restarted engine")


def test_an_engine_started_later_is_used(two, tmp_path):
    late = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc, url = start_frontend(str(tmp_path), two.addresses[1], "frontend-rr",
                               "--engine-address", late, "--routing", "round-robin")
    engine = None
    try:
        wait_healthy(url, [proc])  # one engine live is enough to serve
        assert _engines_up(url) == 1
        engine = start_engine(str(tmp_path), "engine-late", late)
        wait_until(lambda: _engines_up(url) == 2, 120, "the late engine")
        before = engine_stats(late).num_finished
        for i in range(4):
            r = httpx.post(f"{url}/v1/chat/completions", json=_chat(url, f"Hello {i}"),
                           timeout=120)
            assert r.status_code == 200, r.text
        assert engine_stats(late).num_finished - before == 2  # round-robin: every other
    finally:
        proc.stop()
        if engine is not None:
            engine.stop()


def test_dns_form_follows_an_injected_resolver(two):
    """EngineClient in-process with `dns+tcp://engines.test:PORT` and a resolver the test
    controls: two loopback addresses, one engine on each (the module's two, which listen on
    one port of 127.0.0.1 and 127.0.0.2), then one of them leaves."""
    from frontend.engine_client.client import EngineClient
    from postproc.processor import OutputProcessor
    from shared.protocol import EngineRequest, OutputParams, SamplingParams, pack_ids
    from shared.tokenizer import load_tokenizer

    port = int(two.addresses[0].rsplit(":", 1)[1])
    assert two.addresses == [f"tcp://127.0.0.{i}:{port}" for i in (1, 2)]
    ids = [s.engine_id for s in two.stats()]
    answers = {"engines.test": ["127.0.0.1", "127.0.0.2"]}
    asked: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        asked.append(host)
        return list(answers[host])

    async def scenario() -> None:
        from sluice.cli import model_names as _model_names
        from sluice.cli import parse_args

        model = _model_names(parse_args(["frontend"]))[0]
        client = EngineClient(f"dns+tcp://engines.test:{port}",
                              OutputProcessor(load_tokenizer(model)),
                              routing="round-robin", resolver=resolver,
                              resolve_interval_s=0.5)
        await client.start()
        try:
            assert sorted(client.engines) == [f"tcp://127.0.0.{i}:{port}" for i in (1, 2)]
            deadline = time.monotonic() + 180
            while len(client.live_engines()) < 2:
                assert time.monotonic() < deadline, "engines never live"
                await asyncio.sleep(0.2)
            assert client.engine_alive

            async def one(i: int) -> str:
                queue: asyncio.Queue = asyncio.Queue()
                request = EngineRequest(
                    request_id=f"dns-{i}", prompt_token_ids=pack_ids([1, 2, 3, 4]),
                    params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                    reply_to=client.result_address, arrival_time=time.time(),
                    output=OutputParams())
                await client.submit(request, [1, 2, 3, 4], queue)
                engine = client._streams[request.request_id].engine.engine_id
                while (await queue.get()).finish_reason is None:
                    pass
                client.release(request.request_id)
                return engine

            used = {await one(i) for i in range(2)}
            assert used == set(ids)
            # The name now resolves to one address: the other engine takes nothing new.
            answers["engines.test"] = ["127.0.0.2"]
            deadline = time.monotonic() + 10
            while len(client.engines) > 1:
                assert time.monotonic() < deadline, "the departed engine stayed"
                await asyncio.sleep(0.1)
            assert {await one(i) for i in range(2, 5)} == {ids[1]}
        finally:
            await client.stop()

    asyncio.run(scenario())
    assert asked.count("engines.test") >= 2  # re-resolved while running


def test_serve_data_parallel_starts_engines_behind_its_frontend(tmp_path):
    """`sluice serve --data-parallel-size 2` (item 6): two engines, each on its share of the
    CPUs, ids engine-0 and engine-1, behind the one frontend, with a worker on both."""
    from tests.servers import Stack

    stack = Stack(str(tmp_path), "--data-parallel-size", "2", "--postproc-workers", "1")
    try:
        wait_until(lambda: _engines_up(stack.base_url) == 2, 120, "both engines live")
        text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
        # serve's frontend exports its engines' series: both of them, one family each.
        pages = [line for line in text.splitlines()
                 if line.startswith("sluice:kv_cache_total_pages{")]
        assert len(pages) == 2 and any('engine="engine-0"' in p for p in pages) and any(
            'engine="engine-1"' in p for p in pages), pages
        assert text.count("# TYPE sluice:kv_cache_total_pages ") == 1
        for i in range(4):
            r = httpx.post(f"{stack.base_url}/v1/chat/completions",
                           json=_chat(stack.base_url, f"Hi {i}", stream=True), timeout=120)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    finally:
        stack.stop()
