"""Harmony, gpt-oss's chat format, as an answer's text shows it (special tokens kept): a
run of messages, each a header, `<|message|>`, its body, then `<|end|>` (`<|call|>` ends a
tool call, `<|return|>` the answer; both stop generation, so neither is in the text).

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}

The prompt ends with `<|start|>assistant`, so the first header starts at once. A header
holds the channel (`analysis`: thinking; `commentary`: calls and the preambles before them;
`final`: the answer), a recipient when the message is a call (`to=functions.NAME`, before
the channel or after it), and the arguments' content type (`json`, or `<|constrain|>json`).

`read_messages` is written for streaming as the other readers are (chat/tool_parsers/base.py):
with `final` False it returns only what is certain, so a longer text's messages extend a
shorter one's. Text that is not Harmony (where a header should start) is read as one plain
message to its end, so a model that leaves the format loses nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from iterserve.chat.streamed_text import partial_marker_length

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
# What the answer's text must keep for it to be read (they are the tokenizer's special tokens).
SPECIAL_TOKENS = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
# What ends a body: its own end, or (when a model omits it) the next message's start.
_BODY_ENDS = (END, CALL, RETURN, START)
# A header is a few words on one line, and starts with the channel or the recipient (the
# first: its role is in the prompt) or with the role.
_LONGEST_HEADER = 256
_HEADER_LEADS = (CHANNEL, " to=", "assistant")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str | None  # None: no channel named, or text outside the format
    recipient: str | None  # "functions.get_weather" for a call
    body: str
    complete: bool  # its end was seen (or the answer ended)

    @property
    def is_call(self) -> bool:
        return self.recipient is not None and self.recipient != "assistant"


def read_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of an answer's text, as far as they are certain (see the module doc).
    The last may be incomplete; with `final` every message is complete."""
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        if text.startswith(START, pos):
            pos += len(START)
        elif not final and START.startswith(text[pos:]):
            break  # the next message's start, still coming
        header_end = text.find(MESSAGE, pos)
        header = text[pos:] if header_end < 0 else text[pos:header_end]
        if not _could_be_header(header):
            messages.append(HarmonyMessage(None, None, text[pos:], final))  # not Harmony
            break
        if header_end < 0:  # a header still coming (or cut short before any body)
            break
        body_start = header_end + len(MESSAGE)
        ends = [(at, marker) for marker in _BODY_ENDS if (at := text.find(marker, body_start)) >= 0]
        if not ends:
            body = text[body_start:]
            if not final:
                body = body[: len(body) - max(partial_marker_length(body, m) for m in _BODY_ENDS)]
            messages.append(_message(header, body, final))
            break
        at, marker = min(ends)
        messages.append(_message(header, text[body_start:at], True))
        pos = at if marker == START else at + len(marker)
    return messages


def _could_be_header(text: str) -> bool:
    """Whether `text` is (the start of) a header: decided by its start, so a longer text
    never reverses it."""
    if "\n" in text or len(text) > _LONGEST_HEADER:
        return False
    return any(text.startswith(lead) or lead.startswith(text) for lead in _HEADER_LEADS)


def _message(header: str, body: str, complete: bool) -> HarmonyMessage:
    channel = _CHANNEL_NAME.search(header)
    recipient = _RECIPIENT.search(header)
    return HarmonyMessage(
        channel.group(1) if channel else None,
        recipient.group(1) if recipient else None,
        body,
        complete,
    )


def call_text(recipient: str, arguments: str) -> str:
    """A call as the chat template writes an earlier one (the recipient in the role's
    header): the form the `openai` tool parser reads."""
    return f"{START}assistant to={recipient}{CHANNEL}commentary json{MESSAGE}{arguments}{CALL}"
