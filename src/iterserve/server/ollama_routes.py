"""Ollama's API under /api: chat, generate (templated, raw, fill in the middle), embed,
the model listings (`tags`, `ps`, `show`) and `version`, for the `ollama` client, LangChain's
ChatOllama and the apps written for Ollama (ollama_protocol.py says how each request is
read).

An answer is Ollama's: streamed by default as newline-delimited JSON objects (one per step
that adds text, thinking or calls; the last `done: true` with `done_reason` and the
durations, in nanoseconds), or one object with `stream: false`. A call's arguments are an
object; the thinking is `thinking`. Errors are Ollama's `{"error": "..."}`, in the stream
too once it has begun.

Model names follow Ollama's `name:tag`: the served names are listed as `NAME:latest`, and a
request may name a model either way (ServingContext.resolve_model, for every API). The
model stays loaded whatever `keep_alive` says; an empty prompt (or message list) is Ollama's
request to load it, answered at once. Pulling, pushing, creating, copying and deleting
models are Ollama's registry's work: a 400 that says so (the model is what the server was
started with).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from iterserve.chat.answer import AnswerStream, read_answer
from iterserve.chat.reasoning_parsers import ThinkingReader
from iterserve.chat.tool_parsers import ParsedCall
from iterserve.chat.tools import ToolPlan
from iterserve.core.logprobs import TokenLogprobs
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import encode_prompt
from iterserve.pooling_params import PoolingParams
from iterserve.prompt_truncation import PromptTruncation
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.server.chat import chat_plan, render_prompt, start_chat
from iterserve.server.errors import as_api_error, ollama_error_body
from iterserve.server.ollama_protocol import (
    OLLAMA_API_VERSION,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from iterserve.server.pooled_requests import run_pooled
from iterserve.server.serving import (
    INFILL_ANSWER_ROOM,
    EngineStreamResponse,
    ServingContext,
    Submitted,
    access_record,
    respond,
    stream_events,
    submit,
)

NDJSON = "application/x-ndjson"
# A model's dtype as GGUF types name it, for `quantization_level` where no file type says.
_DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# What /api/ps says of when the model is unloaded: never (it stays for the server's life).
_NEVER = "2318-08-30T00:00:00Z"


class JsonBodiesUnderApi:
    """Ollama reads every request body as JSON whatever its Content-Type, and its own
    documentation's examples send them with `curl -d`, whose type is a form's: bodies under
    /api are given to the routes as JSON (an ASGI middleware on the request's headers)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/api/"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def ollama_root_routes() -> APIRouter:
    """`/`: the liveness check Ollama's clients make before anything else (no key needed,
    as Ollama's)."""
    router = APIRouter()

    @router.get("/", response_class=PlainTextResponse)
    @router.head("/", response_class=PlainTextResponse)
    def running() -> str:
        return "iterserve is running"

    return router


def ollama_routes(ctx: ServingContext) -> APIRouter:
    api = APIRouter(prefix="/api")
    models = _ModelListing(ctx, _timestamp())

    @api.get("/version")
    def version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}

    @api.get("/tags")
    def tags() -> dict[str, Any]:
        return {"models": models.entries()}

    @api.get("/ps")
    def running() -> dict[str, Any]:
        return {"models": models.running()}

    @api.post("/show")
    def show(body: OllamaShowRequest) -> dict[str, Any]:
        requested = body.model or body.name
        if not requested:
            raise InvalidRequestError("model: the field is required", "model")
        return models.show(ctx.resolve_model(requested))

    @api.post("/chat")
    async def chat(body: OllamaChatRequest, raw: Request) -> Response:
        return await _chat(body, raw, ctx)

    @api.post("/generate")
    async def generate(body: OllamaGenerateRequest, raw: Request) -> Response:
        return await _generate(body, raw, ctx)

    @api.post("/embed")
    async def embed(body: OllamaEmbedRequest, raw: Request) -> dict[str, Any]:
        inputs = [body.input] if isinstance(body.input, str) else body.input
        start = time.monotonic()
        truncation = PromptTruncation(-1, "right") if body.truncate else None
        outputs = await _embedded(ctx, raw, body.model, inputs, body.dimensions, truncation)
        return {
            "model": body.model,
            "embeddings": [out.embedding or [] for out in outputs],
            "total_duration": _ns(time.monotonic() - start),
            "load_duration": 0,
            "prompt_eval_count": sum(len(out.prompt_token_ids) for out in outputs),
        }

    @api.post("/embeddings")
    async def embeddings(body: OllamaEmbeddingsRequest, raw: Request) -> dict[str, Any]:
        outputs = await _embedded(ctx, raw, body.model, [body.prompt], None, None)
        return {"embedding": outputs[0].embedding or [] if outputs else []}

    for path, method in (
        ("/pull", "POST"), ("/push", "POST"), ("/create", "POST"), ("/copy", "POST"),
        ("/delete", "DELETE"), ("/blobs/{digest}", "POST"), ("/blobs/{digest}", "HEAD"),
    ):  # fmt: skip
        api.add_api_route(path, _registry_refusal(ctx), methods=[method])
    return api


