"""POST /v1/responses: OpenAI's Responses API over the chat path.

The request becomes a chat request (responses_protocol.py) and runs as one; the answer
is shaped as Responses output items: a `message` with one `output_text` part, then a
`function_call` item per call the tool parser read. Streamed, it is Responses' typed
events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
..., `response.completed`), each with its `sequence_number`.

A stored response (`store`, the default) is committed to the response store before the
last event (or the body) leaves: a client that saw it complete can chain to it, whatever
happens to the server next (response_chain.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from iterserve.chat.tool_parsers.streaming import ToolCallStream, parse_answer
from iterserve.core.outputs import TokenLogprobs
from iterserve.engine.outputs import RequestOutput
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.chat import ChatRun, start_chat
from iterserve.server.logprobs import chat_logprobs
from iterserve.server.protocol import UsageInfo
from iterserve.server.response_chain import known_tokens, previous_response, stored_response
from iterserve.server.responses_protocol import ResponsesRequest, new_item_id, responses_param
from iterserve.server.serving import (
    SSE_DONE,
    ServingContext,
    respond,
    sse_error,
    stream_events,
)

# Called with the final Response object and the engine's last output, before either leaves.
_Keep = Callable[[dict[str, Any], RequestOutput], Awaitable[None]]


async def create_response(body: ResponsesRequest, raw: Request, ctx: ServingContext) -> Response:
    store = ctx.response_store
    previous = await previous_response(body, store)
    try:
        chat = body.to_chat_request(previous.history if previous else [])
        run = await start_chat(chat, raw, ctx, id_prefix="resp_", known=known_tokens(previous))
    except InvalidRequestError as error:
        error.param = responses_param(error.param)
        raise
    shape = _Shape(body, run, int(time.time()))
    logprobs = _Logprobs(ctx) if run.params.logprobs is not None else None

    async def keep(response: dict[str, Any], output: RequestOutput) -> None:
        if body.stored:
            await store.save(stored_response(response, body, previous, output))

    async def final(outputs: list[RequestOutput], usage: UsageInfo) -> dict[str, Any]:
        output = outputs[0]
        text_logprobs = logprobs.of(output.logprobs) if logprobs else []
        items = _output_items(output, run, text_logprobs)
        response = shape.response(_status(output.finish_reason), items, usage)
        await keep(response, output)
        return response

    def events() -> AsyncIterator[str]:
        return _stream(shape, run, logprobs, keep)

    return await respond(raw, run.submitted, 1, body.stream, events, final)


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(text: str, status: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "message",
        "id": new_item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [_text_part(text, logprobs)],
    }


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


@dataclass(frozen=True)
class _Logprobs:
    """Token logprobs in the Responses shape, which is chat's: {token, logprob, bytes,
    top_logprobs}. With tool calls they cover every token, calls' included, as chat's do."""

    ctx: ServingContext

    def of(self, entries: list[TokenLogprobs | None] | None) -> list[dict[str, Any]]:
        return [entry.model_dump() for entry in chat_logprobs(entries or [], self.ctx.decode_token)]


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": new_item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _output_items(
    output: RequestOutput, run: ChatRun, logprobs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A message with the answer's text (unless it is calls alone), then its calls."""
    status = _status(output.finish_reason)
    reader = run.plan.reader
    if reader is None:
        return [_message_item(output.text, status, logprobs)]
    answer = parse_answer(reader, output.text, run.plan.max_calls)
    items = (
        [_message_item(answer.content or "", status, logprobs)]
        if answer.content or not answer.calls
        else []
    )
    items += [
        _call_item(reader.new_call_id(), call.name, call.arguments, "completed")
        for call in answer.calls
    ]
    return items


@dataclass(frozen=True)
class _Shape:
    """The fields of the Response object that do not change as it runs."""

    body: ResponsesRequest
    run: ChatRun
    created_at: int

    def response(
        self, status: str, output: list[dict[str, Any]], usage: UsageInfo | None
    ) -> dict[str, Any]:
        body, params = self.body, self.run.params
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.run.submitted.request_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.run.model,
            "output": output,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": body.stored,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else _usage(usage),
            **body.settings(),
        }


def _usage(usage: UsageInfo) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


