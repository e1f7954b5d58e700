"""Stored Responses (`/v1/responses` with `store`) as records in the shared state store.

A record (`StoredResponse`) holds the response body, its conversation as chat messages (what
`previous_response_id` continues), its input items (`GET .../input_items`), the owner (a
hash of the API key that made it, where keys are configured: another key gets a 404), and,
for a background response, the chat request (so another frontend can run it again when the
one running it died: its lease ran out). Records expire after `--responses-ttl`.

Keys: `response:{id}` the record, `response-cancel:{id}` a cancel asked for,
`response-lease:{id}` the frontend running a background response, `background:{id}` (its
owner) while a background response is unfinished, for the frontends' sweeps to find.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from starlette.requests import Request

from frontend.base.api_models import ChatCompletionRequest, ChatMessage
from frontend.base.errors import APIError, bad_request
from frontend.base.principal import principal_of
from frontend.responses.models import InputItem, ResponseObject
from frontend.state.owned_records import OwnedRecords
from frontend.state.store import StateStore, ValueTooLarge

DEFAULT_TTL_S = 30 * 24 * 3600  # OpenAI keeps stored responses 30 days
LEASE_S = 6.0  # a background runner renews its lease every LEASE_S / 3


class StoredResponse(msgspec.Struct):
    response: ResponseObject
    # The conversation so far without the instructions (a follow-up's own instructions
    # replace them, as OpenAI's do): input messages, then this response's answer.
    conversation: list[ChatMessage]
    input_items: list[dict[str, Any]] = []
    owner: str = ""
    chat: ChatCompletionRequest | None = None  # background only: to run it again
    hex: str = ""  # the id's hex part, which item ids reuse


class InputItemList(msgspec.Struct):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


def owner_of(http: Request, keys: frozenset[str]) -> str:
    """Who owns what this request stores: where API keys are configured, a hash of the key
    it presented that the auth middleware accepted; else nobody in particular. With
    --api-keys-file, the principal the key middleware found says it (the same hash)."""
    principal = principal_of(http.scope)
    if principal is not None:
        return principal.owner
    if not keys:
        return ""
    auth = http.headers.get("authorization", "")
    presented = [auth[7:].strip() if auth[:7].lower() == "bearer " else "",
                 http.headers.get("x-api-key", "").strip()]
    key = next((k for k in presented if k in keys), "")
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param)


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def input_item_dicts(items: str | list[InputItem] | None, hex_id: str) -> list[dict[str, Any]]:
    """The request's input as OpenAI lists it back: items with ids, unset fields left out."""
    if items is None:
        return []
    if isinstance(items, str):
        items = [InputItem(role="user", content=items)]
    out = []
    for i, item in enumerate(items):
        body = _without_nulls(msgspec.to_builtins(item))
        if isinstance(body.get("content"), str):
            body["content"] = [{"type": "input_text", "text": body["content"]}]
        prefix = _ID_PREFIXES.get(item.type, "item")
        out.append({"id": f"{prefix}_{hex_id}in{i}", **body})
    return out


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


_decoder = msgspec.json.Decoder(StoredResponse)
_encoder = msgspec.json.Encoder()


class ResponseRecords(OwnedRecords[StoredResponse]):
    """Stored responses in a `StateStore`, read and written as `StoredResponse`."""

    prefix = "response"
    decoder = _decoder
    not_found = staticmethod(not_found)

    def __init__(self, store: StateStore, ttl_s: float | None = DEFAULT_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s

    async def put(self, stored: StoredResponse) -> bool:
        """Stores it; False when it is larger than the store takes (then nothing is kept)."""
        try:
            await self.store.put(f"response:{stored.response.id}", _encoder.encode(stored),
                                 self.ttl_s, counted=True)
        except ValueTooLarge:
            return False
        return True

    async def delete(self, response_id: str, owner: str) -> None:
        await self.find(response_id, owner)
        await self.store.delete(f"response:{response_id}")

    async def mark_unfinished(self, stored: StoredResponse) -> None:
        await self.store.put(f"background:{stored.response.id}", stored.owner.encode(),
                             self.ttl_s)

    async def unfinished(self) -> list[StoredResponse]:
        """The background responses not finished yet (markers of finished ones are dropped)."""
        out = []
        for key in await self.store.scan("background:"):
            response_id = key[len("background:"):]
            owner = await self.store.get(key)
            stored = None if owner is None else await self.get(response_id, owner.decode())
            if stored is None or stored.chat is None:
                await self.store.delete(key)
            else:
                out.append(stored)
        return out

    async def finished(self, response_id: str) -> None:
        await self.store.delete(f"background:{response_id}")
        await self.release(response_id)

    async def ask_cancel(self, response_id: str) -> None:
        await self.store.put(f"response-cancel:{response_id}", b"1", LEASE_S * 10)

    async def cancel_asked(self, response_id: str) -> bool:
        return await self.store.get(f"response-cancel:{response_id}") is not None

    async def lease(self, response_id: str, holder: str) -> bool:
        return await self.store.claim(f"response-lease:{response_id}", holder, LEASE_S)

    async def release(self, response_id: str) -> None:
        await self.store.delete(f"response-lease:{response_id}")


def list_input_items(stored: StoredResponse, limit: int, order: str, after: str | None
                     ) -> InputItemList:
    return InputItemList(*page_of(stored.input_items, limit, order, after))


def page_of(items: list[dict[str, Any]], limit: int, order: str, after: str | None
            ) -> tuple[list[dict[str, Any]], str | None, str | None, bool]:
    """One page of a list of items with ids, as OpenAI lists them: (data, first_id,
    last_id, has_more); a bad `limit`, `order` or `after` is a 400 naming it."""
    if not 1 <= limit <= 100:
        raise bad_request("limit must be between 1 and 100", "limit")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    items = list(items if order == "asc" else reversed(items))
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"no item with id {after!r}", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return (page, page[0]["id"] if page else None, page[-1]["id"] if page else None,
            len(items) > limit)


def list_query(http: Request) -> tuple[int, str, str | None]:
    """A list route's `limit` (default 20), `order` (default desc) and `after`."""
    query = http.query_params
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise bad_request("limit must be an integer", "limit") from None
    return limit, query.get("order", "desc"), query.get("after")
