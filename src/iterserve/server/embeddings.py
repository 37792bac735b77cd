"""POST /v1/embeddings: each input becomes one embedding request in the engine (prefill only,
in the scheduler's embed lane: docs/embeddings.md), all queued as one group, all or none
(server/pooled_requests.py)."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.pooling_params import PoolingParams
from iterserve.prompt_truncation import PromptTruncation
from iterserve.server.embeddings_protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from iterserve.server.pooled_requests import run_pooled
from iterserve.server.serving import ServingContext, access_record


async def create_embeddings(body: EmbeddingRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.resolve_model(body.model)
    prompts = body.prompts()
    request_id = f"embd-{uuid.uuid4().hex}"
    access_record(raw).request_id = request_id
    truncation = PromptTruncation.of(body.truncate_prompt_tokens, body.truncation_side)
    pooling = PoolingParams(dimensions=body.dimensions, truncation=truncation)
    outputs = await run_pooled(ctx, prompts, pooling, request_id, raw, "input", model)
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    data = [
        Embedding.encoded(i, out.embedding or [], body.encoding_format)
        for i, out in enumerate(outputs)
    ]
    response = EmbeddingResponse(
        data=data,
        model=model,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    )
    return JSONResponse(response.model_dump(mode="json"), headers={"X-Request-Id": request_id})