@dataclass
class _Events:
    """The stream's typed events, numbered, and the output items they have built."""

    shape: _Shape
    items: list[dict[str, Any]] = field(default_factory=list)
    message: dict[str, Any] | None = None  # the message item being written, if any
    sequence: int = 0
    # Logprobs of tokens whose text is not out yet (held back: a stop string, a call).
    pending: list[dict[str, Any]] = field(default_factory=list)

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def response(self, kind: str, status: str) -> str:
        return self.event(kind, response=self.shape.response(status, self.items, None))

    def open_message(self) -> str:
        if self.message is not None:
            return ""
        self.message = _message_item("", "in_progress", [])
        self.items.append(self.message)
        where = {"item_id": self.message["id"], "output_index": len(self.items) - 1}
        part = _text_part("", [])
        return self.event(
            "response.output_item.added", output_index=where["output_index"], item=self.message
        ) + self.event("response.content_part.added", **where, content_index=0, part=part)

    def text(self, delta: str) -> str:
        """The text made since the last event, with the logprobs of its tokens (and of
        those held back before it)."""
        opened = self.open_message()
        assert self.message is not None
        part = self.message["content"][0]
        part["text"] += delta
        logprobs, self.pending = self.pending, []
        part["logprobs"] += logprobs
        where = {"item_id": self.message["id"], "output_index": len(self.items) - 1}
        return opened + self.event(
            "response.output_text.delta", **where, content_index=0, delta=delta, logprobs=logprobs
        )

    def close_message(self, status: str) -> str:
        message, self.message = self.message, None
        if message is None:
            return ""
        message["status"] = status
        where = {"item_id": message["id"], "output_index": self.items.index(message)}
        part = message["content"][0]
        part["logprobs"] += self.pending  # tokens whose text never came out
        self.pending = []
        return (
            self.event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            )
            + self.event("response.content_part.done", **where, content_index=0, part=part)
            + self.event(
                "response.output_item.done", output_index=where["output_index"], item=message
            )
        )

    def call(self, call_id: str, name: str, arguments: str) -> str:
        events = self.close_message("completed")
        item = _call_item(call_id, name, "", "in_progress")
        self.items.append(item)
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        events += self.event("response.output_item.added", output_index=index, item=item)
        events += self.event("response.function_call_arguments.delta", **where, delta=arguments)
        item["arguments"], item["status"] = arguments, "completed"
        events += self.event("response.function_call_arguments.done", **where, arguments=arguments)
        return events + self.event("response.output_item.done", output_index=index, item=item)


async def _stream(
    shape: _Shape, run: ChatRun, logprobs: _Logprobs | None, keep: _Keep
) -> AsyncIterator[str]:
    events = _Events(shape)
    yield events.response("response.created", "in_progress")
    yield events.response("response.in_progress", "in_progress")
    reader = run.plan.reader
    calls = None if reader is None else ToolCallStream(reader, run.plan.max_calls)
    last: list[RequestOutput] = []  # the finished output
    final: list[dict[str, Any]] = []  # the Response object the last event will carry

    def on_output(_: int, output: RequestOutput) -> str:
        if logprobs is not None:
            events.pending += logprobs.of(output.delta_logprobs)
        if calls is None:
            text, new_calls = output.delta_text, []
        else:
            found = calls.feed(output.delta_text, output.finished)
            text, new_calls = found.content, found.new_calls
        chunk = events.text(text) if text else ""
        for _, call_id, call in new_calls:
            chunk += events.call(call_id, call.name, call.arguments)
        if output.finished:
            last.append(output)
        return chunk

    def on_end(usage: UsageInfo) -> str:
        status = _status(last[0].finish_reason)
        # An answer with neither text nor calls is still one (empty) message, as unstreamed.
        opened = events.open_message() if not events.items else ""
        closed = events.close_message(status)
        final.append(shape.response(status, events.items, usage))
        return opened + closed

    async for chunk in stream_events(run.submitted, None, on_output, on_end, done=False):
        if chunk:  # a token whose text is held back (a stop string, a call) has no event
            yield chunk
    if not final:  # the engine failed: stream_events has said so
        return
    response = final[0]
    try:
        await keep(response, last[0])
    except Exception as error:  # not kept: the response must not say it completed
        yield sse_error(error) + SSE_DONE  # as stream_events ends a failed stream
        return
    yield events.event(f"response.{response['status']}", response=response)
