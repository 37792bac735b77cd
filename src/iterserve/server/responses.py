"""POST /v1/responses: OpenAI's Responses API over the chat path.

The request becomes a chat request (responses_protocol.py) and runs as one; the answer
is shaped as Responses output items: a thinking model's `reasoning` item (its thinking as
one `reasoning_text` part), a `message` with one `output_text` part, then a
`function_call` item per call the tool parser read. Streamed, it is Responses' typed
events (`response.created`, `response.output_item.added`, `response.reasoning_text.delta`,
`response.output_text.delta`, ..., `response.completed`), each with its `sequence_number`.

A stored response (`store`, the default) is committed to the response store before the
last event (or the body) leaves: a client that saw it complete can chain to it, whatever
happens to the server next (response_chain.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from iterserve.chat.answer import Answer, AnswerStream, read_answer
from iterserve.chat.tool_parsers import AnswerReader
from iterserve.core.outputs import TokenLogprobs
from iterserve.engine.outputs import RequestOutput
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.chat import ChatRun, start_chat
from iterserve.server.conversation_store import ConversationStore
from iterserve.server.logprobs import chat_logprobs
from iterserve.server.protocol import UsageInfo
from iterserve.server.response_chain import (
    conversation_history,
    known_tokens,
    previous_response,
    stored_response,
)
from iterserve.server.response_truncation import fitted_history
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
    if body.reasoning is not None and body.reasoning.asks_for_thinking and ctx.reasoning is None:
        raise InvalidRequestError(
            "reasoning is not supported by this model: the server reads no thinking from its "
            "answers (a model with <think> in its chat template, or --reasoning-parser)",
            "reasoning",
        )
    store, conversations = ctx.response_store, ConversationStore(ctx.response_store)
    conversation = await conversation_history(body, conversations)
    previous = await previous_response(body, store)
    try:
        history = previous.history if previous else conversation or []
        if body.truncation == "auto" and history:  # renders the prompt a few times: off the loop
            history = await asyncio.to_thread(fitted_history, body, history, ctx)
        chat = body.to_chat_request(history, images=ctx.image_marker is not None)
        run = await start_chat(chat, raw, ctx, id_prefix="resp_", known=known_tokens(previous))
    except InvalidRequestError as error:
        error.param = responses_param(error.param)
        raise
    shape = _Shape(body, run, int(time.time()))
    logprobs = _Logprobs(ctx) if run.params.logprobs is not None else None

    async def keep(response: dict[str, Any], output: RequestOutput) -> None:
        if body.stored:
            await store.save(stored_response(response, body, previous, output))
        if (conversation_id := body.conversation_id) is not None:
            # The conversation goes on with this turn: its input, then its output.
            items = [*body.input_items(), *response["output"]]
            await conversations.add(conversation_id, items)

    async def final(outputs: list[RequestOutput], usage: UsageInfo) -> dict[str, Any]:
        output = outputs[0]
        text_logprobs = logprobs.of(output.logprobs) if logprobs else []
        answer = read_answer(output.text, run.reasoning, run.plan)
        usage.completion_tokens_details.reasoning_tokens = run.reasoning_tokens(
            ctx, output.token_ids, answer.thought
        )
        status = _status(output.finish_reason)
        items = _output_items(answer, status, text_logprobs, run.plan.reader)
        response = shape.response(status, items, usage)
        await keep(response, output)
        return response

    def events() -> AsyncIterator[str]:
        return _stream(shape, run, ctx, logprobs, keep)

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


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    """The thinking as OpenAI's reasoning item: no summary is made, the text is its one
    `reasoning_text` part."""
    return {
        "type": "reasoning",
        "id": new_item_id("rs"),
        "summary": [],
        "content": [_reasoning_part(text)],
        "status": status,
    }


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


@dataclass(frozen=True)
class _Logprobs:
    """Token logprobs in the Responses shape, which is chat's: {token, logprob, bytes,
    top_logprobs}. With tool calls they cover every token, calls' included, as chat's do."""

    ctx: ServingContext

    def of(self, entries: list[TokenLogprobs | None] | None) -> list[dict[str, Any]]:
        entries = entries or []
        logprobs = chat_logprobs(entries, self.ctx.decode_token, self.ctx.token_bytes)
        return [entry.model_dump() for entry in logprobs]


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
    answer: Answer, status: str, logprobs: list[dict[str, Any]], reader: AnswerReader | None
) -> list[dict[str, Any]]:
    """The thinking's reasoning item, a message with the answer's text (unless it is calls
    alone, or thinking alone: max_output_tokens ran out in it), then its calls."""
    items = [] if answer.reasoning is None else [_reasoning_item(answer.reasoning, status)]
    if answer.content or not (answer.calls or answer.reasoning):
        items.append(_message_item(answer.content or "", status, logprobs))
    items += [
        _call_item(reader.new_call_id(), call.name, call.arguments, "completed")
        for call in answer.calls
        if reader is not None  # calls are read by a reader only
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
            "store": body.stored,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "truncation": body.truncation or "disabled",
            "usage": None if usage is None else _usage(usage),
            **body.settings(),
        }


def _usage(usage: UsageInfo) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": usage.completion_tokens_details.reasoning_tokens
        },
        "total_tokens": usage.total_tokens,
    }


@dataclass
class _Events:
    """The stream's typed events, numbered, and the output items they have built."""

    shape: _Shape
    items: list[dict[str, Any]] = field(default_factory=list)
    reasoning: dict[str, Any] | None = None  # the reasoning item being written, if any
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

    def thinking(self, delta: str) -> str:
        """Thinking made since the last event, in the reasoning item (opened on its first)."""
        opened = ""
        if self.reasoning is None:
            self.reasoning = _reasoning_item("", "in_progress")
            self.items.append(self.reasoning)
            index = len(self.items) - 1
            where = {"item_id": self.reasoning["id"], "output_index": index}
            opened = self.event(
                "response.output_item.added", output_index=index, item=self.reasoning
            ) + self.event(
                "response.content_part.added", **where, content_index=0, part=_reasoning_part("")
            )
        part = self.reasoning["content"][0]
        part["text"] += delta
        where = {"item_id": self.reasoning["id"], "output_index": self.items.index(self.reasoning)}
        return opened + self.event(
            "response.reasoning_text.delta", **where, content_index=0, delta=delta
        )

    def close_reasoning(self, status: str) -> str:
        item, self.reasoning = self.reasoning, None
        if item is None:
            return ""
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        part = item["content"][0]
        return (
            self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            + self.event("response.content_part.done", **where, content_index=0, part=part)
            + self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )

    def open_message(self) -> str:
        if self.message is not None:
            return ""
        closed = self.close_reasoning("completed")  # the answer follows the thinking
        self.message = _message_item("", "in_progress", [])
        self.items.append(self.message)
        where = {"item_id": self.message["id"], "output_index": len(self.items) - 1}
        part = _text_part("", [])
        return (
            closed
            + self.event(
                "response.output_item.added", output_index=where["output_index"], item=self.message
            )
            + self.event("response.content_part.added", **where, content_index=0, part=part)
        )

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
        events = self.close_reasoning("completed") + self.close_message("completed")
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
    shape: _Shape, run: ChatRun, ctx: ServingContext, logprobs: _Logprobs | None, keep: _Keep
) -> AsyncIterator[str]:
    events = _Events(shape)
    yield events.response("response.created", "in_progress")
    yield events.response("response.in_progress", "in_progress")
    answer = AnswerStream.of(run.reasoning, run.plan)
    last: list[RequestOutput] = []  # the finished output
    final: list[dict[str, Any]] = []  # the Response object the last event will carry

    def on_output(_: int, output: RequestOutput) -> str:
        if logprobs is not None:
            events.pending += logprobs.of(output.delta_logprobs)
        found = answer.feed(output.delta_text, output.finished)
        chunk = events.thinking(found.reasoning) if found.reasoning else ""
        chunk += events.text(found.content) if found.content else ""
        for _, call_id, call in found.new_calls:
            chunk += events.call(call_id, call.name, call.arguments)
        if output.finished:
            last.append(output)
        return chunk

    def on_end(usage: UsageInfo) -> str:
        status = _status(last[0].finish_reason)
        usage.completion_tokens_details.reasoning_tokens = run.reasoning_tokens(
            ctx, last[0].token_ids, answer.thought
        )
        # An answer with neither text nor calls is still one (empty) message, as unstreamed
        # (but an answer that was all thinking).
        opened = events.open_message() if not events.items else ""
        closed = events.close_reasoning(status) + events.close_message(status)
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
