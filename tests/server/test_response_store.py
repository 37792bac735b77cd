"""The SQLite store of Responses on its own: a round trip, what outlives the process's
connection, retention by count and by age, concurrent saves, and where the file goes."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from iterserve.server.response_store import (
    IN_MEMORY,
    ResponseStore,
    Retention,
    StoredResponse,
    default_store_path,
)


def _stored(response_id: str, tokens: int = 3) -> StoredResponse:
    response: dict[str, Any] = {
        "id": response_id,
        "output": [{"type": "message", "role": "assistant", "content": []}],
        "usage": {"input_tokens": tokens - 1},
    }
    conversation = [{"type": "message", "role": "user", "content": "héllo ✓"}]
    return StoredResponse(response_id, response, conversation, list(range(70_000, 70_000 + tokens)))


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_saved_response_reads_back_after_the_store_is_reopened(tmp_path: Path) -> None:
    path = tmp_path / "new" / "dir" / "responses.sqlite3"  # directories made as needed
    store = ResponseStore(path)
    asyncio.run(store.save(_stored("resp_a")))
    store.close()
    reopened = ResponseStore(path)
    try:
        stored = asyncio.run(reopened.get("resp_a"))
        assert stored == _stored("resp_a")
        assert stored is not None and stored.prompt_tokens == 2
        assert stored.history == [*stored.conversation, *stored.response["output"]]
        assert asyncio.run(reopened.delete("resp_a")) is True
        assert asyncio.run(reopened.delete("resp_a")) is False
        assert asyncio.run(reopened.get("resp_a")) is None
    finally:
        reopened.close()
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_retention_drops_the_oldest_by_count_and_by_age() -> None:
    clock = _Clock()
    store = ResponseStore(IN_MEMORY, Retention(max_count=2, max_age_seconds=100), clock)

    async def run() -> None:
        for name in "abc":
            await store.save(_stored(f"resp_{name}"))
            clock.now += 10
        assert [await store.get(f"resp_{n}") is not None for n in "abc"] == [False, True, True]
        clock.now += 85  # b is 105 s old, c 95 s: b is past the age limit, read or not
        assert await store.get("resp_b") is None and await store.get("resp_c") is not None
        clock.now += 10
        await store.save(_stored("resp_d"))  # a save prunes what has aged out
        assert await store.get("resp_c") is None and await store.get("resp_d") is not None

    try:
        asyncio.run(run())
    finally:
        store.close()


def test_no_limit_keeps_everything() -> None:
    clock = _Clock()
    store = ResponseStore(IN_MEMORY, Retention(max_count=0, max_age_seconds=0), clock)

    async def run() -> list[bool]:
        for i in range(30):
            await store.save(_stored(f"resp_{i}"))
            clock.now += 1e9
        return [await store.get(f"resp_{i}") is not None for i in range(30)]

    try:
        assert all(asyncio.run(run()))
    finally:
        store.close()


def test_concurrent_saves_all_land(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite3")

    async def run() -> list[StoredResponse | None]:
        await asyncio.gather(*(store.save(_stored(f"resp_{i}", i + 1)) for i in range(50)))
        return list(await asyncio.gather(*(store.get(f"resp_{i}") for i in range(50))))

    try:
        assert asyncio.run(run()) == [_stored(f"resp_{i}", i + 1) for i in range(50)]
    finally:
        store.close()


def test_a_store_from_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(RuntimeError, match="newer iterserve"):
        ResponseStore(path)


def test_negative_retention_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        Retention(max_count=-1)


def test_the_default_file_is_under_the_user_s_data_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_store_path() == tmp_path / "iterserve" / "responses.sqlite3"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_store_path() == tmp_path / "home" / ".local/share/iterserve/responses.sqlite3"