def ollama_name(name: str) -> str:
    """A served name as Ollama lists it: with a tag (`:latest` where it has none)."""
    return name if ":" in name else f"{name}:latest"


def _registry_refusal(ctx: ServingContext) -> Callable[[], Any]:
    def refuse() -> Any:
        served = ", ".join(ollama_name(name) for name in ctx.served_model_names)
        raise InvalidRequestError(
            f"model: this server serves the models it was started with ({served}); it does "
            "not pull, push, create, copy or delete models",
            "model",
        )

    return refuse


async def _embedded(
    ctx: ServingContext,
    raw: Request,
    requested: str,
    inputs: list[str],
    dimensions: int | None,
    truncation: PromptTruncation | None,
) -> list[RequestOutput]:
    model = ctx.resolve_model(requested)
    inputs = [text for text in inputs if text]  # Ollama answers an empty input with nothing
    if not inputs:
        return []
    request_id = f"ollama-embed-{uuid.uuid4().hex}"
    access_record(raw).request_id = request_id
    pooling = PoolingParams(dimensions=dimensions, truncation=truncation)
    return await run_pooled(ctx, inputs, pooling, request_id, raw, "input", model)


# ---- answers ------------------------------------------------------------------------------


def _timestamp() -> str:
    """Now, as Ollama's `created_at` (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def ndjson(payload: dict[str, Any]) -> str:
    return json.dumps(payload) + "\n"


def _error_line(error: Exception) -> str:
    """An error once the stream has begun: Ollama's error object as its last line."""
    return ndjson(ollama_error_body(as_api_error(error)))


async def _nothing() -> str:
    return ""  # NDJSON has no comment to keep a connection alive with


def _done_reason(output: RequestOutput) -> str:
    return "length" if output.finish_reason == "length" else "stop"


def _durations(started: float, output: RequestOutput) -> dict[str, int]:
    """Ollama's statistics of an answer, in nanoseconds: the prompt's time is up to the
    first token (from the request's first step), the answer's the rest."""
    total = time.monotonic() - started
    timings = output.timings
    if timings and timings.first_token is not None and timings.finished is not None:
        prompt = timings.first_token - (timings.first_scheduled or timings.arrival)
        answer = timings.finished - timings.first_token
    else:
        prompt, answer = 0.0, total
    return {
        "total_duration": _ns(total),
        "load_duration": 0,  # loaded when the server started
        "prompt_eval_count": len(output.prompt_token_ids),
        "prompt_eval_duration": _ns(prompt),
        "eval_count": len(output.token_ids),
        "eval_duration": _ns(answer),
    }


