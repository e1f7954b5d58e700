"""The engine's raw logprob buffers -> entries with token text, for the OpenAI shapes."""

from __future__ import annotations

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


def logprob_entries(
    token_ids: np.ndarray, raw: TokenLogprobs, texts: TokenTexts
) -> list[LogprobEntry]:
    chosen = np.frombuffer(raw.token_logprobs, dtype="<f4")
    count = len(chosen)
    top_ids = np.frombuffer(raw.top_ids, dtype="<i4").reshape(count, -1)
    # A token a grammar forbids has logprob -inf, which JSON cannot carry (it would become
    # null); report it as -9999.0, as vLLM does.
    top_lps = np.maximum(np.frombuffer(raw.top_logprobs, dtype="<f4").reshape(count, -1),
                         FORBIDDEN_LOGPROB)
    entries = []
    for i in range(count):
        token_id = int(token_ids[i])
        top = [
            TopLogprob(int(t), texts(int(t)), float(lp))
            for t, lp in zip(top_ids[i], top_lps[i], strict=True)
        ]
        entries.append(LogprobEntry(token_id, texts(token_id), float(chosen[i]), top))
    return entries
