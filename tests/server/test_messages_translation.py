"""A Messages request read as the chat request it amounts to (server/messages_protocol.py),
without a server: where a system instruction given mid-conversation goes, for a template
that writes system messages anywhere and for one that writes them only at the start."""

from __future__ import annotations

from typing import Any

import pytest

from iterserve.server.messages_protocol import MessagesRequest

CALL = {"type": "tool_use", "id": "t1", "name": "ls", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}


def _chat(messages: list[dict[str, Any]], anywhere: bool) -> list[tuple[str, Any]]:
    request = MessagesRequest(model="m", max_tokens=1, system="top", messages=messages)  # type: ignore[arg-type]
    return [(m["role"], m["content"]) for m in request.chat_messages(system_anywhere=anywhere)]


@pytest.mark.parametrize(
    ("messages", "anywhere", "expected"),
    [
        # Where it stands, for a template that writes it there.
        (
            [{"role": "user", "content": "u"}, {"role": "system", "content": "S"}],
            True,
            [("system", "top"), ("user", "u"), ("system", "S")],
        ),
        # Otherwise it joins the nearest user turn: the last one's, at the end...
        (
            [{"role": "user", "content": "u"}, {"role": "system", "content": "S"}],
            False,
            [("system", "top"), ("user", "u\nS")],
        ),
        # ... the next one's, after its own text...
        (
            [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
                {"role": "system", "content": [{"type": "text", "text": "S"}]},
                {"role": "user", "content": "v"},
            ],
            False,
            [("system", "top"), ("user", "u"), ("assistant", "a"), ("user", "v\nS")],
        ),
        # ... after the tool results it carries, so a call still meets its result first...
        (
            [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": [CALL]},
                {"role": "system", "content": "S"},
                {"role": "user", "content": [RESULT]},
            ],
            False,
            [
                ("system", "top"),
                ("user", "u"),
                ("assistant", None),
                ("tool", "a.txt"),
                ("user", "S"),
            ],
        ),
        # ... and before an assistant turn, the turn before it.
        (
            [
                {"role": "user", "content": "u"},
                {"role": "system", "content": "S"},
                {"role": "assistant", "content": "a"},
            ],
            False,
            [("system", "top"), ("user", "u\nS"), ("assistant", "a")],
        ),
        # At the start, beside the top-level system prompt, either way: one system message.
        (
            [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}],
            False,
            [("system", "top\nS"), ("user", "u")],
        ),
    ],
)
def test_a_mid_conversation_system_instruction(
    messages: list[dict[str, Any]], anywhere: bool, expected: list[tuple[str, Any]]
) -> None:
    assert _chat(messages, anywhere) == expected
