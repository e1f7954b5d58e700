"""What the Responses handlers share (their records, the background runner, the
conversations, the keys that own objects), and the write every finished response makes: its
items join its conversation."""

from __future__ import annotations

import logging

import msgspec

from frontend.base.errors import APIError
from frontend.responses.background import BackgroundRunner
from frontend.responses.conversations import ConversationRecords
from frontend.responses.models import ResponseObject
from frontend.responses.stored import ResponseRecords, StoredResponse
from frontend.state.store import StoreUnavailable

log = logging.getLogger("sluice.frontend.responses")


class Responses(msgspec.Struct):
    """What the routes share: the records, the background runner, the conversations, the keys
    that own objects."""

    records: ResponseRecords
    runner: BackgroundRunner
    conversations: ConversationRecords
    keys: frozenset[str] = frozenset()  # API keys; where set, each owns what it stores


async def add_to_conversation(responses: Responses, record: StoredResponse,
                               response: ResponseObject) -> None:
    """A finished response's input and output items join its conversation. The answer is
    made by then, so a conversation deleted meanwhile (404) or grown past what the store
    keeps (413) only goes without them; a store that is away is the caller's 503."""
    if response.conversation is None or response.status not in ("completed", "incomplete"):
        return
    items = [*record.input_items, *(msgspec.to_builtins(item) for item in response.output)]
    try:
        async with responses.conversations.changing(response.conversation.id,
                                                    record.owner) as conv:
            conv.items.extend(items)
    except StoreUnavailable:
        raise
    except APIError as exc:
        log.warning("response %s not added to conversation %s: %s", response.id,
                    response.conversation.id, exc.message)
