"""Prompts that are pooled, not sampled (embeddings, a reranker's pairs): queued as one group
of prefill-only requests in the scheduler's embed lane, all or none, and their outputs
collected once every one has ended."""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import Request

from iterserve.core.request import EMBED_LANE
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import Prompt
from iterserve.engine.request_stream import GenerationRequest
from iterserve.pooling_params import PoolingParams
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.server.serving import (
    ServingContext,
    access_record,
    collect_final,
    until_disconnected,
)

_NO_SAMPLING = SamplingParams(max_tokens=1)  # what such a request carries: nothing is sampled


async def run_pooled(
    ctx: ServingContext,
    prompts: Sequence[Prompt],
    pooling: PoolingParams,
    request_id: str,
    raw: Request,
    field: str,
    model: str | None = None,
) -> list[RequestOutput]:
    """Every prompt's output, in order, run with `model`'s LoRA adapter where it names one;
    a request the engine refuses (the queue's bound, a prompt past the context) is a 400
    naming `field`, the API's own name for the inputs."""
    arrival = time.monotonic()
    requests = [
        GenerationRequest(
            prompt,
            _NO_SAMPLING,
            f"{request_id}-{i}",
            lane=EMBED_LANE,
            arrival_time=arrival,
            pooling=pooling,
            lora=ctx.loras.get(model) if model is not None else None,
        )
        for i, prompt in enumerate(prompts)
    ]
    try:
        ctx.engine.check_group_size(len(requests))
    except InvalidRequestError as error:  # the queue's bound, said of this API's field
        raise InvalidRequestError(str(error), field) from None
    try:
        stream = await ctx.engine.add(requests)
    except InvalidRequestError as error:  # a prompt past the context, say
        param = field if error.param in ("input", "documents") else error.param
        raise InvalidRequestError(str(error), param, error.code) from None
    record = access_record(raw)
    outputs = await until_disconnected(raw, collect_final(stream, record))
    record.prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return outputs
