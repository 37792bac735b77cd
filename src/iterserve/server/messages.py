"""POST /v1/messages: Anthropic's Messages API over the chat path, and
POST /v1/messages/count_tokens.

The request becomes a chat request (messages_protocol.py) and runs as one; the answer is
shaped as Anthropic's content blocks: a thinking model's `thinking` block, a `text` block,
then a `tool_use` block per call the tool parser read. Streamed, it is Anthropic's events,
named on their `event:` lines: `message_start`, then per block `content_block_start`, its
deltas (`thinking_delta` and a closing `signature_delta`, `text_delta`,
`input_json_delta`) and `content_block_stop`, then `message_delta` (the stop reason and
usage) and `message_stop`.

A thinking block's `signature` is a digest of its text: Anthropic's lets its servers check
that thinking sent back is unchanged; here thinking sent back is read as it comes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from iterserve.chat.answer import Answer, AnswerStream, read_answer
from iterserve.chat.tool_parsers import AnswerReader
from iterserve.engine.outputs import RequestOutput
from iterserve.invalid_request import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError
from iterserve.server.chat import ChatRun, chat_plan, prompt_tokens, start_chat
from iterserve.server.context_edits import apply_edits, read_edits
from iterserve.server.errors import anthropic_error_body, as_api_error
from iterserve.server.messages_protocol import MessagesRequest, ModelTraits, TokenCountRequest
from iterserve.server.protocol import UsageInfo
from iterserve.server.serving import ServingContext, respond, stream_events


def messages_routes(ctx: ServingContext) -> APIRouter:
    v1 = APIRouter(prefix="/v1")

    @v1.post("/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(body, request, ctx)

    # Plain `def`: FastAPI runs it on its thread pool, so a long conversation does not
    # hold up the event loop while it is rendered and tokenized.
    @v1.post("/messages/count_tokens")
    def count_tokens(body: TokenCountRequest) -> dict[str, Any]:
        ctx.resolve_model(body.model)
        edited, _ = _edited(body, ctx)
        counted: dict[str, Any] = {"input_tokens": _prompt_tokens(edited, ctx)}
        if body.context_management is not None:
            counted["context_management"] = {"original_input_tokens": _prompt_tokens(body, ctx)}
        return counted

    return v1


def _traits(ctx: ServingContext) -> ModelTraits:
    return ModelTraits(
        thinks=ctx.reasoning is not None,
        system_anywhere=ctx.system_anywhere,
        images=ctx.image_marker is not None,
    )


def _prompt_tokens(body: MessagesRequest, ctx: ServingContext) -> int:
    """The request's input tokens: its prompt as rendered for the model."""
    chat = body.to_chat_request(_traits(ctx))
    with body.naming_fields():
        plan = chat_plan(chat, ctx, chat.sampling_params(ctx.sampling_defaults))
        return prompt_tokens(chat, ctx, plan)


def _edited(
    body: MessagesRequest, ctx: ServingContext
) -> tuple[MessagesRequest, list[dict[str, Any]] | None]:
    """The request after its context edits, and the edits applied (None: it asked for none)."""
    if body.context_management is None:
        return body, None
    edits = read_edits(body.context_management)
    return apply_edits(body, edits, lambda request: _prompt_tokens(request, ctx))


async def create_message(body: MessagesRequest, raw: Request, ctx: ServingContext) -> Response:
    applied = None
    if body.context_management is not None:  # edits may render the conversation twice:
        body, applied = await asyncio.to_thread(_edited, body, ctx)  # not on the event loop
    chat = body.to_chat_request(_traits(ctx))
    try:
        with body.naming_fields():
            run = await start_chat(chat, raw, ctx, id_prefix="msg_", context_cuts=True)
    except InvalidRequestError as error:
        if error.code != CONTEXT_LENGTH_EXCEEDED:
            raise
        # Anthropic's words, on which Claude Code compacts the conversation.
        tokens = await asyncio.to_thread(_prompt_tokens, body, ctx)  # a long prompt: off the loop
        most = ctx.max_model_len - 1
        message = f"prompt is too long: {tokens} tokens > {most} maximum"
        raise InvalidRequestError(message, "messages", error.code) from None
    shape = _Shape(body, run, ctx, applied)

    def final(outputs: list[RequestOutput], usage: UsageInfo) -> dict[str, Any]:
        output = outputs[0]
        if body.warms_only:  # the one token the engine sampled is not an answer
            return shape.message([], ("max_tokens", None), shape.usage(usage, output, None))
        answer = read_answer(output.text, run.reasoning, run.plan)
        content = _content(answer, run.plan.reader, body.shows_thinking)
        stop = shape.stop(output, bool(answer.calls))
        return shape.message(content, stop, shape.usage(usage, output, answer.thought))

    def events() -> AsyncIterator[str]:
        return _stream(shape, run)

    return await respond(raw, run.submitted, 1, body.stream, events, final)


