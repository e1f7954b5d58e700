"""Prompt budgets (req T-5 to T-7): how long a prompt may be, and how it is cut.

Pure functions over token ids and text; `frontend.input.tokenization` runs them around the tokenizer
in its thread pool. The numbers:

- max_input_tokens = max_model_len: a prompt alone may fill the context (a generation request
  is then refused for lack of room, req P-5, which is a clearer error than a silent cut).
- max_truncation_tokens = max_model_len - 1 for generation: truncating to the full context
  would leave no room for even one new token.
- max_input_chars = max_input_tokens * max_chars_per_token: no token is longer than
  max_chars_per_token characters, so a longer text is certainly too long. It is checked
  before tokenizing, so a multi-megabyte paste costs one len().
"""

from __future__ import annotations

from typing import Literal

import msgspec

Side = Literal["left", "right"]
Offsets = list[tuple[int, int]]

_NO_POSITION = (0, 0)  # fast tokenizers give added special tokens (BOS...) this offset


class BudgetError(ValueError):
    """A prompt (or a truncation setting) that does not fit; a 400 for the client.

    `param` names the request field to blame; None means the prompt itself.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TokenizeParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one prompt is tokenized and cut (the tokenizer stage's own parameters, req T-1)."""

    max_total_tokens: int  # the model's context: prompt + output
    generation: bool = True  # False: pooling, no output tokens to leave room for
    truncate_prompt_tokens: int | None = None  # keep this many tokens; -1: as many as allowed
    truncation_side: Side | None = None  # None: left for generation, right for pooling
    pad_prompt_tokens: int | None = None  # pad to this many tokens; -1: max_input_tokens
    add_special_tokens: bool = True  # completions True, chat False (req T-4)
    return_offsets: bool = False
    needs_detokenization: bool = False  # recover the text after truncation (req T-10)

    @property
    def max_input_tokens(self) -> int:
        return self.max_total_tokens

    @property
    def max_truncation_tokens(self) -> int:
        if not self.generation:
            return self.max_input_tokens
        return max(0, self.max_input_tokens - 1)

    @property
    def side(self) -> Side:
        # Generation keeps the recent turns; pooling keeps the document's opening.
        if self.truncation_side is not None:
            return self.truncation_side
        return "left" if self.generation else "right"

    @property
    def keep_tokens(self) -> int | None:
        """Tokens truncation keeps, or None when the request asked for no truncation."""
        if self.truncate_prompt_tokens is None:
            return None
        if self.truncate_prompt_tokens < 0:
            return self.max_truncation_tokens
        return self.truncate_prompt_tokens

    @property
    def encode_cap(self) -> int | None:
        """Most tokens worth keeping from the tokenizer when not truncating: one past the
        limit, so an over-long prompt still fails the length check instead of passing it."""
        if self.truncate_prompt_tokens is not None:
            return None
        return self.max_input_tokens + 1

    @property
    def pair_max_length(self) -> int:
        """What a tokenizer joining two segments may return: the tokens truncation keeps, or
        the cap. It cuts the segments' text, never the special tokens it adds around them."""
        keep = self.keep_tokens
        return keep if keep is not None else self.max_input_tokens + 1

    def max_input_chars(self, max_chars_per_token: int) -> int:
        return self.max_input_tokens * max_chars_per_token


class FittedText(msgspec.Struct, frozen=True):
    text: str
    cut_left: int = 0  # characters removed from the start (offsets shift by this)
    cut_right: int = 0


class PromptTokens(msgspec.Struct):
    """A prompt after the tokenizer stage, with what L-4 wants visible."""

    ids: list[int]
    offsets: Offsets | None = None  # character span of each token, in the original text
    num_chars: int = 0  # characters of the text given to the stage, before any cut
    chars_cut: int = 0  # removed before tokenizing by the character ceiling
    tokens_cut: int = 0  # removed by token truncation
    text: str | None = None  # the prompt as text after truncation, when asked for
    token_types: list[int] | None = None  # a pair's segment of each token (cross-encoders)


def check_truncation(params: TokenizeParams) -> None:
    value = params.truncate_prompt_tokens
    if value is None or value == -1:
        return
    if value < 1:
        raise BudgetError(
            "truncate_prompt_tokens must be -1 (as many as fit) or at least 1",
            "truncate_prompt_tokens",
        )
    if value > params.max_input_tokens:
        raise BudgetError(
            f"truncate_prompt_tokens={value} is larger than this model's maximum context "
            f"length of {params.max_input_tokens} tokens",
            "truncate_prompt_tokens",
        )


# ---------------------------------------------------------------- before tokenizing


