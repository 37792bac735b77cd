"""The scoring routes' bodies: POST /v1/rerank (Jina's and Cohere's shape, as vLLM and
llama.cpp's server take it; with `texts` instead of `documents`, Hugging Face TEI's, as
llama.cpp's also takes it), POST /v1/score and POST /classify (vLLM's). Unknown fields are
ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from iterserve.engine.prompts import Prompt
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.embeddings_protocol import EmbeddingRequest

# As many documents as OpenAI's embeddings take inputs.
MAX_DOCUMENTS = 2048


class RerankDocument(BaseModel):
    text: str


class RerankRequest(BaseModel):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument] | None = None
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    # TEI's shape: `texts` for documents, `return_text` for return_documents (default off),
    # and an answer that is the bare list of results, each with a `score`.
    texts: list[str] | None = None
    return_text: bool = False
    raw_scores: bool = False

    @property
    def tei(self) -> bool:
        return self.texts is not None and self.documents is None

    @property
    def field(self) -> str:
        return "texts" if self.tei else "documents"

    def document_texts(self) -> list[str]:
        """The documents' texts; InvalidRequestError naming the field for none or too many."""
        given = self.texts if self.tei else self.documents
        if not given:
            raise InvalidRequestError(f"{self.field} must not be empty", self.field)
        if len(given) > MAX_DOCUMENTS:
            raise InvalidRequestError(
                f"{self.field} has {len(given)} items; at most {MAX_DOCUMENTS}", self.field
            )
        if self.raw_scores:  # TEI's logits: this server answers probabilities only
            raise InvalidRequestError(
                "raw_scores is not served: scores are in (0, 1)", "raw_scores"
            )
        return [d if isinstance(d, str) else d.text for d in given]

    def returns_text(self) -> bool:
        return self.return_text if self.tei else self.return_documents


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class TEIRank(BaseModel):
    index: int
    score: float
    text: str | None = None


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


class ClassifyRequest(BaseModel):
    model: str | None = None
    # Lists of ids before lists of texts: pydantic's smart union then reads [1, 2] as ids.
    input: str | list[int] | list[str] | list[list[int]]

    def prompts(self) -> list[Prompt]:
        """One prompt per input, checked as an embeddings request's `input` is."""
        return EmbeddingRequest(input=self.input).prompts()


class ClassifyData(BaseModel):
    index: int
    label: str  # the most probable label's name
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassifyData]
    usage: ScoringUsage
