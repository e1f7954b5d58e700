"""Stop strings under beam search: a beam whose text reaches one ends there, as a stop id
ends it, and its answer is cut as the sampling path cuts it.

Each step, every continuation the search ranks (`BeamSearch.candidates`) that no stop id
ends is decoded and matched, so a beam finishes on the token that completes a stop string
(and, among the best `width`, joins the finished beams, scored at that length). Its text
is then cut by the sampling path's own matcher (`postproc.stop_strings.StopMatcher`): at
the earliest stop string, which stays in only with include_stop_str_in_output, and no
match may end inside the text of the first min_tokens tokens (that gate comes first).
"""

from __future__ import annotations

import asyncio

import msgspec

from frontend.pipeline.beam_search import Beam
from frontend.pipeline.serving_context import ServingContext
from postproc.stop_strings import StopMatcher


class BeamStops(msgspec.Struct, frozen=True):
    stops: list[str]
    include_stop: bool  # include_stop_str_in_output
    min_tokens: int = 0
    skip_special_tokens: bool = True

    async def matches(self, ctx: ServingContext, beams: list[Beam],
                      stop_ids: frozenset[int]) -> list[str | None]:
        """The stop string each candidate's text ends on (None: none, or a stop id ends it
        already)."""
        async def one(beam: Beam) -> str | None:
            if beam.tokens[-1] in stop_ids:
                return None
            return (await self.cut(ctx, beam.tokens))[1]

        return list(await asyncio.gather(*(one(b) for b in beams)))

    async def cut(self, ctx: ServingContext, ids: list[int]) -> tuple[str, str | None]:
        """(the text of `ids` up to the earliest stop string, that string or None)."""
        text = await ctx.tokenization.decode(ids, self.skip_special_tokens)
        gated = min(self.min_tokens, len(ids))
        floor = 0
        if gated:
            early = await ctx.tokenization.decode(ids[:gated], self.skip_special_tokens)
            floor = len(early) if text.startswith(early) else min(len(early), len(text))
        matcher = StopMatcher(self.stops, self.include_stop)
        head = matcher.feed(text[:floor], gated=True)[0] if floor else ""
        rest, matched = matcher.feed(text[floor:])
        if matched is None:
            rest += matcher.flush()
        return head + rest, matched
