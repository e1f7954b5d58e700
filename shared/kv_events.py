"""KV-cache events on vLLM's wire (`--kv-events-config`): the Structs, the config, endpoints.

An engine publishes, once per step that changed its prefix cache, a ZeroMQ multipart message
[topic, sequence number (8 bytes, big-endian), msgpack payload]. The payload is a
`KVEventBatch` encoded as vLLM (v0.26 on) encodes it: the batch as an array
`[ts, events, data_parallel_rank]`, each event a map tagged by `"type"` (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`) with vLLM's field names; fields that default are left
out. A consumer holding vLLM's own `KVEventBatch` decoder decodes it unchanged. The replay
socket (ROUTER) answers a request [start sequence number] with every buffered
[sequence number, payload] from there, then [-1 as 8 bytes, b""].

Engines and frontends share this module: the engine encodes these Structs, a frontend under
`--routing kv` decodes them (every limit below applies to what it receives).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool, on whatever device it lives
MEDIUM_CPU = "CPU"  # vLLM's offload tier; sluice's offload tier, when it lands, names it so
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker (vLLM's)

# What a frontend accepts: a hash is a uint64 (vLLM's int form; msgpack holds no larger
# int), and one event names at most this many pages (a 1M-token prompt in 16-token pages).
U64 = Annotated[int, msgspec.Meta(ge=0)]
MAX_PAGES = 1 << 16
MAX_TOKENS = 1 << 22
Hashes = Annotated[list[U64], msgspec.Meta(max_length=MAX_PAGES)]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base: a tagged map (`"type": "<class name>"`)."""


class BlockStored(KVCacheEvent):
    """Full pages that entered the prefix cache: their hashes in prefix order, the hash of
    the page before the first (None: the prompt's first page), their tokens."""

    block_hashes: Hashes
    parent_block_hash: U64 | None
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_TOKENS)]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # vLLM's later fields, kept so vLLM's own messages decode here too; sluice sends none.
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Pages whose prefix-cache entries were evicted (recycled for other tokens)."""

    block_hashes: Hashes
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The engine's prefix cache is empty (sluice sends it when an engine starts)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: Annotated[list[KVEvent], msgspec.Meta(max_length=MAX_PAGES)]
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------- the config


class KvEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's KVEventsConfig, key for key (its JSON is taken as is)."""

    enable_kv_cache_events: bool = False
    publisher: Literal["zmq", "null"] | None = None  # None: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    hwm: Annotated[int, msgspec.Meta(ge=0)] = 100_000
    max_queue_size: Annotated[int, msgspec.Meta(ge=1)] = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


class KvEventsConfigError(ValueError):
    pass


def parse_kv_events_config(text: str) -> KvEventsConfig:
    """--kv-events-config's JSON, checked: unknown keys, wrong types and endpoints no socket
    could use are errors that name the problem."""
    try:
        config = msgspec.json.decode(text, type=KvEventsConfig)
    except msgspec.ValidationError as exc:
        raise KvEventsConfigError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise KvEventsConfigError(f"not a JSON object: {exc}") from None
    check_endpoint("endpoint", config.endpoint)
    if config.replay_endpoint is not None:
        check_endpoint("replay_endpoint", config.replay_endpoint)
        if not binds(config.replay_endpoint):
            raise KvEventsConfigError(f"replay_endpoint {config.replay_endpoint!r}: the "
                                      "replay socket binds; give tcp://*:PORT or ipc://PATH")
    return config


def check_endpoint(key: str, endpoint: str) -> None:
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise KvEventsConfigError(f"{key} {endpoint!r}: expected tcp://HOST:PORT, "
                                  "ipc://PATH or inproc://NAME")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise KvEventsConfigError(f"{key} {endpoint!r}: a tcp endpoint needs HOST:PORT "
                                      "with a port in 1..65535")


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (or ipc/inproc) binds; a named host is connected to (a
    subscriber that binds, or a broker, waits there)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")))


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's data-parallel offset: rank r publishes on the base port + r (ipc and inproc
    get a `_dp<r>` suffix), so the engines of one host never collide."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def connectable(endpoint: str, engine_address: str) -> str:
    """The address a frontend connects to for an engine's bound `endpoint`: a wildcard host
    becomes the host the frontend reaches the engine at (loopback for an ipc engine)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host not in ("*", "0.0.0.0", "::", "[::]"):
        return endpoint
    engine_host = "127.0.0.1"
    if engine_address.startswith("tcp://"):
        engine_host = engine_address[len("tcp://"):].rpartition(":")[0] or engine_host
    return f"tcp://{engine_host}:{port}"
