"""The engine's raw logprob buffers -> entries with token text, for the OpenAI shapes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shared.protocol import LogprobEntry, TokenLogprobs, TopLogprob

FORBIDDEN_LOGPROB = -9999.0


class TokenTexts:
    """id -> the token's own text, decoded once per id and remembered."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def token_id_name(token_id: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids names it."""
    return f"token_id:{token_id}"


def logprob_entries(
    token_ids: np.ndarray, raw: TokenLogprobs, texts: Callable[[int], str]
) -> list[LogprobEntry]:
    """`texts`: a token id's text (TokenTexts), or its name (token_id_name)."""
    chosen = np.frombuffer(raw.token_logprobs, dtype="<f4")
    count = len(chosen)
    top_ids = np.frombuffer(raw.top_ids, dtype="<i4").reshape(count, -1)
    # A token a grammar forbids has logprob -inf, which JSON cannot carry (it would become
    # null); report it as -9999.0, as vLLM does.
    top_lps = np.maximum(np.frombuffer(raw.top_logprobs, dtype="<f4").reshape(count, -1),
                         FORBIDDEN_LOGPROB)
    ranks = np.frombuffer(raw.ranks, dtype="<i4") if raw.ranks else np.zeros(count, "<i4")
    entries = []
    for i in range(count):
        token_id = int(token_ids[i])
        top = [
            TopLogprob(int(t), texts(int(t)), float(lp))
            for t, lp in zip(top_ids[i], top_lps[i], strict=True)
        ]
        entries.append(LogprobEntry(token_id, texts(token_id), float(chosen[i]), top,
                                    int(ranks[i])))
    return entries
