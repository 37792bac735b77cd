"""Speculative decoding, the scheduler's side: proposing draft tokens and counting them.

A request that speculates puts 1 + k query tokens into a step: its last token and k
guesses of what follows. The executor samples the target model at all 1 + k positions
and keeps the guesses up to the first one its own sample disagrees with, plus that
sample (executor/torch_runner.py). Each kept guess is a token for the price of a query
row in a step that streams the weights anyway, and the text is exactly what one token
per step would have given: a guess is kept only where it equals the target's own draw.

Proposers: prompt lookup here (n-gram matching, vLLM's `ngram`: code, documents being
edited and chats that quote their context repeat themselves, and a repeated n-gram's
continuation is a good guess that costs no model), which follows a request's predicted
output first where it has one (core/predicted_output.py), and a smaller draft model
(executor/draft_model.py), which the engine injects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from iterserve.core.predicted_output import PredictionCursor
from iterserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftQuery:
    """Guess up to `k` tokens to follow `token_ids` (the request's prompt and output so
    far, which only ever grow for one request id; read, never changed)."""

    request_id: str
    token_ids: list[int]
    k: int
    # How the request samples: a draft model samples its guesses the same way, so the
    # target can accept them by the ratio of the two distributions.
    sampling_params: SamplingParams
    num_prompt_tokens: int = 0  # token_ids[num_prompt_tokens:] is the output so far


class Proposer(Protocol):
    """Where drafts come from. Called once per step with every request that may speculate,
    so a proposer that runs a model batches them; `forget` when a request is gone."""

    def propose(self, queries: list[DraftQuery]) -> list[list[int]]: ...

    def forget(self, request_id: str) -> None: ...


class NgramProposer:
    """Finds the longest suffix n-gram (n from `n_max` down to `n_min`) of a request's
    tokens that occurred earlier in them and proposes the tokens that followed its most
    recent earlier occurrence (continued periodically where it runs into the end).

    Each request keeps an index from n-gram to where its last occurrence ended, extended
    by the tokens added since the previous call, so a proposal costs O(n_max - n_min)
    dictionary lookups rather than a scan of the whole context.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min} and {n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self._indexes: dict[str, _NgramIndex] = {}
        self._predictions: dict[str, PredictionCursor] = {}

    def propose(self, queries: list[DraftQuery]) -> list[list[int]]:
        return [self.predicted(q) or self.lookup(q.request_id, q.token_ids, q.k) for q in queries]

    def predicted(self, query: DraftQuery) -> list[int]:
        """Up to k tokens of the request's predicted output that follow its answer so far
        (none without a prediction, or where the answer has left it)."""
        prediction = query.sampling_params.prediction
        if not prediction:
            return []
        cursor = self._predictions.get(query.request_id)
        if cursor is None:
            cursor = PredictionCursor(prediction, self.n_min, self.n_max)
            self._predictions[query.request_id] = cursor
        return cursor.draft(query.token_ids, query.k, query.num_prompt_tokens)

    def lookup(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow `tokens` (which only ever grow per request)."""
        if k < 1 or len(tokens) <= self.n_min:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _NgramIndex(self.n_min, self.n_max)
        index.extend(tokens)
        end = len(tokens)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            follower = index.follower.get(tuple(tokens[end - n :]))
            if follower is not None:
                # What followed, and past the end the same again: a match `period` tokens
                # back says the text repeats with that period (small models' loops do).
                period = end - follower
                return [tokens[follower + i % period] for i in range(k)]
        return []

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
        self._predictions.pop(request_id, None)


class _NgramIndex:
    """n-gram -> position of the token that followed its latest occurrence.

    Position j is indexed once the token at j exists, so the suffix being looked up
    (whose follower does not exist yet) never finds itself.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.follower: dict[tuple[int, ...], int] = {}
        self._next = 1  # first position not yet indexed as a follower

    def extend(self, tokens: list[int]) -> None:
        for j in range(self._next, len(tokens)):
            for n in range(self.n_min, min(self.n_max, j) + 1):
                self.follower[tuple(tokens[j - n : j])] = j
        self._next = max(self._next, len(tokens))


@dataclass
class SpecDecodeStats:
    """Totals over the engine's life. A *draft* is one request's guesses in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose guess at position i was accepted.
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculating request gains per step: its accepted guesses plus the
        target's own token (1.0 would be plain decoding)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
