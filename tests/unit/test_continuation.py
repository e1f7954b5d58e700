"""Continuations (issue 39): a request moved to another engine mid-stream carries the tokens
it had generated. The engine goes on with the next token exactly as the first engine would
have (greedy, and seeded sampling with penalties: the draw at position k depends only on
seed and k), counts them in usage and max_tokens, and refuses a malformed continuation with
a 400; the postproc step replays them unsent, so the text goes on where it stopped."""

import msgspec
import pytest
import torch

from engine.step.sampler import position_generator
from postproc.processor import OutputProcessor
from shared.protocol import Continuation, OutputParams, RequestOutput, pack_ids, unpack_ids
from shared.tokenizer import load_tokenizer
from tests.unit.engine_builders import (
    VOCAB,
    assert_all_free,
    build_core,
    prompts,
    random_weights,
    request,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = prompts([9])[0]
SAMPLED = {"temperature": 1.0, "seed": 7, "presence_penalty": 0.5}


@pytest.fixture(scope="module")
def weights():
    return random_weights()


def _run(core, req) -> list:
    """Steps one request to its end; its outputs."""
    core.add(req)
    outputs = []
    while core.has_work:
        outputs += [out for _, out in core.step()]
    assert_all_free(core)
    return outputs


@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_continuation_goes_on_with_the_same_tokens(weights, params, cut):
    core, _ = build_core(weights)
    whole = [t for out in _run(core, request("r", PROMPT, **params))
             for t in unpack_ids(out.new_token_ids).tolist()]
    assert len(whole) == 12
    moved = request("r~1", PROMPT, **params)
    moved = msgspec.structs.replace(moved, continuation=Continuation(
        pack_ids(whole[:cut]), [1] * cut))
    core, _ = build_core(weights)  # another engine: nothing cached, no generator state
    outputs = _run(core, moved)
    rest = [t for out in outputs for t in unpack_ids(out.new_token_ids).tolist()]
    assert rest == whole[cut:]
    # Usage counts the moved tokens once: output counts go on from the cut.
    assert [o.num_output_tokens for o in outputs] == list(range(cut + 1, 13))
    assert outputs[-1].finish_reason == "length"
    assert all(o.first_token_time is None and o.num_cached_tokens is None for o in outputs)


def test_a_seeded_draw_depends_on_seed_and_position_only():
    draw = lambda seed, pos: torch.rand(4, generator=position_generator(seed, pos))  # noqa: E731
    assert torch.equal(draw(7, 3), draw(7, 3))
    assert not torch.equal(draw(7, 3), draw(7, 4))
    assert not torch.equal(draw(7, 3), draw(8, 3))
    draw(2**64 - 1, 2**40)  # the whole seed range


@pytest.mark.parametrize(("continuation", "max_tokens", "problem"), [
    (Continuation(pack_ids([VOCAB]), [1]), 12, "must lie in"),
    (Continuation(pack_ids([-1]), [1]), 12, "must lie in"),
    (Continuation(b"\x01\x02", [1]), 12, "int32"),
    (Continuation(pack_ids([1, 2]), [1]), 12, "frame_sizes"),
    (Continuation(pack_ids([1, 2]), [3, -1]), 12, "frame_sizes"),
    (Continuation(pack_ids([1]), [0, 0, 1]), 12, "frame_sizes"),
    (Continuation(pack_ids([1, 2]), [2]), 2, "max_tokens"),
    (Continuation(pack_ids([1] * 250), [250]), 1000, "max_model_len"),
    (Continuation(pack_ids([1]), [1], float("nan")), 12, "cumulative_logprob"),
])
def test_a_malformed_continuation_is_refused(weights, continuation, max_tokens, problem):
    core, _ = build_core(weights)
    req = msgspec.structs.replace(request("bad", PROMPT, max_tokens=max_tokens),
                                  continuation=continuation)
    outputs = _run(core, req)
    assert len(outputs) == 1 and outputs[0].finish_reason == "error"
    assert outputs[0].error_status == 400 and problem in outputs[0].error


# --- the postproc side ------------------------------------------------------------------------

ANSWER = " Café au lait ☕ costs 3 € in Paris, stop here or not."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def _frames(processor, request_id, ids, start, end, prompt):
    """Frames of outputs start..end-1, one token each; the last of `ids` finishes."""
    frames = []
    for i in range(start, end):
        out = RequestOutput(request_id=request_id, new_token_ids=pack_ids(ids[i:i + 1]),
                            num_prompt_tokens=len(prompt), num_output_tokens=i + 1,
                            finish_reason="length" if i == len(ids) - 1 else None)
        frames += processor.process([out]).frames
        if frames and frames[-1].finish_reason:
            break
    return frames


@pytest.mark.parametrize("stop", [[], ["stop here"]])
def test_replayed_frames_leave_the_text_where_the_client_has_it(tokenizer, stop):
    prompt = tokenizer.encode("Prices:", add_special_tokens=False)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    params = OutputParams(stop=stop)
    whole = OutputProcessor(tokenizer)
    whole.register("r", prompt, params)
    reference = _frames(whole, "r", ids, 0, len(ids), prompt)
    expected = "".join(f.text for f in reference)
    for cut in range(1, len(reference)):  # every place a stream can be cut, mid-character too
        first = OutputProcessor(tokenizer)
        first.register("r", prompt, params)
        before = _frames(first, "r", ids, 0, cut, prompt)
        moved = OutputProcessor(tokenizer)  # another worker, on the other engine
        moved.register("r~1", prompt, params, Continuation(pack_ids(ids[:cut]), [1] * cut))
        after = _frames(moved, "r~1", ids, cut, len(ids), prompt)
        assert "".join(f.text for f in before + after) == expected, cut
        assert [f.seq for f in before + after] == list(range(len(before) + len(after)))
        assert after[-1].finish_reason == reference[-1].finish_reason


# --- the flags ----------------------------------------------------------------------------------


def test_migration_flags_take_their_range_and_reach_the_configs(capsys, monkeypatch):
    from sluice import cli

    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    for argv in (["frontend", "--migration-limit", "-1"], ["frontend", "--migration-limit", "1.5"],
                 ["serve", "--migration-limit", "x"], ["frontend", "--engine-timeout", "-1"],
                 ["frontend", "--engine-timeout", "inf"], ["serve", "--engine-timeout", "nan"],
                 ["engine", "--shutdown-timeout", "-0.5"]):
        with pytest.raises(SystemExit) as exited:
            cli.build_parser().parse_args(argv)
        assert exited.value.code == 2, argv
        assert argv[1] in capsys.readouterr().err
    parse = cli.build_parser().parse_args
    config = cli.frontend_config(parse(["frontend"]), "tcp://127.0.0.1:1", None)
    assert (config.migration_limit, config.engine_timeout_s) == (3, 30.0)
    config = cli.frontend_config(parse(["frontend", "--migration-limit", "0",
                                        "--engine-timeout", "0"]), "tcp://127.0.0.1:1", None)
    assert (config.migration_limit, config.engine_timeout_s) == (0, 0.0)
    assert parse(["engine", "--shutdown-timeout", "0"]).shutdown_timeout == 0.0