def _content(
    answer: Answer, reader: AnswerReader | None, shows_thinking: bool
) -> list[dict[str, Any]]:
    """The thinking, the text (an empty one when the answer has nothing else), the calls."""
    blocks = []
    if answer.reasoning is not None:
        blocks.append(_thinking_block(answer.reasoning, shows_thinking))
    if answer.content or not (answer.calls or answer.reasoning):
        blocks.append(_text_block(answer.content or ""))
    if reader is not None:  # calls are read by a reader only
        blocks += [
            _tool_use_block(reader.new_call_id(), call.name, call.arguments)
            for call in answer.calls
        ]
    return blocks


def _thinking_block(text: str, shown: bool) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text if shown else "", "signature": _signature(text)}


def _signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _tool_use_block(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    # The parsers read a call's arguments as a JSON object's text.
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}


@dataclass(frozen=True)
class _Shape:
    """What every form of the answer (the whole message, the stream's events) shares."""

    body: MessagesRequest
    run: ChatRun
    ctx: ServingContext
    applied_edits: list[dict[str, Any]] | None  # None: the request asked for no edits

    @property
    def context_management(self) -> dict[str, Any]:
        """What the answer says of the context edits (nothing when none were asked for)."""
        edits = self.applied_edits
        return {} if edits is None else {"context_management": {"applied_edits": edits}}

    def message(
        self,
        content: list[dict[str, Any]],
        stop: tuple[str | None, str | None],
        usage: dict[str, Any],
    ) -> dict[str, Any]:
        reason, sequence = stop
        return {
            "id": self.run.submitted.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.run.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
            **self.context_management,
        }

    def stop(self, output: RequestOutput, called: bool) -> tuple[str, str | None]:
        """Anthropic's stop reason, and the stop sequence that matched."""
        if self.body.warms_only:
            return "max_tokens", None
        if output.finish_reason == "length":
            # max_tokens is a bound the context window may cut first.
            full = len(output.token_ids) >= self.body.max_tokens
            return ("max_tokens" if full else "model_context_window_exceeded"), None
        if called:
            return "tool_use", None
        if isinstance(output.stop_reason, str):
            return "stop_sequence", output.stop_reason
        return "end_turn", None

    def usage(
        self, usage: UsageInfo, output: RequestOutput | None, thought: bool | None
    ) -> dict[str, Any]:
        """Anthropic's usage: `input_tokens` are those the prefix cache did not hold (the
        cached ones are `cache_read_input_tokens`; the three add up to the prompt)."""
        cached = usage.prompt_tokens_details.cached_tokens
        made = 0 if self.body.warms_only else usage.completion_tokens
        thinking = 0
        if output is not None:
            thinking = self.run.reasoning_tokens(self.ctx, output.token_ids, bool(thought))
        return {
            "input_tokens": usage.prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": made,
            "output_tokens_details": {"thinking_tokens": thinking},
        }


