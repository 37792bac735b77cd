"""GET and DELETE /v1/responses/{id}, and GET /v1/responses/{id}/input_items: the
stored Responses, as OpenAI serves them. A response made with `store: false` was never
kept, so it is as unknown here as an id never issued (404)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter

from iterserve.server.errors import APIError
from iterserve.server.response_store import ResponseStore, StoredResponse

_MAX_LIMIT = 100  # OpenAI's bound on a page of input items


def stored_response_routes(store: ResponseStore) -> APIRouter:
    v1 = APIRouter(prefix="/v1")

    @v1.get("/responses/{response_id}")
    async def retrieve(response_id: str, stream: str | None = None) -> dict[str, Any]:
        if stream is not None and stream.lower() not in ("false", "0"):
            raise APIError(
                400,
                "a stored response is returned whole: its events are not kept to stream again",
                "stream",
            )
        return (await _stored(store, response_id)).response

    @v1.delete("/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        if not await store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @v1.get("/responses/{response_id}/input_items")
    async def input_items(
        response_id: str, limit: str = "20", order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        return item_page((await _stored(store, response_id)).conversation, limit, order, after)

    return v1


def item_page(
    items: Sequence[dict[str, Any]], limit: str | int, order: str, after: str | None
) -> dict[str, Any]:
    """A page of items as OpenAI lists them (a response's input items, a conversation's):
    `limit` of them, `order` asc (oldest first) or desc, after the item with id `after`."""
    count = _limit(str(limit))
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', not {order!r}", "order")
    ordered = list(items) if order == "asc" else list(items)[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise APIError(400, f"no item with id {after!r} here", "after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:count]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(ordered) > count,
    }


async def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    stored = await store.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "response_id")


def _limit(text: str) -> int:
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_LIMIT:
        raise APIError(
            400, f"limit must be an integer from 1 to {_MAX_LIMIT}, not {text!r}", "limit"
        )
    return limit
