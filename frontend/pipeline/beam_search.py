"""Beam search's bookkeeping, as transformers' `generate(num_beams=..., do_sample=False)`.

Pure logic, no I/O: `BeamSearch.advance` takes, for every running beam, the best next tokens
with their log-probabilities (the engine's one-token answers, `beam_runner`), and keeps the
`width` best running beams and the `width` best finished ones. The rules are transformers'
(its vectorised `_beam_search`, 4.50 on), so the answers match it token for token:

- each step the (1 + number of stop ids) * width best continuations over all beams are
  ranked by summed logprob; the best `width` that hit no stop continue;
- of the best `width`, those that end (a stop id, max_tokens reached, or a stop string the
  caller found in its text: `take`'s `text_stops`) are finished, scored summed logprob /
  generated_length ** length_penalty (the stop token counted);
- `early_stopping` true: stop once `width` beams finished; false: stop once the best running
  beam, scored at its current length, cannot beat the worst finished one; "never": the same,
  but scored at max_tokens when length_penalty > 0 (longer can only score better then).

Sums are float32, as transformers' scores, so near-ties rank the same.
"""

from __future__ import annotations

import msgspec
import numpy as np

from shared.protocol import LogprobEntry, TopLogprob


class BeamSettings(msgspec.Struct, frozen=True):
    width: int  # beams kept (n, or best_of where the completions API asks it)
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and stop_token_ids
    min_tokens: int = 0  # no stop id ends a beam before this many tokens

    @property
    def keep(self) -> int:
        """Continuations ranked each step: enough that `width` survive every stop."""
        return max(2, 1 + len(self.stop_ids)) * self.width

    @property
    def num_top(self) -> int:
        """Alternatives to ask per beam: `keep`, plus the stop ids dropped under min_tokens."""
        return self.keep + (len(self.stop_ids) if self.min_tokens else 0)


class Beam(msgspec.Struct):
    tokens: list[int]
    logprob: float  # summed over tokens (float32)
    entries: list[LogprobEntry]  # per token: its logprob and the step's alternatives
    score: float = 0.0  # finished beams: logprob / len ** length_penalty
    stopped: bool = False  # ended by a stop id (else by max_tokens or a stop string)
    stop_string: str | None = None  # ended by this stop string in its text


def _add32(a: float, b: float) -> float:
    return float(np.float32(a) + np.float32(b))


class BeamSearch:
    """One prompt's search; `running` are the beams to extend next, `done` when to stop."""

    def __init__(self, settings: BeamSettings) -> None:
        self.settings = settings
        self.running: list[Beam] = [Beam([], 0.0, [])]
        self.finished: list[Beam] = []  # best first, at most width
        self.improvable = True
        self.done = settings.max_tokens < 1
        self.generated = 0

    def advance(self, steps: list[LogprobEntry]) -> None:
        """One step: `steps[b]` is running beam b's next-token entry (its `top` the best
        alternatives, best first)."""
        self.take(self.candidates(steps))

    def candidates(self, steps: list[LogprobEntry]) -> list[Beam]:
        """The step's `keep` best continuations, best first (`advance`'s first half: a
        caller with stop strings reads their text before `take`)."""
        return [self._grow(b, t, total, steps[b]) for total, b, t in self._ranked(steps)]

    def take(self, grown: list[Beam], text_stops: list[str | None] | None = None) -> None:
        """The step's second half: `text_stops[j]`, the stop string candidate j's text
        ends on (None: none), ends it as a stop id would."""
        s = self.settings
        length = self.generated + 1
        text_stops = text_stops or [None] * len(grown)
        ends = [b.tokens[-1] in s.stop_ids or length >= s.max_tokens or m is not None
                for b, m in zip(grown, text_stops, strict=True)]
        for j, (beam, end) in enumerate(zip(grown, ends, strict=True)):
            if j < s.width and end:
                beam.score = float(np.float32(beam.logprob) / (length ** s.length_penalty))
                beam.stopped = beam.tokens[-1] in s.stop_ids
                beam.stop_string = None if beam.stopped else text_stops[j]
                self.finished.append(beam)
        self.finished.sort(key=lambda b: b.score, reverse=True)  # stable: earlier first
        del self.finished[s.width:]
        self.running = [b for b, end in zip(grown, ends, strict=True) if not end][: s.width]
        self.generated = length
        self._check_done(all(ends))

    def _ranked(self, steps: list[LogprobEntry]) -> list[tuple[float, int, TopLogprob]]:
        """The `keep` best (summed logprob, beam, token) continuations, best first; ties keep
        beam order, as a top-k over the flattened scores."""
        s = self.settings
        early = self.generated < s.min_tokens
        options = [
            (_add32(beam.logprob, t.logprob), b, t)
            for b, (beam, step) in enumerate(zip(self.running, steps, strict=True))
            for t in step.top
            if not (early and t.token_id in s.stop_ids)
        ]
        options.sort(key=lambda o: o[0], reverse=True)
        return options[: s.keep]

    def _grow(self, b: int, t: TopLogprob, total: float, step: LogprobEntry) -> Beam:
        beam = self.running[b]
        entry = LogprobEntry(t.token_id, t.token, t.logprob, step.top)
        return Beam(beam.tokens + [t.token_id], total, beam.entries + [entry])

    def _check_done(self, all_ended: bool) -> None:
        s = self.settings
        full = len(self.finished) == s.width
        if full and self.running:
            if s.early_stopping == "never" and s.length_penalty > 0:
                best_length = s.max_tokens  # longer only scores better: assume the longest
            else:
                best_length = self.generated
            best = np.float32(self.running[0].logprob) / (best_length ** s.length_penalty)
            self.improvable = self.improvable and bool(best > self.finished[-1].score)
        self.done = (all_ended or not self.running or not self.improvable
                     or (full and s.early_stopping is True))

    def best(self, n: int) -> list[Beam]:
        """The n best finished beams, best first."""
        return self.finished[:n]
