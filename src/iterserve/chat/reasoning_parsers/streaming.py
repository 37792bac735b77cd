"""An answer's reasoning and content as it streams: the difference between consecutive
scans of the text so far (base.py), so the deltas add up to the whole answer's split."""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.chat.reasoning_parsers.base import ThinkingReader


@dataclass
class ReasoningStream:
    reader: ThinkingReader
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0
    thought: bool = False  # whether the answer has a thinking part (so far)

    def feed(self, delta_text: str, final: bool) -> tuple[str, str]:
        """The reasoning and the content `delta_text` (and, when `final`, the end of the
        answer) make certain."""
        self.text += delta_text
        split = self.reader.scan(self.text, final)
        self.thought = split.reasoning is not None
        reasoning = (split.reasoning or "")[self.sent_reasoning :]
        content = split.content[self.sent_content :]
        self.sent_reasoning += len(reasoning)
        self.sent_content += len(content)
        return reasoning, content
