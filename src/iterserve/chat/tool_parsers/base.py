"""What every tool-call parser shares: the parsed call, and how an answer is read.

An `AnswerReader` reads the model's text and splits it into content and calls. It is written
once for both ways an answer leaves the server: `scan(text, final=True)` is the whole
answer's parse, and `scan(prefix, final=False)` is what is already certain about a
streamed prefix, holding back anything that could still turn out to be (part of) a call.
The streaming code only sends the difference between consecutive scans, so the calls
and content a client reassembles are those of the non-streamed answer by construction.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


# What a scan found, in text order: content pieces and calls.
Piece = str | ParsedCall


class AnswerReader(ABC):
    @abstractmethod
    def scan(self, text: str, final: bool) -> list[Piece]:
        """The pieces of `text` that are certain. With `final` False, a later, longer
        text's pieces must extend these: content may only grow at its end (the last
        piece) and calls are never taken back; a possible call is left out until it is
        complete. With `final` True, the whole text is accounted for."""

    def new_call_id(self) -> str:
        """The id a call read from the answer gets: the client sends it back with the
        call and with its result, and the chat template may check it."""
        return f"call_{secrets.token_hex(12)}"


class ToolParser(AnswerReader):
    """A model family's call format: how to read it, and how to write or describe it."""

    name: ClassVar[str]
    # Text that opens a call; when the tokenizer makes one a special token, the server
    # keeps special tokens in the output text so the parser can see it.
    markers: ClassVar[tuple[str, ...]]
    # How a call looks, for a system prompt that teaches the format (tool_prompt.py).
    call_format: ClassVar[str]

    @abstractmethod
    def write_call(self, function: Mapping[str, Any]) -> str:
        """A call ({"name", "arguments": {...}}) as the model would write it."""

    def with_tools(self, schemas: Mapping[str, Mapping[str, Any]]) -> ToolParser:
        """The reader for one request, whose tools' parameter schemas are `schemas` (by
        function name). A format whose calls carry their own types (JSON) ignores them."""
        return self

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        """Whether a chat template asks the model for this format (for `auto`)."""
        return any(marker in chat_template for marker in cls.markers)


def shows_tools(chat_template: str) -> bool:
    """Whether a chat template has a place for tool definitions (else tool_prompt.py)."""
    return "tools" in chat_template


def shows_tool_calls(chat_template: str) -> bool:
    """Whether a chat template writes an assistant's earlier calls itself."""
    return "tool_calls" in chat_template


def call_from_object(value: Any, argument_keys: Sequence[str]) -> ParsedCall | None:
    """A call from decoded JSON {"name": ..., <argument key>: {...}}; None when the
    object is not one (the text then stays content)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in argument_keys:
        if key not in value:
            continue
        arguments = value[key]
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    return None
