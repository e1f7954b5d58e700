"""A bare engine client for tests: EngineRequests in, token ids out, over the real sockets."""

from __future__ import annotations

import time
import uuid

import zmq

from shared.codec import encode, frontend_inbound_decoder
from shared.protocol import EngineRequest, OutputBatch, SamplingParams, pack_ids, unpack_ids
from shared.transport import free_tcp_port, make_socket


class RawEngineClient:
    def __init__(self, engine_address: str) -> None:
        self.ctx = zmq.Context()
        self.dealer = make_socket(self.ctx, zmq.DEALER)
        self.dealer.connect(engine_address)
        self.reply_to = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.pull = make_socket(self.ctx, zmq.PULL)
        self.pull.bind(self.reply_to)
        self.decoder = frontend_inbound_decoder()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, timeout_s: float = 300
    ) -> list[list[int]]:
        """Send every prompt at once; return each one's generated ids in order."""
        ids = [f"test-{uuid.uuid4().hex}" for _ in prompts]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        for request_id, prompt in zip(ids, prompts, strict=True):
            request = EngineRequest(request_id, pack_ids(prompt), params, self.reply_to,
                                    time.time())
            self.dealer.send(encode(request))
        pending = set(ids)
        deadline = time.monotonic() + timeout_s
        while pending:
            if not self.pull.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise TimeoutError(f"{len(pending)} requests unfinished")
            batch = self.decoder.decode(self.pull.recv())
            assert isinstance(batch, OutputBatch)
            for out in batch.outputs:
                assert out.error is None, out.error
                outputs[out.request_id].extend(unpack_ids(out.new_token_ids).tolist())
                if out.finish_reason is not None:
                    pending.discard(out.request_id)
        return [outputs[i] for i in ids]

    def close(self) -> None:
        self.dealer.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


def engine_stats(engine_address: str, timeout_s: float = 10.0):
    """The engine's EngineStats, asked for with a Ping as a frontend's heartbeat does."""
    from shared.protocol import EngineStats, Ping

    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER)
    try:
        sock.connect(engine_address)
        sock.send(encode(Ping(sender_id="test", sent_at=time.time())))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("the engine did not answer a ping")
        stats = frontend_inbound_decoder().decode(sock.recv())
        assert isinstance(stats, EngineStats)
        return stats
    finally:
        sock.close(linger=0)
        ctx.term()
