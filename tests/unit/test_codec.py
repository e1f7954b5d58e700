"""The wire codec: every message round-trips, token ids stay raw int32, bad input is refused."""

import msgspec
import numpy as np
import pytest

from shared import protocol
from shared.codec import (
    encode,
    engine_from_worker_decoder,
    engine_inbound_decoder,
    frontend_inbound_decoder,
    worker_inbound_decoder,
)
from shared.protocol import (
    AbortRequest,
    ChunkFormat,
    Constraint,
    Continuation,
    EnergyReading,
    EngineCommand,
    EngineCommandResult,
    EngineRequest,
    EngineStats,
    FrameBatch,
    FunctionCallDelta,
    HistogramCounts,
    ImageInput,
    LogprobEntry,
    LoraAdapterInfo,
    LoraUpdate,
    LoraUpdateResult,
    OutputBatch,
    OutputParams,
    Ping,
    PoolingParams,
    RequestOutput,
    SamplingParams,
    TextFrame,
    ThinkingBudget,
    TokenLogprobs,
    ToolCallDelta,
    TopLogprob,
    TraceContext,
    WorkBatch,
    WorkerDone,
    WorkerHeartbeat,
    pack_ids,
    pack_tensor,
    unpack_ids,
    unpack_tensor,
)

PROMPT = [1, 0, 2**31 - 1, 128000, 7, -1]


def _full_params() -> SamplingParams:
    return SamplingParams(
        max_tokens=17,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=12345,
        stop_token_ids=[2, 32000],
        ignore_eos=True,
        min_tokens=3,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        logit_bias=[(5, -100.0), (9, 2.5)],
        logprobs=3,
        prompt_logprobs=0,
        constraint=Constraint(kind="json_schema", grammar='{"grammars": []}'),
        allowed_token_ids=[0, 5, 2**31 - 1],
        bad_words=[[7], [3, 4, 5]],
        thinking=ThinkingBudget(budget=64, start_ids=[10], end_ids=[11, 12], starts_inside=True),
    )


def _token_logprobs(k: int, n: int, ranked: bool = False) -> TokenLogprobs:
    return TokenLogprobs(
        token_logprobs=np.linspace(-3, 0, k, dtype="<f4").tobytes(),
        top_ids=pack_ids(range(k * n)),
        top_logprobs=np.full(k * n, -1.5, dtype="<f4").tobytes(),
        ranks=pack_ids(range(1, k + 1)) if ranked else b"",
    )


ENGINE_INBOUND = {
    "request": EngineRequest(
        request_id="req-1",
        prompt_token_ids=pack_ids(PROMPT),
        params=_full_params(),
        reply_to="tcp://127.0.0.1:5555",
        arrival_time=1712345678.25,
        output=OutputParams(
            skip_special_tokens=False,
            stop=["\n\n", "END"],
            include_stop_str_in_output=True,
            min_tokens=3,
            logprobs=True,
            reasoning_parser="qwen3",
            starts_in_reasoning=True,
            tool_parser="hermes",
            tools=b'[{"type": "function", "function": {"name": "f"}}]',
            tool_prefill='<tool_call>\n{"name": "f", "arguments": ',
            tokens_as_ids=True,
            chunk=ChunkFormat(
                kind="completion", response_id="cmpl-1", created=17, model="m", index=2,
                logprobs=True, continuous_usage=True, echo="Once upon",
                reasoning_field="reasoning", token_ids=True,
            ),
        ),
        cache_salt="tenant-ünïcode-salt",
        priority=-7,
        images=[ImageInput(pack_tensor(np.full((2, 3, 4, 4), 0.5, np.float32)),
                           pack_tensor(np.ones((2, 4, 4), bool)), offset=3, length=9)],
        continuation=Continuation(pack_ids([9, 8, 7]), frame_sizes=[1, 0, 2],
                                  cumulative_logprob=-2.5),
        lora_name="sql-ünï",
        trace_context=TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                                   "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
        priority_tier=3,
    ),
    "request-defaults": EngineRequest(
        request_id="req-2",
        prompt_token_ids=pack_ids([5]),
        params=SamplingParams(max_tokens=1),
        reply_to="ipc:///tmp/x",
        arrival_time=0.0,
    ),
    "request-pooling": EngineRequest(
        request_id="req-3",
        prompt_token_ids=pack_ids([5, 6]),
        params=SamplingParams(max_tokens=1),
        reply_to="ipc:///tmp/x",
        arrival_time=0.0,
        pooling=PoolingParams(task="classify", normalize=False, dimensions=16,
                              token_type_ids=pack_ids([0, 1])),
    ),
    "abort": AbortRequest(request_ids=["a", "b", "ünïcode"]),
    "abort-empty": AbortRequest(request_ids=[]),
    "ping": Ping(sender_id="frontend-0", sent_at=3.5),
    "lora-load": LoraUpdate(op_id="op-1", action="load", name="a", path="/adapters/ä"),
    "lora-unload": LoraUpdate(op_id="op-2", action="unload", name="a"),
    "command": EngineCommand(op_id="op-3", command="read_energy"),
}

