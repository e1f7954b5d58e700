"""The Conversations API's routes (`/v1/conversations`, `.../items`): create, retrieve,
update metadata, delete; list, add, retrieve and delete items. The records live in the state
store (frontend.responses.conversations); a response joins one with `conversation` on
`POST /v1/responses` (frontend.responses.api)."""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request

from frontend.base.errors import APIError, bad_request
from frontend.responses.chat_request import input_messages
from frontend.responses.conversation_models import (
    Conversation,
    ConversationCreate,
    ConversationUpdate,
    DeletedConversation,
    ItemList,
    ItemsCreate,
)
from frontend.responses.conversations import MAX_ITEMS_PER_CALL, check_metadata
from frontend.responses.models import InputItem
from frontend.responses.shared import Responses
from frontend.responses.stored import input_item_dicts, list_query, owner_of, page_of


def item_not_found(item_id: str) -> APIError:
    return APIError(404, f"Item with id '{item_id}' not found.", "item_id")


def _new_items(items: list[InputItem] | None) -> list[dict[str, Any]]:
    """Items a client adds: checked as a response's input would be (a 400 naming
    `items[i]`), bounded per call, then given ids."""
    items = items or []
    if len(items) > MAX_ITEMS_PER_CALL:
        raise bad_request(f"{len(items)} items: at most {MAX_ITEMS_PER_CALL} may be added at "
                          "a time", "items")
    try:
        input_messages(items)
    except APIError as exc:
        param = exc.param.replace("input[", "items[", 1) if exc.param else "items"
        raise APIError(exc.status, exc.message, param) from exc
    return input_item_dicts(items, uuid.uuid4().hex)


async def create(http: Request, body: ConversationCreate, responses: Responses
                 ) -> Conversation:
    metadata = check_metadata(body.metadata)
    record = await responses.conversations.create(
        owner_of(http, responses.keys), _new_items(body.items), metadata)
    return record.conversation


async def retrieve(http: Request, responses: Responses, conversation_id: str) -> Conversation:
    record = await responses.conversations.find(conversation_id,
                                                owner_of(http, responses.keys))
    return record.conversation


async def update(http: Request, body: ConversationUpdate, responses: Responses,
                 conversation_id: str) -> Conversation:
    metadata = check_metadata(body.metadata)
    async with responses.conversations.changing(
            conversation_id, owner_of(http, responses.keys)) as record:
        record.conversation.metadata = metadata
    return record.conversation


async def delete(http: Request, responses: Responses, conversation_id: str
                 ) -> DeletedConversation:
    await responses.conversations.delete(conversation_id, owner_of(http, responses.keys))
    return DeletedConversation(conversation_id)


async def list_items(http: Request, responses: Responses, conversation_id: str) -> ItemList:
    record = await responses.conversations.find(conversation_id,
                                                owner_of(http, responses.keys))
    return ItemList(*page_of(record.items, *list_query(http)))


async def add_items(http: Request, body: ItemsCreate, responses: Responses,
                    conversation_id: str) -> ItemList:
    items = _new_items(body.items)
    async with responses.conversations.changing(
            conversation_id, owner_of(http, responses.keys)) as record:
        responses.conversations.check_room(record, len(items), "items")
        record.items.extend(items)
    return ItemList(items, items[0]["id"] if items else None,
                    items[-1]["id"] if items else None, False)


async def retrieve_item(http: Request, responses: Responses, conversation_id: str,
                        item_id: str) -> dict[str, Any]:
    record = await responses.conversations.find(conversation_id,
                                                owner_of(http, responses.keys))
    for item in record.items:
        if item["id"] == item_id:
            return item
    raise item_not_found(item_id)


async def delete_item(http: Request, responses: Responses, conversation_id: str,
                      item_id: str) -> Conversation:
    """Drops one item; the answer is the conversation, as OpenAI's."""
    async with responses.conversations.changing(
            conversation_id, owner_of(http, responses.keys)) as record:
        kept = [item for item in record.items if item["id"] != item_id]
        if len(kept) == len(record.items):
            raise item_not_found(item_id)
        record.items = kept
    return record.conversation