def _event(kind: str, **fields: Any) -> str:
    payload = json.dumps({"type": kind, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n"


def _error_event(error: Exception) -> str:
    api_error = as_api_error(error)
    body = anthropic_error_body(api_error.status, api_error.message, api_error.param)
    return _event("error", error=body["error"])


@dataclass
class _Events:
    """The stream's events and the blocks they have opened."""

    shape: _Shape
    started: bool = False
    blocks: int = 0  # how many have been opened
    open: str | None = None  # the type of the block being written
    thinking: list[str] = field(default_factory=list)  # the open thinking block's text

    def start(self, prompt_tokens: int, cached: int, output: RequestOutput | None) -> str:
        """message_start, with the prompt's tokens (from the first output on, the prefix
        cache's part of them; before it, message_delta's usage brings it)."""
        self.started = True
        prompt = UsageInfo.of(prompt_tokens, 0, cached)
        usage = self.shape.usage(prompt, output, None)
        return _event("message_start", message=self.shape.message([], (None, None), usage))

    def _open(self, block: dict[str, Any]) -> str:
        closed = self.close()
        self.open = block["type"]
        self.blocks += 1
        return closed + _event("content_block_start", index=self.blocks - 1, content_block=block)

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.blocks - 1, delta=delta)

    def close(self) -> str:
        if self.open is None:
            return ""
        signed = ""
        if self.open == "thinking":
            text, self.thinking = "".join(self.thinking), []
            signed = self._delta({"type": "signature_delta", "signature": _signature(text)})
        self.open = None
        return signed + _event("content_block_stop", index=self.blocks - 1)

    def thought(self, delta: str) -> str:
        # The signature comes last, in a signature_delta, once the text is whole.
        block = {"type": "thinking", "thinking": "", "signature": ""}
        opened = "" if self.open == "thinking" else self._open(block)
        self.thinking.append(delta)
        if not self.shape.body.shows_thinking:
            return opened
        return opened + self._delta({"type": "thinking_delta", "thinking": delta})

    def text(self, delta: str) -> str:
        opened = "" if self.open == "text" else self._open(_text_block(""))
        return opened + self._delta({"type": "text_delta", "text": delta})

    def call(self, call_id: str, name: str, arguments: str) -> str:
        block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        return (
            self._open(block)
            + self._delta({"type": "input_json_delta", "partial_json": arguments})
            + self.close()
        )

    def end(self, stop: tuple[str, str | None], usage: dict[str, Any]) -> str:
        """The last block closed (an empty text block when the answer had none), the stop
        reason and usage, message_stop."""
        if not self.blocks and not self.shape.body.warms_only:
            closing = self.text("") + self.close()
        else:
            closing = self.close()
        reason, sequence = stop
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        shape = self.shape
        ending = _event("message_delta", delta=delta, usage=usage, **shape.context_management)
        return closing + ending + _event("message_stop")


async def _stream(shape: _Shape, run: ChatRun) -> AsyncIterator[str]:
    events = _Events(shape)
    answer = AnswerStream.of(run.reasoning, run.plan)
    last: list[RequestOutput] = []  # the finished output

    def on_output(_: int, output: RequestOutput) -> str:
        chunk = ""
        if not events.started:
            prompt, cached = len(output.prompt_token_ids), output.num_cached_tokens
            chunk = events.start(prompt, cached, output)
        if output.finished:
            last.append(output)
        if shape.body.warms_only:
            return chunk
        found = answer.feed(output.delta_text, output.finished)
        chunk += events.thought(found.reasoning) if found.reasoning else ""
        chunk += events.text(found.content) if found.content else ""
        for _, call_id, call in found.new_calls:
            chunk += events.call(call_id, call.name, call.arguments)
        return chunk

    def on_end(usage: UsageInfo) -> str:
        output = last[0]
        stop = shape.stop(output, answer.called)
        return events.end(stop, shape.usage(usage, output, answer.thought))

    async def ping() -> str:
        # Anthropic's keep-alive. Its clients take events only after message_start: that
        # goes first, with the prompt counted apart (the engine's count comes with its
        # first output).
        if events.started:
            return _event("ping")
        tokens = await asyncio.to_thread(_prompt_tokens, shape.body, shape.ctx)
        return events.start(tokens, 0, None)

    stream = stream_events(
        run.submitted, None, on_output, on_end, False, _error_event, keep_alive=ping
    )
    async for chunk in stream:
        if chunk:  # a token whose text is held back (a stop string, a call) has no event
            yield chunk
