"""What an embedding request asks for: how its prompt's hidden states become one vector.

An embedding request is prefill-only: it computes its prompt, pools the final-norm hidden
states into one vector and ends without sampling (docs/embeddings.md). Torch-free, so the
scheduler (core/) can carry it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# last: the last token's state (decoder embedding models: Qwen3-Embedding, e5-mistral);
# mean: the mean over every prompt token; cls: the first token's.
PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[PoolingType, ...] = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """`pooling` and `normalize` None: the model's own (engine/pooling.py reads them from the
    checkpoint or --pooling). `dimensions`: keep the first this many numbers (a matryoshka
    model only), re-normalized when the model normalizes."""

    pooling: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    @property
    def needs_every_token(self) -> bool:
        """Whether the pool reads states of tokens before the last: such a request cannot take
        its prefix from the cache (a cached block has K/V, not the hidden states pooled)."""
        return self.pooling != "last"
