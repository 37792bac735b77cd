"""A prompt cut to its last (or first) tokens before it runs: vLLM's `truncate_prompt_tokens`
and `truncation_side`, for a client that would rather lose the start of a long document
than get a 400 for it (a RAG pipeline's embeddings, a long chat's oldest turns).

Cutting the ids, not the text, keeps the count exact. The cut is idempotent, so a
data-parallel front end may cut to route (by the prefix the replica will see) and the
replica cuts again to no effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from iterserve.invalid_request import InvalidRequestError

TruncationSide = Literal["left", "right"]
_FIELD = "truncate_prompt_tokens"


@dataclass(frozen=True)
class PromptTruncation:
    # The tokens kept; -1: as many as the model's context holds.
    keep: int
    # "left" (vLLM's default) cuts the start and keeps the last `keep` tokens; "right" keeps
    # the first.
    side: TruncationSide = "left"

    def __post_init__(self) -> None:
        if self.keep != -1 and self.keep < 1:
            raise InvalidRequestError(
                f"{_FIELD} must be -1 (the model's context) or at least 1, got {self.keep}",
                _FIELD,
            )
        if self.side not in ("left", "right"):
            raise InvalidRequestError(
                f"truncation_side must be 'left' or 'right', got {self.side!r}",
                "truncation_side",
            )

    @classmethod
    def of(cls, keep: int | None, side: TruncationSide | None) -> PromptTruncation | None:
        """A request's two fields (None: no cut; a side alone cuts nothing, as in vLLM)."""
        return None if keep is None else cls(keep, side or "left")

    def apply(self, token_ids: list[int], max_model_len: int) -> list[int]:
        keep = max_model_len if self.keep == -1 else self.keep
        if keep > max_model_len:
            raise InvalidRequestError(
                f"{_FIELD} ({keep}) is greater than the model's maximum context length "
                f"({max_model_len})",
                _FIELD,
            )
        if len(token_ids) <= keep:
            return token_ids
        return token_ids[-keep:] if self.side == "left" else token_ids[:keep]