class _Logprobs:
    """Ollama's `logprobs`: each token's text, log-probability and bytes, and its top
    candidates."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def token(self, token_id: int, logprob: float) -> dict[str, Any]:
        ctx = self.ctx
        return {"token": ctx.decode_token(token_id), "logprob": logprob,
                "bytes": list(ctx.token_bytes(token_id))}  # fmt: skip

    def of(self, entries: list[TokenLogprobs | None]) -> list[dict[str, Any]]:
        return [
            {
                **self.token(e.token_id, e.logprob),
                "top_logprobs": [self.token(t, lp) for t, lp in e.top],
            }  # fmt: skip
            for e in entries
            if e is not None
        ]


def _calls(calls: list[ParsedCall], first: int = 0) -> list[dict[str, Any]]:
    return [
        {"function": {"index": first + k, "name": c.name, "arguments": json.loads(c.arguments)}}
        for k, c in enumerate(calls)
    ]


def _message(content: str, thinking: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return message


def _piece(
    body: OllamaChatRequest | OllamaGenerateRequest,
    content: str,
    thinking: str | None,
    calls: list[dict[str, Any]],
) -> dict[str, Any]:
    """One object of an answer: /api/chat's `message`, or /api/generate's `response` (and
    `thinking`)."""
    piece: dict[str, Any] = {"model": body.model, "created_at": _timestamp()}
    if isinstance(body, OllamaChatRequest):
        return piece | {"message": _message(content, thinking, calls)}
    return piece | {"response": content} | ({"thinking": thinking} if thinking else {})


def _loaded(body: OllamaChatRequest | OllamaGenerateRequest, ctx: ServingContext) -> Response:
    """Ollama's answer to a request that only loads (or unloads) the model."""
    ctx.resolve_model(body.model)
    done = {"done": True, "done_reason": "unload" if body.unloads else "load"}
    return JSONResponse(_piece(body, "", None, []) | done)


def _check_thinks(body: OllamaChatRequest | OllamaGenerateRequest, ctx: ServingContext) -> None:
    """`think` (true, or an effort) for a model whose thinking the server does not read."""
    if body.think not in (None, False) and ctx.reasoning is None:
        raise InvalidRequestError(f"think: {body.model!r} does not think", "think")


@dataclass
class _Answer:
    """An answer in Ollama's shape, whole or streamed: /api/chat's `message` (`chat`), or
    /api/generate's `response` and `thinking` (with `context`, the prompt's tokens and the
    answer's, unless `raw`)."""

    body: OllamaChatRequest | OllamaGenerateRequest
    submitted: Submitted
    reasoning: ThinkingReader | None
    plan: ToolPlan
    started: float
    logprobs: _Logprobs | None

    def _closing(self, output: RequestOutput) -> dict[str, Any]:
        closed: dict[str, Any] = {"done": True, "done_reason": _done_reason(output)}
        body = self.body
        if isinstance(body, OllamaGenerateRequest) and not body.raw:
            closed["context"] = [*output.prompt_token_ids, *output.token_ids]  # its memory
        return closed | _durations(self.started, output)

    def whole(self, outputs: list[RequestOutput], _: Any) -> dict[str, Any]:
        output = outputs[0]
        answer = read_answer(output.text, self.reasoning, self.plan)
        result = _piece(self.body, answer.content or "", answer.reasoning, _calls(answer.calls))
        if self.logprobs is not None:
            result["logprobs"] = self.logprobs.of(output.logprobs or [])
        return result | self._closing(output)

    def lines(self) -> AsyncIterator[str]:
        stream = AnswerStream.of(self.reasoning, self.plan)
        calls_sent = 0
        last: list[RequestOutput] = []

        def on_output(_: int, output: RequestOutput) -> str:
            nonlocal calls_sent
            found = stream.feed(output.delta_text, output.finished)
            calls = _calls([call for _, _, call in found.new_calls], calls_sent)
            calls_sent += len(calls)
            if output.finished:
                last.append(output)
            probs = self.logprobs.of(output.delta_logprobs) if self.logprobs is not None else []
            if not (found.content or found.reasoning or calls or probs):
                return ""
            line = _piece(self.body, found.content, found.reasoning, calls) | {"done": False}
            return ndjson(line | ({"logprobs": probs} if probs else {}))

        def on_end(_: Any) -> str:
            return ndjson(_piece(self.body, "", None, []) | self._closing(last[0]))

        return _ndjson_stream(self.submitted, on_output, on_end)

    async def respond(self, raw: Request) -> Response:
        if self.body.stream:
            response = EngineStreamResponse(self.lines(), self.submitted.stream, media_type=NDJSON)
            response.headers.update(self.submitted.headers)
            return response
        return await respond(raw, self.submitted, 1, False, self.lines, self.whole)