def fit_text(text: str, params: TokenizeParams, max_chars_per_token: int) -> FittedText:
    """The character ceiling (req T-5): reject, or cut to it when truncation was asked for.

    A cut text of max_input_chars characters still has at least max_input_tokens tokens, so
    token truncation afterwards decides exactly what remains; this cut only bounds the work.
    """
    ceiling = params.max_input_chars(max_chars_per_token)
    excess = len(text) - ceiling
    if excess <= 0:
        return FittedText(text)
    if params.keep_tokens is None:
        raise BudgetError(
            f"This model's maximum context length is {params.max_input_tokens} tokens, and the "
            f"prompt has {len(text)} characters, more than {params.max_input_tokens} tokens "
            f"can hold (at most {ceiling}). Shorten the prompt, or set truncate_prompt_tokens."
        )
    if params.side == "left":
        return FittedText(text[excess:], cut_left=excess)
    return FittedText(text[:ceiling], cut_right=excess)


def fit_pair(first: str, second: str, params: TokenizeParams, max_chars_per_token: int
             ) -> tuple[FittedText, FittedText]:
    """The ceiling for a pair (score, rerank): its two texts together, without truncation;
    with it, each cut to the ceiling on its own (either may end up holding every kept token)."""
    ceiling = params.max_input_chars(max_chars_per_token)
    total = len(first) + len(second)
    if params.keep_tokens is None and total > ceiling:
        raise BudgetError(
            f"This model's maximum context length is {params.max_input_tokens} tokens, and the "
            f"pair has {total} characters, more than {params.max_input_tokens} tokens can hold "
            f"(at most {ceiling}). Shorten it, or set truncate_prompt_tokens.")
    return (fit_text(first, params, max_chars_per_token),
            fit_text(second, params, max_chars_per_token))


def shift_offsets(offsets: Offsets, chars: int) -> Offsets:
    """Offsets into a left-cut text, moved back into the original text's coordinates.
    Special tokens keep (0, 0): it means "no position", not "the first character"."""
    if chars == 0:
        return offsets
    return [o if o == _NO_POSITION else (o[0] + chars, o[1] + chars) for o in offsets]


# ---------------------------------------------------------------- after tokenizing


def truncation_slice(num_tokens: int, params: TokenizeParams) -> slice | None:
    keep = params.keep_tokens
    if keep is None or num_tokens <= keep:
        return None
    return slice(num_tokens - keep, None) if params.side == "left" else slice(0, keep)


def _cut(values: list | None, cut: slice) -> list | None:
    return values[cut] if values is not None else None


def truncate(tokens: PromptTokens, params: TokenizeParams) -> PromptTokens:
    """Cuts ids and every parallel array with one slice, so token i keeps its offsets."""
    cut = truncation_slice(len(tokens.ids), params)
    if cut is None:
        return tokens
    kept = tokens.ids[cut]
    return msgspec.structs.replace(
        tokens, ids=kept, offsets=_cut(tokens.offsets, cut),
        token_types=_cut(tokens.token_types, cut), tokens_cut=len(tokens.ids) - len(kept),
    )


def _padded(values: list | None, filler, extra: int, side: Side) -> list | None:
    if values is None:
        return None
    return [filler] * extra + values if side == "left" else values + [filler] * extra


def pad(tokens: PromptTokens, params: TokenizeParams, pad_token_id: int | None,
        side: Side = "right") -> PromptTokens:
    """Pads to pad_prompt_tokens (-1: max_input_tokens) on the tokenizer's padding side,
    every parallel array with it (offsets "no position", token types 0, as HF pads)."""
    target = params.pad_prompt_tokens
    if target is not None and target < 0:
        target = params.max_input_tokens
    if target is None or len(tokens.ids) >= target:
        return tokens
    if pad_token_id is None:
        raise BudgetError("this tokenizer has no pad token", "pad_prompt_tokens")
    extra = target - len(tokens.ids)
    return msgspec.structs.replace(
        tokens, ids=_padded(tokens.ids, pad_token_id, extra, side),
        offsets=_padded(tokens.offsets, _NO_POSITION, extra, side),
        token_types=_padded(tokens.token_types, 0, extra, side),
    )


def check_length(tokens: PromptTokens, params: TokenizeParams, capped: bool) -> PromptTokens:
    limit = params.max_input_tokens
    if len(tokens.ids) <= limit:
        return tokens
    # A capped tokenizer stopped counting at limit + 1: the prompt may be longer still.
    count = f"at least {len(tokens.ids)}" if capped else str(len(tokens.ids))
    raise BudgetError(
        f"This model's maximum context length is {limit} tokens, and the prompt has {count} "
        "tokens. Shorten the prompt, or set truncate_prompt_tokens."
    )


def finish(
    tokens: PromptTokens, params: TokenizeParams, *, capped: bool, pad_token_id: int | None,
    pad_side: Side = "right",
) -> PromptTokens:
    """Truncate, then pad, then check the length (req T-7). Padding before a left cut would
    keep the padding and drop the prompt; checking before the cut would reject what the
    client asked us to cut."""
    tokens = truncate(tokens, params)
    tokens = pad(tokens, params, pad_token_id, pad_side)
    return check_length(tokens, params, capped)
