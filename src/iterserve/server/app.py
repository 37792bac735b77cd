"""The FastAPI app: OpenAI routes under /v1 (stored Responses included), Anthropic's
/v1/messages, llama-server's /completion and /infill, Ollama's /api, plus /tokenize,
/detokenize, /health and /metrics.

`create_app(AsyncEngine(LLMEngine(config)))` gives an ASGI app; its lifespan
starts the engine loop and, on shutdown, drains it. Any ServingEngine will do: a
DataParallelEngine puts a fleet of replicas behind the same routes.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request

from iterserve.chat.reasoning import ReasoningSupport
from iterserve.chat.tool_parsers import select_tool_parser
from iterserve.engine.score_prompts import PairPrompts
from iterserve.engine.serving_engine import ServingEngine
from iterserve.server.access_log import AccessLogMiddleware
from iterserve.server.conversation_routes import conversation_routes
from iterserve.server.conversation_store import ConversationStore
from iterserve.server.errors import APIError, install_error_handlers
from iterserve.server.image_urls import MediaAccess
from iterserve.server.llama_server_routes import llama_server_routes
from iterserve.server.lora_routes import lora_routes
from iterserve.server.messages import messages_routes
from iterserve.server.metrics import ServerMetrics
from iterserve.server.ollama_routes import (
    JsonBodiesUnderApi,
    ollama_root_routes,
    ollama_routes,
)
from iterserve.server.openai_routes import openai_routes
from iterserve.server.response_store import IN_MEMORY, ResponseStore, Retention
from iterserve.server.scoring import scoring_routes
from iterserve.server.serving import ANY_MODEL_NAME, ServingContext
from iterserve.server.status_routes import admin_routes, status_routes
from iterserve.server.stored_response_routes import stored_response_routes
from iterserve.server.tokenize import tokenizer_routes

logger = logging.getLogger("iterserve.server")


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    api_key: str | None = None
    # Seconds in-flight requests get to finish once shutdown starts.
    shutdown_timeout: float = 30.0
    tool_call_parser: str = "auto"  # a name in TOOL_PARSER_CHOICES
    # Where stored Responses live: a SQLite file, or nowhere on disk (`iterserve serve`
    # defaults to a file under the user's data directory; an app built here to memory).
    responses_store: str = IN_MEMORY
    responses_retention: Retention = field(default_factory=Retention)
    reasoning_parser: str = "auto"  # a name in REASONING_PARSER_CHOICES
    # Every chat's template kwargs under its own (--default-chat-template-kwargs).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # A request's own `chat_template` renders it (--trust-request-chat-template).
    trust_request_chat_template: bool = False
    # GET /tokenizer_info (--enable-tokenizer-info-endpoint).
    tokenizer_info: bool = True
    # Where image URLs may be read from (server/image_urls.py): a directory, hosts.
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] = field(default_factory=list)


def _api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    bearer = f"Bearer {api_key}".encode()
    key = (api_key or "").encode()

    async def check(request: Request) -> None:
        if api_key is None:
            return
        # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key.
        # Both are compared (constant time: no timing oracle), whichever came.
        given = request.headers.get("authorization", "").encode()
        by_bearer = hmac.compare_digest(given, bearer)
        header = request.headers.get("x-api-key", "").encode()
        by_header = bool(key) and hmac.compare_digest(header, key)
        if not (by_bearer or by_header):
            raise APIError(
                401,
                "missing or wrong API key: send it as 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>')",
                code="invalid_api_key",
            )

    return check


def create_app(async_engine: ServingEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    store = ResponseStore(settings.responses_store, settings.responses_retention)
    ctx = _serving_context(async_engine, settings, store)
    metrics = ServerMetrics(async_engine)
    async_engine.on_finished = metrics.observe_finished

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await async_engine.shutdown(settings.shutdown_timeout)
        store.close()  # after the engine: the last responses have been saved

    app = FastAPI(title="iterserve", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.serving = ctx
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(AccessLogMiddleware, on_response=metrics.observe_http)
    app.add_middleware(JsonBodiesUnderApi)  # Ollama's clients: `curl -d` bodies are JSON

    guarded = [Depends(_api_key_check(settings.api_key))]
    app.include_router(openai_routes(ctx), dependencies=guarded)
    app.include_router(messages_routes(ctx), dependencies=guarded)  # Anthropic's
    app.include_router(scoring_routes(ctx), dependencies=guarded)
    app.include_router(
        lora_routes(ctx, async_engine.served_model.lora_enabled), dependencies=guarded
    )
    app.include_router(stored_response_routes(store), dependencies=guarded)
    app.include_router(conversation_routes(ConversationStore(store)), dependencies=guarded)
    # vLLM's paths, outside /v1 but behind the same key.
    app.include_router(admin_routes(async_engine), dependencies=guarded)
    app.include_router(tokenizer_routes(ctx, settings.tokenizer_info), dependencies=guarded)
    # llama-server's own completion API (/completion, /infill), for clients of llama.cpp.
    app.include_router(llama_server_routes(ctx), dependencies=guarded)
    # Ollama's API (/api/chat, /api/generate, /api/embed, ...), for Ollama's clients and apps.
    app.include_router(ollama_routes(ctx), dependencies=guarded)
    app.include_router(ollama_root_routes())
    app.include_router(status_routes(async_engine, metrics))
    return app


def _serving_context(
    async_engine: ServingEngine, settings: ServerSettings, store: ResponseStore
) -> ServingContext:
    model = async_engine.served_model
    names = [name for name in settings.served_model_names if name != ANY_MODEL_NAME]
    ctx = ServingContext(
        engine=async_engine,
        served_model_names=names or [model.name],
        eos_token_ids=model.eos_token_ids,
        any_model_name=ANY_MODEL_NAME in settings.served_model_names,
        tokenizer=model.tokenizer,
        chat_template=model.chat_template,
        max_model_len=model.max_model_len,
        response_store=store,
        tool_parser=select_tool_parser(settings.tool_call_parser, model.chat_template),
        reasoning=ReasoningSupport.for_model(
            settings.reasoning_parser, model.tokenizer, model.chat_template
        ),
        loras={lora.lora_name: lora for lora in model.loras},
        pair_prompts=PairPrompts(model.tokenizer, model.rerank_template) if model.scores else None,
        embeds=model.embeds,
        image_marker=model.facts.image_marker,
        images=async_engine.image_inputs,
        media=MediaAccess(
            Path(local) if (local := settings.allowed_local_media_path) else None,
            tuple(domain.lower() for domain in settings.allowed_media_domains),
        ),
        labels=model.labels,
        sampling_defaults=model.sampling_defaults,
        default_template_kwargs=settings.default_chat_template_kwargs,
        trust_request_chat_template=settings.trust_request_chat_template,
    )
    logger.info(
        "tool calls: %s (--tool-call-parser %s)",
        ctx.tool_parser.name if ctx.tool_parser else "not parsed",
        settings.tool_call_parser,
    )
    reasoning = ctx.reasoning
    logger.info(
        "reasoning: %s (--reasoning-parser %s)%s",
        reasoning.parser.name if reasoning else "not parsed",
        settings.reasoning_parser,
        reasoning.effort_note() if reasoning else "",
    )
    if ctx.default_template_kwargs:
        logger.info(
            "every chat's template kwargs, under its own: %s (--default-chat-template-kwargs)",
            ctx.default_template_kwargs,
        )
    return ctx
