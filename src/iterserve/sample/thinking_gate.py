"""Where a constrained request's output is relative to its thinking, token by token: a
thinking model's structured output (or forced tool call) starts after `</think>`, so its
grammar neither masks nor follows the tokens before (docs/reasoning.md).

A `ThinkingGate` is immutable: following a token gives the next gate, so a guessed token
(speculative decoding) is followed and taken back by keeping the gate from before it.
Watching token ids rather than text keeps this on the executor's side, which has no
tokenizer; the end marker may be several tokens, matched as the tokenizer writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from iterserve.structured_output import ThinkingMarkers


class Phase(Enum):
    UNDECIDED = "undecided"  # nothing sampled yet; the model may open thinking or answer
    THINKING = "thinking"  # inside the thinking: the grammar waits
    ANSWER = "answer"  # after it: the grammar has every token


@dataclass(frozen=True)
class ThinkingGate:
    markers: ThinkingMarkers
    phase: Phase
    recent: tuple[int, ...] = ()  # the last tokens of the thinking, as long as the end marker

    @classmethod
    def start(cls, markers: ThinkingMarkers) -> ThinkingGate:
        """Before the first output token: inside the thinking the prompt opened, or
        undecided where the model opens it itself."""
        return cls(markers, Phase.THINKING if markers.open is None else Phase.UNDECIDED)

    @property
    def is_open(self) -> bool:
        """Whether the grammar now has the tokens."""
        return self.phase is Phase.ANSWER

    @property
    def masks(self) -> bool:
        """Whether the next token is drawn under the grammar (an undecided gate's first
        token: the grammar's, or the one that opens thinking)."""
        return self.phase is not Phase.THINKING

    def after(self, token_id: int) -> tuple[ThinkingGate, bool]:
        """The gate after one more output token, and whether the grammar takes that token
        (only an undecided gate's first token that does not open thinking)."""
        if self.phase is Phase.UNDECIDED:
            if token_id == self.markers.open:
                return replace(self, phase=Phase.THINKING), False
            return replace(self, phase=Phase.ANSWER), True
        if self.phase is Phase.ANSWER:
            return self, True
        end = self.markers.end
        recent = (*self.recent, token_id)[-len(end) :]
        if recent == end:
            return ThinkingGate(self.markers, Phase.ANSWER), False
        return replace(self, recent=recent), False

    def follow(self, token_ids: Sequence[int]) -> tuple[ThinkingGate, int]:
        """The gate after `token_ids`, and how many of them it took before the grammar
        takes the rest (the rest: from that index on, all go to the grammar)."""
        gate = self
        for taken, token_id in enumerate(token_ids):
            if gate.is_open:
                return gate, taken
            gate, to_grammar = gate.after(token_id)
            if to_grammar:
                return gate, taken
        return gate, len(token_ids)
