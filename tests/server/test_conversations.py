"""OpenAI's Conversations API through the official client: a conversation's items made,
listed, added and deleted; a Responses request naming it reads its items before its input
(its prompt is the chat of them all) and adds its input and output to it; what cannot be
is refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_fixtures import MODEL_NAME, RunningServer, running_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_llama_dir) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _chat_tokens(server: RunningServer, messages: list[dict[str, str]]) -> int:
    reply = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    return int(reply.json()["count"])


def _texts(client: openai.OpenAI, conversation_id: str) -> list[tuple[str, str]]:
    items = client.conversations.items.list(conversation_id, order="asc").data
    return [(item.role, item.content[0].text) for item in items]  # type: ignore[union-attr]


def test_a_response_reads_its_conversation_and_adds_its_turn(
    client: openai.OpenAI, server: RunningServer
) -> None:
    first = {"type": "message", "role": "user", "content": "Hi, I am Ada."}
    conversation = client.conversations.create(items=[first], metadata={"topic": "names"})  # type: ignore[list-item]
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "names"}
    assert client.conversations.retrieve(conversation.id).created_at == conversation.created_at
    assert _texts(client, conversation.id) == [("user", "Hi, I am Ada.")]

    answer = client.responses.create(
        model=MODEL_NAME, conversation=conversation.id, input="What is my name?",
        max_output_tokens=4, temperature=0,
    )  # fmt: skip
    asked = [
        {"role": "user", "content": "Hi, I am Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    assert answer.usage is not None
    assert answer.usage.input_tokens == _chat_tokens(server, asked)
    assert answer.conversation is not None and answer.conversation.id == conversation.id
    turn = [*asked, {"role": "assistant", "content": answer.output_text}]
    assert _texts(client, conversation.id) == [(m["role"], m["content"]) for m in turn]

    again = client.responses.create(
        model=MODEL_NAME, conversation={"id": conversation.id}, input="And again?",
        max_output_tokens=4, temperature=0, store=False,
    )  # fmt: skip
    assert again.usage is not None
    assert again.usage.input_tokens == _chat_tokens(
        server, [*turn, {"role": "user", "content": "And again?"}]
    )
    assert len(client.conversations.items.list(conversation.id).data) == 5


def test_items_are_added_listed_and_deleted_and_a_conversation_goes_with_them(
    client: openai.OpenAI,
) -> None:
    conversation = client.conversations.create()
    added = client.conversations.items.create(
        conversation.id,
        items=[
            {"type": "message", "role": "user", "content": "one"},
            {"type": "message", "role": "assistant", "content": "two"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "3"}]},
        ],
    )
    ids = [item.id for item in added.data]
    assert len(set(ids)) == 3 and all(i.startswith("msg_") for i in ids)
    newest_first = client.conversations.items.list(conversation.id, limit=2)
    assert [item.id for item in newest_first.data] == ids[:0:-1] and newest_first.has_more
    rest = client.conversations.items.list(conversation.id, limit=2, after=ids[1])
    assert [item.id for item in rest.data] == ids[:1] and not rest.has_more
    middle = client.conversations.items.retrieve(ids[1], conversation_id=conversation.id)
    assert middle.content[0].type == "output_text"  # type: ignore[union-attr]
    client.conversations.items.delete(ids[1], conversation_id=conversation.id)
    assert _texts(client, conversation.id) == [("user", "one"), ("user", "3")]
    updated = client.conversations.update(conversation.id, metadata={"k": "v"})
    assert updated.metadata == {"k": "v"}
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(conversation.id)


@pytest.mark.parametrize(
    "request_body, status, param",
    [
        ({"conversation": "conv_unknown", "input": "hi"}, 404, "conversation"),
        (
            {"conversation": "<made>", "previous_response_id": "resp_x", "input": "hi"},
            400,
            "conversation",
        ),
    ],
)
def test_a_response_naming_a_conversation_it_cannot_continue_is_refused(
    client: openai.OpenAI,
    server: RunningServer,
    request_body: dict[str, Any],
    status: int,
    param: str,
) -> None:
    if request_body["conversation"] == "<made>":
        request_body = {**request_body, "conversation": client.conversations.create().id}
    reply = httpx.post(
        f"{server.base_url}/v1/responses", json={"model": MODEL_NAME, **request_body}
    )
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_items_the_server_cannot_read_are_refused_when_given(server: RunningServer) -> None:
    base = f"{server.base_url}/v1/conversations"
    reply = httpx.post(base, json={"items": [{"type": "image_generation_call", "id": "ig_1"}]})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "items.0.type"
    made = httpx.post(base, json={}).json()["id"]
    twice = [{"type": "message", "role": "user", "content": "x", "id": "msg_same"}] * 2
    reply = httpx.post(f"{base}/{made}/items", json={"items": twice})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "items"
    assert httpx.get(f"{base}/{made}/items").json()["data"] == []  # none of them was added


def test_truncation_auto_drops_the_oldest_turns_a_conversation_outgrew(
    client: openai.OpenAI, server: RunningServer
) -> None:
    """A conversation past the context (512 tokens here): refused as it is; with
    `truncation: "auto"` the fewest oldest turns are dropped, up to a user message, that
    leave the answer its room, and the conversation itself keeps every item."""
    turns = []
    for i in range(6):
        turns.append({"role": "user", "content": f"Question {i}: " + "tell me more " * 25})
        turns.append({"role": "assistant", "content": f"Answer {i}: " + "there is more " * 25})
    conversation = client.conversations.create(
        items=[{"type": "message", **turn} for turn in turns]  # type: ignore[misc]
    )
    ask = {"role": "user", "content": "Last question?"}
    counts = [_chat_tokens(server, [*turns[cut:], ask]) for cut in range(0, len(turns) + 1, 2)]
    assert counts[0] > 512, "the conversation must outgrow the context"
    fitting = [count for count in counts if count <= 512 - 8]
    assert fitting and fitting[0] != counts[0]

    def respond(**extra: Any) -> Any:
        return client.responses.create(
            model=MODEL_NAME, conversation=conversation.id, input=ask["content"],
            max_output_tokens=8, temperature=0, **extra,
        )  # fmt: skip

    with pytest.raises(openai.BadRequestError):
        respond()
    answer = respond(truncation="auto")
    assert answer.truncation == "auto"
    assert answer.usage is not None and answer.usage.input_tokens == fitting[0]
    assert len(client.conversations.items.list(conversation.id, limit=100).data) == 14
