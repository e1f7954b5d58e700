"""Prompt budgets (req T-5 to T-7), branch by branch, with the real tokenizer."""

import pytest

from frontend.input.budgets import (
    BudgetError,
    FittedText,
    PromptTokens,
    TokenizeParams,
    check_truncation,
    finish,
    fit_text,
    shift_offsets,
)
from frontend.input.tokenization import InputSettings, Tokenization
from shared.tokenizer import load_tokenizer, tokenizer_facts
from tests.tiny_tokenizer import BOS_ID, MAX_CHARS_PER_TOKEN, tiny_tokenizer

LIMIT = 10  # max_model_len for these tests: small, so real prompts cross it
TEXT = ("The quick brown fox jumps over the lazy dog; " * 200).strip()  # ~9k chars, ~2k tokens


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def stage(tokenizer):
    facts = tokenizer_facts(tokenizer, "default")
    settings = InputSettings(max_chars_per_token=facts.max_chars_per_token,
                             pad_token_id=facts.pad_token_id, threads=1)
    stage = Tokenization(tokenizer, settings)
    yield stage
    stage.shutdown()


def params(**kw) -> TokenizeParams:
    kw.setdefault("max_total_tokens", LIMIT)
    return TokenizeParams(**kw)


def encode(tokenizer, text, special=True):
    e = tokenizer.backend_tokenizer.encode(text, add_special_tokens=special)
    return e.ids, e.offsets


# ---------------------------------------------------------------- the numbers (T-5)


def test_derived_budgets():
    gen = params()
    assert gen.max_input_tokens == LIMIT  # the prompt alone may fill the context
    assert gen.max_truncation_tokens == LIMIT - 1  # truncation leaves room for one token
    assert gen.side == "left"  # generation keeps the recent turns
    assert gen.max_input_chars(7) == LIMIT * 7
    pooling = params(generation=False)
    assert pooling.max_truncation_tokens == LIMIT and pooling.side == "right"
    assert params(truncation_side="right").side == "right"
    assert params(truncate_prompt_tokens=-1).keep_tokens == LIMIT - 1
    assert params(truncate_prompt_tokens=4).keep_tokens == 4
    assert params().keep_tokens is None


def test_encode_cap_only_without_truncation():
    assert params().encode_cap == LIMIT + 1
    assert params(truncate_prompt_tokens=-1).encode_cap is None


@pytest.mark.parametrize("value", [None, -1, 1, LIMIT])
def test_truncation_values_accepted(value):
    check_truncation(params(truncate_prompt_tokens=value))


@pytest.mark.parametrize("value,words", [(0, "-1"), (-2, "-1"), (LIMIT + 1, "larger than")])
def test_truncation_values_rejected(value, words):
    with pytest.raises(BudgetError, match=words) as info:
        check_truncation(params(truncate_prompt_tokens=value))
    assert info.value.param == "truncate_prompt_tokens"


# ---------------------------------------------------------------- character ceiling (T-5)


def test_text_under_the_ceiling_is_untouched():
    assert fit_text("x" * 70, params(), 7) == FittedText("x" * 70)


def test_text_over_the_ceiling_is_rejected_without_truncation():
    with pytest.raises(BudgetError, match="71 characters") as info:
        fit_text("x" * 71, params(), 7)
    assert info.value.param is None  # the prompt itself


def test_text_over_the_ceiling_is_cut_on_the_truncation_side():
    text = "a" * 5 + "b" * 70
    left = fit_text(text, params(truncate_prompt_tokens=-1), 7)
    assert left == FittedText("b" * 70, cut_left=5)
    right = fit_text(text, params(truncate_prompt_tokens=3, truncation_side="right"), 7)
    assert right == FittedText(text[:70], cut_right=5)


