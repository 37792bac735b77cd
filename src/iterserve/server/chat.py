"""POST /v1/chat/completions: messages through the model's chat template, n choices; a
thinking model's thinking goes to `reasoning_content`, calls to `tool_calls`."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response
from PIL import Image

from iterserve.chat.answer import AnswerDelta, AnswerStream, read_answer
from iterserve.chat.image_parts import first_image_field, take_images
from iterserve.chat.messages import ChatMessage
from iterserve.chat.reasoning import cap_thinking
from iterserve.chat.reasoning_parsers import ThinkingReader
from iterserve.chat.tool_parsers import ParsedCall
from iterserve.chat.tool_prompt import render_with_tools
from iterserve.chat.tool_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from iterserve.chat.tools import ToolPlan, plan_tools
from iterserve.core.outputs import TokenLogprobs
from iterserve.engine.images import ImagesPrompt
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import RenderedChat, continuing, with_documents
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.server.logprobs import chat_logprobs, prompt_logprobs, token_names
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
    """The conversation through the template, as `LLM.chat` renders it (with the thinking
    switch `reasoning_effort` sets); the engine tokenizes it on its own thread. An image
    is its model's marker here (chat_prompt has the images)."""
    return _rendered(body, ctx, plan)[0]


def chat_prompt(
    body: ChatCompletionRequest, ctx: ServingContext, plan: ToolPlan
) -> RenderedChat | ImagesPrompt:
    """The conversation's prompt: its rendering, with its images if it has any."""
    rendered, images = _rendered(body, ctx, plan)
    return ImagesPrompt(rendered.text, tuple(images), rendered=True) if images else rendered


def prompt_tokens(body: ChatCompletionRequest, ctx: ServingContext, plan: ToolPlan) -> int:
    """How many tokens the conversation's prompt is, each image's by its size (the tower
    not run): what a count reports. Called off the event loop: the image URLs the server
    may read are read here."""
    read_images_now(body.messages, ctx)
    return len(ctx.prompt_token_ids(chat_prompt(body, ctx, plan)))


def read_images_now(messages: Sequence[ChatMessage], ctx: ServingContext) -> None:
    """Off the event loop: the image URLs the server may read, read into data URLs (a text
    model refuses an image part)."""
    _refuse_images(messages, ctx)
    if ctx.image_marker is not None and first_image_field(messages):
        asyncio.run(ctx.media.resolve(messages))


def _refuse_images(messages: Sequence[ChatMessage], ctx: ServingContext) -> None:
    if ctx.image_marker is None and (field := first_image_field(messages)):
        raise InvalidRequestError(f"{field}: this model takes no images (text only)", field)


def _rendered(
    body: ChatCompletionRequest, ctx: ServingContext, plan: ToolPlan
) -> tuple[RenderedChat, list[Image.Image]]:
    _refuse_images(body.messages, ctx)
    messages = [message.as_template_input(i) for i, message in enumerate(body.messages)]
    messages, images = take_images(messages)
    template = ctx.chat_template_for(body.chat_template)
    kwargs = ctx.template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
    rendered = render_with_tools(
        ctx.tokenizer,
        template,
        messages,
        plan,
        body.add_generation_prompt,
        with_documents(kwargs, body.documents, template),
        body.continue_final_message,
    )
    return rendered, images


def chat_plan(body: ChatCompletionRequest, ctx: ServingContext, params: SamplingParams) -> ToolPlan:
    """What the request's tools mean here (chat/tools.py); may adjust `params`."""
    return plan_tools(
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        ctx.chat_template_for(body.chat_template),
        ctx.tool_parser,
        params,
        ctx.special_tokens,
    )


@dataclass
class ChatRun:
    """A chat request accepted by the engine: what answering it needs, in either API's shape
    (this module's chat completions, responses.py's Responses)."""

    body: ChatCompletionRequest
    model: str  # the name to answer with
    params: SamplingParams
    plan: ToolPlan
    reasoning: ThinkingReader | None  # None: the answer is not read for thinking
    submitted: Submitted

    def reasoning_tokens(self, ctx: ServingContext, token_ids: list[int], thought: bool) -> int:
        return ctx.reasoning.reasoning_tokens(token_ids, thought) if ctx.reasoning else 0


