"""POST /v1/completions: one or more prompts, n choices each, streamed or not.

Choice `i * n + j` is choice j of prompt i, as in OpenAI's API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.engine.async_engine import RequestStream, expand_n
from iterserve.engine.outputs import RequestOutput
from iterserve.server.logprobs import completion_logprobs
from iterserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from iterserve.server.serving import (
    SSE_DONE,
    AccessRecord,
    EngineStreamResponse,
    ServingContext,
    access_record,
    collect_final,
    sse,
    sse_error,
    until_disconnected,
    usage_of,
)


async def create_completion(body: CompletionRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.resolve_model(body.model)
    body.check_supported()
    # An explicit null means "all the context allows": the engine fills it in once the
    # prompt is tokenized; 16 only stands in until then.
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    params = body.to_sampling_params(max_tokens, body.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    record = access_record(raw)
    record.request_id = request_id
    arrival = time.monotonic()
    prompts = body.prompts()
    ctx.engine.check_group_size(params.n * len(prompts))  # before building them all
    requests = []
    for prompt_index, prompt in enumerate(prompts):
        requests += expand_n(
            prompt,
            params,
            f"{request_id}-{prompt_index}",
            lane=body.lane,
            priority=body.priority,
            arrival_time=arrival,
            fill_context=body.max_tokens is None,
        )
    stream = await ctx.engine.add(requests)
    headers = {"X-Request-Id": request_id}
    if body.stream:
        chunks = _stream(body, stream, ctx, model, request_id, record, n=params.n)
        response = EngineStreamResponse(chunks, stream)
        response.headers.update(headers)
        return response

    outputs = await until_disconnected(raw, collect_final(stream, record))
    choices = [_choice(i, out, body.logprobs is not None, ctx) for i, out in enumerate(outputs)]
    usage = usage_of(outputs, params.n)
    record.prompt_tokens = usage.prompt_tokens
    result = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    return JSONResponse(result.model_dump(mode="json"), headers=headers)


def _choice(
    index: int, output: RequestOutput, logprobs: bool, ctx: ServingContext
) -> CompletionChoice:
    return CompletionChoice(
        index=index,
        text=output.text,
        logprobs=completion_logprobs(output.logprobs or [], ctx.decode_token, 0)
        if logprobs
        else None,
        finish_reason=output.finish_reason,
    )


async def _stream(
    body: CompletionRequest,
    stream: RequestStream,
    ctx: ServingContext,
    model: str,
    request_id: str,
    record: AccessRecord,
    n: int,
) -> AsyncIterator[str]:
    created = int(time.time())
    text_length: dict[int, int] = {}  # where the next delta starts, for logprobs' text_offset
    finals: dict[int, RequestOutput] = {}
    try:
        async with stream:
            async for index, output in stream:
                record.saw(output)
                if output.finished:
                    finals[index] = output
                if not (output.delta_token_ids or output.finished):
                    continue
                # A token whose text is held back (half a UTF-8 character, a possible stop
                # string) or has none (a special token) still gets its chunk, with empty
                # text, as vLLM sends it: a client's TBT then sees every token.
                logprobs = None
                if body.logprobs is not None:
                    offset = text_length.get(index, 0)
                    logprobs = completion_logprobs(output.delta_logprobs, ctx.decode_token, offset)
                text_length[index] = text_length.get(index, 0) + len(output.delta_text)
                chunk = CompletionResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=output.delta_text,
                            logprobs=logprobs,
                            finish_reason=output.finish_reason,
                        )
                    ],
                )
                yield sse(chunk.model_dump_json())
    except Exception as error:  # the 200 is out: report it in the stream
        yield sse_error(error)
        yield SSE_DONE
        return
    outputs = [finals[i] for i in sorted(finals)]
    usage = usage_of(outputs, n)
    record.prompt_tokens = usage.prompt_tokens
    if body.include_usage:
        chunk = CompletionResponse(
            id=request_id, created=created, model=model, choices=[], usage=usage
        )
        yield sse(chunk.model_dump_json())
    yield SSE_DONE