FRONTEND_INBOUND = {
    "outputs": OutputBatch(
        outputs=[
            RequestOutput(
                request_id="req-1",
                new_token_ids=pack_ids([9, 8]),
                num_prompt_tokens=6,
                num_output_tokens=2,
                first_token_time=12.5, num_cached_tokens=32,
                logprobs=_token_logprobs(2, 3),
                pooled=pack_tensor(np.arange(4, dtype=np.float32)),
                prompt_logprobs=_token_logprobs(6, 0, ranked=True),
                cumulative_logprob=-2.75,
            ),
            RequestOutput(
                request_id="req-2",
                new_token_ids=pack_ids([32000]),
                num_prompt_tokens=1,
                num_output_tokens=5,
                finish_reason="stop",
                stop_reason=32000,
            ),
            RequestOutput(
                request_id="req-3",
                new_token_ids=b"",
                num_prompt_tokens=0,
                num_output_tokens=0,
                finish_reason="error",
                error="the prompt is empty",
                error_status=400,
            ),
        ],
        step_time=99.0,
    ),
    "outputs-empty": OutputBatch(outputs=[], step_time=0.0),
    "frames": FrameBatch(
        frames=[
            TextFrame(
                request_id="req-1",
                seq=0,
                text="Hello, wörld ✓",
                token_ids=pack_ids([1, 2, 3]),
                num_prompt_tokens=4,
                num_output_tokens=3,
                first_token_time=1.0, num_cached_tokens=16, num_reasoning_tokens=2,
                logprobs=[
                    LogprobEntry(
                        1, "a", -0.5, [TopLogprob(1, "a", -0.5), TopLogprob(9, "é", -2.0)]
                    ),
                    LogprobEntry(2, "", -1.0, []),
                ],
                prompt_logprobs=[LogprobEntry(7, "<s>", -4.0, [TopLogprob(3, "x", -0.1)], 12)],
                cumulative_logprob=-1.5,
                reasoning="hmm ✓",
                tool_calls=[
                    ToolCallDelta(index=0, id="call_1", type="function",
                                  function=FunctionCallDelta(name="f", arguments="")),
                    ToolCallDelta(index=0, function=FunctionCallDelta(arguments='{"a": 1}')),
                ],
                chunk=b'data: {"id": "x"}\n\n',
                pooled=pack_tensor(np.ones(3, dtype=np.float32)),
            ),
            TextFrame(
                request_id="req-1",
                seq=1,
                text="",
                token_ids=b"",
                num_prompt_tokens=4,
                num_output_tokens=3,
                finish_reason="stop",
                stop_reason="</s>",
            ),
            TextFrame(
                request_id="req-2",
                seq=5,
                text="x",
                token_ids=pack_ids([4]),
                num_prompt_tokens=4,
                num_output_tokens=9,
                finish_reason="length",
                stop_reason=17,
                error="boom",
                error_status=503,
            ),
        ]
    ),
    "stats": EngineStats(
        engine_id="engine-0",
        model_name="tiny",
        max_model_len=2048,
        num_total_pages=100,
        num_free_pages=42,
        num_running=3,
        num_waiting=1,
        num_steps=1000,
        max_seqs_in_step=8,
        num_finished=77,
        num_aborted=2,
        sent_at=5.0,
        num_preemptions=4,
        num_computed_tokens=123456,
        prefix_cache_queries=640,
        prefix_cache_hits=320,
        step_time_total_s=12.5,
        num_postproc_workers=3,
        postproc_assigned=50,
        postproc_replayed=7,
        page_size=16,
        histograms={"queue_time": HistogramCounts(counts=[1, 0, 3], total=0.75)},
        draining=True,
        lora_adapters=[LoraAdapterInfo("a", "/adapters/a"),
                       LoraAdapterInfo("b", "/adapters/b", base_model_name="base")],
        kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="tcp://*:5558",
        kv_events_dropped=3,
        tokenizer_fingerprint="175fc183ddaf5265",
        speculative=True,
    ),
    "lora-result": LoraUpdateResult(op_id="op-1", status=404, message="No adapter found"),
    "command-result": EngineCommandResult(
        op_id="op-3", status=200, message="ok", energy=[EnergyReading("nvml:gpu-0", 1.5)],
        path="/traces/engine-0.pt.trace.json"),
}


