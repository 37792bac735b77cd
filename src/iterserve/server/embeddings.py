"""POST /v1/embeddings: each input becomes one embedding request in the engine (prefill only,
in the scheduler's embed lane: docs/embeddings.md), all queued as one group, all or none."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.core.request import EMBED_LANE
from iterserve.engine.request_stream import GenerationRequest
from iterserve.pooling_params import PoolingParams
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.server.embeddings_protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from iterserve.server.serving import (
    ServingContext,
    access_record,
    collect_final,
    until_disconnected,
)

# What an embedding request carries for sampling: nothing is sampled.
_NO_SAMPLING = SamplingParams(max_tokens=1)


async def create_embeddings(body: EmbeddingRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.resolve_model(body.model)
    prompts = body.prompts()
    request_id = f"embd-{uuid.uuid4().hex}"
    record = access_record(raw)
    record.request_id = request_id
    arrival = time.monotonic()
    pooling = PoolingParams(dimensions=body.dimensions)
    requests = [
        GenerationRequest(
            prompt,
            _NO_SAMPLING,
            f"{request_id}-{i}",
            lane=EMBED_LANE,
            arrival_time=arrival,
            pooling=pooling,
        )  # fmt: skip
        for i, prompt in enumerate(prompts)
    ]
    try:
        ctx.engine.check_group_size(len(requests))
    except InvalidRequestError as error:  # the queue's bound, said of this API's field
        raise InvalidRequestError(str(error), "input") from None
    stream = await ctx.engine.add(requests)
    outputs = await until_disconnected(raw, collect_final(stream, record))
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    record.prompt_tokens = prompt_tokens
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
