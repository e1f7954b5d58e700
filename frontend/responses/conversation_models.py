"""OpenAI Conversations API bodies as msgspec Structs (`/v1/conversations`)."""

from __future__ import annotations

from typing import Any

import msgspec

from frontend.responses.models import InputItem


class ConversationCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    items: list[InputItem] | None = None
    metadata: dict[str, str] | None = None


class ConversationUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    metadata: dict[str, str] | None


class ItemsCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    items: list[InputItem]


class Conversation(msgspec.Struct):
    id: str
    created_at: int
    metadata: dict[str, str]
    object: str = "conversation"


class DeletedConversation(msgspec.Struct):
    id: str
    deleted: bool = True
    object: str = "conversation.deleted"


class ItemList(msgspec.Struct):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


class ConversationRecord(msgspec.Struct):
    """What the store keeps: the conversation, its owner and its items (as listed back)."""

    conversation: Conversation
    owner: str
    items: list[dict[str, Any]] = []
