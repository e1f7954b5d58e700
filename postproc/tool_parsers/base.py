"""What every tool-call parser shares: the data shapes, call ids, and the streaming machinery.

A parser instance holds one request's state. `feed(delta_text)` takes the next piece of
detokenized output (after the reasoning parser, if any, has taken its part) and returns what
can no longer change (req O-2): content text, and tool calls as OpenAI streaming deltas.
`finish()` flushes what was held back. `parse(text)` is the one-shot form, for non-streaming
responses; it runs the same machine on the whole text, so a streamed request and a
non-streamed one always agree, however the text was split.

A call opens with a header delta (index, id, type "function", the function name, empty
arguments). In the formats that write the name before a JSON arguments object (hermes and
llama3_json's `{"name": ..., "arguments": {...}}`, mistral's `name[ARGS]{...}`) the
arguments then follow in fragments as the model writes them, each a piece that can no
longer change (`call_json.call_head`, `_open_call`, `_call_args`): once the header is out the
call stays a call, unfinished or not. Other formats, and calls that do not begin with
their name, are emitted whole when complete, as a header and one arguments delta (then the
arguments are normalised JSON, `json.dumps` with non-ASCII kept); a call of those that never
finishes or is broken comes back as content. Either way the streamed result equals the
one-shot result exactly.

Content rules, shared by all formats:
- Delimiters (`<tool_call>`, `[TOOL_CALLS]`, ...) never appear in content, whole or in part:
  a possible prefix of one at the end of the text is held back until it is decided.
- Whitespace that only separates content from a call, or calls from each other, is not
  content ("Let me check.\\n\\n<tool_call>..." gives content "Let me check."). Output without
  calls comes back exactly as generated.
- Text that fails to become a call (broken JSON, unfinished at the end) is content, with the
  delimiters taken out: it is not lost.
"""

from __future__ import annotations

import hashlib
import secrets
import string
from typing import Any, ClassVar

import msgspec

# The deltas travel from postproc workers to frontends, so the wire protocol defines them.
from postproc.markers import find_first, partial_suffix_len
from shared.protocol import FunctionCallDelta, ToolCallDelta
from shared.tool_specs import tools_by_name

_ALNUM = string.ascii_letters + string.digits


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ToolDelta(msgspec.Struct):
    content: str = ""
    calls: list[ToolCallDelta] = msgspec.field(default_factory=list)


class ParsedTools(msgspec.Struct):
    content: str | None  # None when there is none (OpenAI's shape for a tool-call message)
    calls: list[ToolCall]


