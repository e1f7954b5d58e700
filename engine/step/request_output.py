"""A request's `RequestOutput`: what it has to report since the last one."""

from __future__ import annotations

import numpy as np

from engine.request.sequence import Sequence
from shared.protocol import RequestOutput, TokenLogprobs, pack_ids, pack_tensor


def output_for(seq: Sequence, logprobs: TokenLogprobs | None = None) -> RequestOutput:
    """The request's news since its last output: its new tokens (now reported), its finish
    and, on the first output, its first-token facts and prompt logprobs."""
    start = seq.num_prompt_tokens + seq.num_reported
    new = seq.token_ids[start:]
    is_first = seq.num_reported == 0 and bool(new)
    seq.num_reported += len(new)
    wants = seq.params.logprobs is not None
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=pack_ids(new),
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        error=seq.error,
        error_status=seq.error_status,
        first_token_time=seq.first_token_time if is_first else None,
        num_cached_tokens=seq.num_cached_tokens if is_first else None,
        logprobs=logprobs if new else None,
        prompt_logprobs=prompt_logprobs(seq) if is_first else None,
        cumulative_logprob=seq.cumulative_logprob if wants else None,
        pooled=pack_tensor(seq.pooled) if seq.pooled is not None else None,
    )


def prompt_logprobs(seq: Sequence) -> TokenLogprobs | None:
    """All prompt positions' logprobs; the first token has none (NaN, no alternatives)."""
    n = seq.params.prompt_logprobs
    if n is None:
        return None
    parts = [seq.prompt_logprob_parts[k] for k in sorted(seq.prompt_logprob_parts)]
    chosen = np.concatenate([[np.nan], *(p.chosen for p in parts)]).astype("<f4")
    top_ids = np.concatenate([np.zeros((1, n)), *(p.top_ids for p in parts)]).astype("<i4")
    top_lps = np.concatenate([np.full((1, n), np.nan), *(p.top_logprobs for p in parts)])
    ranks = np.concatenate([[0], *(p.ranks for p in parts)]).astype("<i4")
    return TokenLogprobs(chosen.tobytes(), top_ids.tobytes(), top_lps.astype("<f4").tobytes(),
                         ranks.tobytes())
