"""OpenAI's Conversations: a conversation is a list of Responses items kept on the server
(messages, function calls and their outputs, reasoning), which a Responses request names
with `conversation` to read them before its input, and to which that response's input and
output are then added. The OpenAI Agents SDK's OpenAIConversationsSession keeps an agent's
memory this way.

Kept in the stored Responses' SQLite file, on its thread (server/response_store.py), so a
conversation outlives the server as stored responses do. Every item gets an id when added
(as OpenAI lists them), and a message's text given as a plain string is kept as the one
text part OpenAI lists it as.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Sequence
from typing import Any

from iterserve.sampling_params import InvalidRequestError
from iterserve.server.response_store import ResponseStore
from iterserve.server.responses_protocol import listed_item


def conversation_object(
    conversation_id: str, created_at: int, metadata: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": conversation_id,
        "object": "conversation",
        "created_at": created_at,
        "metadata": metadata,
    }


class ConversationStore:
    def __init__(self, store: ResponseStore) -> None:
        self._store = store

    async def create(
        self, metadata: dict[str, Any], items: Sequence[dict[str, Any]]
    ) -> dict[str, Any]:
        conversation_id = f"conv_{secrets.token_hex(24)}"
        created_at = int(time.time())

        def create(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO conversations (id, created_at, metadata) VALUES (?, ?, ?)",
                (conversation_id, created_at, json.dumps(metadata, ensure_ascii=False)),
            )
            _insert(db, conversation_id, [listed_item(item) for item in items])

        await self._store.run(create, write=True)
        return conversation_object(conversation_id, created_at, metadata)

    async def get(self, conversation_id: str) -> dict[str, Any] | None:
        def get(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute(
                "SELECT created_at, metadata FROM conversations WHERE id = ?", (conversation_id,)
            ).fetchone()
            return (
                None
                if row is None
                else conversation_object(conversation_id, row[0], json.loads(row[1]))
            )

        return await self._store.run(get)

    async def update(self, conversation_id: str, metadata: dict[str, Any]) -> dict[str, Any] | None:
        def update(db: sqlite3.Connection) -> bool:
            return (
                db.execute(
                    "UPDATE conversations SET metadata = ? WHERE id = ?",
                    (json.dumps(metadata, ensure_ascii=False), conversation_id),
                ).rowcount
                > 0
            )

        if not await self._store.run(update, write=True):
            return None
        return await self.get(conversation_id)

    async def delete(self, conversation_id: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            return (
                db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)).rowcount
                > 0
            )

        return await self._store.run(delete, write=True)

    async def add(
        self, conversation_id: str, items: Sequence[dict[str, Any]]
    ) -> list[dict[str, Any]] | None:
        """The items added, with their ids; None if there is no such conversation."""
        listed = [listed_item(item) for item in items]

        def add(db: sqlite3.Connection) -> bool:
            if (
                db.execute(
                    "SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)
                ).fetchone()
                is None
            ):
                return False
            _insert(db, conversation_id, listed)
            return True

        return listed if await self._store.run(add, write=True) else None

    async def items(self, conversation_id: str) -> list[dict[str, Any]] | None:
        """Every item, oldest first; None if there is no such conversation."""

        def items(db: sqlite3.Connection) -> list[dict[str, Any]] | None:
            if (
                db.execute(
                    "SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)
                ).fetchone()
                is None
            ):
                return None
            rows = db.execute(
                "SELECT item FROM conversation_items WHERE conversation_id = ? ORDER BY seq",
                (conversation_id,),
            ).fetchall()
            return [json.loads(row[0]) for row in rows]

        return await self._store.run(items)

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        def delete_item(db: sqlite3.Connection) -> bool:
            return (
                db.execute(
                    "DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                    (conversation_id, item_id),
                ).rowcount
                > 0
            )

        return await self._store.run(delete_item, write=True)


def _insert(db: sqlite3.Connection, conversation_id: str, items: Sequence[dict[str, Any]]) -> None:
    try:
        db.executemany(
            "INSERT INTO conversation_items (conversation_id, item_id, item) VALUES (?, ?, ?)",
            [(conversation_id, item["id"], json.dumps(item, ensure_ascii=False)) for item in items],
        )
    except sqlite3.IntegrityError:  # the transaction rolls back: none of them is added
        raise InvalidRequestError(
            "items: an item's id is already in this conversation (or given twice)", "items"
        ) from None
