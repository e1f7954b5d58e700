"""Incremental detokenization for streaming (req O-2).

Each push decodes only a short window: the tokens of the last emitted chunk (context) plus the
tokens not yet emitted. The new text is what the window decodes to beyond what its context
decodes to. Context matters because decoders are not token-local: SentencePiece-style decoders
drop the leading space of the first token they see, and a byte-level token may carry only part
of a UTF-8 character. We hold text back while it ends in U+FFFD, the decoder's mark for an
unfinished character, so no delta ever carries half a character.

For byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen, GPT-2) the joined deltas equal
`tokenizer.decode(output_ids, skip_special_tokens=...)` exactly. For SentencePiece-style
tokenizers the first output token keeps its leading space when the prompt's last token is
ordinary text (a continuation, as in "The capital is" + " Paris"), which a bare decode of the
output ids would strip; `detokenize` gives the same text in one call, so a non-streaming
response can match a streamed one.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"
# Prompt tokens used as context. A few suffice: the space rule needs one ordinary token
# before the output, and the UTF-8 rule needs none.
_PROMPT_CONTEXT = 4


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
        skip_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`skip_ids`: special tokens to leave out while the others are kept (with
        skip_special_tokens False): how an output parser sees its delimiters when they are
        special tokens while every other special token is skipped as the request asked."""
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer: no Python per token
        self._skip = skip_special_tokens
        self._skip_ids = skip_ids
        self._parts: list[str] = []
        self._window: list[int] = []
        self._context_len = 0  # how many leading window tokens were already emitted
        self._context_text = ""
        self._start_context(prompt_token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def _start_context(self, prompt_token_ids: Sequence[int]) -> None:
        context = self._kept(prompt_token_ids[-_PROMPT_CONTEXT:])
        text = self._decode(context)
        if text.endswith(_REPLACEMENT):
            # The prompt ends inside a character, so the first output bytes would finish the
            # prompt's character rather than start their own; decode the output on its own.
            return
        self._window = context
        self._context_len = len(context)
        self._context_text = text

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds generated tokens; returns the text that is now stable (may be "")."""
        self._window.extend(self._kept(token_ids))
        text = self._decode(self._window)
        if len(text) <= len(self._context_text) or text.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or an unfinished character at the end
        return self._emit(text)

    def _kept(self, ids: Sequence[int]) -> list[int]:
        if not self._skip_ids:
            return list(ids)
        return [i for i in ids if i not in self._skip_ids]

    def flush(self) -> str:
        """At the end of generation: everything still held back, unfinished bytes included."""
        text = self._decode(self._window)
        if len(text) <= len(self._context_text):
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        # Decoders only append as the window grows, so the window's text begins with its
        # context's text and the remainder is new.
        delta = text[len(self._context_text) :]
        self._window = self._window[self._context_len :]
        self._context_len = len(self._window)
        self._context_text = self._decode(self._window)
        self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]  # join lazily, once per read
        return self._parts[0] if self._parts else ""


def detokenize(
    tokenizer,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    skip_special_tokens: bool = True,
) -> str:
    """The text a stream of the same tokens would add up to, in one call."""
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    detok.push(output_token_ids)
    detok.flush()
    return detok.text
