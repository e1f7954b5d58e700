"""llama4_pythonic and llama4_json: Llama 4's tool-call formats, under vLLM's names.

    llama4_pythonic:  <|python_start|>[get_weather(city="Paris")]<|python_end|>
                      [get_weather(city="Paris"), get_time()]
    llama4_json:      {"name": "get_weather", "parameters": {"city": "Paris"}}

`llama4_pythonic` is `pythonic`, which already reads Llama 4's `<|python_start|>` /
`<|python_end|>` wrapping; `llama4_json` is `llama3_json` (vLLM registers one class under
both names): the output begins with the call object, or `<|python_tag|>` opens calls.
"""

from __future__ import annotations

import json
from typing import Any

from postproc.tool_parsers.base import ToolParser
from postproc.tool_parsers.llama3_json import Llama3JsonToolParser
from postproc.tool_parsers.pythonic import PythonicToolParser
from shared.grammar_parts import special_token_lark


class Llama4PythonicToolParser(PythonicToolParser):
    name = "llama4_pythonic"


class Llama4JsonToolParser(Llama3JsonToolParser):
    name = "llama4_json"
    # Text unless the model's vocabulary has it as a special token: Lark's `<|python_tag|>`
    # would not compile for a vocabulary without it.
    begin_lark = json.dumps("<|python_tag|>")

    @classmethod
    def for_vocabulary(cls, tokenizer: Any) -> type[ToolParser]:
        token = special_token_lark(tokenizer, "<|python_tag|>")
        if token is None:
            return cls
        return type(cls.__name__, (cls,), {"__module__": cls.__module__, "begin_lark": token})