def test_real_prompt_over_the_ceiling_never_tokenized(stage, monkeypatch):
    borrowed = []
    monkeypatch.setattr(stage.pool, "borrow", lambda: borrowed.append(1))
    ceiling = LIMIT * stage.settings.max_chars_per_token
    with pytest.raises(BudgetError, match=f"at most {ceiling}"):
        stage.tokenize_sync("y" * (ceiling + 1), params())
    assert borrowed == []


# ---------------------------------------------------------------- tokenizer cap (T-6)


def test_cap_keeps_the_length_check_honest(stage, tokenizer):
    text = TEXT[:300]  # under the character ceiling, far over 10 tokens
    assert len(encode(tokenizer, text)[0]) > LIMIT + 1
    with pytest.raises(BudgetError, match=f"has at least {LIMIT + 1} tokens"):
        stage.tokenize_sync(text, params())


def test_prompt_filling_the_context_passes(stage, tokenizer):
    ids = encode(tokenizer, TEXT)[0][:LIMIT]
    text = tokenizer.decode(ids)
    assert encode(tokenizer, text)[0] == ids
    assert stage.tokenize_sync(text, params()).ids == ids


def test_short_prompt_is_exact(stage, tokenizer):
    out = stage.tokenize_sync("Hello there", params())
    assert out.ids == encode(tokenizer, "Hello there")[0]
    assert (out.tokens_cut, out.chars_cut, out.num_chars) == (0, 0, 11)


# ---------------------------------------------------------------- truncation (T-7)


def test_left_truncation_keeps_the_end(stage, tokenizer):
    text = TEXT[:300]
    full = encode(tokenizer, text)[0]
    out = stage.tokenize_sync(text, params(truncate_prompt_tokens=-1))
    assert out.ids == full[-(LIMIT - 1):]
    assert out.tokens_cut == len(full) - (LIMIT - 1)


def test_right_truncation_keeps_the_start(stage, tokenizer):
    text = TEXT[:300]
    out = stage.tokenize_sync(text, params(truncate_prompt_tokens=4, truncation_side="right"))
    assert out.ids == encode(tokenizer, text)[0][:4]


def test_offsets_after_a_left_cut_point_into_the_original_text(stage, tokenizer):
    # Over the character ceiling: cut on the left before tokenizing, then by tokens.
    assert len(TEXT) > LIMIT * stage.settings.max_chars_per_token
    out = stage.tokenize_sync(TEXT, params(truncate_prompt_tokens=-1, return_offsets=True))
    assert out.chars_cut == len(TEXT) - LIMIT * stage.settings.max_chars_per_token
    full_ids, full_offsets = encode(tokenizer, TEXT)
    keep = LIMIT - 1
    assert out.ids == full_ids[-keep:]
    assert out.offsets == full_offsets[-keep:]  # same token, same span of the original
    assert "".join(TEXT[s:e] for s, e in out.offsets) == TEXT[out.offsets[0][0]:]


def test_offsets_are_cut_with_the_ids(stage, tokenizer):
    text = TEXT[:300]
    out = stage.tokenize_sync(
        text, params(truncate_prompt_tokens=3, truncation_side="right", return_offsets=True)
    )
    assert out.offsets == encode(tokenizer, text)[1][:3]


def test_special_token_offsets_do_not_move():
    assert shift_offsets([(0, 0), (0, 5), (6, 11)], 100) == [(0, 0), (100, 105), (106, 111)]
    assert shift_offsets([(0, 3)], 0) == [(0, 3)]


def test_offsets_of_a_tokenizer_with_bos():
    tok = tiny_tokenizer()
    stage = Tokenization(tok, InputSettings(max_chars_per_token=MAX_CHARS_PER_TOKEN, threads=1))
    try:
        out = stage.tokenize_sync("hello world", params(return_offsets=True))
    finally:
        stage.shutdown()
    assert out.ids[0] == BOS_ID and out.offsets[0] == (0, 0)


# ---------------------------------------------------------------- order (T-7)


