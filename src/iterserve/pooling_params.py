"""What an embedding, scoring or classifying request asks for: how its prompt's hidden
states become one vector, one score, or its labels' probabilities.

Both are prefill-only: they compute the prompt, pool the final-norm hidden states and end
without sampling (docs/embeddings.md). A scoring request (a query and a document as one
prompt, for a reranker) reads its last token's state through the model's score head
(model/score_head.py). Torch-free, so the scheduler (core/) can carry it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from iterserve.prompt_truncation import PromptTruncation

# last: the last token's state (decoder embedding models: Qwen3-Embedding, e5-mistral);
# mean: the mean over every prompt token; cls: the first token's.
PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[PoolingType, ...] = ("last", "mean", "cls")
# embed: the pooled vector; score: the score head's one number from the last token's state;
# classify: every label's probability from the head's logits.
PoolingTask = Literal["embed", "score", "classify"]


@dataclass(frozen=True)
class PoolingParams:
    """`pooling` and `normalize` None: the model's own (engine/pooling.py reads them from the
    checkpoint or --pooling). `dimensions`: keep the first this many numbers (a matryoshka
    model only), re-normalized when the model normalizes. `task` "score": the request is a
    (query, document) pair whose relevance the model's score head gives (pooling "last");
    "classify": a text whose labels' probabilities a classifier's head gives."""

    pooling: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    task: PoolingTask = "embed"
    # vLLM's truncate_prompt_tokens: the input cut to its last (or first) tokens.
    truncation: PromptTruncation | None = None

    @property
    def needs_every_token(self) -> bool:
        """Whether the pool reads states of tokens before the last: such a request cannot take
        its prefix from the cache (a cached block has K/V, not the hidden states pooled)."""
        return self.pooling != "last"