WORKER_INBOUND = {
    "work": WorkBatch(
        assignments=[ENGINE_INBOUND["request"]],
        outputs=FRONTEND_INBOUND["outputs"].outputs,
        step_time=0.25,
        reset=True,
    ),
    "work-empty": WorkBatch(assignments=[], outputs=[], step_time=0.0),
}

ENGINE_FROM_WORKER = {
    "worker_heartbeat": WorkerHeartbeat(worker_id="postproc-1", sent_at=2.5),
    "abort": AbortRequest(request_ids=["stopped-by-string"]),
    "worker_done": WorkerDone(request_ids=["a", "b"]),
}


def _struct_types() -> set[type]:
    return {
        cls
        for cls in vars(protocol).values()
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls is not msgspec.Struct
    }


def _nested_types(value) -> set[type]:
    """Every Struct type inside a message, with how it is reached not mattering."""
    if isinstance(value, msgspec.Struct):
        found = {type(value)}
        for field in value.__struct_fields__:
            found |= _nested_types(getattr(value, field))
        return found
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return set().union(*(_nested_types(v) for v in value)) if value else set()
    return set()


ALL_MESSAGES = (*ENGINE_INBOUND.values(), *FRONTEND_INBOUND.values(),
                *WORKER_INBOUND.values(), *ENGINE_FROM_WORKER.values())


def test_cases_cover_every_tagged_message():
    tagged = {cls for cls in _struct_types() if cls.__struct_config__.tag is not None}
    assert {type(m) for m in ALL_MESSAGES} == tagged


def test_cases_cover_every_protocol_struct():
    # A new Struct in shared/protocol/ must get a round-trip case here.
    assert set().union(*(_nested_types(m) for m in ALL_MESSAGES)) == _struct_types()


def test_cases_set_every_field_somewhere():
    # Each field takes a non-default value in some case, so omit_defaults cannot hide a field
    # that fails to round-trip.
    unset = {(cls.__name__, f) for cls in _struct_types() for f in cls.__struct_fields__}
    stack = list(ALL_MESSAGES)
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, msgspec.Struct):
            for info in msgspec.structs.fields(value):
                current = getattr(value, info.name)
                if info.default_factory is not msgspec.NODEFAULT:
                    default = info.default_factory()
                else:
                    default = info.default
                if default is msgspec.NODEFAULT or current != default:
                    unset.discard((type(value).__name__, info.name))
                stack.append(current)
    assert not unset