def _logprobs(ctx: ServingContext, params: SamplingParams) -> _Logprobs | None:
    return _Logprobs(ctx) if params.logprobs is not None else None


async def _chat(body: OllamaChatRequest, raw: Request, ctx: ServingContext) -> Response:
    if not body.messages:
        return _loaded(body, ctx)
    _check_thinks(body, ctx)
    if body.tools and ctx.tool_parser is None:  # Ollama's "does not support tools"
        raise InvalidRequestError(
            f"tools: {body.model!r} does not support tools here: no tool call parser reads its "
            "answers (--tool-call-parser)",
            "tools",
        )
    _check_images(ctx, [f"messages.{i}.images" for i, m in enumerate(body.messages) if m.images])
    started = time.monotonic()
    chat = body.to_chat_request()
    chat.model = ctx.resolve_model(body.model)
    params = body.sampling_params(ctx.sampling_defaults)
    run = await start_chat(chat, raw, ctx, "ollama-", context_cuts=True, params=params)
    logprobs = _logprobs(ctx, params)
    answer = _Answer(body, run.submitted, run.reasoning, run.plan, started, logprobs)
    return await answer.respond(raw)


def _check_images(ctx: ServingContext, fields: list[str]) -> None:
    """Images sent to a model that takes none: a 400 naming the first (Ollama's own is a
    500 that says the model is missing data required for image input)."""
    if fields and ctx.image_marker is None:
        raise InvalidRequestError(f"{fields[0]}: this model takes no images (text only)", fields[0])


async def _generate(body: OllamaGenerateRequest, raw: Request, ctx: ServingContext) -> Response:
    body.check_supported()
    _check_images(ctx, ["images"] if body.images else [])
    if body.loads_only:
        return _loaded(body, ctx)
    if not body.raw:  # a raw prompt is the client's: no template switch to turn
        _check_thinks(body, ctx)
    started = time.monotonic()
    model = ctx.resolve_model(body.model)
    params = body.sampling_params(ctx.sampling_defaults)
    chat = body.to_chat_request()
    chat.model = model
    if not (body.raw or body.suffix is not None or body.context):  # a one-turn chat
        run = await start_chat(chat, raw, ctx, "ollama-", context_cuts=True, params=params)
        submitted, reasoning, plan = run.submitted, run.reasoning, run.plan
    else:
        ids = await asyncio.to_thread(_prompt_ids, body, chat, params, ctx)
        request_id = f"ollama-{uuid.uuid4().hex}"
        submitted = await submit(raw, ctx, request_id, [(request_id, ids)], params,
                                 "interactive", 0, fill_context=True, lora=ctx.loras.get(model))  # fmt: skip
        reasoning, plan = None, chat_plan(chat, ctx, params)
    answer = _Answer(body, submitted, reasoning, plan, started, _logprobs(ctx, params))
    return await answer.respond(raw)


def _prompt_ids(
    body: OllamaGenerateRequest, chat: Any, params: SamplingParams, ctx: ServingContext
) -> list[int]:
    """The token ids of a raw prompt, a fill in the middle (`suffix`), or a templated one
    after an earlier answer's `context`."""
    tokenizer = ctx.tokenizer
    if body.suffix is not None:  # as /infill lays it out
        unbounded = params.max_tokens >= ctx.max_model_len
        room = INFILL_ANSWER_ROOM if unbounded else params.max_tokens
        ids = ctx.infill_ids(body.prompt, body.suffix, [], "", room, "suffix")
    elif body.raw:
        ids = list(tokenizer.encode(body.prompt))
    else:
        rendered = render_prompt(chat, ctx, chat_plan(chat, ctx, params))
        ids = encode_prompt(tokenizer, rendered)
    return [*(body.context or []), *ids]


