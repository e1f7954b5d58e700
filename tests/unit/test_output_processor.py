"""The postproc step (req O-2, O-3, P-9): engine token batches -> text frames, with stop
strings held back and cut, and the engine's stop token kept out of the text unless asked."""

import pytest

from postproc.processor import OutputProcessor
from shared.protocol import OutputParams, RequestOutput, pack_ids
from shared.tokenizer import load_tokenizer

PROMPT = "The capital of France is"
ANSWER = " Paris. It is a city of art and light."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def run(tokenizer, ids, params: OutputParams, finish=("length", None)):
    """Feeds ids one per step as the engine would; returns the frames."""
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    processor.register("r", prompt, params)
    frames = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        output = RequestOutput(
            request_id="r", new_token_ids=pack_ids([token]), num_prompt_tokens=len(prompt),
            num_output_tokens=i + 1, finish_reason=finish[0] if last else None,
            stop_reason=finish[1] if last else None,
        )
        processed = processor.process([output])
        frames.extend(processed.frames)
        if processed.frames and processed.frames[-1].finish_reason is not None:
            break
    return frames


def text(frames) -> str:
    return "".join(f.text for f in frames)


@pytest.mark.parametrize("include", [False, True])
def test_eos_and_stop_token_ids_stay_out_of_the_text_unless_asked(tokenizer, include):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    params = OutputParams(skip_special_tokens=False, include_stop_str_in_output=include)
    frames = run(tokenizer, [*ids, eos], params, finish=("stop", None))
    assert text(frames) == ANSWER + ("<|im_end|>" if include else "")
    # A stop token id that is ordinary text: the same rule.
    frames = run(tokenizer, ids, params, finish=("stop", ids[-1]))
    last = tokenizer.decode(ids[-1:])
    expected = ANSWER if include else ANSWER[: -len(last)]
    assert text(frames) == expected
    assert (frames[-1].finish_reason, frames[-1].stop_reason) == ("stop", ids[-1])


def test_length_finish_keeps_the_last_token(tokenizer):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert text(run(tokenizer, ids, OutputParams())) == ANSWER


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_and_reported(tokenizer, include):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    params = OutputParams(stop=["city of"], include_stop_str_in_output=include)
    frames = run(tokenizer, ids, params)
    assert text(frames) == (" Paris. It is a city of" if include else " Paris. It is a ")
    assert (frames[-1].finish_reason, frames[-1].stop_reason) == ("stop", "city of")


def test_no_frame_leaks_a_prefix_of_a_stop_string(tokenizer):
    # "a city of art" never matches "a city of light", but until "art" arrives it could.
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    stop = "city of light"
    frames = run(tokenizer, ids, OutputParams(stop=[stop]))
    emitted = ""
    for i, frame in enumerate(frames[:-1]):
        emitted += frame.text
        generated = tokenizer.decode(ids[: i + 1])
        # The last len(stop) - 1 characters generated so far are never out yet.
        assert len(emitted) <= max(0, len(generated) - (len(stop) - 1))
        assert generated.startswith(emitted)
    assert text(frames) == ANSWER  # no match: everything held back comes out at the end


def test_hold_back_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    frames = run(tokenizer, ids, OutputParams(stop=["zzzzzz"]))
    assert text(frames) == ANSWER
    # Until the end, the last len(stop) - 1 characters stay back.
    assert len("".join(f.text for f in frames[:-1])) <= len(ANSWER) - 5
