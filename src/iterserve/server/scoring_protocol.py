"""The scoring routes' bodies: POST /v1/rerank (Jina's and Cohere's shape, as vLLM and
llama.cpp's server take it) and POST /v1/score (vLLM's). Unknown fields are ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from iterserve.sampling_params import InvalidRequestError

# As many documents as OpenAI's embeddings take inputs.
MAX_DOCUMENTS = 2048


class RerankDocument(BaseModel):
    text: str


class RerankRequest(BaseModel):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True

    def texts(self) -> list[str]:
        """The documents' texts; InvalidRequestError naming `documents` for none or too many."""
        if not self.documents:
            raise InvalidRequestError("documents must not be empty", "documents")
        if len(self.documents) > MAX_DOCUMENTS:
            raise InvalidRequestError(
                f"documents has {len(self.documents)} items; at most {MAX_DOCUMENTS}", "documents"
            )
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class ScoringUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class RerankResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    model: str
    results: list[RerankResult]
    usage: ScoringUsage


class ScoreRequest(BaseModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoringUsage
