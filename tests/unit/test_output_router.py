"""The engine's output router over real zmq sockets: assignment to the least-loaded worker,
replay of a dead worker's requests (on a failed send, or missed heartbeats), fallback to the
frontend when no worker is left, and forgetting requests a worker reported done."""

import time

import pytest
import zmq

from engine.process.output_router import OutputRouter
from shared.codec import encode, frontend_inbound_decoder, worker_inbound_decoder
from shared.protocol import (
    EngineRequest,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    WorkBatch,
    WorkerDone,
    WorkerHeartbeat,
    pack_ids,
)
from shared.transport import make_socket, new_ipc_address


class FakeWorker:
    made: list["FakeWorker"] = []

    def __init__(self, ctx, address: str, name: str) -> None:
        self.name = name
        self.sock = make_socket(ctx, zmq.DEALER)
        self.sock.connect(address)
        FakeWorker.made.append(self)

    def beat(self) -> None:
        self.sock.send(encode(WorkerHeartbeat(self.name, time.time())))

    def batches(self, timeout_ms: int = 200) -> list[WorkBatch]:
        out = []
        while self.sock.poll(timeout_ms):
            out.append(worker_inbound_decoder().decode(self.sock.recv()))
            timeout_ms = 50
        return out


@pytest.fixture
def setup():
    ctx = zmq.Context()
    address = new_ipc_address("router-test")
    router = OutputRouter(ctx, address, worker_timeout_s=0.6)
    frontend_address = new_ipc_address("router-frontend")
    frontend = make_socket(ctx, zmq.PULL)
    frontend.bind(frontend_address)
    yield ctx, address, router, frontend, frontend_address
    for worker in FakeWorker.made:
        worker.sock.close(linger=0)
    FakeWorker.made.clear()
    router.close()
    frontend.close(linger=0)
    ctx.term()


def request(request_id: str, reply_to: str) -> EngineRequest:
    return EngineRequest(request_id, pack_ids([1, 2, 3]), SamplingParams(max_tokens=8), reply_to,
                         0.0)


def output(request_id: str, token: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, pack_ids([token]), 3, token, finish_reason=finish)


def join(router: OutputRouter, *workers: FakeWorker) -> None:
    for w in workers:
        w.beat()
    deadline = time.monotonic() + 5
    while router.counts.live_workers < len(workers) and time.monotonic() < deadline:
        router.poll_workers()
        time.sleep(0.01)
    assert router.counts.live_workers == len(workers)
    for w in workers:  # each is told to reset on joining
        assert [b.reset for b in w.batches()] == [True]


def frontend_batches(sock) -> list[OutputBatch]:
    out = []
    while sock.poll(200):
        out.append(frontend_inbound_decoder().decode(sock.recv()))
    return out


def ids_of(outputs) -> list[tuple[str, int]]:
    return [(o.request_id, o.num_output_tokens) for o in outputs]


def test_requests_spread_over_workers_and_replay_when_one_dies(setup):
    ctx, address, router, frontend, fa = setup
    w1, w2 = FakeWorker(ctx, address, "w1"), FakeWorker(ctx, address, "w2")
    join(router, w1, w2)
    for rid in ("a", "b"):
        router.add_request(request(rid, fa))
    router.route([(fa, output("a", 1)), (fa, output("b", 1))], 0.0)
    got = {w.name: w.batches() for w in (w1, w2)}
    # One request each, assigned with its first output.
    assigned = {w: [r.request_id for b in bs for r in b.assignments] for w, bs in got.items()}
    assert sorted(assigned.values()) == [["a"], ["b"]]
    owner_of_a = w1 if assigned["w1"] == ["a"] else w2
    other = w2 if owner_of_a is w1 else w1
    router.route([(fa, output("a", 2))], 0.0)
    assert ids_of(owner_of_a.batches()[0].outputs) == [("a", 2)]

    owner_of_a.sock.close(linger=0)  # SIGKILL, as far as the router can tell
    time.sleep(0.3)
    router.route([(fa, output("a", 3))], 0.0)
    replay = other.batches()
    assert [r.request_id for b in replay for r in b.assignments] == ["a"]
    # Everything "a" produced so far, in order, for the heir to rebuild the same frames.
    assert ids_of([o for b in replay for o in b.outputs]) == [("a", 1), ("a", 2), ("a", 3)]
    assert router.counts.replayed == 1 and router.counts.live_workers == 1
    assert frontend_batches(frontend) == []  # nothing bypassed the fleet


def test_last_worker_gone_falls_back_to_the_frontend(setup):
    ctx, address, router, frontend, fa = setup
    w = FakeWorker(ctx, address, "w")
    join(router, w)
    router.add_request(request("a", fa))
    router.route([(fa, output("a", 1))], 0.0)
    assert len(w.batches()) == 1
    # It stops beating but stays connected: the heartbeat timeout buries it.
    time.sleep(0.8)
    router.poll_workers()
    assert router.counts.live_workers == 0
    router.route([(fa, output("a", 2, "length"))], 0.0)
    outputs = [o for b in frontend_batches(frontend) for o in b.outputs]
    # The frontend gets the history and then the rest, and post-processes them itself.
    assert ids_of(outputs) == [("a", 1), ("a", 2)]


def test_done_requests_are_not_replayed(setup):
    ctx, address, router, frontend, fa = setup
    w1, w2 = FakeWorker(ctx, address, "w1"), FakeWorker(ctx, address, "w2")
    join(router, w1, w2)
    router.add_request(request("a", fa))
    router.route([(fa, output("a", 1, "stop"))], 0.0)
    owner = w1 if w1.batches() else w2
    other = w2 if owner is w1 else w1
    owner.sock.send(encode(WorkerDone(["a"])))
    time.sleep(0.1)
    router.poll_workers()
    owner.sock.close(linger=0)
    time.sleep(1.0)  # past the timeout: the router buries the owner
    other.beat()
    time.sleep(0.1)
    router.poll_workers()
    assert router.counts.live_workers == 1
    assert router.counts.replayed == 0
    assert other.batches() == []


def test_without_a_fleet_outputs_go_straight_to_frontends(setup):
    ctx, _, _, frontend, fa = setup
    router = OutputRouter(ctx, None)
    router.add_request(request("a", fa))
    router.route([(fa, output("a", 1)), (fa, output("a", 2, "stop"))], 0.5)
    [batch] = frontend_batches(frontend)
    assert ids_of(batch.outputs) == [("a", 1), ("a", 2)] and batch.step_time == 0.5
    assert router.poll_workers() == []
    router.close()
