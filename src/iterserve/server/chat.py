"""POST /v1/chat/completions: messages through the model's chat template, n choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.engine.async_engine import RequestStream, expand_n
from iterserve.engine.outputs import RequestOutput
from iterserve.sampling_params import InvalidRequestError
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


def render_prompt(body: ChatCompletionRequest, ctx: ServingContext) -> str:
    """The conversation as text; the engine tokenizes it on its own thread.

    Rendering to text and encoding without special tokens gives the same ids
    as `apply_chat_template(tokenize=True)` (which is exactly that), so the
    server sees the same prompt as `LLM.chat`.
    """
    if not ctx.chat_template:
        raise InvalidRequestError("this model has no chat template; use /v1/completions")
    if not body.messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    messages = [message.as_template_input() for message in body.messages]
    try:
        return ctx.tokenizer.apply_chat_template(
            messages,
            chat_template=ctx.chat_template,
            add_generation_prompt=body.add_generation_prompt,
            tokenize=False,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as error:  # jinja raises for conversations the template forbids
        raise InvalidRequestError(
            f"the chat template cannot render these messages: {error}", "messages"
        ) from error


async def create_chat_completion(
    body: ChatCompletionRequest, raw: Request, ctx: ServingContext
) -> Response:
    model = ctx.resolve_model(body.model)
    limit = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    logprobs = body.requested_logprobs()
    params = body.to_sampling_params(16 if limit is None else limit, logprobs)
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
        fill_context=limit is None,  # OpenAI chat: no limit means what the context leaves
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
                if not (output.delta_text or output.delta_logprobs or output.finished):
                    continue  # held back (a possible stop string, half a character)
                delta = (
                    DeltaMessage(content=output.delta_text) if output.delta_text else DeltaMessage()
                )
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
