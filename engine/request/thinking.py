"""vLLM's thinking_token_budget: once a request has thought for its budget of tokens, the
engine writes the reasoning parser's end tag (its token ids, one a step), so the answer
starts instead of the model thinking on until max_tokens.

A tracker follows a sequence's output incrementally (only tokens it has not seen yet), so
preemption and recompute change nothing: its state is a function of the output so far.
"""

from __future__ import annotations

import itertools

from shared.protocol import ThinkingBudget


class ThinkingTracker:
    def __init__(self, spec: ThinkingBudget) -> None:
        self.spec = spec
        self.inside = spec.starts_inside  # the prompt may have opened the section
        self.thought = 0  # thinking tokens so far, over every section
        self.seen = 0  # output tokens observed
        self._tail: list[int] = []  # the last few output tokens, to match the tags

    def observe(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Catch up with a sequence's output (token_ids after the prompt; only the part
        not seen yet is read, without copying the rest)."""
        longest = max(len(self.spec.start_ids), len(self.spec.end_ids))
        start = num_prompt_tokens + self.seen
        for token in itertools.islice(token_ids, start, None):
            self._tail = (self._tail + [token])[-longest:]
            if self.inside:
                self.thought += 1
                if self._ends_with(self.spec.end_ids):
                    self.inside = False
            elif self._ends_with(self.spec.start_ids):
                self.inside = True
        self.seen = len(token_ids) - num_prompt_tokens

    def forced(self) -> int | None:
        """The token the next step must produce, or None while the budget lasts."""
        if not self.inside or self.thought < self.spec.budget:
            return None
        end = self.spec.end_ids
        # Continue a partly written end tag rather than start it again.
        written = next((k for k in range(len(end) - 1, 0, -1) if self._ends_with(end[:k])), 0)
        return end[written]

    def _ends_with(self, ids: list[int]) -> bool:
        return len(self._tail) >= len(ids) and self._tail[len(self._tail) - len(ids):] == ids