def test_truncate_then_pad_then_check():
    tokens = PromptTokens(ids=[11, 12, 13, 14, 15], offsets=[(i, i + 1) for i in range(5)])
    out = finish(tokens, params(truncate_prompt_tokens=3, pad_prompt_tokens=6), capped=False,
                 pad_token_id=0)
    # Padding first would have put the pads at the end and a left cut would keep only them.
    assert out.ids == [13, 14, 15, 0, 0, 0]
    assert out.offsets == [(2, 3), (3, 4), (4, 5), (0, 0), (0, 0), (0, 0)]
    assert out.tokens_cut == 2


def test_padding_past_the_limit_fails_the_length_check():
    with pytest.raises(BudgetError, match=f"has {LIMIT + 2} tokens"):
        finish(PromptTokens(ids=[1]), params(pad_prompt_tokens=LIMIT + 2), capped=False,
               pad_token_id=0)


def test_pad_to_the_maximum():
    out = finish(PromptTokens(ids=[1]), params(pad_prompt_tokens=-1), capped=False,
                 pad_token_id=9)
    assert out.ids == [1] + [9] * (LIMIT - 1)


def test_padding_follows_the_tokenizers_side_with_every_parallel_array():
    """pad_prompt_tokens pads on the tokenizer's padding_side (vLLM's), after a cut on
    either side, and token types and offsets grow with the ids."""
    tokens = PromptTokens(ids=[11, 12, 13, 14], offsets=[(i, i + 1) for i in range(4)],
                          token_types=[0, 0, 1, 1])
    left = finish(tokens, params(truncate_prompt_tokens=3, truncation_side="right",
                                 pad_prompt_tokens=5), capped=False, pad_token_id=0,
                  pad_side="left")
    assert left.ids == [0, 0, 11, 12, 13] and left.token_types == [0, 0, 0, 0, 1]
    assert left.offsets == [(0, 0), (0, 0), (0, 1), (1, 2), (2, 3)]
    right = finish(tokens, params(pad_prompt_tokens=6), capped=False, pad_token_id=0)
    assert right.ids == [11, 12, 13, 14, 0, 0] and right.token_types == [0, 0, 1, 1, 0, 0]
    same = finish(tokens, params(pad_prompt_tokens=4), capped=False, pad_token_id=None)
    assert same.ids == tokens.ids  # already long enough: no pad token needed
    with pytest.raises(BudgetError, match="no pad token") as err:
        finish(tokens, params(pad_prompt_tokens=5), capped=False, pad_token_id=None)
    assert err.value.param == "pad_prompt_tokens"


def test_length_check_says_exact_count_when_not_capped():
    with pytest.raises(BudgetError, match=f"has {LIMIT + 5} tokens"):
        finish(PromptTokens(ids=[1] * (LIMIT + 5)), params(), capped=False, pad_token_id=None)


def test_needs_detokenization_gives_the_text_after_truncation(stage, tokenizer):
    text = TEXT[:300]
    out = stage.tokenize_sync(text, params(truncate_prompt_tokens=4, needs_detokenization=True))
    assert out.text == tokenizer.decode(out.ids) and text.endswith(out.text)


def test_a_pair_leaves_its_tokenizer_copy_untruncated(tokenizer):
    """tokenize_pair cuts with the tokenizer's own truncation, which transformers leaves set
    on the copy: the next prompt tokenized with that copy must not be cut by it."""
    settings = InputSettings(max_chars_per_token=MAX_CHARS_PER_TOKEN * 20, threads=1)
    stage = Tokenization(tokenizer, settings)
    try:
        pair = stage.tokenize_pair_sync("hello there", "world " * 20,
                                        params(generation=False, truncate_prompt_tokens=5))
        assert len(pair.ids) == 5
        assert stage.pool.copies == 1  # the one copy, used by both jobs below
        whole = stage.tokenize_sync(TEXT, TokenizeParams(max_total_tokens=10_000))
        assert len(whole.ids) == len(encode(tokenizer, TEXT)[0]) > 5
    finally:
        stage.shutdown()
