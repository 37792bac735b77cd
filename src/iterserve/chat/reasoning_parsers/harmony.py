"""gpt-oss's thinking, in Harmony's channels (chat/harmony.py reads the messages): the
`analysis` messages are the reasoning; `final` messages and `commentary` preambles are the
content; a call (a message with a recipient) is handed on in the one form the `openai`
tool parser reads (`harmony.call_text`), once the call is whole.

The prompt ends with `<|start|>assistant`, so the model picks the channel itself: the
answer starts where thinking may come (`ThinkingStart.INSIDE`), and the grammar of
structured output starts after the final message's header, as llama.cpp constrains it.
A prompt that opened the final message itself (a continued answer) reads as content.
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.chat.harmony import (
    CHANNEL,
    END,
    MESSAGE,
    SPECIAL_TOKENS,
    START,
    call_text,
    read_messages,
)
from iterserve.chat.reasoning_parsers.base import (
    ReasoningParser,
    ReasoningSplit,
    ThinkingReader,
    ThinkingStart,
)

ANALYSIS, FINAL = "analysis", "final"
_ASSISTANT = f"{START}assistant"


@dataclass(frozen=True)
class HarmonyReader(ThinkingReader):
    start: ThinkingStart
    opened: str = ""  # a message header the prompt ended with (its answer's body follows)

    def scan(self, text: str, final: bool) -> ReasoningSplit:
        if self.start is ThinkingStart.CLOSED:
            return ReasoningSplit(None, text)
        thoughts: list[str] = []
        content = ""
        text_before = False  # whether content ends with a message's text (not a call)
        for message in read_messages(self.opened + text, final):
            if message.is_call:
                if message.complete and message.recipient is not None:
                    content += call_text(message.recipient, message.body)
                    text_before = False
            elif message.channel == ANALYSIS:
                thoughts.append(message.body)
            else:
                content += ("\n" if text_before else "") + message.body
                text_before = True
        return ReasoningSplit("\n".join(thoughts) if thoughts else None, content)


class HarmonyParser(ReasoningParser):
    """vLLM's name: openai_gptoss."""

    markers = SPECIAL_TOKENS
    open_marker = None
    end_marker = END
    grammar_marker = f"{CHANNEL}{FINAL}{MESSAGE}"
    effort_levels = ("low", "medium", "high")

    def start_of(self, prompt: str) -> ThinkingStart:
        return ThinkingStart.CLOSED if FINAL in _opened(prompt) else ThinkingStart.INSIDE

    def budget_markers(self, start: ThinkingStart) -> tuple[str, str, str] | None:
        """The thinking is an answer's first message when it is an analysis one; a budget
        run out ends that message and opens the next one's header, whose channel (the
        final answer, or a call's commentary) the model then picks itself."""
        if start is ThinkingStart.CLOSED:
            return None
        return f"{CHANNEL}{ANALYSIS}{MESSAGE}", END, f"{END}{_ASSISTANT}"

    def reader(self, prompt: str) -> HarmonyReader:
        return HarmonyReader(self.start_of(prompt), _opened(prompt))

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return CHANNEL in chat_template


def _opened(prompt: str) -> str:
    """The header of an assistant message the prompt opened and left for the answer to
    write ("" when it ends at `<|start|>assistant`, as the generation prompt does)."""
    at = prompt.rfind(_ASSISTANT)
    tail = prompt[at + len(_ASSISTANT) :] if at >= 0 else ""
    return tail if tail.endswith(MESSAGE) and END not in tail else ""
