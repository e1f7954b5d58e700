"""KV-cache events (issue 50): --kv-events-config's boundaries, the endpoints' rules, the
engine's event log, the frontend's index and `kv` placement, and the frontend's subscriber
over real ZeroMQ sockets (malformed messages, holes, replay)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from engine.process.kv_events import KvEventPublisher
from engine.step.kv_cache import KvEventLog, PageAllocator
from frontend.engine_client.kv_events import KvEventSubscriber
from frontend.engine_client.kv_index import KvIndex
from frontend.engine_client.placement import Candidate, Placement, prefix_key, rank
from shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    connectable,
    offset_endpoint,
    parse_kv_events_config,
)
from shared.page_hash import chain_hash, external_hash, prompt_page_hashes, root_hash
from shared.protocol import pack_ids
from sluice import cli

ON = '"enable_kv_cache_events": true'


@pytest.mark.parametrize("text, message", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field `endpont`"),
    ('{"enable_kv_cache_events": "yes"}', "Expected `bool`"),
    (f'{{{ON}, "publisher": "kafka"}}', "Invalid enum value 'kafka'"),
    (f'{{{ON}, "hwm": -1}}', "Expected `int` >= 0"),
    (f'{{{ON}, "hwm": 1.5}}', "Expected `int`"),
    (f'{{{ON}, "buffer_steps": 0}}', "Expected `int` >= 1"),
    (f'{{{ON}, "max_queue_size": 0}}', "Expected `int` >= 1"),
    (f'{{{ON}, "topic": 5}}', "Expected `str`"),
    (f'{{{ON}, "endpoint": "localhost:5557"}}', "expected tcp://HOST:PORT"),
    (f'{{{ON}, "endpoint": "http://*:5557"}}', "expected tcp://HOST:PORT"),
    (f'{{{ON}, "endpoint": "tcp://*"}}', "needs HOST:PORT"),
    (f'{{{ON}, "endpoint": "tcp://*:0"}}', "port in 1..65535"),
    (f'{{{ON}, "endpoint": "tcp://*:65536"}}', "port in 1..65535"),
    (f'{{{ON}, "replay_endpoint": "tcp://10.0.0.1:5558"}}', "the replay socket binds"),
    ('[true]', "Expected `object`, got `array`"),
    ("{enable", "not a JSON object"),
])
def test_bad_configs_stop_the_engine_naming_the_flag(text, message, capsys):
    for command in ("engine", "serve"):
        with pytest.raises(SystemExit):
            cli.parse_args([command, "--kv-events-config", text])
        err = capsys.readouterr().err
        assert "--kv-events-config" in err and message in err, err


def test_config_defaults_are_vllms():
    config = parse_kv_events_config(f"{{{ON}}}")
    assert config.publishes and config.endpoint == "tcp://*:5557"
    assert (config.replay_endpoint, config.buffer_steps, config.hwm, config.max_queue_size,
            config.topic) == (None, 10_000, 100_000, 100_000, "")
    assert not parse_kv_events_config("{}").publishes  # vLLM: off unless enabled
    assert not parse_kv_events_config(f'{{{ON}, "publisher": "null"}}').publishes
    assert parse_kv_events_config(f'{{{ON}, "publisher": "zmq"}}').publishes


def test_serve_gives_each_engine_the_config_and_its_rank():
    text = f'{{{ON}, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6100"}}'
    args = cli.parse_args(["serve", "--kv-events-config", text])
    engine = cli._engine_argv(args, [], "ipc:///tmp/e0")
    argvs = cli._engine_argvs(engine, ["ipc:///tmp/e0", "ipc:///tmp/e1"])
    for i, argv in enumerate(argvs):
        assert argv[argv.index("--data-parallel-rank") + 1] == str(i)
        child = cli.parse_args(argv)
        config = cli.engine_config(child, argv[argv.index("--engine-address") + 1])
        assert config.kv_events == parse_kv_events_config(text)
        assert config.data_parallel_rank == i
    assert cli.engine_config(cli.parse_args(["engine"]), "ipc:///tmp/x").kv_events is None
    with pytest.raises(SystemExit):
        cli.parse_args(["engine", "--data-parallel-rank", "-1"])


def test_endpoints_follow_vllms_rules():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::]:5557", 1) == "tcp://[::]:5558"
    assert offset_endpoint("ipc:///tmp/ev", 2) == "ipc:///tmp/ev_dp2"
    assert offset_endpoint(None, 2) is None
    # A wildcard is reached where the engine is; a named host or a path as given.
    assert connectable("tcp://*:5557", "tcp://10.1.2.3:7000") == "tcp://10.1.2.3:5557"
    assert connectable("tcp://0.0.0.0:5557", "ipc:///tmp/engine") == "tcp://127.0.0.1:5557"
    assert connectable("tcp://10.9.9.9:5557", "tcp://10.1.2.3:7000") == "tcp://10.9.9.9:5557"
    assert connectable("ipc:///tmp/ev", "tcp://10.1.2.3:7000") == "ipc:///tmp/ev"


# ---------------------------------------------------------------- the engine's side


def test_the_log_sends_runs_of_pages_and_one_removal_per_step():
    tokens = list(range(40))
    hashes = [root_hash(None)]
    for i in range(5):
        hashes.append(chain_hash(hashes[-1], tokens[i * 8:(i + 1) * 8]))
    hashes = hashes[1:]
    log = KvEventLog()
    log.stored(hashes, [0, 1, 3], tokens, 8, lora_id=7, lora_name="a")
    log.removed(hashes[0])
    log.removed(hashes[1])
    log.cleared()
    first, second, removed, cleared = log.take()
    assert first.block_hashes == [external_hash(h) for h in hashes[:2]]
    assert first.parent_block_hash is None and first.token_ids == tokens[:16]
    assert (first.lora_id, first.lora_name, first.medium, first.block_size) == (7, "a", "GPU", 8)
    assert second.parent_block_hash == external_hash(hashes[2])
    assert second.token_ids == tokens[24:32]
    assert removed.block_hashes == [external_hash(hashes[0]), external_hash(hashes[1])]
    assert isinstance(cleared, AllBlocksCleared) and log.take() == []
    assert list(prompt_page_hashes(tokens, 8, None)) == [external_hash(h) for h in hashes]


def test_an_evicted_page_is_removed_once_and_only_when_recycled():
    alloc = PageAllocator(num_pages=2, page_size=4)
    alloc.events = KvEventLog()
    a, b = alloc.allocate(2)
    assert alloc.register(a, b"ha") and not alloc.register(b, b"ha")  # first writer wins
    alloc.release([a, b])
    assert alloc.events.take() == []  # released, still cached: nothing happened
    alloc.allocate(1)  # the plain free page
    assert alloc.events.take() == []
    alloc.allocate(1)  # now the cached one is recycled
    assert alloc.events.take() == [BlockRemoved([external_hash(b"ha")], "GPU")]


def test_a_prefix_cache_reset_waits_for_owned_pages_then_clears_all():
    """/reset_prefix_cache: refused while a sequence owns a page (its hashes stay true);
    then every cached prefix is gone, every page free and AllBlocksCleared recorded."""
    alloc = PageAllocator(num_pages=3, page_size=4)
    alloc.events = KvEventLog()
    a, b = alloc.allocate(2)
    alloc.register(a, b"ha")
    alloc.register(b, b"hb")
    alloc.release([a])
    assert alloc.reset_prefix_cache() == 1  # b is still owned
    assert alloc.events.take() == [] and alloc.cached_prefix([b"ha"]) == [a]
    alloc.release([a, b])
    assert alloc.reset_prefix_cache() == 0
    assert alloc.events.take() == [AllBlocksCleared()]
    assert alloc.cached_prefix([b"ha"]) == [] and alloc.num_free == 3
    assert sorted(alloc.allocate(3)) == [0, 1, 2]
    assert alloc.events.take() == []  # nothing cached was left to remove


# ---------------------------------------------------------------- the frontend's side


def _stored(hashes, medium="GPU"):
    return BlockStored(hashes, None, [0] * 4 * len(hashes), 4, None, medium, None)


def test_the_index_knows_each_engines_leading_run():
    index = KvIndex(max_pages=6)
    index.apply("x", KVEventBatch(1.0, [_stored([1, 2, 3])]))
    index.apply("y", KVEventBatch(1.0, [_stored([1, 2]), _stored([9], medium="CPU")]))
    assert index.longest_runs(iter([1, 2, 3, 4]), ["x", "y", "z"]) == {"x": 3, "y": 2, "z": 0}
    assert index.longest_runs([9], ["y"]) == {"y": 0}  # only the engine's own pool counts
    index.apply("x", KVEventBatch(2.0, [BlockRemoved([2], "GPU")]))
    assert index.longest_runs([1, 2, 3], ["x", "y"]) == {"x": 1, "y": 2}
    index.apply("y", KVEventBatch(3.0, [AllBlocksCleared()]))
    assert index.pages_of("y") == 0 and index.pages_of("x") == 2
    index.apply("x", KVEventBatch(4.0, [_stored(list(range(10, 15)))]))  # 7 > max_pages
    assert index.pages_of("x") == 0 and index.longest_runs([1], ["x"]) == {"x": 0}


def test_kv_placement_takes_the_longest_run_within_the_load_bound():
    kv = Placement("kv")
    key = prefix_key(pack_ids(list(range(64))), None)
    first, second, third = rank(key, ["a", "b", "c"])

    def cands(cached: dict, loads=None):
        return [Candidate(n, (loads or {}).get(n, 0), cached_pages=cached.get(n, 0))
                for n in ("a", "b", "c")]

    assert kv.choose(key, cands({third: 3, second: 1})) == third
    assert kv.choose(key, cands({})) == first  # nobody holds it: as prefix
    assert kv.choose(key, cands({second: 2, third: 2})) == second  # ties: rendezvous order
    # The holder is over the bound (ceil(1.25 * 7 / 3) = 3): the next longest, else prefix.
    assert kv.choose(key, cands({third: 4, first: 1}, {third: 6})) == first
    assert kv.choose(key, cands({third: 4}, {third: 6})) == first
    assert Placement("prefix").choose(key, cands({third: 3})) == first


def _wait(condition, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_the_subscriber_drops_bad_messages_and_holes(tmp_path):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    endpoint = f"ipc://{tmp_path}/ev"
    pub.bind(endpoint)
    index = KvIndex()
    subscriber = KvEventSubscriber(index)
    subscriber.start()
    try:
        subscriber.follow("e", "ipc:///e", endpoint, "")

        def send(seq, batch):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])

        # Until the subscription is up (ZeroMQ's slow joiner): seq 0 again is a restart.
        _wait(lambda: send(0, KVEventBatch(1.0, [_stored([1])])) or index.pages_of("e"),
              "the subscription")
        pub.send_multipart([b"", b"\x00" * 8])  # two frames
        pub.send_multipart([b"", b"\x01", msgspec.msgpack.encode(KVEventBatch(1.0, []))])
        pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
        pub.send_multipart([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [-5]}]])])
        send(1, KVEventBatch(2.0, [_stored([2])]))
        _wait(lambda: index.pages_of("e") == 2, "batch 1")
        assert subscriber.malformed == 4 and subscriber.gaps == 0
        send(3, KVEventBatch(3.0, [_stored([3])]))  # 2 never came, and no replay to ask
        _wait(lambda: subscriber.gaps == 1, "the hole")
        assert index.longest_runs([3], ["e"]) == {"e": 1} and index.pages_of("e") == 1
        subscriber.forget("e")
        _wait(lambda: index.pages_of("e") == 0, "forget")
        subscriber.follow("bad", "ipc:///bad", "tcp://nowhere:x", "")  # an engine's odd stats
        _wait(lambda: subscriber.malformed == 5, "the bad endpoint")
        subscriber.follow("e", "ipc:///e", endpoint, "")  # the thread still works
        _wait(lambda: send(4, KVEventBatch(4.0, [_stored([4])])) or index.pages_of("e"),
              "following again")
    finally:
        subscriber.stop()
        pub.close(linger=0)
        ctx.term()


def test_a_late_subscriber_catches_up_from_the_replay(tmp_path):
    config = parse_kv_events_config(f'{{{ON}, "endpoint": "ipc://{tmp_path}/ev", '
                                    f'"replay_endpoint": "ipc://{tmp_path}/rp", '
                                    '"buffer_steps": 2}')
    publisher = KvEventPublisher(zmq.Context.instance(), config, rank=0)
    index = KvIndex()
    subscriber = KvEventSubscriber(index)
    subscriber.start()
    try:
        for i in range(3):  # before anyone listens; the ring keeps the last two
            publisher.publish([_stored([10 + i])])
        time.sleep(0.2)
        subscriber.follow("e", "ipc:///e", publisher.endpoint, publisher.replay_endpoint)
        _wait(lambda: index.pages_of("e") == 2, "the replay")  # 11 and 12; 10 left the ring
        assert index.longest_runs([11], ["e"]) == {"e": 1} and subscriber.gaps == 1
        publisher.publish([_stored([13])])
        _wait(lambda: index.pages_of("e") == 3, "the live batch after the replay")
        assert subscriber.malformed == 0
    finally:
        subscriber.stop()
        publisher.close()
