"""What the completion and chat endpoints share: the serving context, the
per-request record the access log prints, submitting a group of requests,
waiting for the engine while watching for the client to leave, and the
streaming loop (server-sent events, the error event, usage, [DONE])."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from iterserve.chat.reasoning import ReasoningSupport, thinking_template_kwargs
from iterserve.chat.tool_parsers import ToolParser
from iterserve.core.lora import LoRARequest
from iterserve.engine.chat_template import template_problem
from iterserve.engine.fill_in_middle import ExtraFile, FimFormat, fim_format, infill_tokens
from iterserve.engine.images import ImageInputs, ImagesPrompt
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import Prompt, RenderedChat, encode_prompt, takes_system_anywhere
from iterserve.engine.request_stream import EngineStoppedError, RequestStream, expand_n
from iterserve.engine.score_prompts import PairPrompts
from iterserve.engine.serving_engine import ServingEngine
from iterserve.engine.token_bytes import token_byte_reader
from iterserve.model.tokenizer import chat_template_of
from iterserve.sampling_defaults import SamplingDefaults
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.server.errors import APIError, as_api_error, error_body
from iterserve.server.image_urls import MediaAccess
from iterserve.server.logprobs import token_decoder
from iterserve.server.protocol import UsageInfo
from iterserve.server.response_store import ResponseStore

T = TypeVar("T")
_Body = BaseModel | dict[str, Any]

# The scope key under which a handler leaves what the access log should print.
ACCESS_RECORD_KEY = "iterserve.access"


@dataclass
class AccessRecord:
    """Filled in by a handler as it goes, printed by the access log when the response ends."""

    arrival: float = field(default_factory=time.monotonic)
    request_id: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    finish_reasons: list[str] = field(default_factory=list)

    def saw(self, output: RequestOutput) -> None:
        # A stand-in until the handler reports usage; right unless the client left early.
        self.prompt_tokens = self.prompt_tokens or len(output.prompt_token_ids)
        if self.ttft is None and output.delta_token_ids:
            self.ttft = time.monotonic() - self.arrival
        if output.finished:
            self.completion_tokens += len(output.token_ids)
            self.finish_reasons.append(output.finish_reason or "")


def access_record(request: Request) -> AccessRecord:
    record = request.scope.get(ACCESS_RECORD_KEY)
    if record is None:
        record = request.scope[ACCESS_RECORD_KEY] = AccessRecord()
    return record


# A request's template is checked once, not at each of a chat's renders nor again for every
# request that sends the same one (a client sends its template with each request).
_template_problem = functools.lru_cache(maxsize=32)(template_problem)


# Among --served-model-name's names: take any name a request gives (ServingContext).
ANY_MODEL_NAME = "*"
# What a fill in the middle leaves the answer when the request does not bound it.
INFILL_ANSWER_ROOM = 256


@dataclass
class ServingContext:
    engine: ServingEngine
    served_model_names: list[str]
    tokenizer: Any
    chat_template: str | None
    max_model_len: int
    response_store: ResponseStore  # stored Responses (previous_response_id, GET, DELETE)
    tool_parser: ToolParser | None = None  # --tool-call-parser, or what `auto` found
    reasoning: ReasoningSupport | None = None  # --reasoning-parser, or what `auto` found
    # LoRA adapters served by name (a request's `model` picks one): --lora-modules, and
    # those /v1/load_lora_adapter added.
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    # `--served-model-name ... '*'`: any other name asks for the model, as llama-server
    # takes whatever a client sends (llama.vscode names its embeddings' model "GPT-4").
    any_model_name: bool = False
    eos_token_ids: tuple[int, ...] = ()  # the model's tokens that end an answer
    # A reranker's pairs as prompts (None: no score head), and whether it embeds: what
    # /v1/rerank and /v1/score answer with (server/scoring.py).
    pair_prompts: PairPrompts | None = None
    embeds: bool = False
    # What the chat template writes where an image goes; None: the model takes no images.
    image_marker: str | None = None
    # The model's images, where this process holds the tower (not a fleet's front end).
    images: ImageInputs | None = None
    media: MediaAccess = field(default_factory=MediaAccess)  # where image URLs may be read
    labels: tuple[str, ...] = ()  # a classifier head's, where it serves /classify
    # What a request's unset sampling fields take (--generation-config).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Every chat's template kwargs, under a request's own (--default-chat-template-kwargs).
    default_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # A request's own `chat_template` renders it (--trust-request-chat-template).
    trust_request_chat_template: bool = False
    decode_token: Callable[[int], str] = field(init=False)
    token_bytes: Callable[[int], bytes] = field(init=False)  # a token's own bytes
    special_tokens: set[str] = field(init=False)
    # A code model's tokens for completions' `suffix` (None: it has none).
    fill_in_middle: FimFormat | None = field(init=False)

    def __post_init__(self) -> None:
        self.decode_token = token_decoder(self.tokenizer)
        self.token_bytes = token_byte_reader(self.tokenizer)
        self.special_tokens = set(getattr(self.tokenizer, "all_special_tokens", ()))
        self.fill_in_middle = fim_format(self.tokenizer)

    def template_kwargs(
        self, given: Mapping[str, Any] | None, effort: str | None
    ) -> Mapping[str, Any] | None:
        """A chat's template kwargs: the server's defaults under the request's own, with what
        `reasoning_effort` sets (the thinking switch, or gpt-oss's effort). A request's effort
        overrides a default's, as its own kwargs do; only its own kwargs can contradict it."""
        defaults = dict(self.default_template_kwargs)
        if effort is not None and self.reasoning is not None:
            defaults.pop(self.reasoning.effort_variable, None)
        merged = {**defaults, **(given or {})}
        return thinking_template_kwargs(self.reasoning, merged or None, effort)

    @property
    def template_text(self) -> str | None:
        """The text of the template chats are rendered with (--chat-template's, else the
        tokenizer's own), for clients that render prompts themselves."""
        return self.chat_template or chat_template_of(self.tokenizer)

    def chat_template_for(self, given: str | None) -> str | None:
        """The template a chat renders with: the request's own `chat_template` (its text) if
        the server trusts requests' templates, as vLLM's --trust-request-chat-template does,
        else the server's. A request's template is Jinja run on the server, so it is refused
        unless the server was told to run them. The tool-call and reasoning parsers stay the
        server's."""
        if given is None:
            return self.chat_template
        if not self.trust_request_chat_template:
            raise InvalidRequestError(
                "chat_template: this server renders chats with its own template; one sent "
                "with a request is taken only when the server is started with "
                "--trust-request-chat-template",
                "chat_template",
            )
        if problem := _template_problem(given, self.tokenizer):
            raise InvalidRequestError(f"chat_template {problem}", "chat_template")
        return given

    @functools.cached_property
    def system_anywhere(self) -> bool:
        """The chat template writes a system message given mid-conversation."""
        return takes_system_anywhere(self.tokenizer, self.chat_template)

    @functools.cached_property
    def infill_end_ids(self) -> tuple[int, ...]:
        """The tokens an infill's answer ends at, as llama-server's: the model's EOS, and a
        code model's markers that begin another file (its repository's, a file's)."""
        fim = self.fill_in_middle
        markers = () if fim is None else (fim.repository, fim.file_separator)
        ids = self.tokenizer.convert_tokens_to_ids([m for m in markers if m is not None])
        return (*self.eos_token_ids, *(i for i in ids if i not in self.eos_token_ids))

    def infill_ids(
        self,
        prefix: str,
        suffix: str,
        extra: list[ExtraFile],
        cursor_line: str,
        answer_room: int,
        param: str,
    ) -> list[int]:
        """A fill in the middle's prompt in the model's tokens (engine/fill_in_middle.py),
        cut to leave `answer_room` tokens of the context (at most half of it) for the answer;
        a 400 naming `param` for a model without such tokens."""
        fim = self.fill_in_middle
        if fim is None:
            raise InvalidRequestError(
                f"{param}: this model has no fill-in-the-middle tokens, so it cannot infill",
                param,
            )
        tokenizer = self.tokenizer
        bos = [t for t in tokenizer.encode("") if t == tokenizer.bos_token_id]
        return infill_tokens(
            fim,
            lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
            tokenizer.convert_tokens_to_ids,
            prefix,
            suffix,
            extra,
            cursor_line,
            self.max_model_len - min(answer_room, self.max_model_len // 2),
            bos,
        )

    def prompt_token_ids(self, prompt: str | RenderedChat | ImagesPrompt) -> list[int]:
        """The token ids a prompt runs as, each image's laid out by its size (the tower not
        run): what token counts report. A fleet's front end holds no image processor: there
        an image counts as its marker's tokens (the replica lays it out)."""
        if not isinstance(prompt, ImagesPrompt):
            return encode_prompt(self.tokenizer, prompt)
        if self.images is not None:
            return self.images.token_ids(prompt, "messages")
        if prompt.rendered:
            return encode_prompt(self.tokenizer, RenderedChat(prompt.text))
        return encode_prompt(self.tokenizer, prompt.text)

    def resolve_model(self, requested: str | None) -> str:
        """The name to answer with: the model's, or a LoRA adapter's (either also with
        Ollama's default tag, `NAME:latest`, as Ollama's own /v1 takes it); an unknown model
        is a 404 as OpenAI's (and vLLM's) `model_not_found`."""
        if requested is not None and requested.endswith(":latest"):
            stem = requested.removesuffix(":latest")
            if stem in self.loras or stem in self.served_model_names:
                requested = stem
        if requested in self.loras:
            return requested
        if requested is None or requested in self.served_model_names or self.any_model_name:
            return self.served_model_names[0]
        served = ", ".join(repr(name) for name in [*self.served_model_names, *self.loras])
        raise APIError(
            404,
            f"the model {requested!r} does not exist here; this server serves {served}",
            "model",
            "model_not_found",
        )


async def _client_gone(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the
    client disconnects first: a non-streaming client that gives up must not
    keep its KV blocks busy until max_tokens."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise APIError(499, "the client closed the connection")


async def collect_final(stream: RequestStream, record: AccessRecord) -> list[RequestOutput]:
    """Run a group of requests to the end; their last outputs in index order."""
    finals: dict[int, RequestOutput] = {}
    async with stream:
        async for index, output in stream:
            record.saw(output)
            if output.finished:
                finals[index] = output
    if any(output.finish_reason == "abort" for output in finals.values()):
        raise EngineStoppedError("the server shut down before the request finished")
    return [finals[i] for i in range(len(stream.request_ids))]


def usage_of(outputs: list[RequestOutput], n: int) -> UsageInfo:
    """Usage of prompts with n choices each, outputs in choice order: a prompt counts
    once however many choices it has (OpenAI's convention), with what its first
    choice found in the prefix cache."""
    firsts = outputs[::n] if n else []
    return UsageInfo.of(
        sum(len(out.prompt_token_ids) for out in firsts),
        sum(len(out.token_ids) for out in outputs),
        sum(out.num_cached_tokens for out in firsts),
        sum(out.num_draft_tokens for out in outputs),
        sum(out.num_accepted_tokens for out in outputs),
    )


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(error: Exception) -> str:
    """An error after the 200 went out can only be told in the stream itself."""
    api_error = as_api_error(error)
    return sse(json.dumps(error_body(api_error.status, api_error.message, api_error.param)))


class EngineStreamResponse(StreamingResponse):
    """A streaming response that aborts its engine requests however it ends:
    finished, client gone, cancelled before its first chunk (when the body
    generator never started, so its own cleanup would never run)."""

    def __init__(
        self,
        content: AsyncIterator[str],
        stream: RequestStream,
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(content, media_type=media_type)
        self._engine_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine_stream.abort()


# ---- one request group, from submission to response -------------------------------------


@dataclass
class Submitted:
    """A handler's group of engine requests (prompts x n choices), accepted."""

    request_id: str
    record: AccessRecord
    stream: RequestStream

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id}


async def submit(
    raw: Request,
    ctx: ServingContext,
    request_id: str,
    prompts: list[tuple[str, Prompt]],
    params: SamplingParams,
    lane: str,
    priority: int,
    fill_context: bool,
    lora: LoRARequest | None = None,
) -> Submitted:
    """Queue `params.n` choices of each (id, prompt) as one group, all or none."""
    record = access_record(raw)
    record.request_id = request_id
    arrival = time.monotonic()
    ctx.engine.check_group_size(params.n * len(prompts))  # before building them all
    requests = []
    for base_id, prompt in prompts:
        requests += expand_n(
            prompt,
            params,
            base_id,
            lane=lane,
            priority=priority,
            arrival_time=arrival,
            fill_context=fill_context,
            lora=lora,
        )
    return Submitted(request_id, record, await ctx.engine.add(requests))


async def respond(
    raw: Request,
    submitted: Submitted,
    n: int,
    streaming: bool,
    events: Callable[[], AsyncIterator[str]],
    final: Callable[[list[RequestOutput], UsageInfo], _Body | Awaitable[_Body]],
) -> Response:
    """The SSE stream `events()`, or once every choice is done the JSON of `final` (awaited
    when it is a coroutine: a body that must be stored before it leaves)."""
    if streaming:
        response = EngineStreamResponse(events(), submitted.stream)
        response.headers.update(submitted.headers)
        return response
    outputs = await until_disconnected(raw, collect_final(submitted.stream, submitted.record))
    usage = usage_of(outputs, n)
    submitted.record.prompt_tokens = usage.prompt_tokens
    body = final(outputs, usage)
    if inspect.isawaitable(body):
        body = await body
    content = body.model_dump(mode="json") if isinstance(body, BaseModel) else body
    return JSONResponse(content, headers=submitted.headers)


# Seconds a stream may send nothing before a keep-alive goes out: a long prompt's prefill on
# a CPU (Claude Code's 12,000 tokens at ~65 tok/s on an 8B: ~3 minutes), or a wait in the
# queue, sends nothing else, and proxies drop connections idle for a minute (nginx's
# default read timeout).
KEEP_ALIVE_AFTER = 10.0
# An SSE comment: every SSE reader skips it (the openai SDK's, browsers' EventSource).
SSE_KEEP_ALIVE = ": keep-alive\n\n"


async def _sse_comment() -> str:
    return SSE_KEEP_ALIVE


async def stream_events(
    submitted: Submitted,
    n: int | None,
    chunk: Callable[[int, RequestOutput], str],
    usage_chunk: Callable[[UsageInfo], str] | None,
    done: bool = True,
    error_event: Callable[[Exception], str] | None = None,
    keep_alive: Callable[[], Awaitable[str]] = _sse_comment,
) -> AsyncIterator[str]:
    """The streaming loop: `chunk(index, output)` for every output that carries a token or
    a finish, an error event if the engine fails after the 200 went out (`error_event`'s,
    by default OpenAI's error and [DONE]), then usage (with `n` choices a prompt; None:
    all choices are of one prompt) and [DONE] (unless not `done`: the Responses and
    Messages APIs end on their own last event). `await keep_alive()` whenever
    KEEP_ALIVE_AFTER seconds pass without an output (an SSE comment; Anthropic's API has
    its `ping`)."""
    finals: dict[int, RequestOutput] = {}
    try:
        async with submitted.stream as stream:
            while True:
                try:
                    # The wait is the stream's queue: one that times out loses nothing.
                    async with asyncio.timeout(KEEP_ALIVE_AFTER) as wait:
                        index, output = await anext(stream)
                except TimeoutError:
                    if not wait.expired():  # the engine's own error, not the wait's
                        raise
                    yield await keep_alive()
                    continue
                except StopAsyncIteration:
                    break
                submitted.record.saw(output)
                if output.finished:
                    finals[index] = output
                if not (output.delta_token_ids or output.finished):
                    continue
                # A token whose text is held back (half a UTF-8 character, a possible stop
                # string) or has none (a special token) still gets its chunk, with empty
                # text, as vLLM sends it: a client's TBT then sees every token.
                yield chunk(index, output)
    except Exception as error:  # the 200 is out: report it in the stream
        yield error_event(error) if error_event else sse_error(error) + SSE_DONE
        return
    usage = usage_of([finals[i] for i in sorted(finals)], len(finals) if n is None else n)
    submitted.record.prompt_tokens = usage.prompt_tokens
    if usage_chunk is not None:
        yield usage_chunk(usage)
    if done:
        yield SSE_DONE