async def start_chat(
    body: ChatCompletionRequest,
    raw: Request,
    ctx: ServingContext,
    id_prefix: str = "chatcmpl-",
    known: Sequence[Sequence[int]] = (),
    context_cuts: bool = False,
    params: SamplingParams | None = None,
) -> ChatRun:
    """Check the request, render the conversation and queue its choices. `known`: token
    sequences an earlier turn ran, longest first; the prompt keeps the first its rendering
    starts with (prompts.continuing), so that turn's cached blocks are found again.
    `context_cuts`: the token limit is a bound the context may cut (Anthropic's), not one
    that must fit in it (OpenAI's). `params`: the sampling an API reads in its own terms
    (Ollama's options), rather than the chat request's fields."""
    model = ctx.resolve_model(body.model)
    params = params or body.sampling_params(ctx.sampling_defaults)
    if body.prediction is not None:  # what drafts follow, where the engine speculates
        predicted = ctx.tokenizer.encode(body.prediction.text(), add_special_tokens=False)
        params.prediction = tuple(predicted) or None
    plan = chat_plan(body, ctx, params)
    ctx.engine.check_group_size(params.n)  # before rendering the template
    if ctx.image_marker is not None:
        await ctx.media.resolve(body.messages)  # file and web image URLs, where allowed
    prompt = chat_prompt(body, ctx, plan)
    if isinstance(prompt, RenderedChat):  # an earlier turn's tokens, where they still fit
        prompt = continuing(prompt, known, ctx.tokenizer)
    # The prompt says where the answer starts (in the thinking, or not); a grammar starts
    # after the thinking.
    reasoning = ctx.reasoning.prepare(prompt.text, params) if ctx.reasoning else None
    if body.thinking_token_budget is not None:
        cap_thinking(ctx.reasoning, reasoning, params, body.thinking_token_budget)
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
    submitted = await submit(
        raw,
        ctx,
        request_id,
        [(request_id, prompt)],
        params,
        body.lane,
        body.priority,
        # OpenAI chat: no limit means what is left.
        fill_context=context_cuts or body.token_limit is None,
        lora=ctx.loras.get(model),
    )
    return ChatRun(body, model, params, plan, reasoning, submitted)


async def create_chat_completion(
    body: ChatCompletionRequest, raw: Request, ctx: ServingContext
) -> Response:
    run = await start_chat(body, raw, ctx)
    logprobs = run.params.logprobs
    names = token_names(ctx.decode_token, body.return_tokens_as_token_ids)

    def final(outputs: list[RequestOutput], usage: UsageInfo) -> ChatCompletionResponse:
        choices = []
        for index, output in enumerate(outputs):
            answer = read_answer(output.text, run.reasoning, run.plan)
            usage.completion_tokens_details.reasoning_tokens += run.reasoning_tokens(
                ctx, output.token_ids, answer.thought
            )
            calls = _tool_calls(answer.calls, run.plan)
            message = AssistantMessage(
                content=answer.content,
                reasoning_content=answer.reasoning,
                tool_calls=calls or None,
            )
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=_logprobs(output.logprobs, logprobs, names, ctx.token_bytes),
                    finish_reason=_finish_reason(output.finish_reason, bool(calls)),
                    stop_reason=output.stop_reason,
                    token_ids=output.token_ids if body.return_token_ids else None,
                )
            )
        response = ChatCompletionResponse(
            id=run.submitted.request_id, model=run.model, choices=choices, usage=usage
        )
        # The choices share one prompt.
        if body.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs(
                outputs[0].prompt_logprobs or [], body.prompt_logprobs, ctx.decode_token
            )
        if body.return_token_ids:
            response.prompt_token_ids = outputs[0].prompt_token_ids
        return response

    events = functools.partial(_stream, body, run, ctx, names)
    return await respond(raw, run.submitted, run.params.n, body.stream, events, final)


def _tool_calls(calls: list[ParsedCall], plan: ToolPlan) -> list[ToolCall]:
    """The calls read in an answer, with ids from the parser that read them."""
    reader = plan.reader
    if reader is None:
        return []
    return [
        ToolCall(
            id=reader.new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments)
        )
        for call in calls
    ]


def _finish_reason(reason: str | None, called: bool) -> str | None:
    # An answer cut by max_tokens says so even when it holds calls: the last may be missing.
    return "tool_calls" if called and reason == "stop" else reason


def _logprobs(
    entries: list[TokenLogprobs | None] | None,
    wanted: int | None,
    names: Callable[[int], str],
    raw: Callable[[int], bytes],
) -> ChatChoiceLogprobs | None:
    if wanted is None:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(entries or [], names, raw))


