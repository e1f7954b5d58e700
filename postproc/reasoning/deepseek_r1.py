"""deepseek_r1: DeepSeek-R1 style. The output starts in the thinking block whether or not it
writes `<think>` (R1 templates pre-fill it), and the block ends at `</think>`. An output
without `</think>` is all reasoning. A prompt that ends after a closed block (thinking turned
off, e.g. DeepSeek-V3.1 with `thinking=False`) makes the output all content."""

from __future__ import annotations

from postproc.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    thinks_by_default = True
