"""Formats whose calls sit between an opening and a closing marker, possibly after some
text: Hermes' `<tool_call>...</tool_call>`, Qwen3-Coder's XML inside the same tags,
DeepSeek's `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`, LFM2's
`<|tool_call_start|>[...]<|tool_call_end|>`. One scan serves them all; each format only
says how a block's body reads. A block whose body is not calls stays content, markers
and all, so nothing the model wrote is lost."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from iterserve.chat.streamed_text import partial_marker_length
from iterserve.chat.tool_parsers.base import ParsedCall, Piece, ToolParser


class BlockToolParser(ToolParser):
    OPEN: ClassVar[str]  # also the format's marker
    CLOSE: ClassVar[str]

    @abstractmethod
    def read_block(self, body: str) -> list[ParsedCall] | None:
        """The calls a block's body (the text between the markers) holds, in order; None
        when it is not calls (the block then stays content)."""

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            pieces.append(text[pos:start])
            body = start + len(self.OPEN)
            end = text.find(self.CLOSE, body)
            if end < 0:
                # The answer ended inside the block (cut short, or the closing marker was
                # a stop string): calls if the body is whole.
                if final:
                    pieces += self.read_block(text[body:]) or [text[start:]]
                return pieces
            pos = end + len(self.CLOSE)
            pieces += self.read_block(text[body:end]) or [text[start:pos]]
        tail = text[pos:]
        held = 0 if final else partial_marker_length(tail, self.OPEN)
        pieces.append(tail[: len(tail) - held])
        return pieces