def _answer_deltas(found: AnswerDelta) -> list[DeltaMessage]:
    """The reasoning and the content the parsers are sure of, then per finished call its
    id, type and name, then its arguments (OpenAI's order: clients open a call on its id)."""
    deltas = [DeltaMessage(reasoning_content=found.reasoning)] if found.reasoning else []
    deltas += [DeltaMessage(content=found.content)] if found.content else []
    for index, call_id, call in found.new_calls:
        head = DeltaFunctionCall(name=call.name, arguments="")
        opening = DeltaToolCall(index=index, id=call_id, type="function", function=head)
        arguments = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments))
        deltas += [DeltaMessage(tool_calls=[opening]), DeltaMessage(tool_calls=[arguments])]
    return deltas


async def _stream(
    body: ChatCompletionRequest, run: ChatRun, ctx: ServingContext, names: Callable[[int], str]
) -> AsyncIterator[str]:
    submitted, model, plan = run.submitted, run.model, run.plan
    created = int(time.time())
    wanted = body.requested_logprobs()

    def ids(tokens: list[int]) -> list[int] | None:
        """A chunk's tokens, for vLLM's return_token_ids ([] on a chunk that holds none)."""
        return tokens if body.return_token_ids else None

    def message(
        choices: list[ChatStreamChoice],
        usage: UsageInfo | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        chunk = ChatCompletionChunk(
            id=submitted.request_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_token_ids,
        )
        return sse(chunk.model_dump_json())

    def chunk(index: int, output: RequestOutput) -> str:
        # The last chunk carries only the finish reason unless text came with it.
        text = output.delta_text if output.delta_text or not output.finished else None
        choice = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content=text),
            logprobs=_logprobs(output.delta_logprobs, wanted, names, ctx.token_bytes),
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            token_ids=ids(output.delta_token_ids),
        )
        return message([choice])

    answers: dict[int, AnswerStream] = {}
    reasoning_tokens: dict[int, int] = {}

    def answer_chunks(index: int, output: RequestOutput) -> str:
        stream = answers.setdefault(index, AnswerStream.of(run.reasoning, plan))
        found = stream.feed(output.delta_text, output.finished)
        if output.finished:
            reasoning_tokens[index] = run.reasoning_tokens(ctx, output.token_ids, stream.thought)
        # Every token gets a chunk (see stream_events), an empty one while text is held.
        deltas = _answer_deltas(found) or [DeltaMessage(content="")]
        choices = [
            ChatStreamChoice(index=index, delta=delta, token_ids=ids([])) for delta in deltas
        ]
        # The token's logprobs, ids and finish reason go on the last of them.
        choices[-1].logprobs = _logprobs(output.delta_logprobs, wanted, names, ctx.token_bytes)
        choices[-1].finish_reason = _finish_reason(output.finish_reason, stream.called)
        choices[-1].stop_reason = output.stop_reason
        choices[-1].token_ids = ids(output.delta_token_ids)
        return "".join(message([choice]) for choice in choices)

    def usage_message(usage: UsageInfo) -> str:
        usage.completion_tokens_details.reasoning_tokens = sum(reasoning_tokens.values())
        return message([], usage)

    def role(index: int, prompt_token_ids: list[int] | None = None) -> str:
        choice = ChatStreamChoice(
            index=index, delta=DeltaMessage(role="assistant", content=""), token_ids=ids([])
        )
        return message([choice], prompt_token_ids=prompt_token_ids)

    usage_chunk = usage_message if body.include_usage else None
    read = plan.reader is not None or run.reasoning is not None
    on_output = answer_chunks if read else chunk
    if body.return_token_ids:
        # The prompt's ids go on the first chunk, as vLLM sends them, and they are known once
        # the engine has tokenized the prompt: each choice's role goes with its first output.
        announced: set[int] = set()

        def announced_first(index: int, output: RequestOutput) -> str:
            head = ""
            if index not in announced:
                head = role(index, None if announced else output.prompt_token_ids)
                announced.add(index)
            return head + on_output(index, output)

        async for event in stream_events(submitted, None, announced_first, usage_chunk):
            yield event
        return
    # The role first, for every choice, as OpenAI does: clients build the message from it.
    for index in range(len(submitted.stream.request_ids)):
        yield role(index)
    async for event in stream_events(submitted, None, on_output, usage_chunk):
        yield event