class ToolParser:
    """Base class: subclasses implement `_step` (and `_reset`) for their format."""

    name: ClassVar[str] = ""
    # Strings that never appear in content (removed from fallback text too).
    delimiters: ClassVar[tuple[str, ...]] = ()
    id_length: ClassVar[int] = 24
    id_prefix: ClassVar[str] = "call_"
    # Grammar side (req C-1 to C-3), used by the frontend to force calls with llguidance.
    # `begin_marker`: the text that opens a call; a named tool_choice injects it after the
    # prompt. `begin_lark`: the same as a Lark expression (a string literal, or `<|...|>` for
    # a special token). `next_call_lark`: what comes between one call and the next.
    # Empty `begin_lark`: this format has no grammar (forced calls are refused).
    begin_marker: ClassVar[str] = ""
    begin_lark: ClassVar[str] = ""
    next_call_lark: ClassVar[str] = ""
    # `end_lark`: what closes a run of calls after the last one (pythonic's `]`); empty when
    # each call closes itself. `calls_at_start`: calls count only at the start of the output
    # (after whitespace), so a strict grammar lets the output open with calls or be text that
    # does not begin with `begin_marker`, instead of triggering on the marker anywhere.
    end_lark: ClassVar[str] = ""
    calls_at_start: ClassVar[bool] = False

    @classmethod
    def for_vocabulary(cls, tokenizer: Any) -> type[ToolParser]:
        """This class, or a subclass whose grammar side names the model's special tokens.

        `tokenizer`: llguidance's LLTokenizer for the model, or None. A format whose markers
        are special tokens that llguidance's Lark cannot name (`[TOOL_CALLS]`: only `<|...|>`
        style names work, anything else needs the token id, `<[9]>`) spells them by id here.
        """
        return cls

    @classmethod
    def strict_start_lark(cls) -> str | None:
        """Lark rules for `start` of a strict-tools grammar when the format needs its own
        (Harmony: free messages between calls are themselves special-token markup); None:
        the frontend's generic ones."""
        return None

    @classmethod
    def call_grammar(cls, functions: dict[str, Any], *, strict: bool) -> str | None:
        """Lark rules defining `call`: what follows `begin_marker` in one call of one of
        `functions` (name -> JSON schema of its arguments), up to the end of the call.
        `strict`: every keyword of the schemas must be enforced (else unsupported ones are
        skipped). None when this format has no grammar."""
        return None

    def __init__(
        self,
        tools: list[Any] | None = None,
        *,
        call_id_seed: str | None = None,
        prefill: str = "",
    ):
        """`tools`: the request's OpenAI tools (may be empty).

        `call_id_seed`: when given (e.g. the request id), call ids are derived from it and the
        call's index, so a replay of the same request on another worker produces the same
        ids; otherwise they are random.

        `prefill`: text the server put after the rendered prompt that the output continues,
        such as a forced call's opening (`<tool_call>\n{"name": "f", "arguments": `, req
        C-3). It is parsed as the start of the output but never returned as content.
        """
        self._tools_arg = tools
        self.tools = tools_by_name(tools)
        self._call_id_seed = call_id_seed
        self._prefill = prefill
        self._buf = ""  # text received but not yet decided
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._held_ws = ""  # trailing whitespace of content: kept only if content follows
        self._after_call = False
        self._num_calls = 0
        self._finished = False
        self._truncated = False  # finish(truncated=True): the output ran out of tokens
        self._open_index: int | None = None  # a call whose arguments are streaming
        self._dropped = False  # unfinished call markup was dropped at that finish
        self._reset()
        if prefill:  # whatever it completes on its own is not model output
            self._buf = prefill
            while self._step(False):
                pass
            if self._open_index is None:
                self._content, self._deltas, self._num_calls = [], [], 0
            else:  # the prefill opened a call: its header belongs to the output
                self._content = []
            self._held_ws, self._after_call = "", False

    # -- the public interface ------------------------------------------------------------

    def feed(self, delta_text: str) -> ToolDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if delta_text:
            self._buf += delta_text
            while self._step(False):
                pass
        return self._take()

    def finish(self, truncated: bool = False) -> ToolDelta:
        """Flushes what was held back. `truncated`: the output was cut by max_tokens
        (finish_reason "length"), so call markup it ends inside (a partial begin marker, a
        call still being written) was never finished: it is not content, and only what was
        parsed of it comes back (req O-6)."""
        if not self._finished:
            self._finished = True
            self._truncated = truncated
            while self._step(True):
                pass
            if self._buf:  # a subclass left text undecided: it is content
                self._text(self._buf[: len(self._buf) - self._cut_marker(self._buf)])
                self._buf = ""
            # Whitespace before a call, or before markup cut short, only separated them.
            if self._held_ws and not self._after_call and not self._dropped:
                self._content.append(self._held_ws)
            self._held_ws = ""
        return self._take()

    def parse(self, text: str, truncated: bool = False) -> ParsedTools:
        """One-shot parse of a whole output, on fresh state (this instance is untouched)."""
        fresh = type(self)(
            self._tools_arg, call_id_seed=self._call_id_seed, prefill=self._prefill
        )
        first, last = fresh.feed(text), fresh.finish(truncated)
        return collect([first, last])

    @property
    def num_calls(self) -> int:
        """Calls emitted so far (e.g. to pick finish_reason "tool_calls")."""
        return self._num_calls

    # -- for subclasses --------------------------------------------------------------------

    def _reset(self) -> None:
        """Sets the format's own initial state."""

    def _step(self, final: bool) -> bool:
        """Consumes what it can decide from `self._buf`, calling `_text` / `_call`.

        Returns True to be called again (progress made, state changed). With `final`, nothing
        more will come: everything must be decided.
        """
        raise NotImplementedError

    def _content_until(
        self, markers: tuple[str, ...], final: bool, hold: tuple[str, ...] | None = None
    ) -> str | None:
        """Emit buffered content up to the first of `markers` and consume that marker;
        returns it. With none found, emit everything that cannot be the start of one of
        `hold` (default: the markers), keep the rest for later, and return None."""
        buf = self._buf
        i, marker = find_first(buf, markers)
        if i >= 0:
            self._text(buf[:i])
            self._buf = buf[i + len(marker):]
            return marker
        keep = 0 if final else partial_suffix_len(buf, hold or markers)
        if final and self._truncated:  # a marker cut short by max_tokens: not content
            cut = partial_suffix_len(buf, hold or markers)
            if cut:
                buf, self._dropped = buf[: len(buf) - cut], True
        if len(buf) > keep:
            self._text(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
        else:
            self._buf = buf
        return None

    def _cut_marker(self, text: str) -> int:
        """How much of the end of `text` to drop at a truncated finish: a partial
        delimiter the output ran out of tokens in."""
        cut = partial_suffix_len(text, self.delimiters) if self._truncated else 0
        self._dropped = self._dropped or cut > 0
        return cut

    def _opening(self, tag: str, opener: str, final: bool) -> str | None:
        """How the output begins, after whitespace, for a format whose calls come first:
        "tag" when with `tag` (then taken off the buffer, with the whitespace), "calls" when
        with `opener` (the calls' first character), "content" otherwise or when the output
        is empty; None while that is undecided (nothing yet, or what may become `tag`)."""
        rest = self._buf.lstrip()
        if not rest:
            return "content" if final else None
        if rest.startswith(tag):
            self._buf = rest[len(tag):]
            return "tag"
        if tag.startswith(rest) and not final:
            return None
        return "calls" if rest[0] == opener else "content"

    def _drop_unfinished(self, final: bool) -> bool:
        """At a truncated finish, inside a call that was still being written: drop its
        text (call markup is never content). True when it did."""
        if final and self._truncated:
            self._buf, self._dropped = "", True
            return True
        return False

    def _text(self, text: str) -> None:
        for delimiter in self.delimiters:
            if delimiter in text:
                text = text.replace(delimiter, "")
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            self._content.append(body)

    def _call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        self._held_ws = ""
        self._after_call = True
        index = self._num_calls
        self._num_calls += 1
        self._deltas.append(ToolCallDelta(
            index=index, id=call_id or self._make_id(index), type="function",
            function=FunctionCallDelta(name=name, arguments=""),
        ))
        self._deltas.append(
            ToolCallDelta(index=index, function=FunctionCallDelta(arguments=arguments))
        )

    def _open_call(self, name: str, call_id: str | None = None) -> None:
        """A call whose arguments follow as they are written (`_call_args`): its header
        (index, id, type, name, empty arguments) goes out now."""
        self._held_ws = ""
        self._after_call = True
        index = self._open_index = self._num_calls
        self._num_calls += 1
        self._deltas.append(ToolCallDelta(
            index=index, id=call_id or self._make_id(index), type="function",
            function=FunctionCallDelta(name=name, arguments=""),
        ))

    def _call_args(self, fragment: str) -> None:
        """The next piece of the open call's arguments, as the model wrote it."""
        if fragment and self._open_index is not None:
            self._deltas.append(ToolCallDelta(
                index=self._open_index, function=FunctionCallDelta(arguments=fragment)))

    def _close_call(self) -> None:
        self._open_index = None

    def _make_id(self, index: int) -> str:
        n = self.id_length
        if self._call_id_seed is None:
            body = "".join(secrets.choice(_ALNUM) for _ in range(n))
        else:
            digest = hashlib.sha256(f"{self._call_id_seed}\0{index}".encode()).digest()
            number = int.from_bytes(digest, "big")
            chars = []
            for _ in range(n):
                number, r = divmod(number, len(_ALNUM))
                chars.append(_ALNUM[r])
            body = "".join(chars)
        return self.id_prefix + body

    def _take(self) -> ToolDelta:
        out = ToolDelta("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return out


def collect(deltas: list[ToolDelta]) -> ParsedTools:
    """Aggregates streamed deltas into the non-streaming result."""
    content = "".join(d.content for d in deltas)
    calls: list[ToolCall] = []
    for delta in deltas:
        for c in delta.calls:
            if c.id is not None:
                calls.append(ToolCall(id=c.id, function=FunctionCall(c.function.name or "", "")))
            if c.function.arguments:
                calls[c.index].function.arguments += c.function.arguments
    return ParsedTools(content or None, calls)
