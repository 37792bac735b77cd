"""Guesses for constrained requests cut at the first token their grammar rejects.

Prompt lookup (n-gram) guesses from the text so far, blind to the request's grammar
(structured output): a guess the grammar forbids would only be turned down in
verification (its row is masked, so the target never draws it), and the guesses after it
with it. Cutting them here leaves those query rows to other requests. The draft model
needs no cut: it guesses from logits masked by the grammar (executor/draft_model.py).
"""

from __future__ import annotations

from iterserve.core.speculation import DraftQuery, Proposer
from iterserve.sample.structured import StructuredBatch


class GrammarCheckedProposer:
    """`inner`'s proposals, each constrained request's cut to the prefix its matcher
    (in `structured`, where the executor keeps them) accepts from where the output is."""

    def __init__(self, inner: Proposer, structured: StructuredBatch) -> None:
        self.inner = inner
        self.structured = structured

    def propose(self, queries: list[DraftQuery]) -> list[list[int]]:
        proposals = self.inner.propose(queries)
        for i, (query, guesses) in enumerate(zip(queries, proposals, strict=True)):
            if guesses and query.sampling_params.structured_output is not None:
                proposals[i] = guesses[: self.structured.valid_prefix(query.request_id, guesses)]
        return proposals

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)
