"""Model-free speculative decoding (issue 21): n-gram drafts from a sequence's own context,
verified in the step that feeds them.

- Drafting (`NgramProposer`, prompt lookup): the sequence's last n tokens (n from
  prompt_lookup_max down to prompt_lookup_min) are looked up in its own prompt + output; the
  tokens that followed their latest earlier occurrence are the draft, up to k of them.
- When (`Drafter`): only while the engine holds at most `disable_by_batch_size` sequences (a
  bigger batch is compute-bound: extra rows cost what they save), only as many draft tokens
  as keep the step within the rows that cost about what one costs (`step_tokens`: on the
  CPU, the quantized kernels' small-batch path; past it the step reads dense weights), and
  per sequence only while its drafts are accepted: one that keeps failing pauses, then
  probes again; its drafts are as long as the run of accepted tokens its rate predicts, and
  beside other sequences it needs a higher rate (their rows compete with its draft's).
- Verifying: the scheduler gives a drafting sequence a chunk of 1 + k tokens (its last real
  token, then the draft); the model scores every position in one pass, and `verify` turns the
  k + 1 rows into 1 .. k + 1 tokens. Row j is sampled exactly as a decode step would sample
  it, with the sequence's state (penalties, min_tokens, bad words, grammar) advanced over
  the j draft tokens before it, and the draft token is accepted when the sample equals it.
  For a deterministic draft (q a point mass on x) that *is* the rejection rule of the
  literature: x is accepted with probability p(x), and otherwise the sample is distributed
  as p with x removed and renormalised; greedy rows accept exactly when x is the argmax. So
  output follows the distribution of plain decoding, and each output token costs its seeded
  generator one draw, as it does without speculation.
- The engine core appends the tokens one by one through its usual path (grammar, stop ids,
  max_tokens, one output each), so a stop in the middle of a draft ends the request there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from engine.request.grammar import step_masks
from engine.request.records import DraftState, SampledToken
from shared import histograms as h
from shared.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from engine.request.sequence import Sequence

log = logging.getLogger("sluice.engine")

# Only the most recent tokens are searched: a lookup must stay cheap, it runs every step.
LOOKUP_WINDOW = 8192
# Per-sequence fallback: an acceptance rate (moving average) below this pauses its drafts
# for PAUSE_STEPS steps, after which it probes again from PROBE_RATE.
MIN_ACCEPTANCE = 0.3
PAUSE_STEPS = 16
PROBE_RATE = 0.5
# Beside other sequences a draft row is not free (it competes with their rows for compute),
# so there a sequence drafts only at this acceptance rate or better.
BATCHED_MIN_ACCEPTANCE = 0.6
_EMA_WEIGHT = 0.3  # of the newest draft in the moving average


class NgramProposer:
    def __init__(self, num_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.num_tokens = num_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of the
        longest suffix (lookup_min .. lookup_max tokens) of `tokens`; [] without a match."""
        limit = min(limit, self.num_tokens)
        if limit <= 0 or len(tokens) <= self.lookup_min:
            return []
        a = np.asarray(tokens[-LOOKUP_WINDOW:], dtype=np.int64)
        # Candidate ends: earlier positions holding the last token, latest first.
        ends = np.flatnonzero(a[:-1] == a[-1])[::-1]
        ends = ends[ends >= self.lookup_min - 1]
        if len(ends) == 0:
            return []
        # How far back each candidate keeps matching the suffix (at most lookup_max).
        length = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for back in range(1, self.lookup_max):
            at = ends - back
            alive &= at >= 0
            alive[alive] &= a[at[alive]] == a[-1 - back]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.lookup_min:
            return []
        end = int(ends[int(np.argmax(length == best))])  # the latest of the longest
        return a[end + 1 : end + 1 + limit].tolist()


