"""Stored Responses through the official openai client against a real server:
`previous_response_id` chains (streamed and not), what a chained prompt holds, GET,
DELETE and input_items, `store: false`, unknown ids, retention, concurrent chains, the
prefix cache along a chain, and a server killed with SIGKILL that still answers the
chains made before (the store's file outlives the process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from iterserve.server.app import ServerSettings
from iterserve.server.response_store import Retention
from server_fixtures import (
    MODEL_NAME,
    RunningServer,
    answer_tokens,
    free_port,
    is_healthy,
    running_server,
    scripted_tokens,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    store = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    settings = ServerSettings(served_model_names=[MODEL_NAME], responses_store=str(store))
    with running_server(tiny_llama_dir, settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, text: str, previous: str | None = None, **extra: Any) -> Any:
    return client.responses.create(
        model=MODEL_NAME,
        input=text,
        previous_response_id=previous,
        max_output_tokens=extra.pop("max_output_tokens", 8),
        temperature=0,
        **extra,
    )


def _conversation(client: openai.OpenAI, response_id: str) -> list[str]:
    """The conversation a stored response read, as (role: text) lines, oldest first."""
    items = client.responses.input_items.list(response_id, order="asc", limit=100).data
    return [f"{item.role}: {item.content[0].text}" for item in items]  # type: ignore[union-attr]


def test_a_chain_reads_the_stored_conversation_without_earlier_instructions(
    client: openai.OpenAI, server: RunningServer
) -> None:
    """Each turn's prompt is the chat of everything before it: its token count is the
    equivalent chat completion's. The first turn's instructions are not carried over."""
    answers = ["Blue.", "Green, then.", "Red at last."]
    with scripted_tokens(server, answer_tokens(server, answers[0])):
        first = _ask(client, "Name a colour.", instructions="Answer in one word.")
    assert first.store is True and first.previous_response_id is None
    assert first.output_text == answers[0]
    messages: list[dict[str, str]] = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": answers[0]},
    ]
    previous = first
    for turn, answer in enumerate(answers[1:], start=2):
        question = f"Another one, number {turn}?"
        messages.append({"role": "user", "content": question})
        with scripted_tokens(server, answer_tokens(server, answer)):
            response = _ask(client, question, previous.id)
            chat = client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=8,  # type: ignore[arg-type]
            )
        assert response.previous_response_id == previous.id and response.instructions is None
        assert response.output_text == answer == chat.choices[0].message.content
        assert response.usage is not None and chat.usage is not None
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        messages.append({"role": "assistant", "content": answer})
        previous = response
    assert _conversation(client, previous.id) == [
        f"{m['role']}: {m['content']}" for m in messages[:-1]
    ]


def test_streamed_response_is_stored_as_its_last_event_says(client: openai.OpenAI) -> None:
    first = _ask(client, "Hello there.")
    events = list(
        client.responses.create(
            model=MODEL_NAME,
            input="And again.",
            previous_response_id=first.id,
            max_output_tokens=8,
            stream=True,
        )
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
    streamed = events[-1].response  # type: ignore[union-attr]
    assert streamed.previous_response_id == first.id and streamed.store is True
    assert client.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    # A chain goes on from a streamed turn as from any other.
    third = _ask(client, "Once more.", streamed.id)
    assert _conversation(client, third.id)[:3] == [
        "user: Hello there.",
        f"assistant: {first.output_text}",
        "user: And again.",
    ]


def test_delete_forgets_one_response_and_not_the_chains_after_it(client: openai.OpenAI) -> None:
    first = _ask(client, "One.")
    second = _ask(client, "Two.", first.id)
    reply = httpx.delete(f"{client.base_url}responses/{first.id}")
    assert reply.status_code == 200
    assert reply.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(first.id)
    assert caught.value.body["param"] == "response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(client, "Three.", first.id)
    assert refused.value.code == "previous_response_not_found"
    # Each stored response holds its whole history: the chain after the deleted one goes on.
    third = _ask(client, "Three.", second.id)
    assert _conversation(client, third.id)[0] == "user: One."


def test_store_false_is_neither_fetched_nor_chained(client: openai.OpenAI) -> None:
    response = _ask(client, "Keep this to yourself.", store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(client, "Do you remember?", response.id)
    assert caught.value.status_code == 400 and caught.value.code == "previous_response_not_found"
    assert caught.value.param == "previous_response_id"  # type: ignore[attr-defined]
    assert f"Previous response with id '{response.id}' not found." in caught.value.message
    # A stored turn may follow a stored one and yet not be kept itself.
    kept = _ask(client, "Remember this.")
    unkept = _ask(client, "But not this.", kept.id, store=False)
    assert unkept.previous_response_id == kept.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "resp_unknown"), ("DELETE", "resp_unknown"), ("GET", "resp_unknown/input_items")],
)
def test_unknown_ids_are_404_naming_the_id(server: RunningServer, method: str, path: str) -> None:
    reply = httpx.request(method, f"{server.base_url}/v1/responses/{path}")
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["param"] == "response_id" and "resp_unknown" in error["message"]


def test_input_items_pages_in_either_order(client: openai.OpenAI, server: RunningServer) -> None:
    response = _ask(client, "c", _ask(client, "b", _ask(client, "a").id).id)
    asc = client.responses.input_items.list(response.id, order="asc").data
    assert [item.role for item in asc] == ["user", "assistant"] * 2 + ["user"]  # type: ignore[union-attr]
    assert all(item.id for item in asc)
    desc = client.responses.input_items.list(response.id).data  # OpenAI's default: newest first
    assert [item.id for item in desc] == [item.id for item in reversed(asc)]
    page = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.id for item in page.data] == [item.id for item in asc[:2]] and page.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=asc[1].id)
    assert [item.id for item in rest.data] == [item.id for item in asc[2:]]
    for query, param in [("limit=0", "limit"), ("order=up", "order"), ("after=x", "after")]:
        reply = httpx.get(f"{server.base_url}/v1/responses/{response.id}/input_items?{query}")
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_retention_keeps_the_newest(tiny_llama_dir: Path, tmp_path: Path) -> None:
    settings = ServerSettings(
        served_model_names=[MODEL_NAME],
        responses_store=str(tmp_path / "responses.sqlite3"),
        responses_retention=Retention(max_count=3),
    )
    with running_server(tiny_llama_dir, settings) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        ids = [_ask(client, f"Turn {i}.", max_output_tokens=2).id for i in range(5)]
        for pruned in ids[:2]:
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(pruned)
        assert [client.responses.retrieve(kept).id for kept in ids[2:]] == ids[2:]


def test_concurrent_chains_stay_apart(client: openai.OpenAI) -> None:
    def chain(name: str) -> list[str]:
        previous = None
        for turn in range(4):
            previous = _ask(client, f"{name} {turn}", previous, max_output_tokens=4).id
        return _conversation(client, previous)

    names = ["alpha", "bravo", "charlie", "delta"]
    with ThreadPoolExecutor(len(names)) as pool:
        conversations = list(pool.map(chain, names))
    for name, lines in zip(names, conversations, strict=True):
        assert [line for line in lines if line.startswith("user:")] == [
            f"user: {name} {turn}" for turn in range(4)
        ]


def test_a_chain_finds_its_history_in_the_prefix_cache(
    client: openai.OpenAI, server: RunningServer
) -> None:
    """Answers written one token a character are not how the tokenizer splits their text,
    so a prompt that rendered the history and encoded it again would miss every block
    from the first answer on. A chained prompt starts with the tokens the last turn ran:
    each turn finds every full block of the previous prompt and answer in the cache."""
    tokenizer = server.engine.tokenizer
    answer = "Sure, here it is again."
    spelled = [tokenizer.encode(ch, add_special_tokens=False)[0] for ch in answer]
    assert spelled != tokenizer.encode(answer, add_special_tokens=False)
    block = server.engine.config.cache.block_size
    before = server.metrics()
    previous, ran, shares = None, 0, []
    with scripted_tokens(server, [*spelled, tokenizer.eos_token_id]):
        for turn in range(10):
            response = _ask(client, f"Tell me again ({turn}).", previous, max_output_tokens=64)
            assert response.output_text == answer
            usage = response.usage
            assert usage is not None
            cached = usage.input_tokens_details.cached_tokens
            if turn:  # every full block of the last prompt and answer but its last token
                assert cached == (ran - 1) // block * block  # (sampled, so never run)
            shares.append(cached / usage.input_tokens)
            previous, ran = response.id, usage.input_tokens + usage.output_tokens
    after = server.metrics()
    hits = after["iterserve:prefix_cache_hits_total"] - before["iterserve:prefix_cache_hits_total"]
    assert hits >= sum(share > 0 for share in shares) * block
    assert shares[-1] > 0.85, shares


@pytest.mark.slow
def test_a_killed_server_still_answers_the_chains_made_before(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL leaves no time to flush anything: what a client saw complete must already
    be on disk. The restarted server continues the chain and returns the same objects."""
    store = tmp_path / "store" / "responses.sqlite3"  # its directory is made on start

    def start() -> tuple[subprocess.Popen[str], openai.OpenAI]:
        port = free_port()
        command = [
            sys.executable, "-m", "iterserve.cli", "serve", "--model", str(tiny_llama_dir),
            "--port", str(port), "--served-model-name", MODEL_NAME, "--dtype", "float32",
            "--max-model-len", "512", "--num-kv-blocks", "256", "--enforce-eager",
            "--responses-store", str(store), "--log-level", "warning",
        ]  # fmt: skip
        proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        base = f"http://127.0.0.1:{port}"
        if not wait_until(lambda: is_healthy(base) or proc.poll() is not None, timeout=90):
            proc.kill()
            pytest.fail("the server did not start")
        assert proc.poll() is None, proc.communicate()[1]
        return proc, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

    proc, client = start()
    try:
        first = _ask(client, "Remember the number 7.")
        events = list(
            client.responses.create(
                model=MODEL_NAME,
                input="And the colour blue.",
                previous_response_id=first.id,
                max_output_tokens=8,
                stream=True,
            )
        )
        second = events[-1].response  # type: ignore[union-attr]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    proc, client = start()
    try:
        assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
        assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
        third = _ask(client, "What did I ask you to remember?", second.id)
        assert third.previous_response_id == second.id
        assert _conversation(client, third.id) == [
            "user: Remember the number 7.",
            f"assistant: {first.output_text}",
            "user: And the colour blue.",
            f"assistant: {second.output_text}",
            "user: What did I ask you to remember?",
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
