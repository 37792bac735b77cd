"""POST /v1/chat/completions: messages through the model's chat template, n choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.engine.async_engine import RequestStream, expand_n
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import RenderedChat, render_chat
from iterserve.server.logprobs import chat_logprobs
from iterserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
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


def render_prompt(body: ChatCompletionRequest, ctx: ServingContext) -> RenderedChat:
    """The conversation through the template, as `LLM.chat` renders it; the engine
    tokenizes it on its own thread."""
    messages = [message.as_template_input() for message in body.messages]
    return render_chat(
        ctx.tokenizer,
        ctx.chat_template,
        messages,
        body.add_generation_prompt,
        body.chat_template_kwargs,
    )


async def create_chat_completion(
    body: ChatCompletionRequest, raw: Request, ctx: ServingContext
) -> Response:
    model = ctx.resolve_model(body.model)
    params = body.sampling_params()
    ctx.engine.check_group_size(params.n)
    logprobs = params.logprobs
    prompt = render_prompt(body, ctx)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    record = access_record(raw)
    record.request_id = request_id
    requests = expand_n(
        prompt,
        params,
        request_id,
        lane=body.lane,
        priority=body.priority,
        arrival_time=time.monotonic(),
        fill_context=body.token_limit is None,  # OpenAI chat: no limit means what is left
    )
    stream = await ctx.engine.add(requests)
    headers = {"X-Request-Id": request_id}
    if body.stream:
        response = EngineStreamResponse(
            _stream(body, stream, ctx, model, request_id, record), stream
        )
        response.headers.update(headers)
        return response

    outputs = await until_disconnected(raw, collect_final(stream, record))
    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content=output.text),
            logprobs=_logprobs(output.logprobs, logprobs, ctx),
            finish_reason=output.finish_reason,
        )
        for index, output in enumerate(outputs)
    ]
    usage = usage_of(outputs, len(outputs))
    record.prompt_tokens = usage.prompt_tokens
    result = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    return JSONResponse(result.model_dump(mode="json"), headers=headers)


def _logprobs(
    entries: list | None, wanted: int | None, ctx: ServingContext
) -> ChatChoiceLogprobs | None:
    if wanted is None:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(entries or [], ctx.decode_token))


async def _stream(
    body: ChatCompletionRequest,
    stream: RequestStream,
    ctx: ServingContext,
    model: str,
    request_id: str,
    record: AccessRecord,
) -> AsyncIterator[str]:
    created = int(time.time())
    wanted = body.requested_logprobs()

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        message = ChatCompletionChunk(
            id=request_id, created=created, model=model, choices=choices, usage=usage
        )
        return sse(message.model_dump_json())

    # The role first, for every choice, as OpenAI does: clients build the message from it.
    for index in range(len(stream.request_ids)):
        yield chunk(
            [ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]
        )
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
                # The last chunk carries only the finish reason unless text came with it.
                text = output.delta_text if output.delta_text or not output.finished else None
                delta = DeltaMessage(content=text)
                choice = ChatStreamChoice(
                    index=index,
                    delta=delta,
                    logprobs=_logprobs(output.delta_logprobs, wanted, ctx),
                    finish_reason=output.finish_reason,
                )
                yield chunk([choice])
    except Exception as error:  # the 200 is out: report it in the stream
        yield sse_error(error)
        yield SSE_DONE
        return
    usage = usage_of([finals[i] for i in sorted(finals)], len(finals))
    record.prompt_tokens = usage.prompt_tokens
    if body.include_usage:
        yield chunk([], usage)
    yield SSE_DONE