class Drafter:
    """Decides who drafts, proposes, and keeps the counts `/metrics` exports."""

    def __init__(self, config: SpeculativeConfig, step_tokens: int | None = None) -> None:
        """`step_tokens`: drafts fill a step up to this many tokens at most, the rows that
        cost about what one row costs on this device (None: no such bound)."""
        self.config = config
        self.step_tokens = step_tokens
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        # Per verified draft, for /metrics (shared.histograms: vLLM's counters follow).
        self.histograms = h.spec_decode_histograms()

    def room(self, num_running: int, num_waiting: int) -> int:
        """Draft tokens the next step may take in all: none with more sequences in the
        engine than disable_by_batch_size, else what `step_tokens` leaves beside one token
        per running sequence."""
        if num_running + num_waiting > self.config.disable_by_batch_size:
            return 0
        if self.step_tokens is None:
            return self.config.num_speculative_tokens * num_running
        return max(0, self.step_tokens - num_running)

    def propose(self, seq: Sequence, limit: int, batched: bool = False) -> list[int]:
        """The draft for a decoding sequence (at most `limit` tokens), or []. `batched`:
        other sequences share the step."""
        if seq.params.thinking is not None:
            return []  # its tracker reads each token once; drafts would need a rewind
        state = seq.draft_state
        if state is None:
            state = seq.draft_state = DraftState()
        if state.paused:
            state.paused -= 1
            if state.paused == 0:
                state.rate = PROBE_RATE
            return []
        if batched and state.rate < BATCHED_MIN_ACCEPTANCE:
            return []
        return self.proposer.propose(seq.token_ids, min(limit, _worth(state.rate)))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """After verifying: vLLM's spec_decode counts, and the sequence's own record."""
        self.histograms[h.SPEC_DRAFT_TOKENS].observe(proposed)
        self.histograms[h.SPEC_ACCEPTED_TOKENS].observe(accepted)
        state = seq.draft_state
        state.rate = (1 - _EMA_WEIGHT) * state.rate + _EMA_WEIGHT * accepted / proposed
        if state.rate < MIN_ACCEPTANCE:
            state.paused = PAUSE_STEPS


def _worth(rate: float) -> int:
    """Draft tokens worth their rows at this acceptance rate: about the run of accepted
    tokens a draft gets, rate / (1 - rate), and at least one."""
    return max(1, round(rate / max(1e-6, 1 - rate)))


# ---------------------------------------------------------------- verifying


class DraftCheck(msgspec.Struct):
    """One verifying sequence: its draft, the token its real row gave, where its draft rows
    start in the draft logits, and what verifying has accepted after that first token."""

    seq: Sequence
    draft: list[int]
    row: int
    tokens: list[SampledToken] = []  # sampled at draft rows 1 .. (each after an accepted draft)
    applied: int = 0  # draft tokens appended for the moment to seq.token_ids
    consumed: int = 0  # of those, fed to its grammar


Sample = Callable[..., list["SampledToken"]]  # ModelRunner._sample(seqs, logits, masks)


def verify(checks: list[DraftCheck], first: list[SampledToken], logits: torch.Tensor,
           sample: Sample) -> dict[str, list[SampledToken]]:
    """The tokens each sequence gets after `first` (its real row's), by request id: while
    the token drawn at a row equals the draft token there, the next row is drawn too.
    `logits`: the draft rows of every check (row d of a check: after its first d + 1 draft
    tokens). Each round draws with the sequences' state advanced over the accepted draft
    tokens, then puts it back: the core appends the tokens afterwards, as any other."""
    alive = [c for c, t in zip(checks, first, strict=True) if t.token == c.draft[0]]
    try:
        depth = 0
        while alive:
            alive = [c for c in alive if _apply(c, c.draft[depth])]
            if not alive:
                break
            rows = logits[[c.row + depth for c in alive]]
            tokens = sample([c.seq for c in alive], rows, step_masks([c.seq.grammar
                                                                       for c in alive]))
            depth += 1
            survivors = []
            for check, token in zip(alive, tokens, strict=True):
                check.tokens.append(token)
                if depth < len(check.draft) and token.token == check.draft[depth]:
                    survivors.append(check)
            alive = survivors
    except Exception as exc:  # noqa: BLE001 - the tokens drawn so far stand; drafts stop here
        log.warning("verifying drafts failed (%s: %s); keeping what was accepted",
                    type(exc).__name__, exc)
    finally:
        for check in checks:
            _restore(check)
    return {c.seq.request_id: c.tokens for c in checks if c.tokens}


def _apply(check: DraftCheck, token: int) -> bool:
    """Appends an accepted draft token for the next round; False (and nothing appended)
    when its grammar refuses it or has stopped, which cuts the draft there."""
    seq = check.seq
    grammar = seq.grammar
    if grammar is not None:
        # Asked first: a refused token could leave the matcher in error, past rollback.
        if (grammar.is_stopped or grammar.failed
                or grammar.matcher.validate_tokens([token]) < 1 or not grammar.advance(token)):
            return False
        check.consumed += 1
    seq.token_ids.append(token)
    check.applied += 1
    return True


def _restore(check: DraftCheck) -> None:
    seq = check.seq
    if check.applied:
        del seq.token_ids[-check.applied:]
    if check.consumed:
        seq.grammar.matcher.rollback(check.consumed)
    check.applied = check.consumed = 0
