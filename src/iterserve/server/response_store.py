"""Stored Responses: finished responses in an embedded SQLite database, for
`previous_response_id` and GET/DELETE /v1/responses/{id}. The same file keeps the
Conversations API's conversations (server/conversation_store.py), on the same thread.

One row a response, complete in itself: the Response object as it was finally sent, the
input items the model read (the chain's history included, so deleting or pruning an
earlier response never breaks a later one's chain), and the tokens its prompt and answer
were (so the next turn can reuse their KV through the prefix cache). A row is at most a
context's worth of tokens and text.

Every call runs on one worker thread that owns the connection: the event loop never
waits on the disk, and concurrent requests are serialized without a lock. A save commits
in WAL mode with `synchronous=FULL` before it returns, so a response is on disk before
the event or body that announces it leaves (a process killed after that still has it; so
does a machine that loses power).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

IN_MEMORY = ":memory:"
_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the order they were stored in: pruning's
    id TEXT NOT NULL UNIQUE,
    stored_at REAL NOT NULL,                -- unix seconds
    response TEXT NOT NULL,                 -- the Response object, JSON
    conversation TEXT NOT NULL,             -- the input items the model read, JSON
    token_ids BLOB NOT NULL                 -- prompt + answer, uint32 little-endian
);
CREATE INDEX IF NOT EXISTS responses_stored_at ON responses (stored_at);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,            -- unix seconds
    metadata TEXT NOT NULL                  -- JSON object
);
CREATE TABLE IF NOT EXISTS conversation_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the conversation's order
    conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    item_id TEXT NOT NULL,
    item TEXT NOT NULL,                     -- the item, JSON
    UNIQUE (conversation_id, item_id)
);
"""


def default_store_path() -> Path:
    """$XDG_DATA_HOME/iterserve/responses.sqlite3, ~/.local/share when it is not set."""
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(data_home) / "iterserve" / "responses.sqlite3"


@dataclass(frozen=True)
class StoredResponse:
    id: str
    response: dict[str, Any]  # as finally sent
    conversation: list[dict[str, Any]]  # input items, history first; never `instructions`
    token_ids: list[int]  # the prompt's tokens, then the answer's

    @property
    def history(self) -> list[dict[str, Any]]:
        """What a response chained to this one continues: its input and its output."""
        return [*self.conversation, *self.response["output"]]

    @property
    def prompt_tokens(self) -> int:
        return int(self.response["usage"]["input_tokens"])


@dataclass(frozen=True)
class Retention:
    """How many responses are kept and for how long (0: no limit); the oldest go first."""

    max_count: int = 10_000
    max_age_seconds: float = 30 * 86_400  # OpenAI's: stored responses live 30 days

    def __post_init__(self) -> None:
        if self.max_count < 0 or self.max_age_seconds < 0:
            raise ValueError("a retention limit cannot be negative (0: no limit)")


class ResponseStore:
    def __init__(
        self,
        path: str | Path,
        retention: Retention | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = str(path)
        self.retention = retention or Retention()
        self._clock = clock
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="iterserve-responses")
        self._db: sqlite3.Connection | None = None
        self._worker.submit(self._open).result()  # a store that cannot open fails start-up

    # ---- the event loop's side -------------------------------------------------------

    async def save(self, stored: StoredResponse) -> None:
        """Returns once the response is committed to disk (or memory: `:memory:`)."""
        await self._call(self._save, stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._call(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        """Whether there was such a response."""
        return await self._call(self._delete, response_id)

    async def run(self, work: Callable[[sqlite3.Connection], T], write: bool = False) -> T:
        """`work(connection)` on the store's thread (in a transaction when it writes): for
        the tables other modules keep in this file."""

        def call() -> T:
            if not write:
                return work(self._conn)
            with self._transaction() as db:
                return work(db)

        return await self._call(call)

    def close(self) -> None:
        self._worker.submit(self._close).result()
        self._worker.shutdown()

    async def _call(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, work, *args)

    # ---- the worker thread's side ----------------------------------------------------

    @property
    def _conn(self) -> sqlite3.Connection:
        assert self._db is not None, "the response store is closed"
        return self._db

    def _open(self) -> None:
        if self.path != IN_MEMORY:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None)  # transactions spelled out
        db.execute("PRAGMA busy_timeout = 5000")  # another server on the same file
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")  # a commit is on disk when it returns
        db.execute("PRAGMA foreign_keys = ON")  # a conversation's items go with it
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, _SCHEMA_VERSION):
            db.close()
            raise RuntimeError(
                f"{self.path} holds responses of a newer iterserve (schema {version}); "
                "pass another --responses-store"
            )
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        self._db = db
        with self._transaction():
            self._prune()

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _transaction(self) -> sqlite3.Connection:
        # sqlite3's context manager commits (or rolls back) but does not begin.
        self._conn.execute("BEGIN IMMEDIATE")
        return self._conn

    def _save(self, stored: StoredResponse) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO responses "
                "(id, stored_at, response, conversation, token_ids) VALUES (?, ?, ?, ?, ?)",
                (
                    stored.id,
                    self._clock(),
                    json.dumps(stored.response, ensure_ascii=False),
                    json.dumps(stored.conversation, ensure_ascii=False),
                    _pack(stored.token_ids),
                ),
            )
            self._prune()

    def _prune(self) -> None:
        """Drop what the retention limits no longer keep (inside the caller's transaction)."""
        if self.retention.max_age_seconds:
            cutoff = self._clock() - self.retention.max_age_seconds
            self._conn.execute("DELETE FROM responses WHERE stored_at < ?", (cutoff,))
        if self.retention.max_count:
            self._conn.execute(
                "DELETE FROM responses WHERE seq <= "
                "(SELECT seq FROM responses ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                (self.retention.max_count,),
            )

    def _get(self, response_id: str) -> StoredResponse | None:
        row = self._conn.execute(
            "SELECT response, conversation, token_ids, stored_at FROM responses WHERE id = ?",
            (response_id,),
        ).fetchone()
        if row is None or self._expired(row[3]):
            return None
        return StoredResponse(response_id, json.loads(row[0]), json.loads(row[1]), _unpack(row[2]))

    def _expired(self, stored_at: float) -> bool:
        # Pruning runs on saves; a server that only reads still honours the age limit.
        limit = self.retention.max_age_seconds
        return bool(limit) and stored_at < self._clock() - limit

    def _delete(self, response_id: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0


def _pack(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)
    if sys.byteorder == "big":  # the file reads the same on any machine
        packed.byteswap()
    return packed.tobytes()


def _unpack(blob: bytes) -> list[int]:
    packed = array("I")
    packed.frombytes(blob)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()
