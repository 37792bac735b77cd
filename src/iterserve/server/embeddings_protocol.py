"""POST /v1/embeddings' request and response bodies, in OpenAI's shapes.

`input` is a text, a list of texts, a list of token ids, or a list of lists of ids; unknown
fields are ignored (as vLLM does). An embedding is a list of floats, or with
`encoding_format: base64` the base64 of its little-endian float32 bytes (OpenAI's encoding,
which the official client decodes).
"""

from __future__ import annotations

import base64
import struct
from typing import Literal

from pydantic import BaseModel, Field

from iterserve.engine.prompts import Prompt
from iterserve.prompt_truncation import TruncationSide
from iterserve.sampling_params import InvalidRequestError

# OpenAI's own bound on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model: str | None = None
    # Lists of ids before lists of texts: pydantic's smart union then reads [1, 2] as ids.
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: each input cut to its last (truncation_side "right": first) this many tokens,
    # -1 to the model's context: a long document is embedded by a part, not refused.
    truncate_prompt_tokens: int | None = None
    truncation_side: TruncationSide | None = None

    def prompts(self) -> list[Prompt]:
        """One prompt per input; InvalidRequestError naming `input` for none or an empty one."""
        given = self.input
        prompts: list[Prompt]
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            prompts = [given]  # type: ignore[list-item]
        else:
            prompts = list(given)  # type: ignore[arg-type]
        if not prompts:
            raise InvalidRequestError("input must not be empty", "input")
        if len(prompts) > MAX_INPUTS:
            raise InvalidRequestError(
                f"input has {len(prompts)} items; at most {MAX_INPUTS} per request", "input"
            )
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise InvalidRequestError(f"input[{index}] is empty", "input")
        return prompts


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str

    @classmethod
    def encoded(cls, index: int, vector: list[float], encoding: str) -> Embedding:
        if encoding == "base64":
            raw = struct.pack(f"<{len(vector)}f", *vector)
            return cls(index=index, embedding=base64.b64encode(raw).decode("ascii"))
        return cls(index=index, embedding=vector)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding] = Field(default_factory=list)
    model: str
    usage: EmbeddingUsage
