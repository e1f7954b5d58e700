"""mistral: Mistral's `[TOOL_CALLS]`, in both of its spellings.

    before v11 tokenizers:  [TOOL_CALLS] [{"name": "f", "arguments": {...}}, {...}]
    v11 and later:          [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}
    with call ids (v13):    [TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{...}

`[ARGS]` may be missing when the detokenizer dropped it (`name{...}`). Content may come
before the calls and after them. `[TOOL_CALLS]` is a special token: the request must keep
special tokens in the detokenized text (skip_special_tokens=False).

Call ids are 9 letters and digits (no `call_` prefix): Mistral chat templates reject any
other shape when the conversation comes back with the tool results. An id the model wrote
with `[CALL_ID]` is used as is.

Forced calls (req C-1 to C-3) are generated in the v11+ spelling, `[TOOL_CALLS]name[ARGS]{...}`
(what current Mistral templates render and what mistral-common's own grammars produce, with no
`[CALL_ID]`), or, for models of the older templates, `[TOOL_CALLS][{"name": ..., "arguments":
{...}}]` with one call per array; the model picks. `[TOOL_CALLS]` and `[ARGS]` are named by
token id when they are special tokens of the model (`for_vocabulary`), else spelled as text.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, ClassVar

from postproc.markers import partial_suffix_len
from postproc.tool_parsers.base import ToolParser
from postproc.tool_parsers.call_json import call_from_object, parse_json
from postproc.tool_parsers.scanners import JsonValueEnd
from shared.grammar_parts import call_json_schema, json_layout, special_token_lark

_BOT = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]*")
_GRAMMAR_NAME = re.compile(r"[\w.\-]+")  # names the header reads back whole

_TEXT, _AFTER_BOT, _ARRAY, _NAMED = range(4)


class MistralToolParser(ToolParser):
    name = "mistral"
    delimiters = (_BOT, _ARGS, _CALL_ID)
    id_prefix = ""
    id_length = 9
    begin_marker = _BOT
    begin_lark = json.dumps(_BOT)
    next_call_lark = json.dumps(_BOT)
    args_lark: ClassVar[str] = json.dumps(_ARGS)

    @classmethod
    def for_vocabulary(cls, tokenizer: Any) -> type[ToolParser]:
        bot = special_token_lark(tokenizer, _BOT)
        args = special_token_lark(tokenizer, _ARGS)
        if bot is None and args is None:
            return cls
        return _spelled(cls, bot or cls.begin_lark, args or cls.args_lark)

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        named = []
        for i, (name, schema) in enumerate(functions.items()):
            if not _GRAMMAR_NAME.fullmatch(name):
                raise ValueError(f"the mistral format cannot spell the function name {name!r}")
            arguments = json.dumps(json_layout(schema, strict=strict), ensure_ascii=False)
            named.append(f"mistral_call_{i}: {json.dumps(name)} {cls.args_lark} "
                         f"%json {arguments}")
        array = json.dumps(call_json_schema(functions, "arguments", strict=strict),
                           ensure_ascii=False)
        alternatives = " | ".join(f"mistral_call_{i}" for i in range(len(named)))
        return (f"call: {alternatives} | mistral_array\n" + "\n".join(named)
                + f'\nmistral_array: " "? "[" %json {array} "]"\n')

    def _reset(self) -> None:
        self._mode = _TEXT
        self._scanner: JsonValueEnd | None = None

    def _fallback(self) -> bool:
        """The text after [TOOL_CALLS] is not a call: read it again as content."""
        self._scanner = None
        self._mode = _TEXT
        return True

    def _unfinished(self, final: bool) -> bool:
        """At the end inside a call: cut by max_tokens, its text is dropped; else content."""
        if self._drop_unfinished(final):
            self._scanner = None
            self._mode = _TEXT
            return False
        return self._fallback() if final else False

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._mode == _TEXT:
            if self._content_until((_BOT,), final, hold=self.delimiters) is None:
                return False
            self._mode = _AFTER_BOT
            return True
        if self._mode == _AFTER_BOT:
            rest = buf.lstrip()
            if not rest:
                if final:
                    self._buf = ""
                return False
            self._mode = _ARRAY if rest[0] in "[{" and not rest.startswith(_ARGS) else _NAMED
            return True
        if self._mode == _ARRAY:
            if self._scanner is None:
                self._array_start = len(buf) - len(buf.lstrip())
                self._scanner = JsonValueEnd(self._array_start)
            end = self._scanner.scan(buf)
            if end is None:
                return self._unfinished(final)
            calls = _array_calls(buf[self._array_start:end])
            if calls is None:
                return self._fallback()
            self._scanner = None
            for name, arguments in calls:
                self._call(name, arguments)
            self._buf = buf[end:]
            self._mode = _TEXT
            return True
        return self._named(buf, final)

    def _named(self, buf: str, final: bool) -> bool:
        """`name[ARGS]{...}`: the header goes out once the name and the arguments' `{` are
        there, then the arguments as the model writes them (each piece final); an output
        that ends inside them leaves the call as far as it went."""
        if self._scanner is None:
            header = _header(buf, final)
            if header is _WAIT:
                return False
            if header is _FAIL:
                return self._unfinished(True) if final else self._fallback()
            name, call_id, args_start = header
            self._scanner = JsonValueEnd(args_start)
            self._sent = args_start
            self._open_call(name, call_id)
        end = self._scanner.scan(buf)
        upto = self._scanner.pos if end is None else end
        self._call_args(buf[self._sent:upto])
        self._sent = upto
        if end is None and not final:
            return False
        self._close_call()
        self._scanner = None
        self._buf = "" if end is None else buf[end:]
        self._mode = _TEXT
        return end is not None


@lru_cache(maxsize=16)
def _spelled(cls: type[MistralToolParser], bot: str, args: str) -> type[MistralToolParser]:
    """`cls` with its markers spelled `bot` and `args` in grammars (token ids)."""
    return type(cls.__name__, (cls,), {
        "__module__": cls.__module__, "begin_lark": bot, "next_call_lark": bot,
        "args_lark": args,
    })


_WAIT = object()
_FAIL = object()


def _header(buf: str, final: bool):
    """`name[CALL_ID]id[ARGS]` -> (name, call id or None, where the arguments' `{` is),
    or _WAIT while it may still become one, or _FAIL when it cannot."""
    start = len(buf) - len(buf.lstrip())
    pos = _NAME.match(buf, start).end()
    name = buf[start:pos]
    call_id = None
    if buf.startswith(_CALL_ID, pos):
        id_start = pos + len(_CALL_ID)
        id_end = buf.find(_ARGS, id_start)
        if id_end < 0:
            tail = buf[id_start:]
            body = tail[: len(tail) - partial_suffix_len(tail, (_ARGS,))]
            if final or not (body == "" or body.isalnum()):
                return _FAIL
            return _WAIT
        call_id = buf[id_start:id_end]
        if not call_id.isalnum():
            return _FAIL
        pos = id_end + len(_ARGS)
    elif buf.startswith(_ARGS, pos):
        pos += len(_ARGS)
    else:
        rest = buf[pos:]
        if not rest or _ARGS.startswith(rest) or _CALL_ID.startswith(rest):
            return _FAIL if final else _WAIT  # the name, or its marker, is still arriving
        if rest[0] != "{":
            return _FAIL
    stripped = buf[pos:].lstrip()
    if not stripped:
        return _FAIL if final else _WAIT
    if stripped[0] != "{" or not name:
        return _FAIL
    return name, call_id, len(buf) - len(stripped)


def _array_calls(text: str) -> list[tuple[str, str]] | None:
    try:
        value = parse_json(text)
    except ValueError:
        return None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        return None
    calls = [call_from_object(item) for item in value]
    if any(call is None for call in calls):
        return None
    return calls
