"""An answer split into content and calls by an AnswerReader: whole (`parse_answer`, the
non-streamed response) or as it streams (`ToolCallStream`, one per choice: the content
and calls each new piece of text makes certain), both from the same scans."""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.chat.tool_parsers.base import AnswerReader, ParsedCall


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None  # None: the answer is only calls
    calls: list[ParsedCall]


def parse_answer(reader: AnswerReader, text: str, max_calls: int | None) -> ParsedAnswer:
    """The whole answer split into content and calls (the non-streamed response)."""
    content, calls = _split(reader, text, final=True, max_calls=max_calls)
    return ParsedAnswer((content or None) if calls else content, calls)


def _split(
    reader: AnswerReader, text: str, final: bool, max_calls: int | None
) -> tuple[str, list[ParsedCall]]:
    pieces = reader.scan(text, final)
    calls = [piece for piece in pieces if isinstance(piece, ParsedCall)][:max_calls]
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    # Whitespace before a call is the call's layout, not an answer: it is held while
    # streaming (it may precede a call) and dropped once calls came.
    if calls or not final:
        content = content.rstrip()
    return content, calls


@dataclass
class StreamDelta:
    content: str
    new_calls: list[tuple[int, str, ParsedCall]]  # (index among the calls, id, call)


@dataclass
class ToolCallStream:
    reader: AnswerReader
    max_calls: int | None
    text: str = ""
    sent_content: int = 0
    call_ids: list[str] = field(default_factory=list)

    def feed(self, delta_text: str, final: bool) -> StreamDelta:
        """What `delta_text` (and, when `final`, the end of the answer) makes certain."""
        self.text += delta_text
        content, calls = _split(self.reader, self.text, final, self.max_calls)
        new_content = content[self.sent_content :]
        self.sent_content = len(content)
        fresh = []
        for index in range(len(self.call_ids), len(calls)):
            self.call_ids.append(self.reader.new_call_id())
            fresh.append((index, self.call_ids[index], calls[index]))
        return StreamDelta(new_content, fresh)

    @property
    def called(self) -> bool:
        return bool(self.call_ids)