def _ndjson_stream(
    submitted: Submitted,
    on_output: Callable[[int, RequestOutput], str],
    on_end: Callable[[Any], str],
) -> AsyncIterator[str]:
    async def lines() -> AsyncIterator[str]:
        async for line in stream_events(
            submitted, None, on_output, on_end, done=False, error_event=_error_line,
            keep_alive=_nothing,
        ):  # fmt: skip
            if line:
                yield line

    return lines()


# ---- the models -------------------------------------------------------------------------


def _size_label(parameters: int) -> str:
    """A parameter count as Ollama labels it: "135M", "1.2B", "8.0B"."""
    if parameters >= 1e9:
        return f"{parameters / 1e9:.1f}B"
    return f"{parameters / 1e6:.0f}M" if parameters >= 1e6 else str(parameters)


class _ModelListing:
    """What /api/tags, /api/ps and /api/show say of the served model and its adapters."""

    def __init__(self, ctx: ServingContext, started_at: str) -> None:
        self.ctx = ctx
        self.started_at = started_at
        self.served = ctx.engine.served_model  # what it is does not change while it serves

    def _details(self, parent: str = "") -> dict[str, Any]:
        served = self.served
        facts = served.facts
        family = facts.architecture
        dtype = served.compute.get("dtype", "")
        kind = facts.file_type or _DTYPE_NAMES.get(dtype, dtype.upper())
        return {
            "parent_model": parent,
            "format": facts.file_format,
            "family": family,
            "families": [family] if family else None,
            "parameter_size": _size_label(facts.parameters),
            "quantization_level": kind,
        }

    def _entry(self, name: str, parent: str = "") -> dict[str, Any]:
        size = int(self.served.compute.get("weight_bytes", 0))
        listed = ollama_name(name)
        return {
            "name": listed,
            "model": listed,
            "modified_at": self.started_at,
            "size": size,
            # Not a file's hash (Ollama's is its manifest's): a stable id of the name and size.
            "digest": hashlib.sha256(f"{listed}:{size}".encode()).hexdigest(),
            "details": self._details(ollama_name(parent) if parent else ""),
        }

    def entries(self) -> list[dict[str, Any]]:
        ctx = self.ctx
        base = ctx.served_model_names[0]
        return [self._entry(name) for name in ctx.served_model_names] + [
            self._entry(name, base) for name in ctx.loras
        ]

    def running(self) -> list[dict[str, Any]]:
        context = {"expires_at": _NEVER, "size_vram": 0, "context_length": self.ctx.max_model_len}
        return [entry | context for entry in self.entries()]

    def capabilities(self) -> list[str]:
        ctx = self.ctx
        found = ["completion"] if ctx.pair_prompts is None else []
        found += ["tools"] if ctx.tool_parser is not None else []
        found += ["thinking"] if ctx.reasoning is not None else []
        found += ["insert"] if ctx.fill_in_middle is not None else []
        found += ["vision"] if ctx.image_marker is not None else []
        return found + (["embedding"] if ctx.embeds else [])

    def show(self, model: str) -> dict[str, Any]:
        ctx = self.ctx
        served = self.served
        family = served.facts.architecture
        parent = ctx.served_model_names[0] if model in ctx.loras else ""
        settings = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                    "min_p": "min_p", "repetition_penalty": "repeat_penalty"}  # fmt: skip
        given = served.sampling_defaults.given()
        parameters = "\n".join(
            f"{ollama} {given[name]:g}" for name, ollama in settings.items() if name in given
        )
        return {
            "license": "",
            "modelfile": f"# iterserve serves {ollama_name(model)}\nFROM {served.name}\n"
            + "".join(f"PARAMETER {line}\n" for line in parameters.splitlines()),
            "parameters": parameters,
            "template": ctx.template_text or "",
            "details": self._details(ollama_name(parent) if parent else ""),
            "model_info": {
                "general.architecture": family,
                "general.basename": served.name,
                "general.parameter_count": served.facts.parameters,
                f"{family}.context_length": ctx.max_model_len,
            },
            "capabilities": self.capabilities(),
            "modified_at": self.started_at,
        }
