"""Logprobs as the engine reports them (sampled tokens' and prompt tokens')."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """vLLM's `Logprob`: one token's log-probability and its rank (1: the most likely). Its
    `decoded_token` is left None: the engine detokenizes answers, not candidates."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprobs(Mapping[int, Logprob]):
    """Log-probabilities under the model's raw distribution (log_softmax of raw logits).

    Also vLLM's view of the same numbers, a mapping token id -> `Logprob` of the token and
    its top candidates (ranked 1..n; the token keeps its own rank where it was counted), so
    that code written for vLLM's `prompt_logprobs[i][token_id].logprob` runs as it is."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token_id, logprob), best first; empty if n == 0
    # The token's rank in the distribution (1: the most likely), where it was counted (a
    # prompt token's, vLLM's prompt_logprobs report it).
    rank: int | None = None

    def _by_token(self) -> dict[int, Logprob]:
        ranked = {
            token: Logprob(logprob, rank) for rank, (token, logprob) in enumerate(self.top, 1)
        }
        own = ranked.get(self.token_id)
        rank = self.rank if self.rank is not None else own.rank if own is not None else None
        return {self.token_id: Logprob(self.logprob, rank), **ranked}

    def __getitem__(self, token_id: int) -> Logprob:
        return self._by_token()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_token())

    def __len__(self) -> int:
        return len(self._by_token())