@pytest.mark.parametrize("name", sorted(ENGINE_INBOUND))
def test_engine_inbound_round_trip(name):
    message = ENGINE_INBOUND[name]
    decoded = engine_inbound_decoder().decode(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("name", sorted(FRONTEND_INBOUND))
def test_frontend_inbound_round_trip(name):
    message = FRONTEND_INBOUND[name]
    decoded = frontend_inbound_decoder().decode(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("name", sorted(WORKER_INBOUND))
def test_worker_inbound_round_trip(name):
    message = WORKER_INBOUND[name]
    assert worker_inbound_decoder().decode(encode(message)) == message


@pytest.mark.parametrize("name", sorted(ENGINE_FROM_WORKER))
def test_engine_from_worker_round_trip(name):
    message = ENGINE_FROM_WORKER[name]
    decoded = engine_from_worker_decoder().decode(encode(message))
    assert type(decoded) is type(message) and decoded == message


def test_decode_accepts_memoryview():
    data = encode(ENGINE_INBOUND["ping"])
    assert engine_inbound_decoder().decode(memoryview(data)) == ENGINE_INBOUND["ping"]


def test_nested_structs_keep_their_types():
    decoded = engine_inbound_decoder().decode(encode(ENGINE_INBOUND["request"]))
    assert isinstance(decoded.params, SamplingParams)
    assert decoded.params.stop_token_ids == [2, 32000] and decoded.params.seed == 12345
    batch = frontend_inbound_decoder().decode(encode(FRONTEND_INBOUND["outputs"]))
    assert all(isinstance(o, RequestOutput) for o in batch.outputs)
    frames = frontend_inbound_decoder().decode(encode(FRONTEND_INBOUND["frames"]))
    assert frames.frames[1].stop_reason == "</s>" and frames.frames[2].stop_reason == 17


def test_defaults_are_restored_when_omitted():
    decoded = engine_inbound_decoder().decode(encode(ENGINE_INBOUND["request-defaults"]))
    assert decoded.params == SamplingParams(max_tokens=1)
    assert decoded.params.temperature == 1.0 and decoded.params.stop_token_ids == []
    assert decoded.output == OutputParams() and decoded.output.skip_special_tokens is True
    out = frontend_inbound_decoder().decode(encode(FRONTEND_INBOUND["outputs"])).outputs[0]
    assert out.finish_reason is None and out.error_status == 0


# --- token ids ----------------------------------------------------------------------------------


def test_pack_ids_is_little_endian_int32():
    buf = pack_ids(PROMPT)
    assert isinstance(buf, bytes)
    assert len(buf) == 4 * len(PROMPT)
    assert buf[:8] == b"\x01\x00\x00\x00\x00\x00\x00\x00"
    assert buf[8:12] == b"\xff\xff\xff\x7f"
    assert buf == np.array(PROMPT, dtype="<i4").tobytes()


def test_unpack_ids_round_trip():
    ids = unpack_ids(pack_ids(PROMPT))
    assert ids.dtype == np.dtype("<i4")
    assert ids.tolist() == PROMPT
    assert unpack_ids(pack_ids([])).tolist() == []
    assert pack_ids(np.array([3, 4], dtype=np.int64)) == pack_ids([3, 4])


def test_token_ids_travel_as_raw_bytes():
    ids = list(range(1000, 1300))
    message = EngineRequest(
        request_id="r",
        prompt_token_ids=pack_ids(ids),
        params=SamplingParams(max_tokens=1),
        reply_to="x",
        arrival_time=0.0,
    )
    data = encode(message)
    # The packed buffer appears verbatim (a msgpack bin), not as a list of ints.
    assert pack_ids(ids) in data
    assert len(data) < 4 * len(ids) + 300  # the ids' bytes and the other fields' few
    decoded = engine_inbound_decoder().decode(data)
    assert isinstance(decoded.prompt_token_ids, bytes)
    assert unpack_ids(decoded.prompt_token_ids).tolist() == ids


def test_image_tensors_travel_as_raw_bytes():
    pixels = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    image = ImageInput(pack_tensor(pixels), pack_tensor(np.ones((2, 4, 4), bool)), 1, 5)
    message = EngineRequest(request_id="r", prompt_token_ids=pack_ids([1]),
                            params=SamplingParams(max_tokens=1), reply_to="x",
                            arrival_time=0.0, images=[image])
    data = encode(message)
    assert pixels.tobytes() in data  # verbatim, not pickled, not a list of floats
    decoded = engine_inbound_decoder().decode(data).images[0]
    assert (unpack_tensor(decoded.pixel_values) == pixels).all()
    assert unpack_tensor(decoded.pixel_attention_mask).dtype == np.bool_


@pytest.mark.parametrize("tensor", [
    protocol.RawTensor(b"\0" * 8, [3], "float32"),  # 12 bytes wanted
    protocol.RawTensor(b"\0" * 4, [1], "float64"),
    protocol.RawTensor(b"\0" * 4, [1], "object"),
    protocol.RawTensor(b"", [0], "float32"),
    protocol.RawTensor(b"\0" * 4, [-1, -1], "float32"),
    protocol.RawTensor(b"", [], "float32"),
])
def test_bad_tensors_are_refused(tensor):
    with pytest.raises(ValueError):
        unpack_tensor(tensor)


def test_output_token_ids_travel_as_raw_bytes():
    batch = OutputBatch(
        outputs=[
            RequestOutput(
                request_id="r",
                new_token_ids=pack_ids([70000, 3]),
                num_prompt_tokens=1,
                num_output_tokens=2,
            )
        ],
        step_time=0.0,
    )
    data = encode(batch)
    assert pack_ids([70000, 3]) in data
    decoded = frontend_inbound_decoder().decode(data)
    assert unpack_ids(decoded.outputs[0].new_token_ids).tolist() == [70000, 3]


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FRONTEND_INBOUND))
def test_engine_decoder_rejects_frontend_messages(name):
    with pytest.raises(msgspec.ValidationError):
        engine_inbound_decoder().decode(encode(FRONTEND_INBOUND[name]))


