"""POST /v1/chat/completions: messages through the model's chat template, n choices."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from iterserve.chat.tool_parsers.streaming import (
    StreamDelta,
    ToolCallStream,
    parse_answer,
)
from iterserve.chat.tool_prompt import render_with_tools
from iterserve.chat.tool_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from iterserve.chat.tools import ToolPlan, plan_tools
from iterserve.core.outputs import TokenLogprobs
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import RenderedChat, continuing
from iterserve.sampling_params import SamplingParams
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
from iterserve.server.serving import ServingContext, Submitted, respond, sse, stream_events, submit


def render_prompt(body: ChatCompletionRequest, ctx: ServingContext, plan: ToolPlan) -> RenderedChat:
    """The conversation through the template, as `LLM.chat` renders it; the engine
    tokenizes it on its own thread."""
    messages = [message.as_template_input(i) for i, message in enumerate(body.messages)]
    return render_with_tools(
        ctx.tokenizer,
        ctx.chat_template,
        messages,
        plan,
        body.add_generation_prompt,
        body.chat_template_kwargs,
    )


@dataclass
class ChatRun:
    """A chat request accepted by the engine: what answering it needs, in either API's shape
    (this module's chat completions, responses.py's Responses)."""

    body: ChatCompletionRequest
    model: str  # the name to answer with
    params: SamplingParams
    plan: ToolPlan
    submitted: Submitted


async def start_chat(
    body: ChatCompletionRequest,
    raw: Request,
    ctx: ServingContext,
    id_prefix: str = "chatcmpl-",
    known: Sequence[Sequence[int]] = (),
) -> ChatRun:
    """Check the request, render the conversation and queue its choices. `known`: token
    sequences an earlier turn ran, longest first; the prompt keeps the first its rendering
    starts with (prompts.continuing), so that turn's cached blocks are found again."""
    model = ctx.resolve_model(body.model)
    params = body.sampling_params()
    plan = plan_tools(
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        ctx.chat_template,
        ctx.tool_parser,
        params,
        ctx.special_tokens,
    )
    ctx.engine.check_group_size(params.n)  # before rendering the template
    prompt = continuing(render_prompt(body, ctx, plan), known, ctx.tokenizer)
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
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
    return ChatRun(body, model, params, plan, submitted)


async def create_chat_completion(
    body: ChatCompletionRequest, raw: Request, ctx: ServingContext
) -> Response:
    run = await start_chat(body, raw, ctx)
    logprobs = run.params.logprobs

    def final(outputs: list[RequestOutput], usage: UsageInfo) -> ChatCompletionResponse:
        choices = [
            _choice(index, output, run.plan, _logprobs(output.logprobs, logprobs, ctx))
            for index, output in enumerate(outputs)
        ]
        return ChatCompletionResponse(
            id=run.submitted.request_id, model=run.model, choices=choices, usage=usage
        )

    events = functools.partial(_stream, body, run.submitted, ctx, run.model, run.plan)
    return await respond(raw, run.submitted, run.params.n, body.stream, events, final)


def _choice(
    index: int, output: RequestOutput, plan: ToolPlan, logprobs: ChatChoiceLogprobs | None
) -> ChatChoice:
    reader = plan.reader
    if reader is None:
        message = AssistantMessage(content=output.text)
        return ChatChoice(
            index=index, message=message, logprobs=logprobs, finish_reason=output.finish_reason
        )
    answer = parse_answer(reader, output.text, plan.max_calls)
    calls = [
        ToolCall(
            id=reader.new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments)
        )
        for call in answer.calls
    ]
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=answer.content, tool_calls=calls or None),
        logprobs=logprobs,
        finish_reason=_finish_reason(output.finish_reason, bool(calls)),
    )


def _finish_reason(reason: str | None, called: bool) -> str | None:
    # An answer cut by max_tokens says so even when it holds calls: the last may be missing.
    return "tool_calls" if called and reason == "stop" else reason


def _logprobs(
    entries: list[TokenLogprobs | None] | None, wanted: int | None, ctx: ServingContext
) -> ChatChoiceLogprobs | None:
    if wanted is None:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(entries or [], ctx.decode_token))


def _tool_deltas(found: StreamDelta) -> list[DeltaMessage]:
    """The content the parser is sure of, then per finished call its id, type and name,
    then its arguments (OpenAI's order: clients open a call on its id)."""
    deltas = [DeltaMessage(content=found.content)] if found.content else []
    for index, call_id, call in found.new_calls:
        head = DeltaFunctionCall(name=call.name, arguments="")
        opening = DeltaToolCall(index=index, id=call_id, type="function", function=head)
        arguments = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments))
        deltas += [DeltaMessage(tool_calls=[opening]), DeltaMessage(tool_calls=[arguments])]
    return deltas


async def _stream(
    body: ChatCompletionRequest,
    submitted: Submitted,
    ctx: ServingContext,
    model: str,
    plan: ToolPlan,
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

    reader = plan.reader
    calls: dict[int, ToolCallStream] = {}

    def tool_chunks(index: int, output: RequestOutput) -> str:
        assert reader is not None
        stream = calls.setdefault(index, ToolCallStream(reader, plan.max_calls))
        found = stream.feed(output.delta_text, output.finished)
        # Every token gets a chunk (see stream_events), an empty one while text is held.
        deltas = _tool_deltas(found) or [DeltaMessage(content="")]
        choices = [ChatStreamChoice(index=index, delta=delta) for delta in deltas]
        # The token's logprobs and the finish reason go on the last of them.
        choices[-1].logprobs = _logprobs(output.delta_logprobs, wanted, ctx)
        choices[-1].finish_reason = _finish_reason(output.finish_reason, stream.called)
        return "".join(message([choice]) for choice in choices)

    # The role first, for every choice, as OpenAI does: clients build the message from it.
    for index in range(len(submitted.stream.request_ids)):
        yield message(
            [ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]
        )
    usage_chunk = (lambda usage: message([], usage)) if body.include_usage else None
    on_output = chunk if reader is None else tool_chunks
    async for event in stream_events(submitted, None, on_output, usage_chunk):
        yield event
