"""The think-tag parsers of issue 52's families, under vLLM's names.

deepseek_v3: DeepSeek-V3 / V3.1 / V3.2. V3 writes no thinking; V3.1's template decides by
its `thinking` switch, writing `<think>` (thinking) or `</think>` (not) at the end of the
prompt. So the output is content unless the prompt opened a block or the model writes
`<think>` (vLLM: R1's parser with `thinking=True`, else none).

glm45: GLM-4.5 / 4.6 write `<think>...</think>` themselves; `enable_thinking=False` writes
an empty `<think></think>` into the prompt. An output without `<think>` is content.

kimi_k2: Kimi K2 Thinking. The output starts in thinking (as vLLM, which defaults to R1's
parser); `</think>` ends it, and so does a tool-call section the model opens without closing
the thinking (`<|tool_calls_section_begin|>`, kept in the content for the tool parser).

granite: Granite 3.2+ with `thinking=True`: "Here is my thought process:" opens the
reasoning and "Here is my response:" the answer ("Here's" spellings too). An output that
does not write the first is content.
"""

from __future__ import annotations

from postproc.reasoning.base import ReasoningParser


class DeepSeekV3ReasoningParser(ReasoningParser):
    name = "deepseek_v3"
    thinks_by_default = False


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"
    thinks_by_default = False


class KimiK2ReasoningParser(ReasoningParser):
    name = "kimi_k2"
    thinks_by_default = True
    content_starts = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    start_tag = "Here is my thought process:"
    end_tag = "Here is my response:"
    start_alternatives = ("Here's my thought process:",)
    end_alternatives = ("Here's my response:",)
