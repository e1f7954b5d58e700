"""Stop strings on detokenized text, with hold-back (req P-9, O-2, O-3).

Text that could still be the start of a stop string is held back (at most the longest stop
string minus one character), so a client never sees a prefix of a stop string that later
turns out to match.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        # How much of `pending` came from tokens before min_tokens: a match must end past it.
        self.floor = 0

    def feed(self, text: str, gated: bool = False) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string that matched or None).

        `gated`: the text comes from tokens min_tokens still holds (req P-9: the min_tokens
        gate comes before stop strings), so no match may end inside it; a stop string that
        begins there and ends in later text still counts, as in vLLM."""
        self.pending += text
        match = None
        if gated:
            self.floor = len(self.pending)
        else:
            match = self._earliest_match()
        if match is not None:
            index, stop = match
            end = index + len(stop) if self.include_stop else index
            out, self.pending, self.floor = self.pending[:end], "", 0
            return out, stop
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.floor = max(0, self.floor - cut)
        return out, None

    def flush(self) -> str:
        out, self.pending, self.floor = self.pending, "", 0
        return out

    def _earliest_match(self) -> tuple[int, str] | None:
        best = None
        for stop in self.stops:
            index = self.pending.find(stop, max(0, self.floor - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best
