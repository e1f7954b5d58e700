"""docs/openai-compat.md cannot drift from the request models (req P-1): every field of every
request Struct has exactly one row, nothing else does, and the statuses agree with the
rejected and ignored lists the server enforces."""

import pathlib
import re

import msgspec
import pytest

from frontend.base import api_models
from frontend.base.api_models import (
    ACCEPTED_AND_IGNORED,
    CHAT_UNSUPPORTED_WHEN_SET,
    COMPLETION_UNSUPPORTED_WHEN_SET,
    UNSUPPORTED_WHEN_SET,
)

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "openai-compat.md"
STATUSES = {"supported", "ignored", "rejected"}
ROW = re.compile(r"^\| `([a-z_]+)` \| (\w+) \| .*\|$")

# Section heading -> (request Struct, the unsupported fields enforced for it, or None when the
# section's statuses are enforced elsewhere: the renderer for messages and content parts).
SECTIONS = {
    "`/v1/chat/completions`": (
        api_models.ChatCompletionRequest, UNSUPPORTED_WHEN_SET + CHAT_UNSUPPORTED_WHEN_SET),
    "`/v1/completions`": (
        api_models.CompletionRequest, UNSUPPORTED_WHEN_SET + COMPLETION_UNSUPPORTED_WHEN_SET),
    "`stream_options`": (api_models.StreamOptions, ()),
    "`messages[]`": (api_models.ChatMessage, None),
    "Content parts (`messages[].content[]`)": (api_models.ContentPart, None),
    "`/tokenize`": (api_models.TokenizeRequest, ()),
    "`/detokenize`": (api_models.DetokenizeRequest, ()),
}


def parse(text: str) -> dict[str, dict[str, str]]:
    """{section heading: {field: status}} from the doc's tables."""
    sections: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), {})
            continue
        match = ROW.match(line)
        if match:
            assert current is not None, f"a table row before any section: {line}"
            field, status = match.groups()
            assert field not in current, f"{field} listed twice"
            current[field] = status
        elif line.startswith("| `"):
            pytest.fail(f"a table row the checker cannot read: {line}")
    return sections


@pytest.fixture(scope="module")
def doc() -> dict[str, dict[str, str]]:
    return parse(DOC.read_text(encoding="utf-8"))


def test_every_section_is_there(doc):
    assert set(SECTIONS) <= set(doc)


@pytest.mark.parametrize("section", SECTIONS)
def test_rows_are_exactly_the_struct_fields(doc, section):
    struct, _ = SECTIONS[section]
    fields = {f.encode_name for f in msgspec.structs.fields(struct)}
    rows = doc[section]
    assert set(rows) - fields == set(), f"{section}: rows for fields the server does not know"
    assert fields - set(rows) == set(), f"{section}: fields missing from the doc"
    assert set(rows.values()) <= STATUSES


@pytest.mark.parametrize("section", SECTIONS)
def test_rejected_and_ignored_agree_with_the_code(doc, section):
    struct, unsupported = SECTIONS[section]
    if unsupported is None:
        return
    fields = {f.name for f in msgspec.structs.fields(struct)}
    rows = doc[section]
    rejected = {field for field, _ in unsupported} & fields
    assert {f for f, s in rows.items() if s == "rejected"} == rejected
    ignored = ACCEPTED_AND_IGNORED & fields
    assert {f for f, s in rows.items() if s == "ignored"} == ignored


def test_the_lists_name_real_fields():
    every = set()
    for struct, _ in SECTIONS.values():
        every |= {f.name for f in msgspec.structs.fields(struct)}
    lists = UNSUPPORTED_WHEN_SET + CHAT_UNSUPPORTED_WHEN_SET + COMPLETION_UNSUPPORTED_WHEN_SET
    assert {field for field, _ in lists} <= every
    assert ACCEPTED_AND_IGNORED <= every
    assert not ACCEPTED_AND_IGNORED & {field for field, _ in lists}


def test_parser_catches_drift():
    broken = "## `/v1/completions`\n| Field | Status | Notes |\n|---|---|---|\n" \
             "| `prompt` | supported | x |\n| `sufix` | rejected | typo |\n"
    rows = parse(broken)["`/v1/completions`"]
    fields = {f.name for f in msgspec.structs.fields(api_models.CompletionRequest)}
    assert "sufix" in set(rows) - fields
