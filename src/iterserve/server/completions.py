"""POST /v1/completions: one or more prompts, n choices each, streamed or not.

Choice `i * n + j` is choice j of prompt i, as in OpenAI's API.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from iterserve.engine.fill_in_middle import fill_in_middle_prompts
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompt_embeds import EmbedsPrompt, decode_prompt_embeds
from iterserve.engine.prompts import Prompt
from iterserve.engine.request_stream import ALL_THE_CONTEXT
from iterserve.server.echo import Echo
from iterserve.server.logprobs import completion_logprobs, prompt_logprobs, token_names
from iterserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from iterserve.server.serving import ServingContext, Submitted, respond, sse, stream_events, submit


async def create_completion(body: CompletionRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.resolve_model(body.model)
    body.check_supported()
    # An explicit null means "all the context allows": the engine settles it once the
    # prompt is tokenized.
    max_tokens = ALL_THE_CONTEXT if body.max_tokens is None else body.max_tokens
    # Echo-only still samples one token (the engine always does); it is left out.
    scores_prompt = body.echo and body.logprobs is not None
    params = body.to_sampling_params(
        1 if body.echo_only else max_tokens,
        body.logprobs,
        ctx.sampling_defaults,
        body.logprobs if scores_prompt else None,
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    texts = body.prompts()
    if body.suffix:  # the text after the cursor: ask for what goes between
        texts = fill_in_middle_prompts(texts, body.suffix, ctx.fill_in_middle)
    # vLLM's order: the prompts given as rows first.
    given = [EmbedsPrompt(decode_prompt_embeds(rows)) for rows in body.embedded_prompts()]
    runs: list[Prompt] = [*given, *texts]
    prompts = [(f"{request_id}-{i}", prompt) for i, prompt in enumerate(runs)]
    # One per prompt; choice i * n + j is of prompt i. A cut prompt echoes what ran.
    echoes = [
        Echo(
            prompt if isinstance(prompt, str) and params.truncation is None else None,
            ctx.tokenizer.decode,
            body.echo_only,
            body.logprobs,
        )
        if body.echo
        else None
        for _, prompt in prompts
    ]
    names = token_names(ctx.decode_token, body.return_tokens_as_token_ids)
    submitted = await submit(
        raw,
        ctx,
        request_id,
        prompts,
        params,
        body.lane,
        body.priority,
        fill_context=body.max_tokens is None,
        lora=ctx.loras.get(model),
    )

    def final(outputs: list[RequestOutput], usage: UsageInfo) -> CompletionResponse:
        wants_logprobs = body.logprobs is not None
        choices = [
            _choice(i, out, wants_logprobs, names, echoes[i // params.n])
            for i, out in enumerate(outputs)
        ]
        for choice, output in zip(choices, outputs, strict=True):
            _add_token_fields(choice, output, body, ctx)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    events = functools.partial(_stream, body, submitted, ctx, model, params.n, echoes, names)
    return await respond(raw, submitted, params.n, body.stream, events, final)


def _choice(
    index: int,
    output: RequestOutput,
    logprobs: bool,
    names: Callable[[int], str],
    echo: Echo | None,
) -> CompletionChoice:
    entries = completion_logprobs(output.logprobs or [], names, 0) if logprobs else None
    text = output.text
    if echo is not None:
        text, entries = echo.text(output, text), echo.logprobs(output, entries, names)
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=entries,
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
    )


def _add_token_fields(
    choice: CompletionChoice, output: RequestOutput, body: CompletionRequest, ctx: ServingContext
) -> None:
    """vLLM's prompt_logprobs and return_token_ids, where the request asked for them."""
    if body.prompt_logprobs is not None:
        choice.prompt_logprobs = prompt_logprobs(
            output.prompt_logprobs or [], body.prompt_logprobs, ctx.decode_token
        )
    if body.return_token_ids:
        choice.prompt_token_ids = output.prompt_token_ids
        choice.token_ids = [] if body.echo_only else output.token_ids


def _stream(
    body: CompletionRequest,
    submitted: Submitted,
    ctx: ServingContext,
    model: str,
    n: int,
    echoes: list[Echo | None],
    names: Callable[[int], str],
) -> AsyncIterator[str]:
    created = int(time.time())
    text_length: dict[int, int] = {}  # where the next delta starts, for logprobs' text_offset

    def chunk(index: int, output: RequestOutput) -> str:
        echo = echoes[index // n]
        first = index not in text_length
        offset = text_length.get(index, 0)
        text, logprobs = output.delta_text, None
        if body.logprobs is not None:
            logprobs = completion_logprobs(output.delta_logprobs, names, offset)
        if echo is not None:
            text, logprobs = echo.delta(output, text, logprobs, first, names)
        text_length[index] = offset + len(text)
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )
        if body.return_token_ids:
            choice.prompt_token_ids = output.prompt_token_ids if first else None
            choice.token_ids = [] if body.echo_only else output.delta_token_ids
        return message([choice])

    def message(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        response = CompletionResponse(
            id=submitted.request_id, created=created, model=model, choices=choices, usage=usage
        )
        return sse(response.model_dump_json())

    def usage_chunk(usage: UsageInfo) -> str:
        return message([], usage)

    return stream_events(submitted, n, chunk, usage_chunk if body.include_usage else None)
