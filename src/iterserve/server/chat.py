"""POST /v1/chat/completions: messages through the model's chat template, n choices."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from iterserve.core.outputs import TokenLogprobs
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
    ServingContext,
    Submitted,
    respond,
    sse,
    stream_events,
    submit,
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
    ctx.engine.check_group_size(params.n)  # before rendering the template
    logprobs = params.logprobs
    prompt = render_prompt(body, ctx)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    submitted = await submit(
        raw,
        ctx,
        request_id,
        [(request_id, prompt)],
        params,
        body.lane,
        body.priority,
        fill_context=body.token_limit is None,  # OpenAI chat: no limit means what is left
    )

    def final(outputs: list[RequestOutput], usage: UsageInfo) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=index,
                message=AssistantMessage(content=output.text),
                logprobs=_logprobs(output.logprobs, logprobs, ctx),
                finish_reason=output.finish_reason,
            )
            for index, output in enumerate(outputs)
        ]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    events = functools.partial(_stream, body, submitted, ctx, model)
    return await respond(raw, submitted, params.n, body.stream, events, final)


def _logprobs(
    entries: list[TokenLogprobs | None] | None, wanted: int | None, ctx: ServingContext
) -> ChatChoiceLogprobs | None:
    if wanted is None:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(entries or [], ctx.decode_token))


async def _stream(
    body: ChatCompletionRequest, submitted: Submitted, ctx: ServingContext, model: str
) -> AsyncIterator[str]:
    created = int(time.time())
    wanted = body.requested_logprobs()

    def message(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=submitted.request_id, created=created, model=model, choices=choices, usage=usage
        )
        return sse(chunk.model_dump_json())

    def chunk(index: int, output: RequestOutput) -> str:
        # The last chunk carries only the finish reason unless text came with it.
        text = output.delta_text if output.delta_text or not output.finished else None
        choice = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content=text),
            logprobs=_logprobs(output.delta_logprobs, wanted, ctx),
            finish_reason=output.finish_reason,
        )
        return message([choice])

    # The role first, for every choice, as OpenAI does: clients build the message from it.
    for index in range(len(submitted.stream.request_ids)):
        yield message(
            [ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]
        )
    usage_chunk = (lambda usage: message([], usage)) if body.include_usage else None
    async for event in stream_events(submitted, None, chunk, usage_chunk):
        yield event