@pytest.mark.parametrize("name", sorted(ENGINE_INBOUND))
def test_frontend_decoder_rejects_engine_messages(name):
    with pytest.raises(msgspec.ValidationError):
        frontend_inbound_decoder().decode(encode(ENGINE_INBOUND[name]))


def test_untagged_and_mistyped_messages_rejected():
    decoder = engine_inbound_decoder()
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode({"sender_id": "x", "sent_at": 1.0}))
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode({"type": "ping", "sender_id": 5, "sent_at": 1.0}))
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode({"type": "nope"}))


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\xc1", b"\x81\xa4type", b"\xdb\xff\xff\xff\xff"],
    ids=["empty", "reserved-byte", "truncated-map", "huge-str-length"],
)
@pytest.mark.parametrize("decoder", [engine_inbound_decoder, frontend_inbound_decoder])
def test_garbage_raises_decode_error(garbage, decoder):
    with pytest.raises(msgspec.DecodeError) as info:
        decoder().decode(garbage)
    # Malformed bytes, not a well-formed message of the wrong shape.
    assert not isinstance(info.value, msgspec.ValidationError)


@pytest.mark.parametrize(
    "decoder,message",
    [
        (engine_inbound_decoder, ENGINE_INBOUND["request"]),
        (engine_inbound_decoder, ENGINE_INBOUND["ping"]),
        (frontend_inbound_decoder, FRONTEND_INBOUND["outputs"]),
        (frontend_inbound_decoder, FRONTEND_INBOUND["stats"]),
    ],
)
def test_truncated_or_padded_message_raises_decode_error(decoder, message):
    data = encode(message)
    for bad in (data[: len(data) // 2], data[:-1], data + b"\x00"):
        with pytest.raises(msgspec.DecodeError) as info:
            decoder().decode(bad)
        assert not isinstance(info.value, msgspec.ValidationError)
