"""/v1/conversations: OpenAI's Conversations API (create, retrieve, update, delete; add,
list, retrieve and delete items), over server/conversation_store.py. A Responses request
names a conversation with `conversation` (server/responses.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from iterserve.server.conversation_store import ConversationStore
from iterserve.server.errors import APIError
from iterserve.server.responses_protocol import check_items
from iterserve.server.stored_response_routes import item_page

_MAX_NEW_ITEMS = 20  # OpenAI's bound on the items one call adds


class ConversationCreate(BaseModel):
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None


class ConversationUpdate(BaseModel):
    metadata: dict[str, str]


class ItemsCreate(BaseModel):
    items: list[dict[str, Any]]


def conversation_routes(conversations: ConversationStore) -> APIRouter:
    v1 = APIRouter(prefix="/v1")

    @v1.post("/conversations")
    async def create(body: ConversationCreate) -> dict[str, Any]:
        items = _checked(body.items or [])
        return await conversations.create(body.metadata or {}, items)

    @v1.get("/conversations/{conversation_id}")
    async def retrieve(conversation_id: str) -> dict[str, Any]:
        found = await conversations.get(conversation_id)
        if found is None:
            raise not_found(conversation_id)
        return found

    @v1.post("/conversations/{conversation_id}")
    async def update(conversation_id: str, body: ConversationUpdate) -> dict[str, Any]:
        updated = await conversations.update(conversation_id, body.metadata)
        if updated is None:
            raise not_found(conversation_id)
        return updated

    @v1.delete("/conversations/{conversation_id}")
    async def delete(conversation_id: str) -> dict[str, Any]:
        if not await conversations.delete(conversation_id):
            raise not_found(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @v1.post("/conversations/{conversation_id}/items")
    async def add_items(conversation_id: str, body: ItemsCreate) -> dict[str, Any]:
        added = await conversations.add(conversation_id, _checked(body.items))
        if added is None:
            raise not_found(conversation_id)
        return item_page(added, len(added) or 1, "asc", None)

    @v1.get("/conversations/{conversation_id}/items")
    async def list_items(
        conversation_id: str, limit: str = "20", order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        return item_page(await _items(conversations, conversation_id), limit, order, after)

    @v1.get("/conversations/{conversation_id}/items/{item_id}")
    async def retrieve_item(conversation_id: str, item_id: str) -> dict[str, Any]:
        for item in await _items(conversations, conversation_id):
            if item.get("id") == item_id:
                return item
        raise APIError(404, f"Item with id '{item_id}' not found.", "item_id")

    @v1.delete("/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: str, item_id: str) -> dict[str, Any]:
        if not await conversations.delete_item(conversation_id, item_id):
            await _items(conversations, conversation_id)  # 404 for the conversation first
            raise APIError(404, f"Item with id '{item_id}' not found.", "item_id")
        return await retrieve(conversation_id)

    return v1


def not_found(conversation_id: str) -> APIError:
    return APIError(404, f"Conversation with id '{conversation_id}' not found.", "conversation_id")


async def _items(conversations: ConversationStore, conversation_id: str) -> list[dict[str, Any]]:
    items = await conversations.items(conversation_id)
    if items is None:
        raise not_found(conversation_id)
    return items


def _checked(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(items) > _MAX_NEW_ITEMS:
        raise APIError(400, f"at most {_MAX_NEW_ITEMS} items are added at once", "items")
    check_items(items, "items")
    return items
