"""qwen3: Qwen3 style. The output is content unless it opens a `<think>` block, or the prompt
opened one (Qwen3 thinking-2507 templates pre-fill `<think>\n`). With `enable_thinking=False`
the template writes an empty `<think>\n\n</think>\n\n` into the prompt, and the output is all
content."""

from __future__ import annotations

from postproc.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    thinks_by_default = False
