"""Drafts from a request's predicted output (OpenAI's Predicted Outputs: `prediction` on a chat
request, the text its answer is expected to repeat, such as a file being edited).

The answer is followed through the prediction with a cursor: while each new token is the
prediction's next, the cursor moves on and the next k predicted tokens are the draft. Where
the answer leaves the prediction (the edit), the cursor is lost; it is found again when the
answer's last n tokens (n_max down to n_min) occur in the prediction, at their first
occurrence after where the answer last followed it, so a line that repeats in a file is
picked up where the edit left off rather than at its last copy. A draft is only a guess:
the target keeps what it would have sampled anyway (core/speculation.py), so a prediction
changes how fast an answer comes, never what it is.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class PredictionCursor:
    """Where one request's answer stands in its prediction."""

    def __init__(self, prediction: Sequence[int], n_min: int, n_max: int) -> None:
        self.prediction = list(prediction)
        self.n_min, self.n_max = n_min, n_max
        # n-gram -> the positions just after each of its occurrences, in order.
        self._ends: dict[tuple[int, ...], list[int]] = {}
        for n in range(n_min, n_max + 1):
            for end in range(n, len(self.prediction) + 1):
                self._ends.setdefault(tuple(self.prediction[end - n : end]), []).append(end)
        self.cursor: int | None = 0  # the prediction's token the answer's next should be
        self._floor = 0  # where the answer last followed the prediction
        self._seen = 0  # answer tokens taken into account

    def draft(self, tokens: Sequence[int], k: int, start: int = 0) -> list[int]:
        """Up to k tokens the prediction says come after the answer so far, `tokens[start:]`
        (`tokens` only ever grows; read in place, not copied, each step)."""
        for token in tokens[start + self._seen :]:
            if self.cursor is not None and self._next_is(token):
                self.cursor += 1
                self._floor = self.cursor
            else:
                self.cursor = None
        self._seen = len(tokens) - start
        if self.cursor is None:
            self.cursor = self._find(tokens, len(tokens) - start)
        if self.cursor is None:
            return []
        self._floor = self.cursor
        return self.prediction[self.cursor : self.cursor + k]

    def _next_is(self, token: int) -> bool:
        at = self.cursor
        return at is not None and at < len(self.prediction) and self.prediction[at] == token

    def _find(self, tokens: Sequence[int], answered: int) -> int | None:
        """Just after the first occurrence, from where the answer last followed the
        prediction on, of the longest of the answer's last n tokens (of its `answered`, the
        end of `tokens`) the prediction holds."""
        for n in range(min(self.n_max, answered), self.n_min - 1, -1):
            ends = self._ends.get(tuple(tokens[len(tokens) - n :]))
            if ends:
                at = bisect.bisect_left(ends, self._floor)
                return ends[at] if at < len(ends) else ends[0]
        return None
