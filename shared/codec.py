"""The one codec for every socket: msgpack via msgspec, typed on decode. No pickle anywhere."""

from __future__ import annotations

import msgspec

from shared.protocol import EngineFromWorker, EngineInbound, FrontendInbound, WorkerInbound

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class Decoder:
    """Decodes one socket's messages into the tagged union that socket may carry."""

    def __init__(self, message_type) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def decode(self, data: bytes | memoryview):
        return self._decoder.decode(data)


def engine_inbound_decoder() -> Decoder:
    return Decoder(EngineInbound)


def frontend_inbound_decoder() -> Decoder:
    return Decoder(FrontendInbound)


def worker_inbound_decoder() -> Decoder:
    return Decoder(WorkerInbound)


def engine_from_worker_decoder() -> Decoder:
    return Decoder(EngineFromWorker)
